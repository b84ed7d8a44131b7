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
  the bytes the plan costed (``benchmarks/transitions.py``: on a (2, 4) mesh
  79 of 135 rank-2 reshards matched the model unstaged, 135 staged).
* partial sums run in *regions* (:class:`Region`): the ops that make them
  (``dot_general``, convolutions, ``reduce_sum``: :data:`LOCAL_REDUCE`) and
  the linear ops the plan carries them through (transpose, reshape, a
  grouped sum, casts, adds: :data:`REGION_OPS`; the scatter-add of an
  embedding's gradient: :func:`runs_local`) run together on each
  device's blocks inside one ``shard_map``, and each result used outside is
  reduced there, with ``psum``/``psum_scatter`` (and free slices) toward
  the layout most of its consumers want, along the model's path. GSPMD has
  no partial-sum sharding: left implicit, XLA reduces at the dot itself
  (grouped-query attention's backward: a 384 MiB all-reduce per layer where
  the plan reduced 4x less after the head-group sum) and its dot
  partitioner often all-reduces and permutes where the plan costed a
  reduce-scatter. A chain whose result is wanted before it ends is split in
  regions, the partial sum handed on stacked (:func:`stacked_spec`). A
  chain the lowering cannot write is left to XLA.
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
  (:mod:`autoddl_jax._select`), which keeps whichever program is faster. On
  the realistic zoo the search's boundary left to XLA compiled 2x slower
  than pinned (llama, (2, 4): 63.9 against 31.8 ms; BENCHMARKS.md §1), so
  pinning stays the planner's lowering and the boundary is a candidate;
* Explicit-axis lowering (``jax.sharding.reshard``, ``out_sharding=`` on
  contractions, ``unreduced`` partial sums) is not used. Measured on every
  reshard pair of 1- and 2-axis meshes (``benchmarks/transitions.py
  --explicit``: the partial sum made by a contraction with
  ``out_sharding=PartitionSpec(..., unreduced=...)``, reduced by the
  ``reshard`` that leaves it): staged along the model's path it matches the
  model on 1063 of 1063 pairs -- exactly what staged constraints do -- and
  as one ``reshard`` per transition on 669 (one constraint: 677). It buys
  nothing the constraints and ``shard_map`` regions do not, and it would
  need every op of the step traced again on Explicit axes; staging is what
  makes XLA follow the plan, whichever way a layout is written.

Scan, cond and while bodies are rebuilt with ``lax.scan``/``lax.switch``/
``lax.while_loop`` around the same interpreter, so the layers in a scan are
pinned once for every iteration; remat keeps its policy through
``jax.checkpoint``. XLA's SPMD partitioner then emits the collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoddl_jax._cost import transition_states
from autoddl_jax._graph import INLINE, _closed, _sub_jaxpr
from autoddl_jax._sbp import B_CODE, P_CODE, codes_to_spec

Codes = tuple[int, ...]


# Ops whose partial-sum results are reduced explicitly (their parameters
# name no shapes, so they bind on local blocks unchanged).
LOCAL_REDUCE = frozenset({"dot_general", "conv_general_dilated", "reduce_sum"})
# Ops a partial-sum region (:class:`Region`) may hold besides those: linear
# in their partial operands, so each device's addend goes through them on
# its own, and bindable on local blocks (:func:`_bind_local`).
REGION_OPS = LOCAL_REDUCE | frozenset({
    "transpose", "reshape", "broadcast_in_dim", "convert_element_type", "neg",
    "mul", "div", "add", "sub", "add_any", "squeeze", "copy",
    "select_n", "split", "concatenate", "cumsum"})

# A local step on a block: ("psum" | "psum_scatter" | "slice" | "own",
# mesh axes, dim). "own" makes a whole value a partial sum over its axes
# (the first device keeps it, the others hold zeros: B -> P).
Reduction = tuple[str, tuple[str, ...], "int | None"]



def runs_local(prim: str, cand: Sequence[Codes]) -> bool:
  """Whether an op with candidate ``cand`` (codes per slot) computes its
  block of the result from its operands' blocks alone, so that a region
  can run it: the :data:`REGION_OPS`, and a scatter-add whose operand is
  split on no axis its updates are not (rows of a split table take
  global indices; XLA masks them, a local scatter would not)."""
  if prim in REGION_OPS:
    return True
  if prim == "scatter-add":
    operand, _, updates = cand[:3]
    return all(o < 0 or u >= 0 for o, u in zip(operand, updates))
  return False


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
  for i, eqn in enumerate(jaxpr.eqns):
    sub = ctx + (i,)
    region = pins.regions.get(sub)
    if region is not None:
      # Collected until the region's last eqn, then run as one (values made
      # inside the region stay local: they are partial sums).
      items = pending.setdefault(id(region), [])
      items.append((sub, eqn, [
          stacked[v] if (sub, j) in region.stacked_in else
          pins.constrain_path(read(v), pins.inputs.get((sub, j)))
          if (sub, j) in region.in_codes or isinstance(v, jcore.Literal)
          else None for j, v in enumerate(eqn.invars)]))
      if sub == region.members[-1]:
        outs, handed = run_region(region, pending.pop(id(region)),
                                  pins.mesh)
        for v, x in outs.items():
          env[v] = pins.constrain(x, pins.outputs.get((ctx, v)))
        stacked.update(handed)
      continue
    invals = [read(v) for v in eqn.invars]
    invals = [pins.constrain_path(x, pins.inputs.get((sub, j)))
              for j, x in enumerate(invals)]
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
      outs = _bind(eqn, invals, pins.mesh)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jcore.DropVar):
        env[v] = pins.constrain(x, pins.outputs.get((ctx, v)))
  return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals, mesh: Mesh | None = None):
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


