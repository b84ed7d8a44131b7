"""Which dim of each weight a Megatron layout splits, read from the dataflow.

Megatron-style tensor parallelism splits a matmul's weight by its output
features (column-parallel) when its input activation is whole, and by its
input features (row-parallel) when its input is the split output of an
earlier column-parallel matmul -- so the pair needs one all-reduce. Public
model code gives no order to rely on: attention has three column-parallel
projections (Q, K, V) before its row-parallel output, SwiGLU two (gate, up)
before ``down``; kernels are 3-D ``(d_model, heads, head_dim)``; a
``lax.scan`` over stacked layers uses every weight in the same equation.
So the roles are read off the forward pass, the way XLA's propagation would
carry a split:

* every activation carries the dim a column-parallel matmul split (the
  attention heads, the MLP's hidden units) or none, carried through
  elementwise ops, broadcasts, reshapes, transposes, reductions over other
  dims and loops; a reduction, a ``top_k`` or a contraction over that dim
  ends it (the sum is then whole);
* at a weight's first matmul (``dot_general``, a convolution) in program
  order -- the forward pass comes first -- the weight is row-parallel if
  the activation's split dim is contracted (the weight splits the matching
  dim: the heads of an attention output kernel ``(heads, head_dim,
  d_model)``, the hidden units of ``down``); column-parallel if the
  activation is whole (its output dims after the contracted ones first: the
  heads of ``(d_model, heads, head_dim)``, ``f`` of an ``(experts, d, f)``
  expert kernel); its result is then split on that dim;
* a weight whose activation is the raw input (no parameter met yet: a
  ViT's patch projection, a CNN's stem) stays whole, as does its result,
  so the residual stream is whole; a table first read by ``gather`` (an
  embedding) is split along the dim it is indexed by (the vocabulary).

A weight is followed through dtype converts, transposes, copies and the
slicing of a scanned stack (its leading dim is the layer). Weights that
never meet a matmul (norm scales, biases) get no dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from autoddl_jax import _jaxpr

# Ops a weight passes through unchanged but for its dtype.
_SAME = frozenset({"convert_element_type", "copy", "copy_p",
                   "reduce_precision", "optimization_barrier"})
# Reductions over ``axes``.
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                     "reduce_and", "reduce_or", "argmax", "argmin"})
RAW = "raw"  # an activation no parameter has touched yet
_ABSENT = "absent"  # not an activation (a constant, a weight, an iota)


def _reshape_dim(d: int, old: Sequence[int], new: Sequence[int]
                 ) -> int | None:
  """Where dim ``d`` of shape ``old`` lands in ``new`` as a split's major
  part (the same elements before it, a size it divides or that divides
  it), or None."""
  before = math.prod(old[:d])
  acc = 1
  for j, n in enumerate(new):
    if acc == before and n > 1 and (n % old[d] == 0 or old[d] % n == 0):
      return j
    acc *= n
    if acc > before:
      return None
  return None


class _Walk:
  """One pass over a program; ``dims`` {argument index: dims to split}."""

  def __init__(self):
    self.dims: dict[int, tuple[int, ...]] = {}

  # Per variable: ``split`` (the split dim, None for whole, RAW) and, for a
  # weight, ``origin`` (argument index, the argument dim of each of its
  # dims or None).
  def run(self, jaxpr, split: dict, origin: dict) -> None:
    for eqn in jaxpr.eqns:
      self.eqn(eqn, split, origin)

  def eqn(self, eqn, split: dict, origin: dict) -> None:
    name = eqn.primitive.name
    ins = [None if isinstance(v, jcore.Literal) else v for v in eqn.invars]
    src = {i: origin[v] for i, v in enumerate(ins)
           if v is not None and v in origin}
    have = [_ABSENT if v is None else split.get(v, _ABSENT) for v in ins]
    if name in _jaxpr.INLINE or name in ("scan", "while", "cond"):
      self.body(eqn, split, origin)
      return
    if name in _SAME and src:
      for i, v in enumerate(eqn.outvars):
        if i in src:
          origin[v] = src[i]
      return
    if name == "transpose" and 0 in src:
      arg, amap = src[0]
      origin[eqn.outvars[0]] = (arg, tuple(
          amap[p] for p in eqn.params["permutation"]))
      return
    if name == "gather" and 0 in src and 1 not in src:
      arg, amap = src[0]
      if arg not in self.dims:
        self.dims[arg] = self.mapped(
            amap, eqn.params["dimension_numbers"].start_index_map)
      split[eqn.outvars[0]] = None
      return
    if name == "dot_general" and len(src) == 1:
      split[eqn.outvars[0]] = self.matmul(eqn, *next(iter(src.items())),
                                          have)
      return
    if name == "conv_general_dilated" and list(src) == [1]:
      split[eqn.outvars[0]] = self.conv(
          eqn, *src[1], None if have[0] is _ABSENT else have[0])
      return
    out = _carry(eqn, have)
    if out is not _ABSENT:
      for v in eqn.outvars:
        split[v] = out

  def matmul(self, eqn, w: int, weight, have) -> Any:
    """Decides a weight at its first ``dot_general``; the result's split."""
    arg, amap = weight
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    wc, wb, ac, ab = (lc, lb, rc, rb) if w == 0 else (rc, rb, lc, lb)
    act = None if have[1 - w] is _ABSENT else have[1 - w]
    wrank = eqn.invars[w].aval.ndim
    arank = eqn.invars[1 - w].aval.ndim
    wfree = [d for d in range(wrank) if d not in wc and d not in wb]
    afree = [d for d in range(arank) if d not in ac and d not in ab]
    # Result dims: batch, then lhs free, then rhs free.
    w_at = len(wb) + (0 if w == 0 else len(afree))
    a_at = len(wb) + (len(wfree) if w == 0 else 0)
    if arg not in self.dims:
      if act == RAW:
        self.dims[arg] = ()
      elif act is not None and act in ac:
        self.dims[arg] = self.mapped(amap, [wc[list(ac).index(act)]])
      elif act is None:
        last = max(wc, default=-1)
        order = [d for d in wfree if d > last] + \
            [d for d in wfree if d < last]
        self.dims[arg] = self.mapped(amap, order)
      else:
        self.dims[arg] = ()
    if act == RAW:
      return None
    chosen = self.dims[arg]
    for i, d in enumerate(wfree):
      if chosen and amap[d] == chosen[0]:
        return w_at + i
    if act is not None and act in afree:
      return a_at + afree.index(act)
    if act is not None and act in ab:
      return list(ab).index(act)
    return None

  def conv(self, eqn, arg: int, amap, act) -> Any:
    dn = eqn.params["dimension_numbers"]
    out_f, in_f = dn.rhs_spec[0], dn.rhs_spec[1]
    if arg not in self.dims:
      if act == RAW:
        self.dims[arg] = ()
      elif act == dn.lhs_spec[1]:
        self.dims[arg] = self.mapped(amap, [in_f])
      elif act is None:
        self.dims[arg] = self.mapped(amap, [out_f])
      else:
        self.dims[arg] = ()
    chosen = self.dims[arg]
    if act == RAW:
      return None
    return dn.out_spec[1] if chosen and chosen[0] == amap[out_f] else None

  @staticmethod
  def mapped(amap, dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(amap[d] for d in dims if amap[d] is not None)

  def body(self, eqn, split: dict, origin: dict) -> None:
    """Enters a call or loop body with its operands' states, and gives its
    results the states of the body's results."""
    name, p = eqn.primitive.name, eqn.params
    for address, sub, _ in _jaxpr.bodies(eqn, ()):
      args = list(eqn.invars)
      is_cond = address[-1:] == ("cond",)
      if name == "cond":
        args = args[1:]  # the branch index
      elif name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        args = (args[:nc] if is_cond else args[nc:nc + nb]) + \
            args[nc + nb:]
      args = args[len(args) - len(sub.invars):]
      xs_from = (p["num_consts"] + p["num_carry"] if name == "scan"
                 else len(args))
      ys_from = p["num_carry"] if name == "scan" else len(eqn.outvars)
      sub_split, sub_origin = {}, {}
      for i, (outer, v) in enumerate(zip(args, sub.invars)):
        if isinstance(outer, jcore.Literal):
          continue
        s = split.get(outer, _ABSENT)
        if i >= xs_from and isinstance(s, int):
          s = s - 1 if s > 0 else None  # a scan's xs lose their leading dim
        if s is not _ABSENT:
          sub_split[v] = s
        if outer in origin:
          arg, amap = origin[outer]
          # A scanned stack's body sees one layer: its dims are the
          # stack's but the leading one.
          sub_origin[v] = (arg, amap[1:] if i >= xs_from else amap)
      self.run(sub, sub_split, sub_origin)
      if is_cond:
        continue  # a while's predicate
      for i, (outer, v) in enumerate(zip(eqn.outvars, sub.outvars)):
        if isinstance(v, jcore.Literal) or v not in sub_split or \
            isinstance(split.get(outer), int):
          continue
        s = sub_split[v]
        split[outer] = s + 1 if i >= ys_from and isinstance(s, int) else s


def _carry(eqn, have: list) -> Any:
  """The result's split dim from its operands' (the first split operand's
  dim, moved as the op moves dims; RAW while no operand is more)."""
  name, p = eqn.primitive.name, eqn.params
  if not any(isinstance(h, int) for h in have):
    known = [h for h in have if h is not _ABSENT]
    if not known:
      return _ABSENT
    return RAW if all(h == RAW for h in known) else None
  i = next(k for k, h in enumerate(have) if isinstance(h, int))
  d = have[i]
  out = eqn.outvars[0].aval
  if name == "broadcast_in_dim":
    return p["broadcast_dimensions"][d]
  if name == "reshape":
    return _reshape_dim(d, eqn.invars[0].aval.shape, out.shape)
  if name == "transpose":
    return list(p["permutation"]).index(d)
  if name in _REDUCE:
    axes = p["axes"]
    return None if d in axes else d - sum(a < d for a in axes)
  if name == "top_k":
    return None if d == eqn.invars[0].aval.ndim - 1 else d
  if name in ("squeeze",):
    axes = p["dimensions"]
    return None if d in axes else d - sum(a < d for a in axes)
  if name in ("cumsum", "cumlogsumexp", "cummax", "cummin", "sort"):
    return None if d == p.get("axis", p.get("dimension")) else d
  if name == "concatenate":
    return None if d == p["dimension"] else d
  if name == "dot_general":  # two activations
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    c, b = (lc, lb) if i == 0 else (rc, rb)
    if d in c:
      return None
    if d in b:
      return list(b).index(d)
    lrank = eqn.invars[0].aval.ndim
    lfree = [x for x in range(lrank) if x not in lc and x not in lb]
    if i == 0:
      return len(lb) + lfree.index(d)
    rfree = [x for x in range(eqn.invars[1].aval.ndim)
             if x not in rc and x not in rb]
    return len(lb) + len(lfree) + rfree.index(d)
  if out.ndim == eqn.invars[i].aval.ndim and d < out.ndim:
    return d  # elementwise, slices, pads, selects, converts
  return None


def weight_dims(closed_jaxpr: Any, args: Sequence[int], raw: Sequence[int]
                ) -> dict[int, tuple[int, ...]]:
  """{argument index: its dims a Megatron layout would split, preferred
  first} for the arguments ``args`` (the parameters) that meet a matmul or
  a lookup; ``raw`` are the data arguments (see the module docstring)."""
  jaxpr, _ = _jaxpr.closed(closed_jaxpr)
  walk = _Walk()
  origin = {jaxpr.invars[i]: (i, tuple(range(jaxpr.invars[i].aval.ndim)))
            for i in args}
  walk.run(jaxpr, {jaxpr.invars[i]: RAW for i in raw}, origin)
  return walk.dims
