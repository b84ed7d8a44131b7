"""From a program to the plan :func:`autoddl_jax.plan` returns.

:func:`search_plan` seeds and searches one program (and fits a budget by the
model); :class:`Variants` holds the programs a budget may call for (the step
as written, and with its layer stacks and repeated blocks rematerialised)
and fits them all; :func:`select_compiled` compiles the candidates -- the
search's plan pinned and by its boundary, other starts' plans, the textbook
plans as a user writes them -- and keeps the one whose compiled program is
fastest within the budget (:mod:`autoddl_jax._select`), searching again
under a scaled budget where XLA's memory says the model was short.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable

from jax.sharding import Mesh

from autoddl_jax import _program, _remat, _search, _seeds, _select, _stages
from autoddl_jax._budget import NoFit, fit_budget, propagated
from autoddl_jax._cluster import format_bytes
from autoddl_jax._plan import Plan
from autoddl_jax._program import Program
from autoddl_jax.pipeline import Schedule

SELECT_ENV = "AUTODDL_JAX_SELECT"  # the default of plan(select=...)
SELECT_SECONDS = 120.0
# plan_stages and Variants.fit skip fitting what cannot win (tests turn it
# off to show that doing so changes no plan).
PRUNE_SCHEDULES = True
# Why a plan over the budget was not fitted to it (search_plan's ``beat``,
# plan_stages' schedules): fitting only makes a plan slower.
SLOWER = "slower than a plan that fits, without the budget"
# ... and because no plan of it can fit (MemoryModel.peak_lower_bound).
TOO_BIG = "no plan fits the budget: by the model it needs at least"


def search_plan(program: Program, budget: float | None, verbose: bool,
                t0: float, zero: bool = False, beat: float = math.inf
                ) -> tuple[Plan, NoFit | None, float]:
  """Search ``program`` and fit the budget by the model: (the plan, why
  nothing fits the budget or None, the peak of the best plan without the
  budget). ``zero``: the optimizer moments' layouts are free of their
  parameters' (weight-update sharding). ``beat``: the time of a plan that
  fits already; where the best plan here without the budget is no faster,
  fitting it cannot win and is skipped."""
  if zero:
    program = program.weight_update_sharded()
  prob, graph, mi, remat = (program.problem, program.graph,
                            program.mesh_info, program.remat)
  seeds = _seeds.seeds(program, zero=zero)
  program.memo.setdefault("seeds", {}).update(seeds)
  user = _seeds.user(program)
  if user:
    seeds = {_seeds.Kind.USER.value: user, **seeds}
  progress = None
  if verbose:
    what = "" if remat == _remat.NONE else f", layer stacks remat {remat}"
    what += ", moments free of their parameters" if zero else ""
    print(f"[autoddl_jax] planning {len(graph.ops)} ops, "
          f"{len(prob.groups)} coordinates, {len(seeds)} seeds on "
          f"{dict(zip(mi.axis_names, mi.axis_sizes))}{what}",
          file=sys.stderr, flush=True)
    progress = lambda seed, sweep, obj: print(  # noqa: E731
        f"[autoddl_jax] start {seed:>10}  sweep {sweep:>3}  best "
        f"{obj * 1e3:.6g} ms", file=sys.stderr, flush=True)
  res = propagated(prob, seeds, _search.search(
      prob, seeds, progress=progress, polish=getattr(prob, "untied", None)))
  choice = res.choice
  free_peak = prob.peak_memory(choice)
  over = None  # why no plan fits the budget by the model, if none does
  if budget is not None and free_peak > budget and \
      prob.evaluate(choice).time_s >= beat:
    over = NoFit(SLOWER, res)
  elif budget is not None:
    try:
      choice, res = fit_budget(prob, seeds, res, float(budget), progress)
    except NoFit as e:
      # The model's memory is an estimate: the compiled programs decide.
      over, choice, res = e, e.result.choice, e.result
  best = Plan(program, choice, search=res,
              search_s=time.perf_counter() - t0, memory_budget=budget)
  return best, over, free_peak


class Variants:
  """The programs a budget may call for -- the step as written, and traced
  again with its layer stacks and repeated blocks rematerialised (each
  policy of ``_remat.AUTO`` where ``may_remat``) -- each traced once, and
  :meth:`fit`, which searches them all under a budget with weight-update
  sharding free: the fastest plan that fits by the model, else the
  smallest. :func:`plan` fits the budget with it, and selection fits it
  again, under the budget scaled by the model's error on a compiled
  plan."""

  def __init__(self, fn, args, verbose: bool, program: Program,
               may_remat: bool):
    self.fn, self.args, self.cluster = fn, args, program.cluster
    # The program's own mesh and schedule: a pipelined variant's mesh may
    # split an axis of the user's (autoddl_jax._stages).
    self.mesh, self.schedule = program.mesh, program.schedule
    self.verbose, self.policy = verbose, program.remat
    self.programs = {program.remat: program}
    self.policies = [program.remat] + (list(_remat.AUTO) if may_remat
                                       else [])
    self.remats = False  # a remat variant was searched
    self.may_remat = may_remat

  def fit(self, budget: float, beat: float = math.inf,
          others_fit: bool = False
          ) -> tuple[Plan | None, NoFit | None, list]:
    """``beat``: the time of a plan that fits already (another schedule's);
    a variant whose best plan without the budget is no faster is not
    fitted (fitting only makes a plan slower). A variant no plan of which
    can fit (:meth:`~autoddl_jax._memory.MemoryModel.peak_lower_bound`)
    is searched only where no plan fits at all (it may be the smallest):
    last, and not where a plan fits already (``beat`` is finite, or
    ``others_fit``); the plan is None where no variant is left."""
    found, hopeless, least = {}, {}, math.inf  # by policy, in order
    for i, pol in enumerate(self.policies):
      program = self.programs.get(pol)
      if program is None:
        program = self.programs[pol] = _program.build(
            self.fn, self.args, self.mesh, self.cluster, remat=pol,
            schedule=self.schedule)
        program.memo["declined_dots"] = _remat.declined_dots()
      if pol != self.policy:
        if not _remat.has_checkpoint(program.traced.closed.jaxpr):
          break  # no layer stack nor repeated block: nothing to recompute
        self.remats = True
        if pol == _remat.SELECTIVE and "dots_saveable" in self.programs \
            and not program.memo["declined_dots"]:
          continue  # no batched dot: dots_saveable's program again
      bound = program.problem.peak_lower_bound()
      if PRUNE_SCHEDULES and bound > budget:
        hopeless[i], least = program, min(least, bound)
        if self.verbose:
          print(f"[autoddl_jax] remat {pol}: no plan fits, it needs at "
                f"least {format_bytes(bound)} by the model",
                file=sys.stderr, flush=True)
        continue
      found[i] = self._search(program, budget, beat)
      if found[i][1] is None:
        beat = min(beat, found[i][0].cost.time_s)
    if not (beat < math.inf or others_fit):  # nothing fits: the smallest
      found.update((i, self._search(p, budget, beat))
                   for i, p in hopeless.items())
    options = [found[i] for i in sorted(found)]
    if not options:
      return None, NoFit(f"{TOO_BIG} {format_bytes(least)}", None), []
    fits = [i for i, (_, o) in enumerate(options) if o is None]
    pick = (min(fits, key=lambda i: options[i][0].cost.time_s) if fits else
            min(range(len(options)),
                key=lambda i: options[i][0].cost.memory_bytes))
    return (*options[pick], options)

  def _search(self, program: Program, budget: float, beat: float):
    return search_plan(program, budget, self.verbose, time.perf_counter(),
                       zero=True, beat=beat)[:2]


@dataclasses.dataclass
class _Scouted:
  """A schedule :func:`plan_stages` planned: its plan (the best without
  the budget, then the fitted one), why it does not fit the budget or None,
  its variants, the seconds spent on it, and its name for the log.
  ``free_s``: the time of its best plan without the budget, the bound on
  any plan of it that fits."""
  plan: Plan
  over: NoFit | None
  variants: Variants
  seconds: float
  what: str
  free_s: float


def plan_stages(fn, args, mesh, cluster, verbose: bool, opts, batches,
                budget, may_remat: bool, policy, beat: float = math.inf,
                layers: int | None = None, repeats: int | None = None,
                flat: tuple[float, Callable[[float, bool], float | None]]
                | None = None
                ) -> list[tuple[Plan, NoFit | None, Variants]]:
  """The plans of the pipeline schedules ``opts`` ((mesh axis, stages),
  :func:`_stages.options`), each fitted to ``budget`` as :func:`plan`
  fits the step as written: (plan, why it does not fit or None, its
  variants). ``beat``: the time of the plan without stages, where it
  fits. ``repeats`` forces circular stages of that many chunks on every
  schedule. ``flat``: (the time of the plan without stages, searched
  without the budget and over it; ``fit(beat, others_fit)``, which fits
  it to the budget and returns its time where it fits): fitted among the
  schedules, best first, where it can still win.

  Best first, as a branch and bound: every schedule is traced and
  searched without the budget first, which bounds the time of any plan
  of it that fits (fitting only makes a plan slower). Every schedule gets
  its first microbatch count; the two with the fastest plans without the
  budget get the other counts too; and (``repeats`` None) the fastest
  schedule of all is tried with :func:`_stages.circular_repeats` chunks
  of the ``layers``. Then the schedules are fitted in the order of that
  bound (:func:`_stages.fit_best_first`), and one (or a remat variant of
  one) whose bound is no faster than a plan that fits already is not
  fitted.
  On the 175B GPT this fits 3 of the 11 schedules. Where the fastest
  GPipe schedule that fits is not the one circular stages were tried on,
  they are tried (and fitted, where they can still win) on its stage
  count too, at each of its microbatch counts."""
  mi = _program.mesh_info(mesh, cluster)
  scouted: list[_Scouted] = []

  def scout(axis, stages, m, v=1):
    smesh, name = _stages.stage_mesh(mesh, mi, axis, stages)
    what = (f"{stages} stages over {name!r}"
            + (f" of {v} circular chunks" if v > 1 else "")
            + f", {m} microbatches")
    t0 = time.perf_counter()
    if verbose:
      print(f"[autoddl_jax] pipeline: {what}", file=sys.stderr, flush=True)
    split = None if smesh is mesh else mi.axis_names[axis]
    reps, count = _stages.replica_axes(_program.mesh_info(smesh, cluster),
                                       name, [b // m for b in batches])
    program = _program.build(fn, args, smesh, cluster, remat=policy,
                             schedule=Schedule(stages, m, name, split, reps,
                                               count, v))
    p, _, peak = search_plan(program, None, verbose, t0)
    over = None if budget is None or peak <= budget else NoFit(SLOWER,
                                                               p.search)
    scouted.append(_Scouted(
        p.replace(memory_budget=budget), over,
        Variants(fn, args, verbose, program, may_remat=may_remat),
        time.perf_counter() - t0, what, p.cost.time_s))
    return scouted[-1]

  v = repeats or 1

  def counts(stages):  # circular stages need M >= S
    return [m for m in _stages.microbatch_counts(stages, batches)
            if v == 1 or m >= stages]

  firsts = {(axis, stages): scout(axis, stages, counts(stages)[0], v)
            for axis, stages in opts if counts(stages)}
  for axis, stages in sorted(firsts, key=lambda k: firsts[k].free_s)[:2]:
    for m in counts(stages)[1:]:
      scout(axis, stages, m, v)
  circled = set()  # the schedules circular stages were tried on

  def try_circular(sched, m=None):
    m = m or sched.microbatches
    reps = _stages.circular_repeats(layers, sched.stages, m)
    key = (sched.axis, sched.stages, m)
    if reps is not None and key not in circled:
      circled.add(key)
      scout(mi.axis_names.index(sched.split_from or sched.axis),
            sched.stages, m, reps)

  def fit_from(n, bar, flat):  # the schedules scouted[n:], and flat
    new = scouted[n:]
    bar = min([bar] + [e.free_s for e in new if e.over is None])
    pending = [(e.free_s, e) for e in new if e.over is not None]
    if flat is not None:
      pending.append((flat[0], None))
    return _stages.fit_best_first(pending, bar, budget, flat, verbose,
                                   PRUNE_SCHEDULES)

  circular = repeats is None and layers is not None
  if circular and scouted:
    try_circular(min(scouted, key=lambda e: e.free_s).plan.schedule)
  bar = fit_from(0, beat, flat)
  # The fitting may crown another schedule than the fastest without the
  # budget: circular stages are tried on its stage count too, at every
  # microbatch count (circular stages change what M buys: the 175B GPT on
  # (64, 16): 8 stages at M=32 fit in 16.8 s, 8 of 2 chunks at M=32 in
  # 15.4 s, at M=16 in 14.6 s), fitted where they can still win.
  fitted = [e for e in scouted if e.over is None
            and e.plan.schedule.repeats == 1]
  if circular and fitted:
    n = len(scouted)
    best = min(fitted, key=lambda e: e.plan.cost.time_s).plan.schedule
    if (best.axis, best.stages, best.microbatches) not in circled:
      for m in _stages.microbatch_counts(best.stages, batches):
        try_circular(best, m)
    fit_from(n, bar, None)
  return [(e.plan.replace(search_s=e.seconds), e.over, e.variants)
          for e in scouted]


def select_mode(select: str | None, mesh) -> str:
  concrete = isinstance(mesh, Mesh)
  if select is None:
    env = os.environ.get(SELECT_ENV)
    if env not in (None, "", "compiled", "model"):
      raise ValueError(f"{SELECT_ENV}={env!r}: use 'compiled' or 'model'")
    select = env or ("compiled" if concrete else "model")
    if not concrete:
      select = "model"
  if select not in ("compiled", "model"):
    raise ValueError(f"select must be 'compiled' or 'model', got {select!r}")
  if select == "compiled" and not concrete:
    raise ValueError(
        "select='compiled' needs a concrete jax.sharding.Mesh to compile "
        "for; this mesh is abstract. Plan with select='model' (the default "
        "for an abstract mesh), or pass a Mesh of devices (jax.make_mesh).")
  return select


def _as_written(best: Plan, base: Plan) -> str:
  """The candidate name of the step as written beside ``best``'s variant."""
  stages, remat = best.schedule != base.schedule, best.remat != base.remat
  return ("search:as-written" if stages and remat else
          "search:no-stages" if stages else "search:no-remat")


def select_compiled(best: Plan, budget: float | None, seconds: float,
                     alternatives: int, verbose: bool,
                     base: Plan | None = None, *,
                     refit: Callable[[float], Plan],
                     textbook: bool = True) -> Plan:
  """:func:`plan`'s ``select="compiled"``: the candidates, compiled, and
  the winner with its :class:`Selection`. ``base`` is the plan of the step
  as written where ``best`` is of a remat variant: the textbook plans are
  written on it, and it is a candidate too (``"search:no-remat"``,
  ``"search:no-stages"`` where ``best`` is pipelined, or
  ``"search:as-written"`` where both).
  ``refit(target)``: the plan for a budget of ``target`` by the model
  (:meth:`Variants.fit`). ``textbook=False``: only the search's plans
  are candidates (a forced pipeline)."""
  base = best if base is None else base
  cands = [("search", "pinned", best),
           ("search", "boundary",
            best.variant(best.choice, "boundary", "search"))]
  if base is not best:
    cands.append((_as_written(best, base), "pinned", base))
  if textbook:
    cands += [(k, "boundary", base.textbook(k)) for k in _seeds.TEXTBOOK]
  alts = list(best.search.alternatives.items())[:alternatives] \
      if best.search is not None else []
  cands += [(f"search:{start}", "pinned",
             best.variant(ch, "pinned", f"search:{start}"))
            for start, ch in alts]
  progress = None
  if verbose:
    progress = lambda msg: print(f"[autoddl_jax] {msg}",  # noqa: E731
                                 file=sys.stderr, flush=True)
  key = lambda p, low: p.program_key(low)  # noqa: E731
  t0 = time.perf_counter()
  win, sel = _select.select(cands, budget=budget, time_limit=seconds,
                            key=key, progress=progress)
  if budget is not None:
    # The model's memory is an estimate. Where the search's plan is over
    # the budget by memory_analysis, search again under the budget scaled
    # by the model's error on that plan (twice at most): a plan the model
    # puts that much lower is one XLA puts under the budget.
    last, target = sel.candidates[0], float(budget)
    for attempt in range(2):
      if last.fits is not False or not last.predicted_memory or \
          time.perf_counter() - t0 > seconds:
        break  # fits; nothing to scale by; select_s spent
      target *= last.predicted_memory / last.compiled.memory_bytes
      if progress is not None:
        progress(f"refit under {format_bytes(target)} by the model")
      again = refit(target)
      again = again.replace(lowering="pinned", source="search:refit",
                            selection=None, memory_budget=budget)
      if any(key(p, low) == key(again, "pinned") for _, low, p in cands):
        break  # a plan already compiled
      name = f"search:refit{attempt + 1}"
      cands.append((name, "pinned", again))
      prior = [(key(p, low), c) for (_, low, p), c in
               zip(cands, sel.candidates)]
      win, sel = _select.select(
          [cands[-1]], budget=budget, key=key, progress=progress,
          time_limit=max(0.0, seconds - (time.perf_counter() - t0)),
          prior=prior)
      last = sel.candidates[-1]
      if last.compiled is None:
        break
    sel = dataclasses.replace(sel, compile_s=time.perf_counter() - t0)
  chosen = best if win is None else cands[win][2]
  return chosen.replace(selection=sel)