def reductions(have: Codes, target: Codes, nbytes: float,
               shape: tuple[int, ...], mi: Any
               ) -> tuple[list[Reduction], PartitionSpec] | None:
  """The partial sums of ``have`` reduced toward ``target`` along the cost
  model's path (``_cost.transition_states``), up to its last reduction:
  ``("psum", axes, None)``, ``("psum_scatter", (axis,), dim)`` or a free
  ``("slice", (axis,), dim)`` per step, and the spec of the result (its dims'
  axes in the order the steps tiled them: a scatter against the mesh order
  is left for the next constraint to permute, as the model charges it).
  None where the target keeps a partial sum or the path moves something
  else first."""
  names = mi.axis_names
  cur, steps = tuple(have), []
  tiles: list[list[str]] = [[] for _ in shape]
  for a, c in enumerate(have):
    if c >= 0:
      tiles[c].append(names[a])
  for st in transition_states(have, target, nbytes, shape, mi):
    if P_CODE not in cur:
      break
    changed = [a for a in range(len(cur)) if cur[a] != st[a]]
    if any(cur[a] not in (P_CODE, B_CODE) for a in changed):
      return None
    reduce_to_b = [a for a in changed if cur[a] == P_CODE and st[a] == B_CODE]
    if any(st[a] < 0 and a not in reduce_to_b for a in changed):
      return None  # B -> P, or P -> P: nothing to write
    # Slices first (the reduction then moves the smaller blocks), then the
    # joint all-reduce, then the scatters.
    for a in changed:
      if cur[a] == B_CODE:
        steps.append(("slice", (names[a],), st[a]))
        tiles[st[a]].append(names[a])
    if reduce_to_b:
      steps.append(("psum", tuple(names[a] for a in reduce_to_b), None))
    for a in changed:
      if cur[a] == P_CODE and st[a] >= 0:
        steps.append(("psum_scatter", (names[a],), st[a]))
        tiles[st[a]].append(names[a])
    cur = st
  if P_CODE in cur:
    return None
  entries = [None if not t else (t[0] if len(t) == 1 else tuple(t))
             for t in tiles]
  return steps, PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class Region:
  """Ops that carry partial sums from the ops that make them to where the
  plan reduces them, run together on each device's blocks in one
  ``shard_map``: GSPMD has no partial-sum sharding, so left to XLA a dot
  whose result the plan keeps partial through a transpose, a reshape and a
  reduce_sum (grouped-query attention's backward) is all-reduced at the dot,
  at its full size, instead of where the plan reduces it.

  Keys are eqn keys (call context + (eqn index,)), members in program order.
  ``in_codes``: operands from outside, by the layout they come in (none
  partial). ``stacked_in``: partial sums made by an earlier region of the
  same chain, handed over *stacked* -- a leading dim with one addend per
  device of the partial axes (:func:`stacked_spec`), so that no value ever
  claims a layout it does not have -- by the producer's layout.
  ``slices``: the steps (free slices, then reductions: :data:`Reduction`)
  an operand made inside takes on its way to a member that wants it in
  another layout. ``out_codes``: every
  member result's layout. ``reduce``: per result used by ops outside the
  chain, the reductions (:func:`reductions`) and the spec it leaves with.
  ``stacked_out``: per result a later region takes, its layout."""

  members: tuple[tuple, ...]
  in_codes: Mapping[tuple[tuple, int], Codes]
  out_codes: Mapping[tuple[tuple, int], Codes]
  reduce: Mapping[tuple[tuple, int], tuple[list[Reduction], Any]]
  stacked_in: Mapping[tuple[tuple, int], Codes] = dataclasses.field(
      default_factory=dict)
  slices: Mapping[tuple[tuple, int], tuple[Reduction, ...]] = \
      dataclasses.field(default_factory=dict)
  stacked_out: Mapping[tuple[tuple, int], Codes] = dataclasses.field(
      default_factory=dict)


