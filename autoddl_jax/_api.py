"""The public entry points: :func:`plan`, :func:`hand_plan`, :func:`cost_of`,
:func:`load_plan`.

Each builds a :class:`~autoddl_jax._program.Program` (trace, graph, problem)
and returns a :class:`~autoddl_jax.Plan`: :func:`plan` by searching
(:mod:`autoddl_jax._planner`), :func:`hand_plan` by completing the
shardings a user wrote, :func:`load_plan` from a file.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from autoddl_jax import _boundary, _budget, _gc, _io, _planner, _program
from autoddl_jax import _remat
from autoddl_jax import _search, _select, _stages
from autoddl_jax import pipeline as _pipeline
from autoddl_jax._cluster import H100_NODE, Cluster, default_budget
from autoddl_jax._cluster import format_bytes
from autoddl_jax._errors import MemoryBudgetError, PlanFileError
from autoddl_jax._plan import Plan
from autoddl_jax._problem import PlanCost
from autoddl_jax._problem import Problem

__all__ = ["Plan", "PlanCost", "cost_of", "hand_plan", "load_plan", "plan"]


def _pipeline_arg(pipeline) -> tuple[int | None, int | None]:
  """``plan(pipeline=...)`` as (stages or None, repeats or None)."""
  def count(v):
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1
  if pipeline is None or count(pipeline):
    return pipeline, None
  if isinstance(pipeline, tuple) and len(pipeline) == 2 and all(
      count(v) for v in pipeline) and pipeline[0] > 1:
    return pipeline
  raise ValueError(f"pipeline must be None (the planner decides), 1 (no "
                   f"stages), a stage count S > 1 or (S, V) for S stages "
                   f"of V circular chunks each, got {pipeline!r}")


@_gc.fewer_collections
def plan(fn: Callable, *args: Any, mesh: Mesh | AbstractMesh,
         cluster: Cluster | None = None,
         memory_budget: float | str | None = None,
         verbose: bool | None = None, select: str | None = None,
         select_s: float = _planner.SELECT_SECONDS,
         alternatives: int = 2,
         remat: str | Sequence[str] | None = None,
         pipeline: int | tuple[int, int] | None = None) -> Plan:
  """Finds a sharding plan for ``fn(*args)`` on ``mesh``.

  Args:
    fn: the step function (e.g. a train step: forward, backward, update).
    *args: example arguments: arrays or ``jax.ShapeDtypeStruct``s (only shapes
      and dtypes are used; placed arrays also seed the search with their
      shardings).
    mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes) or an
      ``AbstractMesh`` for planning without devices.
    cluster: the hardware to cost for; defaults to an H100 node preset.
    memory_budget: bytes per device the plan's peak memory must fit in: a
      number or a string such as ``"16GiB"`` or ``"512MB"``. ``None`` (the
      default): what XLA's allocator may take of
      ``cluster.memory_per_device`` (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
      0.75 unless set; the rest is the CUDA context's and the libraries'
      workspace). ``float("inf")``: no constraint.
    verbose: print the search's progress to stderr (one line per start and
      round, with the best cost so far, and per compiled candidate); by
      default only when stderr is a terminal, so scripts, logs and tests
      stay quiet.
    select: how the plan is chosen. ``"compiled"`` (the default for a
      concrete mesh): the search's plan (lowered with all its pins, and with
      its boundary only), the best plans of ``alternatives`` other starts
      and the textbook plans (DP, FSDP, Megatron, FSDP+TP as a user writes
      them) are compiled abstractly, and the plan whose compiled program is
      fastest on ``cluster`` within the budget is returned (one for which
      XLA logs "Involuntary full rematerialization" only if all do)
      (:mod:`autoddl_jax._select`; ``plan.explain()`` shows them all).
      With a budget, a search's plan over it by ``memory_analysis`` is
      fitted again -- sharding, weight-update sharding and remat, as the
      first fit -- under the budget scaled by the model's error on it
      (twice at most: ``"search:refit1"``, ``"search:refit2"``).
      ``"model"``: the cost model's plan, nothing compiled (the default for
      an abstract mesh, which has no devices to compile for). The
      environment variable ``AUTODDL_JAX_SELECT`` sets the default.
    select_s: compiling stops starting new candidates after this
      many seconds (the first is always compiled; multi-process runs
      compile all, to keep one plan on every process).
    alternatives: how many other starts' plans to compile (>= 0).
    remat: rematerialisation of the step's ``jax.lax.scan`` layer stacks
      (``flax.linen.scan`` and ``nnx.scan`` too) and of the blocks a Python
      loop repeats back to back in the function ``jax.grad`` /
      ``jax.value_and_grad`` (``nnx`` ones too) differentiate. ``None``
      (the default): the planner decides -- where the best plan without
      remat does not fit the budget by the model, the step is planned again
      with every stack and block under ``jax.checkpoint`` with
      ``"dots_saveable"``, ``"dots_with_no_batch_dims_saveable"`` (the
      weight matmuls kept, the attention's batched ones recomputed:
      Megatron's selective recomputation, also inside a pipelined stage's
      vmaps) and ``"nothing_saveable"``, and the fastest plan that fits
      wins (the recomputed FLOPs and the smaller residuals
      are in the traced program the model costs). A policy name forces it
      on both; a sequence gives one per scan in the order the step calls
      them (repeated blocks then stay as written); ``"none"`` turns it off.
      A step that already holds a ``jax.checkpoint`` is planned as written.
    pipeline: pipeline stages for the step's ``ad.pipeline.scan`` layer
      stacks (:mod:`autoddl_jax.pipeline`). ``None`` (the default): the
      planner decides -- the step is traced again for each stage count
      ``S > 1`` that divides a mesh axis and the layer count (over a whole
      axis, or the major part of a larger one on a mesh of two axes,
      :mod:`autoddl_jax._stages`)
      and a few microbatch counts, each planned by the same search, and
      fitted to the budget best first (the fastest plan without the budget
      first; a schedule is not fitted where that plan is already no faster
      than one that fits, nor is the plan without stages), and a
      pipelined plan is returned only where it is faster than the best
      plan without stages.
      The best schedule is planned again with circular (interleaved)
      stages too (:attr:`autoddl_jax.pipeline.Schedule.repeats`: each
      stage holds the stack's chunks ``s, s + S, ..``, and the bubble is
      ``(S-1)/(V*M+S-1)``). An int ``S > 1`` forces ``S`` stages (the
      schedule over which axis, and the microbatches, are still chosen);
      ``(S, V)`` forces ``S`` stages of ``V`` circular chunks each; ``1``
      turns pipelining off.

  Returns:
    A :class:`Plan`.

  Raises:
    MemoryBudgetError: no plan fits the budget (by the model with
      ``select="model"``, else by XLA's ``memory_analysis``); the message
      names the budget, the smallest plan and its largest tensors.
  """
  t0 = time.perf_counter()
  budget = _budget.parse_budget(memory_budget)
  select = _planner.select_mode(select, mesh)
  if not (isinstance(select_s, (int, float)) and select_s >= 0):
    raise ValueError(f"select_s must be a number >= 0, got "
                     f"{select_s!r}")
  if isinstance(alternatives, bool) or not isinstance(alternatives, int) \
      or alternatives < 0:
    raise ValueError(f"alternatives must be an int >= 0, got "
                     f"{alternatives!r}")
  if remat is not None:
    remat = _remat.validate(remat)
  pipeline, repeats = _pipeline_arg(pipeline)
  if verbose is None:
    verbose = sys.stderr.isatty()
  cluster = H100_NODE if cluster is None else cluster
  if budget is None and memory_budget is None and isinstance(cluster,
                                                             Cluster):
    budget = default_budget(cluster)[0]
  policy = _remat.NONE if remat is None else remat
  # First the best plan without the budget: where it fits, it is the plan.
  program = _program.build(fn, args, mesh, cluster, remat=policy)
  base, over, free_peak = _planner.search_plan(program, None, verbose, t0)
  base = best = base.replace(memory_budget=budget)
  variants = _planner.Variants(
      fn, args, verbose, program,
      may_remat=remat is None and not _remat.has_checkpoint(
          program.traced.closed.jaxpr))
  options, picked = [(base, over)], None
  calls = [] if pipeline == 1 else _pipeline.calls(
      program.traced.closed.jaxpr)
  staged = pipeline != 1 and _stages.options(calls, program.mesh_info,
                                              pipeline, repeats)
  if pipeline not in (None, 1) and not staged:
    asked = pipeline if repeats is None else (pipeline, repeats)
    what = f"{pipeline} stages" + (f" of {repeats} circular chunks"
                                   if repeats else "")
    raise ValueError(f"pipeline={asked}: cannot plan {what}: "
                     + _stages.why_none(calls, program.mesh_info, pipeline,
                                        repeats))

  def fit(beat: float = math.inf, others_fit: bool = False) -> float | None:
    # It does not fit: shard more, shard the optimizer state apart from the
    # parameters (ZeRO-1/2), recompute a layer's activations in the
    # backward pass -- the model prices each, and the fastest plan that
    # fits wins. (Among pipeline schedules, ``beat``/``others_fit`` as
    # Variants.fit takes them: the time it returns, where it fits.)
    nonlocal best, over, options, picked
    picked, over, options = variants.fit(budget, beat, others_fit)
    best = (picked or base).replace(search_s=time.perf_counter() - t0)
    if over is None:
      return best.cost.time_s
    tried = ("the optimizer state sharded apart from the parameters"
             + (" and the layer stacks and repeated blocks "
                "rematerialised (" + ", ".join(_remat.AUTO) + ")"
                if variants.remats else
                f", with remat={policy!r} as asked" if remat is not None
                else "; the step has no jax.lax.scan layer stack or "
                "repeated block without its own jax.checkpoint to "
                "rematerialise"))
    over = _budget.NoFit(f"{over} Tried: {tried}.", over.result)
    return None

  deferred = None  # fitted among the schedules, best first
  if budget is not None and free_peak > budget:
    if not staged:
      fit()
    elif pipeline is None:
      over = _budget.NoFit(_planner.SLOWER, base.search)  # unless fitted
      deferred = (base.cost.time_s, fit)
    # forced stages: no plan without them is a candidate, nor fitted
  if staged:
    # Pipeline stages: each schedule planned and fitted as the step is;
    # the fastest that fits wins (forced: among the schedules only).
    tried = _planner.plan_stages(
        fn, args, mesh, cluster, verbose, staged, [c.batch for c in calls],
        budget, variants.may_remat, policy,
        layers=math.gcd(*(c.layers for c in calls)), repeats=repeats,
        beat=best.cost.time_s if pipeline is None and over is None
        else math.inf, flat=deferred)
    if not tried:  # forced circular stages, and too few microbatches
      raise ValueError(
          f"pipeline={(pipeline, repeats)}: circular stages need at least "
          f"{pipeline} microbatches, and the batch does not hold that many")
    if pipeline is None:
      tried.append((best, over, variants))
    best, over, variants = min(tried, key=lambda t: (
        t[1] is not None, t[0].cost.time_s))
    best = best.replace(search_s=time.perf_counter() - t0)
    if pipeline is not None:
      base = best  # forced: no plan without stages is a candidate
  if over is not None and memory_budget is None:
    frac = default_budget(cluster)[1]
    over = _budget.NoFit(f"{over} (The budget is the default: {frac:g} of "
                  f"cluster.memory_per_device, as XLA's allocator takes; "
                  "pass memory_budget= to change it, float('inf') to plan "
                  "without it.)", over.result)
    if best.remat == policy:
      base = best  # the textbook plans: on the step as written
    else:
      base = best if options[0][0] is picked else options[0][0]
  if select == "model":
    if over is not None:
      raise MemoryBudgetError(str(over))
    return best.replace(selection=_select.Selection("model", (
        "abstract mesh: no devices to compile for" if not isinstance(
            mesh, Mesh) else "select='model'")))
  chosen = _planner.select_compiled(
      best, budget, float(select_s), alternatives, verbose, base=base,
      refit=lambda target: variants.fit(target)[0],
      textbook=not (pipeline not in (None, 1) and staged))
  sel = chosen.selection
  if budget is not None and (sel.winner is None or not
                             sel.candidates[sel.winner].fits):
    peaks = [c.compiled.memory_bytes for c in sel.candidates
             if c.compiled is not None and c.compiled.memory_bytes]
    # Where the model had a plan under the budget, selection searches
    # again under a budget scaled by the model's error -- unless select_s
    # ran out first: then a longer select_s may find one.
    short = over is None and sel.compile_s >= float(select_s)
    raise MemoryBudgetError(
        (str(over) if over is not None else
         f"no plan fits memory_budget={format_bytes(budget)} per "
         "device by the compiled programs.") +
        (f" By memory_analysis, the smallest compiled candidate needs "
         f"{format_bytes(min(peaks))}." if peaks else "") +
        (f" Selection stopped at select_s={float(select_s):g} s (compiling "
         f"took {sel.compile_s:.0f} s) before searching again under a "
         "budget scaled by the model's memory error: a larger select_s "
         "may find a plan that fits." if short else ""))
  return chosen


@_gc.fewer_collections
def hand_plan(fn: Callable, *args: Any, mesh, in_shardings,
              out_shardings=None, cluster: Cluster | None = None) -> Plan:
  """A Plan whose arguments (and results) follow the given shardings.

  ``in_shardings`` / ``out_shardings`` are what ``jax.jit`` takes: one
  ``NamedSharding`` / ``PartitionSpec`` / None (replicated) for every leaf,
  or a pytree prefix of the arguments (results), such as ``(None, None,
  P("data"))`` for three arguments; flax's boxed trees (``nn.get_sharding``
  of a ``TrainState``, ``nnx.get_named_sharding``) work as they come.

  The intermediates get the cheapest layout under the cost model given that
  boundary, which is what XLA's sharding propagation aims at too.
  """
  t0 = time.perf_counter()
  program = _program.build(fn, args, mesh, cluster, tie_repeated=False)
  mi, tr, graph, prob = (program.mesh_info, program.traced, program.graph,
                         program.problem)
  ins = _boundary.flat_shardings(in_shardings, tr.in_tree, len(tr.in_avals),
                        "in_shardings")
  pins = {}
  for i, (s, a) in enumerate(zip(ins, tr.in_avals)):
    codes = _boundary.to_codes(s, a, mi,
                      f"in_shardings for argument {tr.in_names[i] or i}")
    k = prob.find_candidate(graph.input_ops[i], codes)
    if k is None:
      raise ValueError(f"in_shardings for {tr.in_names[i]}: {s} cannot be "
                       "used for this argument")
    pins[graph.input_ops[i]] = k
  if out_shardings is not None:
    outs = _boundary.flat_shardings(out_shardings, tr.out_tree, len(tr.out_avals),
                           "out_shardings")
    for j, (s, a) in enumerate(zip(outs, tr.out_avals)):
      codes = _boundary.to_codes(s, a, mi, f"out_shardings for result "
                        f"{tr.out_names[j] or j}")
      pins[graph.output_ops[j]] = prob.find_candidate(graph.output_ops[j],
                                                      codes)
  # A hand plan may lay out a result differently from the argument it updates
  # (or a moment differently from its parameter): score those untied.
  groups = [g for g in prob.groups if len(g) > 1]
  keep = [g for g in groups if len({pins[o] for o in g if o in pins}) <= 1]
  if len(keep) != len(groups):
    program = program.with_problem(Problem(graph, mi, program.cluster, keep,
                                           program.donated_ops))
    prob = program.problem
  res = _search.complete(prob, pins, "hand")
  return Plan(program, res.choice, search=res,
              search_s=time.perf_counter() - t0)


@_gc.fewer_collections
def cost_of(fn: Callable, *args: Any, mesh, in_shardings, out_shardings=None,
            cluster: Cluster | None = None) -> PlanCost:
  """Scores a hand-written plan on the same cost model as :func:`plan`.

  Args:
    in_shardings: one sharding, or a pytree prefix of ``args`` (as
      ``jax.jit`` takes) of ``NamedSharding``/``PartitionSpec``/None
      (None = replicated); see :func:`hand_plan`.
    out_shardings: likewise for the results; None leaves them to the model.
  """
  return hand_plan(fn, *args, mesh=mesh, in_shardings=in_shardings,
                   out_shardings=out_shardings, cluster=cluster).cost


@_gc.fewer_collections
def load_plan(path, fn: Callable, *args: Any, mesh: Mesh | AbstractMesh,
              cluster: Cluster | None = None) -> Plan:
  """Reads a plan saved with :meth:`Plan.save` for ``fn(*args)`` on ``mesh``.

  The program is traced again (no search) and must be the one the plan was
  made for, on a mesh of the same axes and sizes and the same cluster;
  otherwise :class:`autoddl_jax.PlanFileError` says what differs. A
  truncated or corrupted file raises it too.
  """
  def build(remat, schedule):
    smesh = mesh
    if schedule is not None and schedule.split_from is not None:
      mi = _program.mesh_info(mesh, cluster or H100_NODE)
      if schedule.split_from not in mi.axis_names:
        raise PlanFileError(f"plan file {path!r} splits mesh axis "
                            f"{schedule.split_from!r} for pipeline stages; "
                            f"this mesh has {mi.axis_names}")
      smesh = _stages.stage_mesh(mesh, mi, mi.axis_names.index(
          schedule.split_from), schedule.stages)[0]
    return _program.build(fn, args, smesh, cluster, remat=remat,
                          schedule=schedule)

  program, data = _io.load(path, build)
  return Plan(program, data["choice"], lowering=data["lowering"],
              source=data["source"])

