"""From a traced program to the op graph the planner searches over.

``jax.make_jaxpr`` gives a ClosedJaxpr. We walk its equations and produce a flat
:class:`OpGraph`:

* ``custom_jvp_call``, ``custom_vjp_call`` and ``remat2`` are opened (their
  equations join the graph; plain nested ``jit`` calls were spliced into
  their caller when the step was traced, :func:`_jaxpr.inline_plain_calls`);
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

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from autoddl_jax import _rules
from autoddl_jax._coords import repeat_key
from autoddl_jax._errors import RuleError
from autoddl_jax._remat import behind_barrier
from autoddl_jax._factors import Aval, Sig
from autoddl_jax._jaxpr import INLINE, bodies, to_aval
from autoddl_jax._opgraph import STAGE_SHIFT, Op, OpGraph, Tensor
from autoddl_jax._rules import eqn_flops
from autoddl_jax._sbp import B_CODE as B, P_CODE as P



# The weight of a reshard into an optimization barrier (see Builder.walk):
# never the cheaper choice, so operands enter it as they were made.
BARRIER_RESHARD_PENALTY = 1e6


def _demanded_layout(eqn) -> tuple[Any, tuple[str, ...]] | None:
  """The (spec, mesh axis names) a ``with_sharding_constraint`` demands,
  a stage shift's ``(STAGE_SHIFT, ((mesh axis, dim), ...), shifted dim)``,
  or None (another op,
  or a constraint with unconstrained dims)."""
  if eqn.primitive.name == STAGE_SHIFT:
    return STAGE_SHIFT, eqn.params["placement"], eqn.params["axis"]
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
    aval = to_aval(value if hasattr(value, "shape") else np.asarray(value))
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
        [(_, sub, sub_consts)] = bodies(eqn, sub_ctx)
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
    in_avals = [to_aval(v.aval) for v in eqn.invars]
    out_avals = [to_aval(v.aval) for v in eqn.outvars]
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
    op.key = repeat_key(eqn, in_avals, out_avals, weight)
    op.fixed = _demanded_layout(eqn)
    return op

  def scan(self, eqn, ins, ctx, weight) -> list[int]:
    start = len(self.ops)
    p = eqn.params
    [(_, body, body_consts)] = bodies(eqn, ctx)
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
    merges = [self.op("~merge", "link", [None] * nb, [to_aval(v.aval)] * nb,
                      [to_aval(v.aval)], _identity_sigs(len(v.aval.shape), nb),
                      weight, [w] * nb) for v in eqn.outvars]
    for b, (bctx, jx, consts) in enumerate(bodies(eqn, ctx)):
      args = [self.link("~link", t, self.tensors[t].aval, w, w) for t in ops_in]
      cts = [self.const(c, w) for c in consts]
      outs = self.walk(jx, cts, args, bctx, w)
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
    (cctx, cj, cconsts), (bctx, bj, bconsts) = bodies(eqn, ctx)
    self.walk(cj, [self.const(c, weight) for c in cconsts], cond_c + carry,
              cctx, weight)
    outs = self.walk(bj, [self.const(c, weight) for c in bconsts],
                     body_c + carry, bctx, weight)
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
    a = to_aval(v.aval)
    split = splittable_in[i] if splittable_in is not None else True
    o = bld.op("input", "input", [], [], [a], _source_sigs(a, split),
               name=in_names[i], leaf=i)
    input_ops.append(o.id)
  outs = bld.walk(jaxpr, consts, [bld.ops[i].outs[0] for i in input_ops], (),
                  1.0)
  output_ops = []
  for i, (t, v) in enumerate(zip(outs, jaxpr.outvars)):
    a = to_aval(v.aval)
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