def stacked_spec(codes: Codes, rank: int, names: Sequence[str]
                 ) -> PartitionSpec:
  """The spec of a partial sum held stacked: a leading dim over the partial
  axes (each device's block is its addend), then the value's own dims."""
  p_axes = tuple(n for n, c in zip(names, codes) if c == P_CODE)
  rest = codes_to_spec(tuple(B_CODE if c == P_CODE else c for c in codes),
                       rank, names)
  return PartitionSpec(p_axes if len(p_axes) > 1 else p_axes[0], *rest)


def _local_shape(shape, codes: Codes | None, mesh: Mesh) -> tuple[int, ...]:
  out = list(shape)
  for a, c in enumerate(codes or ()):
    if c >= 0:
      out[c] //= mesh.shape[mesh.axis_names[a]]
  return tuple(out)


def _bind_local(eqn, args, out_codes: Sequence[Codes | None], mesh: Mesh):
  """Binds ``eqn`` on local blocks: parameters that name result shapes
  (reshape, broadcast_in_dim, split) get the blocks' shapes."""
  bp = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bp, tuple):
    bp = bp[1]
  bp = dict(bp)
  for k in ("out_sharding", "sharding"):
    if k in bp:
      bp[k] = None  # a local op on a manual mesh
  name = eqn.primitive.name
  if name in ("reshape", "broadcast_in_dim", "split"):
    shapes = [_local_shape(v.aval.shape, c, mesh)
              for v, c in zip(eqn.outvars, out_codes)]
    if name == "reshape":
      bp["new_sizes"] = shapes[0]
    elif name == "broadcast_in_dim":
      bp["shape"] = shapes[0]
    else:
      bp["sizes"] = tuple(sh[bp["axis"]] for sh in shapes)
  return eqn.primitive.bind(*args, **bp)


def _apply_reductions(x, steps: Sequence[Reduction], mesh: Mesh):
  for kind, axes, dim in steps:
    if kind == "psum":
      x = lax.psum(x, axes)
    elif kind == "psum_scatter":
      x = lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    elif kind == "own":  # a whole value as a partial sum: one addend
      keep = functools.reduce(operator.and_, [lax.axis_index(a) == 0
                                              for a in axes])
      x = jnp.where(keep, x, jnp.zeros_like(x))
    else:  # a slice of a partial sum is the partial sum of the slice
      n = x.shape[dim] // mesh.shape[axes[0]]
      x = lax.dynamic_slice_in_dim(x, lax.axis_index(axes[0]) * n, n,
                                   axis=dim)
  return x


