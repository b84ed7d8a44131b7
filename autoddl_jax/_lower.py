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
* ops whose results are partial sums (``dot_general``, convolutions,
  ``reduce_sum``: :data:`LOCAL_REDUCE`) run on each device's blocks inside
  ``shard_map`` and are reduced there, with ``psum``/``psum_scatter`` (and
  free slices) toward the layout most of their consumers want, along the
  model's path. Left implicit, XLA's dot partitioner picks where and how to
  reduce -- often an all-reduce and a collective-permute where the plan
  costed a reduce-scatter.

Where the plan and XLA's propagation would agree anyway, the pins cost
nothing: XLA drops constraints that match what it had.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoddl_jax._cost import transition_states
from autoddl_jax._graph import INLINE, _closed, _sub_jaxpr
from autoddl_jax._sbp import B_CODE, P_CODE, codes_to_spec

Codes = tuple[int, ...]


# Ops whose partial-sum results are reduced explicitly (their parameters
# name no shapes, so they bind on local blocks unchanged).
LOCAL_REDUCE = frozenset({"dot_general", "conv_general_dilated", "reduce_sum"})

Reduction = tuple[str, tuple[str, ...], "int | None"]


class Pins:
  """Where to put constraints: var outputs and per-eqn inputs."""

  def __init__(self, mesh: Mesh, outputs: Mapping[tuple, Codes],
               inputs: Mapping[tuple, Codes], bodies: Mapping[tuple, Codes],
               local: Mapping[tuple, Any] | None = None):
    self.mesh = mesh
    # ctx + (eqn index,) -> (operand codes, ((reductions, codes after) per
    # result)): an op whose results are partial sums, run on its local
    # blocks inside ``shard_map`` and reduced there as the plan says.
    self.local = local or {}
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
  for i, eqn in enumerate(jaxpr.eqns):
    sub = ctx + (i,)
    invals = [read(v) for v in eqn.invars]
    invals = [pins.constrain_path(x, pins.inputs.get((sub, j)))
              for j, x in enumerate(invals)]
    name = eqn.primitive.name
    if name in INLINE:
      outs = _inline(eqn, invals, sub, pins)
    elif name == "scan":
      outs = _scan(eqn, invals, sub, pins)
    elif name == "cond":
      outs = _cond(eqn, invals, sub, pins)
    elif name == "while":
      outs = _while(eqn, invals, sub, pins)
    elif sub in pins.local:
      outs = _local_reduce(eqn, invals, pins.local[sub], pins.mesh)
      if not eqn.primitive.multiple_results:
        outs = [outs]
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


def _local_reduce(eqn, invals, spec, mesh: Mesh):
  """Binds ``eqn`` on each device's blocks (``shard_map``) and reduces its
  partial-sum results there with ``psum``/``psum_scatter``: XLA then emits
  exactly the reduce-scatter or all-reduce the plan costed. (Left implicit,
  XLA's dot partitioner often all-reduces and permutes instead:
  ``benchmarks/transitions.py``.)"""
  in_codes, out_plans = spec
  names = mesh.axis_names
  in_specs = tuple(codes_to_spec(c, len(x.shape), names)
                   for c, x in zip(in_codes, invals))
  out_specs = tuple(final if isinstance(final, PartitionSpec) else
                    codes_to_spec(final, len(v.aval.shape), names)
                    for (_, final), v in zip(out_plans, eqn.outvars))
  bp = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bp, tuple):
    bp = bp[1]
  bp = dict(bp)
  if "out_sharding" in bp:
    bp["out_sharding"] = None  # a local op on a manual mesh

  def body(*xs):
    r = eqn.primitive.bind(*xs, **bp)
    rs = list(r) if eqn.primitive.multiple_results else [r]
    for i, (steps, _) in enumerate(out_plans):
      for kind, axes, dim in steps:
        if kind == "psum":
          rs[i] = lax.psum(rs[i], axes)
        elif kind == "psum_scatter":
          rs[i] = lax.psum_scatter(rs[i], axes, scatter_dimension=dim,
                                   tiled=True)
        else:  # a slice of a partial sum is the partial sum of the slice
          n = rs[i].shape[dim] // mesh.shape[axes[0]]
          rs[i] = lax.dynamic_slice_in_dim(
              rs[i], lax.axis_index(axes[0]) * n, n, axis=dim)
    return tuple(rs)

  outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)(*invals)
  return list(outs) if eqn.primitive.multiple_results else outs[0]


def _inline(eqn, invals, ctx, pins):
  jaxpr, consts = _sub_jaxpr(eqn.params)
  args = invals[len(invals) - len(jaxpr.invars):]
  if eqn.primitive.name in CUSTOM_AD:
    return _custom_ad(eqn, jaxpr, consts, invals, ctx, pins)
  if eqn.primitive.name in ("remat2", "checkpoint"):
    fn = jax.checkpoint(
        lambda *a: interpret(jaxpr, consts, a, ctx, pins),
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"))
    return fn(*args)
  return interpret(jaxpr, consts, args, ctx, pins)


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
    return new, outs[ncar:]

  kw = {}
  if "_split_transpose" in p:
    kw["_split_transpose"] = p["_split_transpose"]
  carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                       reverse=p["reverse"], unroll=p["unroll"], **kw)
  return [*carry, *ys]


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
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return fn
