"""From a traced program to the op graph the planner searches over.

``jax.make_jaxpr`` gives a ClosedJaxpr. We walk its equations and produce a flat
:class:`OpGraph`:

* nested ``jit``, ``custom_jvp_call``, ``custom_vjp_call`` and ``remat2`` are
  opened (their equations join the graph);
* ``scan``, ``cond`` and ``while`` keep their bodies as sub-graphs walked once,
  joined to the outer graph by *link* ops (slice of the stacked ``xs``, the
  loop-carried merge, the stacked ``ys``), and every op of a body carries the
  trip count as its ``weight`` -- so layers in a scan are decided once and cost
  does not grow with depth;
* the program's arguments become ``input`` ops and its results ``output`` ops.

Every op gets its 1-D signature list from ``_rules`` (or all-B with a warning).
The graph also remembers which tensor each jaxpr variable became, per call
context, so the lowering can put the plan back onto the very same variables.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from autoddl_jax import _rules
from autoddl_jax._errors import RuleError
from autoddl_jax._remat import behind_barrier
from autoddl_jax._rules import Aval, Sig
from autoddl_jax._sbp import B_CODE as B, P_CODE as P

INLINE = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "remat2", "checkpoint",
          "custom_lin"}
INLINE_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
ELEMENTWISE_FLOP = set(_rules.UNARY) | set(_rules.BINARY) | {
    "add", "sub", "mul", "div", "add_any", "neg", "select_n", "clamp",
    "logistic", "erf"}


# The weight of a reshard into an optimization barrier (see Builder.walk):
# never the cheaper choice, so operands enter it as they were made.
BARRIER_RESHARD_PENALTY = 1e6


def _demanded_layout(eqn) -> tuple[Any, tuple[str, ...]] | None:
  """The (spec, mesh axis names) a ``with_sharding_constraint`` demands, or
  None (another op, or a constraint with unconstrained dims)."""
  if eqn.primitive.name != "sharding_constraint" or eqn.params.get(
      "unconstrained_dims"):
    return None
  s = eqn.params.get("sharding")
  spec, mesh = getattr(s, "spec", None), getattr(s, "mesh", None)
  if spec is None or mesh is None:
    return None
  return spec, tuple(mesh.axis_names)


class UnsupportedPrimitiveWarning(UserWarning):
  """An op with no signature rule: it runs replicated (correct, not fast)."""


@dataclasses.dataclass
class Tensor:
  id: int
  aval: Aval
  name: str
  producer: tuple[int, int] | None = None  # (op id, output slot)
  consumers: list[tuple[int, int]] = dataclasses.field(default_factory=list)

  @property
  def nbytes(self) -> int:
    return math.prod(self.aval.shape) * self.aval.dtype.itemsize


@dataclasses.dataclass
class Op:
  id: int
  prim: str
  kind: str  # "eqn" | "input" | "output" | "const" | "link"
  ins: list[int | None]  # tensor ids; None for a literal operand
  in_avals: list[Aval]
  outs: list[int]
  sigs: list[Sig]  # 1-D signatures
  weight: float = 1.0  # executions per step (trip counts multiplied)
  in_weights: list[float] = dataclasses.field(default_factory=list)
  flops: float = 0.0
  name: str = ""
  leaf: int | None = None  # flat leaf index, for input/output ops
  key: Any = None  # same key = the same op of a repeated (unrolled) block
  # A layout the step itself demands of this op's result (a user's
  # ``with_sharding_constraint``): (PartitionSpec, mesh axis names). The
  # problem holds it fixed, so the reshard into it is planned and costed.
  fixed: Any = None

  def __post_init__(self):
    if not self.in_weights:
      self.in_weights = [self.weight] * len(self.ins)


@dataclasses.dataclass
class OpGraph:
  tensors: list[Tensor]
  ops: list[Op]
  # (call context, jaxpr var) -> tensor id; a context is a tuple of eqn indices.
  var_tensor: dict[tuple[tuple, Any], int]
  input_ops: list[int]  # one per flat argument leaf
  output_ops: list[int]  # one per flat result leaf
  unsupported: dict[str, int]  # primitive -> number of fallback ops
  eqn_op: dict[tuple, int]  # call context + eqn index -> op id
  # call context + eqn index of a scan -> the link op each operand enters
  # the body through (the lowering stages the reshard into it)
  entry_links: dict[tuple, list[int]] = dataclasses.field(
      default_factory=dict)
  # ... and the link each of its stacked results (ys) leaves the body by
  # (the lowering stages the reshard into it inside the body)
  exit_links: dict[tuple, list[int]] = dataclasses.field(
      default_factory=dict)
  # call context + eqn index of a scan or while -> (the carry's tensor in
  # the body, the link op the final carry leaves by), per carry: the
  # lowering stages the reshard from the loop's layout to the result's
  result_links: dict[tuple, list[tuple[int, int]]] = dataclasses.field(
      default_factory=dict)
  # link op entering or leaving a scan's or while's body -> (first, last)
  # op id of the loop, links included: the loop's buffers (stacked xs and
  # ys, carries, consts) live for all of it (the memory model)
  loop_of_link: dict[int, tuple[int, int]] = dataclasses.field(
      default_factory=dict)


def _aval(a) -> Aval:
  dtype = a.dtype
  try:
    dtype = np.dtype(dtype)
  except TypeError:  # extended dtypes (PRNG keys) have no numpy dtype
    dtype = np.dtype(np.uint32)
  return Aval(tuple(int(d) for d in a.shape), dtype)


def _sub_jaxpr(params: dict) -> tuple[Any, list]:
  for key in INLINE_JAXPR_PARAMS:
    if key in params:
      j = params[key]
      if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
      return j, []
  raise KeyError(f"no sub-jaxpr among {sorted(params)}")


def _closed(j) -> tuple[Any, list]:
  if isinstance(j, jcore.ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


def eqn_flops(prim: str, ins: Sequence[Aval], outs: Sequence[Aval],
              params: dict) -> float:
  """FLOPs of one equation (multiply-add = 2)."""
  if prim == "dot_general":
    (lc, _), _ = params["dimension_numbers"]
    k = math.prod(ins[0].shape[d] for d in lc)
    return 2.0 * math.prod(outs[0].shape) * k
  if prim == "conv_general_dilated":
    return _conv_flops(ins[0].shape, ins[1].shape, outs[0].shape, params)
  if prim in ELEMENTWISE_FLOP:
    return float(sum(math.prod(o.shape) for o in outs))
  if prim.startswith("reduce") or prim.startswith("cum") or prim in (
      "argmax", "argmin", "select_and_scatter_add"):
    return float(math.prod(ins[0].shape))
  return 0.0


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


class _Builder:

  def __init__(self):
    self.tensors: list[Tensor] = []
    self.ops: list[Op] = []
    self.var_tensor: dict = {}
    self.unsupported: dict[str, int] = {}
    self.eqn_op: dict[tuple, int] = {}
    self.entry_links: dict[tuple, list[int]] = {}
    self.exit_links: dict[tuple, list[int]] = {}
    self.result_links: dict[tuple, list[tuple[int, int]]] = {}
    self.loop_of_link: dict[int, tuple[int, int]] = {}

  def _loop(self, start: int, links) -> None:
    span = (start, len(self.ops) - 1)
    for o in links:
      self.loop_of_link[o] = span

  def tensor(self, aval: Aval, name: str) -> int:
    t = Tensor(len(self.tensors), aval, name)
    self.tensors.append(t)
    return t.id

  def op(self, prim, kind, ins, in_avals, out_avals, sigs, weight=1.0,
         in_weights=None, flops=0.0, name="", leaf=None, outs=None) -> Op:
    oid = len(self.ops)
    if outs is None:
      outs = [self.tensor(a, name or prim) for a in out_avals]
    o = Op(oid, prim, kind, list(ins), list(in_avals), outs, sigs, weight,
           list(in_weights or []), flops, name or prim, leaf)
    self.ops.append(o)
    for slot, t in enumerate(outs):
      self.tensors[t].producer = (oid, slot)
    for slot, t in enumerate(ins):
      if t is not None:
        self.tensors[t].consumers.append((oid, slot))
    return o

  def add_input(self, t: int, slot_op: Op, slot: int):
    slot_op.ins[slot] = t
    self.tensors[t].consumers.append((slot_op.id, slot))

  # --------------------------------------------------------------- sources
  def const(self, value, weight) -> int:
    aval = _aval(value if hasattr(value, "shape") else np.asarray(value))
    return self.op("const", "const", [], [], [aval], [((), (B,))],
                   weight).outs[0]

  def link(self, prim, t_in, out_aval, in_weight, weight, sigs=None) -> int:
    a = self.tensors[t_in].aval
    sigs = sigs or _identity_sigs(a.rank)
    return self.op(prim, "link", [t_in], [a], [out_aval], sigs, weight,
                   [in_weight]).outs[0]

  # ------------------------------------------------------------------ walk
  def walk(self, jaxpr, consts: list[int], args: list[int], ctx: tuple,
           weight: float) -> list[int]:
    env: dict[Any, int] = {}
    for v, t in zip(jaxpr.constvars, consts):
      env[v] = t
      self.var_tensor[(ctx, v)] = t
    for v, t in zip(jaxpr.invars, args):
      env[v] = t
      self.var_tensor[(ctx, v)] = t

    def read(v) -> int | None:
      return None if isinstance(v, jcore.Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
      name = eqn.primitive.name
      ins = [read(v) for v in eqn.invars]
      sub_ctx = ctx + (i,)
      if name in INLINE:
        sub, sub_consts = _sub_jaxpr(eqn.params)
        cts = [self.const(c, weight) for c in sub_consts]
        ins = [t if t is not None else self.const(v.val, weight)
               for t, v in zip(ins, eqn.invars)]
        if behind_barrier(eqn):
          # A backward pass's recomputation starts from its operands behind
          # an optimization barrier: new values, in the layout they come
          # in, that share no reshard with the forward's (XLA gathers a
          # weight again for the recomputation). A reshard before the
          # barrier would keep its result alive from the forward pass to
          # the recomputation -- what remat is there to avoid -- so the
          # edge into the barrier is priced out of the search.
          ins = [self.link("~barrier", t, self.tensors[t].aval,
                           weight * BARRIER_RESHARD_PENALTY, weight)
                 for t in ins]
          self.entry_links[sub_ctx] = [self.tensors[t].producer[0]
                                       for t in ins]
        outs = self.walk(sub, cts, ins[len(ins) - len(sub.invars):], sub_ctx,
                         weight)
      elif name == "scan":
        outs = self.scan(eqn, ins, sub_ctx, weight)
      elif name == "cond":
        outs = self.cond(eqn, ins, sub_ctx, weight)
      elif name == "while":
        outs = self.while_(eqn, ins, sub_ctx, weight)
      else:
        op = self.eqn(eqn, ins, weight)
        self.eqn_op[sub_ctx] = op.id
        outs = op.outs
      for v, t in zip(eqn.outvars, outs):
        if t is None:  # a literal came out of a sub-jaxpr
          t = self.const(np.zeros(v.aval.shape, v.aval.dtype), weight)
        if not isinstance(v, jcore.DropVar):
          env[v] = t
          self.var_tensor[(ctx, v)] = t
    return [read(v) if not isinstance(v, jcore.Literal) else None
            for v in jaxpr.outvars]

  def eqn(self, eqn, ins, weight) -> Op:
    name = eqn.primitive.name
    in_avals = [_aval(v.aval) for v in eqn.invars]
    out_avals = [_aval(v.aval) for v in eqn.outvars]
    sigs = None
    if not any(isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr))
               for p in eqn.params.values()) or name in ("scatter-add",
                                                         "reduce_window",
                                                         "sort"):
      try:
        sigs = _rules.signatures(name, in_avals, out_avals, eqn.params)
      except Exception as e:
        # A rule that fails is a bug to fix, not a primitive to run
        # replicated: hidden, it would only show as a slow plan.
        ops = ", ".join(f"{a.dtype}{list(a.shape)}" for a in in_avals)
        raise RuleError(
            f"internal error: the signature rule of {name!r} failed on "
            f"({ops}): {type(e).__name__}: {e}. Please report it with the "
            "step that raised it.") from e
    if sigs is None:
      self.unsupported[name] = self.unsupported.get(name, 0) + 1
      sigs = [(tuple(B for _ in in_avals), tuple(B for _ in out_avals))]
    op = self.op(name, "eqn", ins, in_avals, out_avals, sigs, weight,
                 flops=eqn_flops(name, in_avals, out_avals, eqn.params))
    op.key = _repeat_key(eqn, in_avals, out_avals, weight)
    op.fixed = _demanded_layout(eqn)
    return op

  def scan(self, eqn, ins, ctx, weight) -> list[int]:
    start = len(self.ops)
    p = eqn.params
    body, body_consts = _closed(p["jaxpr"])
    nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
    inner_w = weight * length
    ins = [t if t is not None else self.const(v.val, weight)
           for t, v in zip(ins, eqn.invars)]
    const_in = [self.link("~link", t, self.tensors[t].aval, weight, weight)
                for t in ins[:nc]]
    merges = []
    for t in ins[nc:nc + ncar]:
      a = self.tensors[t].aval
      merges.append(self.op("~merge", "link", [t, None], [a, a], [a],
                            _identity_sigs(a.rank, 2), inner_w,
                            [weight, inner_w]))
    xs_in = []
    for t in ins[nc + ncar:]:
      a = self.tensors[t].aval
      inner = Aval(a.shape[1:], a.dtype)
      xs_in.append(self.link("~scan_xs", t, inner, weight, weight,
                             _slice_sigs(inner.rank)))
    self.entry_links[ctx] = (
        [self.tensors[t].producer[0] for t in const_in] + [m.id for m in merges]
        + [self.tensors[t].producer[0] for t in xs_in])
    cts = [self.const(c, inner_w) for c in body_consts]
    outs = self.walk(body, cts,
                     const_in + [m.outs[0] for m in merges] + xs_in, ctx,
                     inner_w)
    outs = [t if t is not None else self.const(
        np.zeros(v.aval.shape, v.aval.dtype), inner_w)
            for t, v in zip(outs, body.outvars)]
    results = []
    for m, t in zip(merges, outs[:ncar]):
      self.add_input(t, m, 1)
      results.append(self.link("~link", t, self.tensors[t].aval, weight,
                               weight))
    self.result_links[ctx] = [(m.outs[0], self.tensors[r].producer[0])
                              for m, r in zip(merges, results)]
    ys = []
    for t in outs[ncar:]:
      a = self.tensors[t].aval
      outer = Aval((length, *a.shape), a.dtype)
      ys.append(self.link("~scan_ys", t, outer, inner_w, weight,
                          _stack_sigs(a.rank)))
    self.exit_links[ctx] = [self.tensors[t].producer[0] for t in ys]
    self._loop(start, self.entry_links[ctx] + self.exit_links[ctx])
    return results + ys

  def cond(self, eqn, ins, ctx, weight) -> list[int]:
    branches = eqn.params["branches"]
    nb = len(branches)
    w = weight / nb
    ops_in = [t if t is not None else self.const(v.val, weight)
              for t, v in zip(ins[1:], eqn.invars[1:])]
    merges = [self.op("~merge", "link", [None] * nb, [_aval(v.aval)] * nb,
                      [_aval(v.aval)], _identity_sigs(len(v.aval.shape), nb),
                      weight, [w] * nb) for v in eqn.outvars]
    for b, br in enumerate(branches):
      jx, consts = _closed(br)
      args = [self.link("~link", t, self.tensors[t].aval, w, w) for t in ops_in]
      cts = [self.const(c, w) for c in consts]
      outs = self.walk(jx, cts, args, ctx + (b,), w)
      for m, t, v in zip(merges, outs, jx.outvars):
        if t is None:
          t = self.const(np.zeros(v.aval.shape, v.aval.dtype), w)
        self.add_input(t, m, b)
    return [m.outs[0] for m in merges]

  def while_(self, eqn, ins, ctx, weight) -> list[int]:
    # The trip count is unknown before running: the body is costed once.
    start = len(self.ops)
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    ins = [t if t is not None else self.const(v.val, weight)
           for t, v in zip(ins, eqn.invars)]
    cond_c = [self.link("~link", t, self.tensors[t].aval, weight, weight)
              for t in ins[:cn]]
    body_c = [self.link("~link", t, self.tensors[t].aval, weight, weight)
              for t in ins[cn:cn + bn]]
    merges = []
    for t in ins[cn + bn:]:
      a = self.tensors[t].aval
      merges.append(self.op("~merge", "link", [t, None], [a, a], [a],
                            _identity_sigs(a.rank, 2), weight,
                            [weight, weight]))
    carry = [m.outs[0] for m in merges]
    cj, cconsts = _closed(p["cond_jaxpr"])
    self.walk(cj, [self.const(c, weight) for c in cconsts], cond_c + carry,
              ctx + ("cond",), weight)
    bj, bconsts = _closed(p["body_jaxpr"])
    outs = self.walk(bj, [self.const(c, weight) for c in bconsts],
                     body_c + carry, ctx + ("body",), weight)
    for m, t, v in zip(merges, outs, bj.outvars):
      if t is None:
        t = self.const(np.zeros(v.aval.shape, v.aval.dtype), weight)
      self.add_input(t, m, 1)
    results = [self.link("~link", c, self.tensors[c].aval, weight, weight)
               for c in carry]
    self.result_links[ctx] = [(c, self.tensors[r].producer[0])
                              for c, r in zip(carry, results)]
    self._loop(start, [self.tensors[t].producer[0] for t in cond_c + body_c]
               + [m.id for m in merges])
    return results


def _repeat_key(eqn, in_avals, out_avals, weight):
  """Ops of structurally identical unrolled blocks share this key: the same
  source location (a Python loop's body), transform (forward or backward),
  primitive, shapes and parameters."""
  si = eqn.source_info
  if si is None or si.traceback is None:
    return None
  try:
    params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items()
                          if not isinstance(v, (jcore.Jaxpr,
                                                jcore.ClosedJaxpr))))
    return (si.traceback, str(si.name_stack), eqn.primitive.name,
            tuple(in_avals), tuple(out_avals), params, weight)
  except TypeError:  # an unhashable traceback or parameter
    return None


def repeat_groups(graph: OpGraph, input_tokens: Sequence[Any],
                  depth: int = 6, min_repeats: int = 4) -> list[list[int]]:
  """Groups of ops that are the same op of repeated (unrolled) blocks.

  Two ops match when they have the same :func:`_repeat_key` and so do their
  producers, ``depth`` levels up the dataflow (a Merkle hash); the program's
  inputs hash by ``input_tokens`` (parameter paths with layer numbers
  removed). Two multiplies from one source line inside one block then stay
  apart, while the same multiply in block 3 and block 7 share one decision.
  Only ops repeated ``min_repeats`` times or more are tied: for a model of two
  or three blocks, the blocks next to the embedding and the head differ too
  much for one decision to fit them all, and the search is cheap anyway.
  """
  tok: list[Any] = []
  for op in graph.ops:
    if op.kind == "input":
      tok.append(("input", input_tokens[op.leaf]))
    elif op.key is not None:
      tok.append(op.key)
    else:
      tok.append((op.prim, op.kind, tuple(op.in_avals)))
  h = [hash(t) for t in tok]
  for _ in range(depth):
    nh = []
    for op in graph.ops:
      ins = tuple(h[graph.tensors[t].producer[0]] if t is not None else 0
                  for t in op.ins)
      nh.append(hash((h[op.id], ins)))
    h = nh
  by_key: dict[int, list[int]] = {}
  for op in graph.ops:
    if op.kind == "eqn" and op.key is not None:
      by_key.setdefault(h[op.id], []).append(op.id)
  return [g for g in by_key.values() if len(g) >= min_repeats]


def _identity_sigs(rank: int, n_in: int = 1) -> list[Sig]:
  sigs = [((B,) * n_in, (B,)), ((P,) * n_in, (P,))]
  sigs += [((d,) * n_in, (d,)) for d in range(rank)]
  return sigs


def _slice_sigs(inner_rank: int) -> list[Sig]:
  """Stacked xs [L, ...] -> one slice [...]: the layer dim never splits."""
  return [((B,), (B,)), ((P,), (P,))] + [((d + 1,), (d,))
                                          for d in range(inner_rank)]


def _stack_sigs(inner_rank: int) -> list[Sig]:
  return [((B,), (B,)), ((P,), (P,))] + [((d,), (d + 1,))
                                          for d in range(inner_rank)]


def _source_sigs(aval: Aval, allow_split: bool) -> list[Sig]:
  sigs = [((), (B,))]
  if allow_split:
    sigs += [((), (d,)) for d in range(aval.rank)]
  return sigs


def build_graph(closed_jaxpr, in_names: Sequence[str],
                out_names: Sequence[str],
                splittable_in: Sequence[bool] | None = None) -> OpGraph:
  """Walks a ClosedJaxpr into an OpGraph (see module docstring)."""
  bld = _Builder()
  jaxpr = closed_jaxpr.jaxpr
  consts = [bld.const(c, 1.0) for c in closed_jaxpr.consts]
  input_ops = []
  for i, v in enumerate(jaxpr.invars):
    a = _aval(v.aval)
    split = splittable_in[i] if splittable_in is not None else True
    o = bld.op("input", "input", [], [], [a], _source_sigs(a, split),
               name=in_names[i], leaf=i)
    input_ops.append(o.id)
  outs = bld.walk(jaxpr, consts, [bld.ops[i].outs[0] for i in input_ops], (),
                  1.0)
  output_ops = []
  for i, (t, v) in enumerate(zip(outs, jaxpr.outvars)):
    a = _aval(v.aval)
    if t is None:
      t = bld.const(np.zeros(a.shape, a.dtype), 1.0)
    sigs = [((s,), ()) for (_, (s,)) in _source_sigs(a, True)]
    o = bld.op("output", "output", [t], [a], [], sigs, name=out_names[i],
               leaf=i)
    output_ops.append(o.id)
  for name, n in sorted(bld.unsupported.items()):
    warnings.warn(
        f"autoddl_jax has no sharding rule for primitive {name!r} ({n} "
        f"use{'s' if n > 1 else ''}); it runs replicated there (correct, "
        "not fast). Please report it.", UnsupportedPrimitiveWarning,
        stacklevel=3)
  return OpGraph(bld.tensors, bld.ops, bld.var_tensor, input_ops, output_ops,
                 dict(bld.unsupported), bld.eqn_op, bld.entry_links,
                 bld.exit_links, bld.result_links, bld.loop_of_link)
