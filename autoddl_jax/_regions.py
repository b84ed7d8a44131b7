"""Partial-sum regions: ops run on each device's blocks, reduced as planned.

GSPMD has no partial-sum sharding: left implicit, XLA reduces a partial
sum at the op that made it. A :class:`Region` is a set of equations the plan
carries partial sums through -- the ops that make them
(:data:`LOCAL_REDUCE`) and the linear ops after them (:data:`REGION_OPS`,
:func:`runs_local`) -- run together inside one ``shard_map`` on local
blocks; each result used outside is reduced there toward the layout its
consumers want, along the cost model's path (:func:`reductions`: ``psum``,
``psum_scatter``, free slices). :func:`run_region` runs one;
:mod:`autoddl_jax._pins` decides them and :mod:`autoddl_jax._lower` calls
them where the interpreter meets them.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import Mesh, PartitionSpec

from autoddl_jax._cost import transition_states
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
    "select_n", "split", "concatenate", "cumsum", "gather", "slice",
    "dynamic_slice"})

# A local step on a block: ("psum" | "psum_scatter" | "psum_slice" |
# "slice" | "own" | "all_gather" | "all_to_all", mesh axes, dim: for an
# all-to-all the (split, new split) dims). "own" makes a whole value
# a partial sum over its axes (the first device keeps it, the others hold
# zeros: B -> P); "all_gather" makes a split dim whole while another axis
# keeps the partial sum.
# "psum_slice" is a reduce-scatter written as a psum and the device's slice
# of it: how a gradient's is written (``Problem.combined``), because XLA's
# combiners merge those into one collective per loop body (on CPU an
# all-reduce whose readers slice; a GPU turns it into a reduce-scatter and
# combines those), where native reduce-scatters stay one per tensor on CPU.
Reduction = tuple[str, tuple[str, ...], "int | tuple[int, int] | None"]



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


def reductions(have: Codes, target: Codes, nbytes: float,
               shape: tuple[int, ...], mi: Any, combined: bool = False
               ) -> tuple[list[Reduction], PartitionSpec] | None:
  """The partial sums of ``have`` reduced toward ``target`` along the cost
  model's path (``_cost.transition_states``), up to its last reduction:
  ``("psum", axes, None)``, ``("psum_scatter", (axis,), dim)`` (or
  ``"psum_slice"`` when the tensor's reductions are ``combined``) or a free
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
        steps.append(("psum_slice" if combined else "psum_scatter",
                      (names[a],), st[a]))
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
  ``stacked_out``: per result a later region takes, its layout.
  ``gather_codes``: per gather, its table's layout (a table split on an
  indexed dim is looked up on each device's rows, the rest masked:
  :func:`_local_gather`)."""

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
  gather_codes: Mapping[tuple, Codes] = dataclasses.field(
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


def _bind_local(eqn, args, out_codes: Sequence[Codes | None], mesh: Mesh,
                table_codes: Codes | None = None):
  """Binds ``eqn`` on local blocks: parameters that name result shapes
  (reshape, broadcast_in_dim, split) get the blocks' shapes; a gather its
  table's blocks (``table_codes``: :func:`_local_gather`)."""
  bp = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bp, tuple):
    bp = bp[1]
  bp = dict(bp)
  for k in ("out_sharding", "sharding"):
    if k in bp:
      bp[k] = None  # a local op on a manual mesh
  name = eqn.primitive.name
  if name == "gather":
    return _local_gather(eqn, args, bp, table_codes, mesh)
  if name in ("slice", "dynamic_slice"):
    # Only dims taken whole may be split (the rules' signatures): on a block
    # they are taken whole too.
    key = "limit_indices" if name == "slice" else "slice_sizes"
    gshape = eqn.invars[0].aval.shape
    bp[key] = tuple(args[0].shape[d] if args[0].shape[d] != n else v
                    for d, (n, v) in enumerate(zip(gshape, bp[key])))
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


