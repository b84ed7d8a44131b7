"""Lowering a plan to ``jax.jit``: in/out shardings plus sharding constraints.

The plan fixes an nd-SBP for every tensor. Arguments and results become the
``in_shardings``/``out_shardings`` of ``jax.jit``. Inside, we re-interpret the
traced jaxpr equation by equation and pin, with ``with_sharding_constraint``:

* each op's output to the nd-SBP its chosen signature produces (skipped for
  ``P``: partial sums cannot be pinned on Auto axes), and
* each op's input, where the plan says that consumer needs a different layout
  than its producer made (this is where the plan's collectives happen). A
  reshard that moves several mesh axes is *staged*: every layout of the cost
  model's path (``_cost.transition_states``) is pinned in turn, one mesh axis
  at a time. Left to XLA as one constraint, such a reshard is often a full
  all-gather and a slice ("Involuntary full rematerialization"), many times
  the bytes the plan costed (``benchmarks/transitions.py`` compiles every
  pair both ways; BENCHMARKS.md section 5).
* partial sums run in *regions* (:class:`Region`): the ops that make them
  (``dot_general``, convolutions, ``reduce_sum``: :data:`LOCAL_REDUCE`) and
  the linear ops the plan carries them through (transpose, reshape, a
  grouped sum, casts, adds, slices: :data:`REGION_OPS`; a lookup in a
  table split over its rows, masked on each device as Megatron's
  vocabulary-parallel embedding; the scatter-add of an
  embedding's gradient: :func:`runs_local`) run together on each
  device's blocks inside one ``shard_map``, and each result used outside is
  reduced there, with ``psum``/``psum_scatter`` (and free slices) toward
  the layout most of its consumers want, along the model's path. GSPMD has
  no partial-sum sharding: left implicit, XLA reduces at the dot itself
  (grouped-query attention's backward: an all-reduce of the whole per-head
  gradient where the plan reduces after the head-group sum) and its dot
  partitioner often all-reduces and permutes where the plan costed a
  reduce-scatter. A gradient's reduce-scatter (a tensor no contraction
  waits on: ``Problem.combined``) is written as a ``psum`` and the
  device's slice of it, so that XLA combines them, one collective per loop
  body, as the model charges (XLA:CPU leaves each ``psum_scatter`` a
  collective of its own; a GPU turns the psum and slice into a
  reduce-scatter and combines those). A chain whose result is wanted
  before it ends is split in regions, the partial sum handed on stacked
  (:func:`stacked_spec`). Inside a chain a partial sum may move a split
  dim (one ``all_to_all``) or gather one while another axis keeps it
  partial; a whole value a member takes as a partial sum comes in as the
  ``shard_map``'s input, its producer outside. A chain the lowering cannot
  write is left to XLA whole -- one op it could not run (a gather, a
  class token's pad) cost the zoo's T5, ViT and MoE Megatron plans up to
  twice the reduce-scatters and gathers the plan costed.
* the step's results, staged into the layout they leave ``jax.jit`` in
  (left to ``out_shardings``, the reshard is one step);
* a loop's or branch's results, to the layout the plan gives them: the
  reshard at a loop's exit has no op of its own, and is staged there like
  any other (one constraint there made XLA replicate a scanned GPT's
  activations: "Involuntary full rematerialization").

Where the plan and XLA's propagation would agree anyway, the pins cost
nothing: XLA drops constraints that match what it had.

Which mechanism is used where (issue 12's list, as measured here):

* staged multi-axis reshards and ``shard_map`` partial-sum regions: in every
  pinned plan (``Plan.lowering == "pinned"``), for the reasons above;
* the jit boundary alone (``Plan.lowering == "boundary"``, no pin inside):
  the textbook plans as a user writes them, and the search's own boundary,
  are compiled that way as candidates of ``ad.plan(select="compiled")``
  (:mod:`autoddl_jax._select`), which keeps whichever program is faster.
  Left to XLA, the search's boundary compiles slower than pinned on the
  realistic zoo (BENCHMARKS.md section 1), so pinning stays the planner's
  lowering and the boundary is a candidate;
* Explicit-axis lowering (``jax.sharding.reshard``, ``out_sharding=`` on
  contractions, ``unreduced`` partial sums) is not used. Measured on every
  reshard pair of 1- and 2-axis meshes (``benchmarks/transitions.py
  --explicit``: the partial sum made by a contraction with
  ``out_sharding=PartitionSpec(..., unreduced=...)``, reduced by the
  ``reshard`` that leaves it): staged along the model's path it matches the
  model exactly where staged constraints do, and unstaged it fails where
  one constraint fails (BENCHMARKS.md section 5). It buys
  nothing the constraints and ``shard_map`` regions do not, and it would
  need every op of the step traced again on Explicit axes; staging is what
  makes XLA follow the plan, whichever way a layout is written.

Scan, cond and while bodies are rebuilt with ``lax.scan``/``lax.switch``/
``lax.while_loop`` around the same interpreter, so the layers in a scan are
pinned once for every iteration; remat keeps its policy through
``jax.checkpoint``. XLA's SPMD partitioner then emits the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding

from autoddl_jax._jaxpr import INLINE, bodies
from autoddl_jax._regions import Codes, Region, run_region
from autoddl_jax._sbp import codes_to_spec



class Pins:
  """Where to put constraints: var outputs and per-eqn inputs."""

  def __init__(self, mesh: Mesh, outputs: Mapping[tuple, Codes],
               inputs: Mapping[tuple, Codes], bodies: Mapping[tuple, Codes],
               regions: Mapping[tuple, Region] | None = None):
    self.mesh = mesh
    # ctx + (eqn index,) -> the partial-sum region the eqn belongs to: run
    # with the region's other eqns on local blocks in ``shard_map`` and
    # reduced there as the plan says (:class:`Region`).
    self.regions = regions or {}
    self.outputs = outputs  # (ctx, var) -> codes
    # (ctx + (eqn index,), operand position) -> the layouts of the reshard,
    # in order: a multi-axis reshard is staged one mesh axis at a time, as
    # the cost model charged it.
    self.inputs = inputs
    self.bodies = bodies  # (ctx, invar) of a loop/branch body -> codes

  def constrain(self, x, codes: Codes | None):
    if codes is None or not hasattr(x, "shape"):
      return x
    spec = codes_to_spec(codes, len(x.shape), self.mesh.axis_names)
    return lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def constrain_path(self, x, path: Sequence[Codes] | None):
    for codes in path or ():
      x = self.constrain(x, codes)
    return x


def interpret(jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: tuple,
              pins: Pins, pin_invars: bool = False) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = pins.constrain(a, pins.bodies.get((ctx, v))) if pin_invars else a
  pending: dict[int, list] = {}  # region -> its eqns met so far
  stacked: dict[Any, Any] = {}  # partial sums handed between regions
  # One reshard per value and path, shared by every reader that wants it
  # (as the cost model charges it): a chain of constraints per reader made
  # XLA emit the last collective once per reader -- an FSDP weight gathered
  # for the forward's dot and again for the backward's.
  resharded: dict[tuple, Any] = {}

  def operand(v, path):
    if not path or isinstance(v, jcore.Literal):
      return read(v)
    key = (v, path)
    if key not in resharded:
      resharded[key] = pins.constrain_path(read(v), path)
    return resharded[key]

  for i, eqn in enumerate(jaxpr.eqns):
    sub = ctx + (i,)
    region = pins.regions.get(sub)
    if region is not None:
      # Collected until the region's last eqn, then run as one (values made
      # inside the region stay local: they are partial sums).
      items = pending.setdefault(id(region), [])
      items.append((sub, eqn, [
          stacked[v] if (sub, j) in region.stacked_in else
          operand(v, pins.inputs.get((sub, j)))
          if (sub, j) in region.in_codes or isinstance(v, jcore.Literal)
          else None for j, v in enumerate(eqn.invars)]))
      if sub == region.members[-1]:
        outs, handed = run_region(region, pending.pop(id(region)),
                                  pins.mesh)
        for v, x in outs.items():
          env[v] = pins.constrain(x, pins.outputs.get((ctx, v)))
        stacked.update(handed)
      continue
    invals = [operand(v, pins.inputs.get((sub, j)))
              for j, v in enumerate(eqn.invars)]
    name = eqn.primitive.name
    if name in INLINE:
      outs = _inline(eqn, invals, sub, pins)
    elif name == "scan":
      outs = _staged_results(_scan(eqn, invals, sub, pins), sub, pins)
    elif name == "cond":
      outs = _cond(eqn, invals, sub, pins)
    elif name == "while":
      outs = _staged_results(_while(eqn, invals, sub, pins), sub, pins)
    else:
      outs = bind_eqn(eqn, invals, pins.mesh)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jcore.DropVar):
        env[v] = pins.constrain(x, pins.outputs.get((ctx, v)))
  return [read(v) for v in jaxpr.outvars]


def bind_eqn(eqn, invals, mesh: Mesh | None = None):
  bp = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bp, tuple):  # older jax: (subfuns, params)
    subfuns, bp = bp
  else:
    subfuns = []
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is None:
    return eqn.primitive.bind(*subfuns, *invals, **bp)
  if mesh is None:
    with ctx:
      return eqn.primitive.bind(*subfuns, *invals, **bp)
  # The equation's context (compute type, PRNG partitioning, XLA metadata) is
  # kept, but not the mesh it was traced under: a step traced inside
  # ``jax.set_mesh`` of an Explicit-axes mesh would otherwise re-enter that
  # mesh, while the planned program runs on its Auto view.
  with ctx, jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return eqn.primitive.bind(*subfuns, *invals, **bp)


def _inline(eqn, invals, ctx, pins):
  [(_, jaxpr, consts)] = bodies(eqn, ctx)
  args = invals[len(invals) - len(jaxpr.invars):]
  if eqn.primitive.name in CUSTOM_AD:
    return _custom_ad(eqn, jaxpr, consts, invals, ctx, pins)
  if eqn.primitive.name in ("remat2", "checkpoint") and eqn.params.get(
      "differentiated"):
    return _differentiated_remat(eqn, jaxpr, consts, args, ctx, pins)
  if eqn.primitive.name in ("remat2", "checkpoint"):
    fn = jax.checkpoint(
        lambda *a: interpret(jaxpr, consts, a, ctx, pins),
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"))
    return fn(*args)
  return interpret(jaxpr, consts, args, ctx, pins)


def _differentiated_remat(eqn, jaxpr, consts, args, ctx, pins):
  """A backward pass's recomputation, bound again as it was traced: marked
  ``differentiated``, so that XLA gets an optimization barrier on its inputs
  and recomputes the forward. Wrapped in a fresh ``jax.checkpoint`` instead,
  unrolled blocks' recomputations were merged with the forward by XLA's CSE
  (no FLOPs spent, no memory saved) -- scans hid it, the loop keeps the two
  apart."""
  # Its inputs are pinned as they enter (the layouts the graph's ~barrier
  # links give them: as made): left free, XLA gave a value the layout its
  # recomputed readers slice it to, sliced it before the barrier and
  # gathered it again behind it for the reader that wants it whole.
  body = jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, ctx, pins,
                                             pin_invars=True))(*args)
  j = body.jaxpr
  open_body = jcore.Jaxpr([], [*j.constvars, *j.invars], j.outvars, j.eqns,
                          effects=j.effects,
                          debug_info=j.debug_info.with_unknown_names())
  return bind_eqn(eqn.replace(params={**eqn.params, "jaxpr": open_body}),
               [*body.consts, *args], pins.mesh)


# Calls with user-defined derivatives: the body is interpreted with its pins,
# and the call is bound again around it, so that differentiating the planned
# function (``jax.grad(plan.jit())``) still uses the user's rule.
CUSTOM_AD = ("custom_jvp_call", "custom_vjp_call")


def _custom_ad(eqn, jaxpr, consts, invals, ctx, pins):
  body = jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, ctx, pins))(
      *invals)
  return bind_eqn(eqn.replace(params={**eqn.params, "call_jaxpr": body}),
               invals, pins.mesh)


def _scan(eqn, invals, ctx, pins):
  p = eqn.params
  [(_, body, consts)] = bodies(eqn, ctx)
  nc, ncar = p["num_consts"], p["num_carry"]
  const_in, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]

  def step(carry, x):
    outs = interpret(body, consts, [*const_in, *carry, *x], ctx, pins,
                     pin_invars=True)
    # The carry goes back to the layout it came in with, staged as costed.
    new = [pins.constrain_path(c, pins.inputs.get((ctx, ("carry", j))))
           for j, c in enumerate(outs[:ncar])]
    # and each stacked result to the layout it is stacked in.
    ys = [pins.constrain_path(y, pins.inputs.get((ctx, ("ys", j))))
          for j, y in enumerate(outs[ncar:])]
    return new, ys

  kw = {}
  if "_split_transpose" in p:
    kw["_split_transpose"] = p["_split_transpose"]
  carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                       reverse=p["reverse"], unroll=p["unroll"], **kw)
  return [*carry, *ys]


def _staged_results(outs, ctx, pins, tag: str = "out"):
  """Results resharded to the plan's layouts, staged one mesh axis at a
  time: a loop's carried results (``tag="out"``, from the layout the loop
  carried them in) or the step's (``tag="result"``, into the layout they
  leave the jit in)."""
  return [pins.constrain_path(x, pins.inputs.get((ctx, (tag, j))))
          for j, x in enumerate(outs)]


def _cond(eqn, invals, ctx, pins):
  index, ops = invals[0], invals[1:]
  fns = []
  for bctx, jx, consts in bodies(eqn, ctx):
    fns.append(lambda *a, jx=jx, consts=consts, bctx=bctx: interpret(
        jx, consts, a, bctx, pins, pin_invars=True))
  return lax.switch(index, fns, *ops)


def _while(eqn, invals, ctx, pins):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cc, bc, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  (cctx, cj, cconsts), (bctx, bj, bconsts) = bodies(eqn, ctx)

  def cond(carry):
    return interpret(cj, cconsts, [*cc, *carry], cctx, pins)[0]

  def body(carry):
    return interpret(bj, bconsts, [*bc, *carry], bctx, pins,
                     pin_invars=True)

  return lax.while_loop(cond, body, list(init))


def planned_function(closed_jaxpr, in_tree, out_tree, pins: Pins,
                     in_names: Sequence[str] | None = None
                     ) -> Callable[..., Any]:
  """A Python function computing the traced program with the plan's pins.

  It takes exactly the argument structure, shapes and dtypes the program was
  traced with: the traced program has those shapes baked in (a mean divides
  by the planned batch size), so other arguments raise ``TypeError``.
  """
  want = [(tuple(a.shape), a.dtype) for a in closed_jaxpr.in_avals]
  names = list(in_names) if in_names is not None else [
      f"leaf {i}" for i in range(len(want))]

  def fn(*args):
    flat, tree = jax.tree_util.tree_flatten(args)
    if tree != in_tree:
      raise TypeError(f"planned function called with arguments of structure "
                      f"{tree}, but it was planned for {in_tree}")
    # Under jax.jit every leaf is a tracer with a shape and a dtype.
    got = [(tuple(x.shape), x.dtype) for x in flat]
    bad = [(n, w, g) for n, w, g in zip(names, want, got) if g != w]
    if bad:
      fmt = lambda t: f"{t[1]}{list(t[0])}"  # noqa: E731
      raise TypeError(
          "the planned step was called with other argument shapes or dtypes "
          "than it was planned for (a plan is made for one signature): " +
          "; ".join(f"{n} planned {fmt(w)}, given {fmt(g)}"
                    for n, w, g in bad[:5]) +
          (f"; and {len(bad) - 5} more" if len(bad) > 5 else "") +
          ". Plan again for these arguments (ad.plan), or use "
          "ad.auto_shard, which plans each new signature once and caches it.")
    # Run on the plan's (Auto-axes) mesh, whatever mesh the caller set with
    # ``jax.set_mesh``: the constraints and the argument types refer to it.
    with jax.sharding.use_abstract_mesh(pins.mesh.abstract_mesh):
      outs = interpret(closed_jaxpr.jaxpr, closed_jaxpr.consts, flat, (),
                       pins)
      outs = _staged_results(outs, (), pins, "result")
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return fn
