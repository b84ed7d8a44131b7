"""Signature rules: for each primitive, the 1-D SBP signatures that are correct.

A signature is ``(input SBPs, output SBPs)`` for one mesh axis such that running
the op on each device's local shards gives the right global result, with no
communication. Signatures on different mesh axes are independent, so the n-D
candidates of an op are the product of its 1-D list over the mesh axes, minus
those that split a dim by more than it divides (see ``_problem``).

:data:`RULES` holds each primitive's :class:`Rule` as a value, one line
each: its signatures (an elementwise factor map, or a rule of
:mod:`autoddl_jax._shape_rules`), the partial sums it carries where it is
linear in some operands (``Rule(f, ("PB",))``: ``P`` in the first operand
and ``B`` in the second give ``P``), how its FLOPs count, and whether it
holds whatever sub-jaxpr its equation carries. :func:`signatures` applies
one (rank-checked); :func:`eqn_flops` is an equation's FLOPs, which the
cost model divides by the candidate's split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from autoddl_jax import _shape_rules as sr
from autoddl_jax._factors import Aval, Sig, SigFn, dedup, elementwise
from autoddl_jax._factors import with_partials


@dataclasses.dataclass(frozen=True)
class Rule:
  """One primitive's rule, as a value.

  ``sigs`` gives the op's 1-D signatures from its operand and result shapes
  and parameters (a factor map or a shape rule); ``linear`` the patterns of
  the partial sums it carries (:func:`~autoddl_jax._factors.with_partials`:
  ``("PB", "BP")`` for a product); ``flops`` how its FLOPs are counted
  (:data:`FLOPS`); ``sees_jaxpr``: the rule holds for the equation whatever
  the sub-jaxpr in its parameters (a scatter-add's update, a reduce
  window's or a sort's comparison), where any other equation holding one
  gets no rule. :meth:`signatures` checks every signature against the
  operands' ranks: a rule that names a dim an operand lacks is a bug.
  """

  sigs: SigFn
  linear: tuple[str, ...] = ()
  flops: str = "none"
  sees_jaxpr: bool = False

  def signatures(self, ins: Sequence[Aval], outs: Sequence[Aval],
                 params: dict[str, Any]) -> list[Sig]:
    sigs = self.sigs(ins, outs, params)
    if self.linear:
      sigs = with_partials(sigs, self.linear, ins, outs)
    sigs = dedup(sigs)
    for sig in sigs:
      codes_in, codes_out = sig
      if len(codes_in) != len(ins) or len(codes_out) != len(outs):
        raise ValueError(f"signature {sig} has {len(codes_in)} input and "
                         f"{len(codes_out)} output codes for {len(ins)} "
                         f"operands and {len(outs)} results")
      for c, a in zip((*codes_in, *codes_out), (*ins, *outs)):
        if c >= a.rank:
          raise ValueError(f"signature {sig} splits dim {c} of a rank-"
                           f"{a.rank} value")
    return sigs


# ------------------------------------------------------------------ the table
UNARY = """abs acos acosh asin asinh atan atanh cbrt ceil clz conj cos cosh
  digamma erf erf_inv erfc exp exp2 expm1 floor imag is_finite lgamma log log1p
  logistic not population_count real round rsqrt sign sin sinh sqrt square tan
  tanh integer_pow reduce_precision""".split()
LINEAR_UNARY = """neg copy stop_gradient sharding_constraint reshard
  device_put""".split()
BINARY = """atan2 rem pow max min nextafter and or xor eq ne lt le gt ge
  eq_to le_to lt_to shift_left shift_right_logical shift_right_arithmetic
  complex""".split()

RULES: dict[str, Rule] = {}
for _name in UNARY:
  RULES[_name] = Rule(elementwise)
for _name in LINEAR_UNARY:
  RULES[_name] = Rule(elementwise, ("P",))
for _name in BINARY:
  RULES[_name] = Rule(elementwise)
for _name in ("add", "sub", "add_any"):
  RULES[_name] = Rule(elementwise, ("PP",))
RULES["mul"] = Rule(elementwise, ("PB", "BP"))
RULES["div"] = Rule(elementwise, ("PB",))
RULES["select_n"] = Rule(elementwise, ("BP",))
RULES["clamp"] = Rule(sr.clamp)
RULES["convert_element_type"] = Rule(sr.convert)
RULES["broadcast_in_dim"] = Rule(sr.broadcast_in_dim, ("PB",))
RULES["reshape"] = Rule(sr.reshape, ("P",))
RULES["transpose"] = Rule(sr.transpose, ("P",))
RULES["squeeze"] = Rule(sr.squeeze, ("P",))
RULES["reduce_sum"] = Rule(sr.reduce(summed=True), ("P",))
for _name in ("reduce_max", "reduce_min", "reduce_prod", "reduce_and",
              "reduce_or", "reduce_xor", "argmax", "argmin"):
  RULES[_name] = Rule(sr.reduce(summed=False))
RULES["cumsum"] = Rule(sr.along_axis("axis"), ("P",))
for _name in ("cumprod", "cummax", "cummin", "cumlogsumexp"):
  RULES[_name] = Rule(sr.along_axis("axis"))
RULES["sort"] = Rule(sr.along_axis("dimension"), sees_jaxpr=True)
RULES["top_k"] = Rule(sr.top_k)
RULES["slice"] = Rule(sr.slice, ("P",))
RULES["dynamic_slice"] = Rule(sr.dynamic_slice, ("PB",))
RULES["dynamic_update_slice"] = Rule(sr.dynamic_update_slice, ("PPB",))
RULES["concatenate"] = Rule(sr.concatenate, ("P",))
RULES["split"] = Rule(sr.split, ("P",))
RULES["stack"] = Rule(sr.stack, ("P",))
RULES["unstack"] = Rule(sr.unstack, ("P",))
RULES["tile"] = Rule(sr.tile, ("P",))
RULES["pad"] = Rule(sr.pad)
RULES["bitcast_convert_type"] = Rule(sr.bitcast)
# Random bits must come out identical to the unsharded program's: generated
# replicated (jax's partitionable threefry is a config flag we do not assume).
for _name in ("random_bits", "random_seed", "random_wrap", "random_unwrap",
              "random_fold_in", "random_split", "threefry2x32"):
  RULES[_name] = Rule(sr.replicated)
RULES["rev"] = Rule(sr.rev, ("P",))
# ad.pipeline's stage shift: elementwise on every device's block (the block
# itself moves to the next stage: a collective-permute the problem charges).
RULES["stage_shift"] = Rule(elementwise, ("P",))
RULES["iota"] = Rule(sr.iota)
RULES["empty2"] = Rule(sr.iota)  # uninitialised: each device makes its own piece
RULES["dot_general"] = Rule(sr.dot_general, ("PB", "BP"))
RULES["conv_general_dilated"] = Rule(sr.conv, ("PB", "BP"))
RULES["reduce_window_max"] = Rule(sr.reduce_window)
RULES["reduce_window_min"] = Rule(sr.reduce_window)
RULES["reduce_window_sum"] = Rule(sr.reduce_window, ("PB",))
RULES["reduce_window"] = Rule(sr.reduce_window, sees_jaxpr=True)
RULES["select_and_scatter_add"] = Rule(sr.select_and_scatter_add, ("PB",))
RULES["select_and_gather_add"] = Rule(sr.select_and_gather_add, ("PB",))
RULES["gather"] = Rule(sr.gather, ("PB",))
RULES["scatter-add"] = Rule(sr.scatter_add, sees_jaxpr=True)
# A scatter's update_jaxpr is the combiner its name says (the rules are
# checked against it in tests/test_rules.py).
for _name in ("scatter", "scatter-mul", "scatter-max", "scatter-min"):
  RULES[_name] = Rule(sr.scatter, sees_jaxpr=True)

ELEMENTWISE_FLOP = set(UNARY) | set(BINARY) | {
    "add", "sub", "mul", "div", "add_any", "neg", "select_n", "clamp",
    "logistic", "erf"}


def _dot_flops(ins, outs, params) -> float:
  (lc, _), _ = params["dimension_numbers"]
  k = math.prod(ins[0].shape[d] for d in lc)
  return 2.0 * math.prod(outs[0].shape) * k


# How an equation's FLOPs are counted (multiply-add = 2), by kind.
FLOPS = {
    "dot": _dot_flops,
    "conv": lambda ins, outs, params: _conv_flops(
        ins[0].shape, ins[1].shape, outs[0].shape, params),
    "elementwise": lambda ins, outs, params: float(
        sum(math.prod(o.shape) for o in outs)),
    "operand": lambda ins, outs, params: float(math.prod(ins[0].shape)),
    "none": lambda ins, outs, params: 0.0,
}


def flops_kind(prim: str) -> str:
  """The :data:`FLOPS` kind of a primitive (with a rule or not)."""
  if prim == "dot_general":
    return "dot"
  if prim == "conv_general_dilated":
    return "conv"
  if prim in ELEMENTWISE_FLOP:
    return "elementwise"
  if prim.startswith("reduce") or prim.startswith("cum") or prim in (
      "argmax", "argmin", "select_and_scatter_add"):
    return "operand"
  return "none"


RULES = {name: dataclasses.replace(rule, flops=flops_kind(name))
         for name, rule in RULES.items()}


def signatures(prim: str, ins: Sequence[Aval], outs: Sequence[Aval],
               params: dict[str, Any]) -> list[Sig] | None:
  """The 1-D signatures of one equation, or None when there is no rule
  (or its parameters hold a sub-jaxpr its rule does not see)."""
  rule = RULES.get(prim)
  if rule is None:
    return None
  if not rule.sees_jaxpr and any(
      isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr))
      for p in params.values()):
    return None
  key = _memo_key(rule, ins, outs, params)
  if key is None:
    return rule.signatures(ins, outs, params)
  return list(_memoised(*key))


# Kept across programs: the planner traces one step many times (a program
# per pipeline schedule and remat variant), the same equations each time.
@functools.lru_cache(maxsize=1 << 16)
def _memoised(rule: Rule, ins: tuple, outs: tuple, items: tuple
              ) -> tuple[Sig, ...]:
  return tuple(rule.signatures(ins, outs, dict(items)))


def _memo_key(rule, ins, outs, params):
  """A hashable key of one equation's signature inputs (the rule itself
  among them, so a rule replaced is not answered from the memo), or None
  where a parameter is a sub-jaxpr or a function (kept out of the memo:
  they would be held alive, and are compared by identity) or unhashable."""
  if any(callable(v) or isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))
         for v in params.values()):
    return None
  key = (rule, tuple(ins), tuple(outs), tuple(sorted(params.items())))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def eqn_flops(prim: str, ins: Sequence[Aval], outs: Sequence[Aval],
              params: dict) -> float:
  """FLOPs of one equation (multiply-add = 2)."""
  rule = RULES.get(prim)
  kind = rule.flops if rule is not None else flops_kind(prim)
  return FLOPS[kind](ins, outs, params)


def _conv_flops(lhs, rhs, out, params) -> float:
  """A convolution's FLOPs as XLA's cost analysis counts them: per spatial
  dim only the (output, kernel) position pairs that land on the input --
  not on padding, nor between the points of a dilated input."""
  dn = params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  n = len(lhs_spec) - 2
  strides = params.get("window_strides") or (1,) * n
  padding = params.get("padding") or ((0, 0),) * n
  base = params.get("lhs_dilation") or (1,) * n
  wdil = params.get("rhs_dilation") or (1,) * n
  valid = 1
  for i in range(n):
    size_in, size_k = lhs[lhs_spec[2 + i]], rhs[rhs_spec[2 + i]]
    size_out = out[out_spec[2 + i]]
    o = np.arange(size_out)[None, :] * strides[i] - padding[i][0]
    idx = o + np.arange(size_k)[:, None] * wdil[i]
    hit = (idx % base[i] == 0) & (idx >= 0) & (idx // base[i] < size_in)
    valid *= int(hit.sum())
  fgc = params.get("feature_group_count", 1) or 1
  bgc = params.get("batch_group_count", 1) or 1
  fma = (lhs[lhs_spec[1]] // fgc) * rhs[rhs_spec[0]] * (
      lhs[lhs_spec[0]] // bgc) * valid
  return 2.0 * fma