def _local_gather(eqn, args, bp, table_codes: Codes | None, mesh: Mesh):
  """A gather on local blocks. Dims of the table the lookup takes whole
  take the block's size; a table split on an indexed dim (an embedding
  split over its vocabulary) is looked up by each device in the rows it
  owns, at the index less its block's first row, and the rows it does not
  own are zeros: the partial sum the plan's signature (S(d) -> P) says,
  summed over the split axes it is the global gather, out-of-bounds
  indices included (clamped, or the fill value on one device -- also where
  the table is itself a partial sum)."""
  table, idx = args
  gshape = eqn.invars[0].aval.shape
  dn = bp["dimension_numbers"]
  sizes = list(bp["slice_sizes"])
  for d, n in enumerate(gshape):
    if table.shape[d] != n and sizes[d] == n:
      sizes[d] = table.shape[d]
  bp["slice_sizes"] = tuple(sizes)
  masked = [(k, d) for k, d in enumerate(dn.start_index_map)
            if table.shape[d] != gshape[d]]
  mode = lax.GatherScatterMode.from_any(bp["mode"])
  fill = mode == lax.GatherScatterMode.FILL_OR_DROP
  # A table that is a partial sum over some axes holds an addend of every
  # row there; the fill value belongs to the sum once, not to each addend.
  partial = [a for a, c in zip(mesh.axis_names, table_codes or ())
             if c == P_CODE]
  if not masked and not (fill and partial):
    return eqn.primitive.bind(table, idx, **bp)
  if any(sizes[d] != 1 for _, d in masked):
    raise NotImplementedError(
        f"a gather of slices {tuple(sizes)} from a table split on an indexed "
        f"dim: only single-row lookups (slice size 1) are run on blocks")
  starts = [idx[..., k] for k in range(idx.shape[-1])]
  # The global index's meaning first: clamped, or (FILL) out of bounds.
  valid = jnp.ones(idx.shape[:-1], bool)
  for k, d in enumerate(dn.start_index_map):
    hi = gshape[d] - bp["slice_sizes"][d] if (k, d) not in masked else \
        gshape[d] - 1
    if fill:
      valid &= (starts[k] >= 0) & (starts[k] <= hi)
    starts[k] = jnp.clip(starts[k], 0, hi)
  mine = jnp.ones(idx.shape[:-1], bool)
  first = functools.reduce(lambda f, a: f & (lax.axis_index(a) == 0),
                           partial, jnp.asarray(True))
  for k, d in masked:
    axes = [a for a, c in zip(mesh.axis_names, table_codes) if c == d]
    block = functools.reduce(lambda b, a: b * mesh.shape[a] +
                             lax.axis_index(a), axes, 0)
    first &= block == 0
    local = starts[k] - block * table.shape[d]
    mine &= (local >= 0) & (local < table.shape[d])
    starts[k] = jnp.clip(local, 0, table.shape[d] - 1)
  bp["mode"] = lax.GatherScatterMode.CLIP
  out = eqn.primitive.bind(table, jnp.stack(starts, -1).astype(idx.dtype),
                           **bp)
  batch = [d for d in range(out.ndim) if d not in dn.offset_dims]
  def expand(m):  # index batch dims -> the result's, offset dims broadcast
    return lax.broadcast_in_dim(m, out.shape, tuple(batch))
  out = jnp.where(expand(mine & valid), out, jnp.zeros_like(out))
  if fill:
    value = bp.get("fill_value")
    value = jnp.nan if value is None else value
    out = jnp.where(expand(~valid) & first, jnp.asarray(value, out.dtype),
                    out)
  return out


def _apply_reductions(x, steps: Sequence[Reduction], mesh: Mesh):
  for kind, axes, dim in steps:
    if kind == "psum":
      x = lax.psum(x, axes)
    elif kind == "psum_scatter":
      x = lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    elif kind == "all_gather":  # a split dim made whole, still partial
      x = lax.all_gather(x, axes[0], axis=dim, tiled=True)
    elif kind == "all_to_all":  # S(h) -> S(w) on one axis, still partial
      h, w = dim
      x = lax.all_to_all(x, axes[0], split_axis=w, concat_axis=h, tiled=True)
    elif kind == "psum_slice":
      x = lax.psum(x, axes)
      n = x.shape[dim] // mesh.shape[axes[0]]
      x = lax.dynamic_slice_in_dim(x, lax.axis_index(axes[0]) * n, n,
                                   axis=dim)
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
                                  range(len(eqn.outvars))], mesh,
                      region.gather_codes.get(key))
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


def local_reduce(eqn, invals, spec, mesh: Mesh):
  """One op whose partial-sum results are reduced on the device: a region
  of one equation (``spec``: operand codes, (reductions, final) per
  result). ``benchmarks/transitions.py`` makes its partial sums so."""
  in_codes, out_plans = spec
  key = ("local",)
  region = Region((key,), {(key, j): c for j, c in enumerate(in_codes)}, {},
                  {(key, s): r for s, r in enumerate(out_plans)})
  outs, _ = run_region(region, [(key, eqn, list(invals))], mesh)
  res = [outs[v] for v in eqn.outvars]
  return res if eqn.primitive.multiple_results else res[0]