def run_region(region: Region, items: Sequence[tuple[tuple, Any, list]],
               mesh: Mesh) -> tuple[dict[Any, Any], dict[Any, Any]]:
  """Runs a region's equations (``items``: (key, eqn, operand values: the
  stacked value for a ``stacked_in`` operand, None for those made inside))
  on each device's blocks and reduces its results there with
  ``psum``/``psum_scatter``, so that XLA emits exactly the collectives the
  plan costed. Returns the global value of each result used outside and
  the stacked value of each result a later region takes, by jaxpr
  variable."""
  names = mesh.axis_names
  ext, ext_specs = [], []
  for key, eqn, invals in items:
    for j, x in enumerate(invals):
      if (key, j) in region.in_codes:
        ext.append(x)
        ext_specs.append(codes_to_spec(region.in_codes[(key, j)],
                                       len(x.shape), names))
      elif (key, j) in region.stacked_in:
        ext.append(x)
        ext_specs.append(stacked_spec(region.stacked_in[(key, j)],
                                      len(x.shape) - 1, names))
  used = [(key, eqn, s) for key, eqn, _ in items
          for s in range(len(eqn.outvars)) if (key, s) in region.reduce]
  handed = [(key, eqn, s) for key, eqn, _ in items
            for s in range(len(eqn.outvars)) if (key, s) in region.stacked_out]
  out_specs = []
  for key, eqn, s in used:
    final = region.reduce[(key, s)][1]
    out_specs.append(final if isinstance(final, PartitionSpec) else
                     codes_to_spec(final, len(eqn.outvars[s].aval.shape),
                                   names))
  for key, eqn, s in handed:
    out_specs.append(stacked_spec(region.stacked_out[(key, s)],
                                  len(eqn.outvars[s].aval.shape), names))

  def body(*xs):
    it, local = iter(xs), {}
    for key, eqn, _ in items:
      args = []
      for j, v in enumerate(eqn.invars):
        if (key, j) in region.in_codes:
          x = next(it)
        elif (key, j) in region.stacked_in:
          x = next(it)[0]
        elif isinstance(v, jcore.Literal):
          x = v.val
        else:
          x = local[v]
        args.append(_apply_reductions(x, region.slices.get((key, j), ()),
                                      mesh))
      r = _bind_local(eqn, args, [region.out_codes.get((key, s)) for s in
                                  range(len(eqn.outvars))], mesh)
      rs = list(r) if eqn.primitive.multiple_results else [r]
      for v, x in zip(eqn.outvars, rs):
        if not isinstance(v, jcore.DropVar):
          local[v] = x
    return (*(_apply_reductions(local[eqn.outvars[s]],
                                region.reduce[(key, s)][0], mesh)
              for key, eqn, s in used),
            *(local[eqn.outvars[s]][None] for key, eqn, s in handed))

  vals = jax.shard_map(body, mesh=mesh, in_specs=tuple(ext_specs),
                       out_specs=tuple(out_specs), check_vma=False)(*ext)
  outs = {eqn.outvars[s]: x for (_, eqn, s), x in zip(used, vals)}
  stacked = {eqn.outvars[s]: x
             for (_, eqn, s), x in zip(handed, vals[len(used):])}
  return outs, stacked


def _local_reduce(eqn, invals, spec, mesh: Mesh):
  """One op whose partial-sum results are reduced on the device: a region
  of one equation (``spec``: operand codes, (reductions, final) per
  result)."""
  in_codes, out_plans = spec
  key = ("local",)
  region = Region((key,), {(key, j): c for j, c in enumerate(in_codes)}, {},
                  {(key, s): r for s, r in enumerate(out_plans)})
  outs, _ = run_region(region, [(key, eqn, list(invals))], mesh)
  res = [outs[v] for v in eqn.outvars]
  return res if eqn.primitive.multiple_results else res[0]


def _inline(eqn, invals, ctx, pins):
  jaxpr, consts = _sub_jaxpr(eqn.params)
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
  body = jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, ctx, pins))(
      *args)
  j = body.jaxpr
  open_body = jcore.Jaxpr([], [*j.constvars, *j.invars], j.outvars, j.eqns,
                          effects=j.effects,
                          debug_info=j.debug_info.with_unknown_names())
  return _bind(eqn.replace(params={**eqn.params, "jaxpr": open_body}),
               [*body.consts, *args], pins.mesh)


# Calls with user-defined derivatives: the body is interpreted with its pins,
# and the call is bound again around it, so that differentiating the planned
# function (``jax.grad(plan.jit())``) still uses the user's rule.
CUSTOM_AD = ("custom_jvp_call", "custom_vjp_call")


def _custom_ad(eqn, jaxpr, consts, invals, ctx, pins):
  body = jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, ctx, pins))(
      *invals)
  return _bind(eqn.replace(params={**eqn.params, "call_jaxpr": body}),
               invals, pins.mesh)


def _scan(eqn, invals, ctx, pins):
  p = eqn.params
  body, consts = _closed(p["jaxpr"])
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
  for b, br in enumerate(eqn.params["branches"]):
    jx, consts = _closed(br)
    fns.append(lambda *a, jx=jx, consts=consts, b=b: interpret(
        jx, consts, a, ctx + (b,), pins, pin_invars=True))
  return lax.switch(index, fns, *ops)


def _while(eqn, invals, ctx, pins):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cc, bc, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  cj, cconsts = _closed(p["cond_jaxpr"])
  bj, bconsts = _closed(p["body_jaxpr"])

  def cond(carry):
    return interpret(cj, cconsts, [*cc, *carry], ctx + ("cond",), pins)[0]

  def body(carry):
    return interpret(bj, bconsts, [*bc, *carry], ctx + ("body",), pins,
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
