"""Rematerialisation of layer stacks and repeated blocks as a planned choice.

A train step is traced after autodiff: its jaxpr already holds the backward
pass, and what the forward keeps for it (the stacked residuals a scan's
forward emits) cannot be changed on that jaxpr without differentiating
again. So a remat choice is a *trace* of the step: while the step is traced
under :func:`scan_policy`, every ``jax.lax.scan`` the user's code calls
(``lax.scan`` itself, ``flax.linen.scan``, ``nnx.scan``) runs its body under
``jax.checkpoint`` with that policy. The jaxpr then holds the recomputation
and the smaller residuals, so the cost model counts the extra FLOPs and the
memory saved from the program itself, and the lowering (which interprets
that jaxpr) keeps the checkpoint. A step whose jaxpr already holds a
``jax.checkpoint`` is planned as given: the user chose.

Scans are matched to a policy by the order the step calls them in
(``policy`` may be one name for all, or a tuple with one per call).

Layers written as a Python loop leave no scan: their blocks follow one
another in the jaxpr. Under one policy name, ``jax.grad`` and
``jax.value_and_grad`` are patched too: the function they differentiate is
traced, runs of a block of equations repeated back to back are found
(:func:`repeated_blocks`), and the function runs as its own jaxpr with each
block under ``jax.checkpoint`` (``prevent_cse``: unrolled, XLA would
otherwise merge the recomputation with the forward) -- the same equations,
so the same function, differentiated as the user asked.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.extend
import numpy as np
from jax import lax

_state = threading.local()
_original_scan = lax.scan


class NoBatchDotsSaveable:
  """``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` for a
  layer that runs inside ``levels`` vmaps: a pipelined stage
  (:mod:`autoddl_jax.pipeline`) vmaps its layers over the stage dim (and
  a replica dim), and each vmap that batches both operands of a matmul
  gives it one more batch dim -- jax's own policy would then save no dot
  at all. Saved: the outputs of matmuls with no batch dims of the layer's
  own (the weight matmuls); recomputed: the attention's batched ones
  (scores and their product with the values) and everything
  elementwise -- Megatron's selective activation recomputation
  (Korthikanti et al. 2022), which recomputes few FLOPs and frees the
  largest residuals (a head's seq x seq scores). Which residuals a policy
  keeps changes no numerics: the planner costs the program it traces.

  A dot ``dots_saveable`` would save and this does not is noted
  (:func:`declined_dots`): where there is none the traced program is
  ``dots_saveable``'s, and the planner does not plan it twice."""

  def __init__(self, levels: int = 0):
    self.levels = levels

  def __call__(self, prim, *args, **params) -> bool:
    if prim is lax.dot_general_p:
      (_, _), (lhs_b, rhs_b) = params["dimension_numbers"]
      saved = len(lhs_b) <= self.levels and len(rhs_b) <= self.levels
    else:
      saved = bool(jax.checkpoint_policies.dots_with_no_batch_dims_saveable(
          prim, *args, **params))
    if not saved and jax.checkpoint_policies.dots_saveable(prim, *args,
                                                            **params):
      _state.declined = True
    return saved

  def __repr__(self):
    return f"NoBatchDotsSaveable(levels={self.levels})"


SELECTIVE = "dots_with_no_batch_dims_saveable"
# Policies by name, cheapest in FLOPs first (and largest in memory).
POLICIES: dict[str, object] = {
    "none": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    SELECTIVE: NoBatchDotsSaveable(0),
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
NONE = "none"
AUTO = ("dots_saveable", SELECTIVE, "nothing_saveable")  # plan(remat=None)


def _checkpoint_policy(name: str):
  """The policy object of ``name`` for a layer traced now: inside the
  vmaps of a pipelined stage (:func:`stage_vmaps`), the selective policy
  excuses their batch dims."""
  if name == SELECTIVE:
    return NoBatchDotsSaveable(getattr(_state, "vmaps", 0))
  return POLICIES[name]


@contextlib.contextmanager
def stage_vmaps(levels: int) -> Iterator[None]:
  """Layers traced inside are vmapped ``levels`` times over (a pipelined
  stage's dim, and its replicas'): :class:`NoBatchDotsSaveable`."""
  before = getattr(_state, "vmaps", 0)
  _state.vmaps = before + levels
  try:
    yield
  finally:
    _state.vmaps = before


def declined_dots() -> bool:
  """Whether the last trace under :func:`scan_policy` held a dot that the
  selective policy recomputes and ``dots_saveable`` saves."""
  return getattr(_state, "declined", False)


def _policy_for(index: int) -> str:
  policy = _state.policy
  if isinstance(policy, str):
    return policy
  return policy[index] if index < len(policy) else NONE


def _scan(f, init, xs=None, length=None, **kwargs):
  index = _state.calls
  _state.calls += 1
  name = _policy_for(index)
  if name != NONE:
    f = jax.checkpoint(f, policy=_checkpoint_policy(name), prevent_cse=False)
  return _original_scan(f, init, xs, length, **kwargs)


def validate(policy: str | Sequence[str]) -> str | tuple[str, ...]:
  names = (policy,) if isinstance(policy, str) else tuple(policy)
  for n in names:
    if n not in POLICIES:
      raise ValueError(f"remat policy {n!r} is not one of "
                       f"{', '.join(POLICIES)}")
  return policy if isinstance(policy, str) else names


@contextlib.contextmanager
def scan_policy(policy: str | Sequence[str]) -> Iterator[None]:
  """Trace with every ``jax.lax.scan`` call's body under ``policy``."""
  policy = validate(policy)
  if getattr(_state, "policy", None) is None:
    _state.declined = False  # (declined_dots)
  if policy == NONE:
    yield
    return
  if getattr(_state, "policy", None) is not None:
    raise RuntimeError("scan_policy does not nest")
  # jax and flax cache traced bodies by function: a body traced before
  # (without the checkpoint) would be reused, and one traced here would be
  # reused after. Clearing the caches costs a re-trace (and recompiles of
  # jitted functions called later), once per planned variant.
  jax.clear_caches()
  _state.policy, _state.calls, _state.blocks = policy, 0, 0
  lax.scan = _scan
  jax.grad = _patched(_original_grad)
  jax.value_and_grad = _patched(_original_value_and_grad)
  try:
    yield
  finally:
    lax.scan = _original_scan
    jax.grad, jax.value_and_grad = _original_grad, _original_value_and_grad
    _state.policy = None
    jax.clear_caches()


def _holds(jaxpr, names: tuple[str, ...]) -> bool:
  """Whether the jaxpr, at any depth, holds an equation of one of ``names``."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      return True
    if any(_holds(sub, names)
           for sub in jax.extend.core.jaxprs_in_params(eqn.params)):
      return True
  return False


def has_checkpoint(jaxpr) -> bool:
  """Whether the jaxpr, at any depth, holds a ``jax.checkpoint``."""
  return _holds(jaxpr, ("checkpoint", "remat2"))


# XLA:CPU drops a checkpoint's optimization barriers early in its pipeline
# (before layout assignment; XLA:GPU only after scheduling and its own
# rematerialisation), and its later CSE then merges an unrolled block's
# recomputation with the forward: no FLOPs spent, no memory saved -- the
# program is not the one planned. Scanned stacks are immune (the two live in
# different loops). Compiled with this option, XLA:CPU keeps the barriers to
# code generation, as XLA:GPU does.
KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def behind_barrier(eqn) -> bool:
  """Whether XLA puts an optimization barrier on ``eqn``'s operands: a
  differentiated ``jax.checkpoint`` that prevents CSE (the recomputation a
  backward pass makes)."""
  return (eqn.primitive.name in ("remat2", "checkpoint")
          and bool(eqn.params.get("differentiated"))
          and bool(eqn.params.get("prevent_cse", True)))


def _unrolled_recompute(jaxpr) -> bool:
  """Whether ``jaxpr`` holds a backward pass's recomputation behind a
  barrier (:func:`behind_barrier`) outside any loop body."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if behind_barrier(eqn):
      return True
    if name not in ("scan", "while") and any(
        _unrolled_recompute(sub)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params)):
      return True
  return False


def cpu_keeps_recompute(jaxpr, mesh) -> bool:
  """Whether a program of ``jaxpr`` on ``mesh`` needs :data:`KEEP_BARRIERS`:
  CPU devices, and an unrolled recomputation to keep."""
  devices = getattr(mesh, "devices", None)
  if devices is None or devices.flat[0].platform != "cpu":
    return False
  return _unrolled_recompute(jaxpr)


# ------------------------------------------------- repeated unrolled blocks
# A Python loop over layers leaves no scan to wrap: its blocks follow one
# another in the loss function's jaxpr as the same equations over and over.
# While a remat variant is traced, ``jax.grad`` and ``jax.value_and_grad``
# (which ``nnx.grad``/``nnx.value_and_grad`` call too) are patched: the
# function they differentiate is traced once to find those runs, then run as
# its own jaxpr with each block under ``jax.checkpoint`` -- the same
# equations, so the same function -- and differentiated as the user asked.
_original_grad = jax.grad
_original_value_and_grad = jax.value_and_grad
# Equations that make a block worth recomputing: a block without one holds
# no activation worth the FLOPs.
_HEAVY = ("dot_general", "conv_general_dilated")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _signature(eqn) -> str:
  """Equal for the same equation of two blocks: primitive, parameters (sub-
  jaxprs printed, object addresses dropped) and operand/result types."""
  params = _ADDRESS.sub("", repr(sorted(
      (k, str(v)) for k, v in eqn.params.items())))
  return "|".join((eqn.primitive.name, params,
                   ",".join(str(v.aval) for v in eqn.invars),
                   ",".join(str(v.aval) for v in eqn.outvars)))


def _heavy(eqn) -> bool:
  return eqn.primitive.name in _HEAVY or any(
      _holds(sub, _HEAVY)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params))


def repeated_blocks(jaxpr) -> list[tuple[int, int, int]]:
  """Runs of a block of equations repeated back to back in ``jaxpr``'s
  top level: ``(start, length, count)``, count >= 2, in program order.

  Greedy: the run covering the most equations first (the shortest block
  among equal covers: one layer, not two), then the same in what is left.
  Each block holds a contraction or convolution.
  """
  eqns = jaxpr.eqns
  n = len(eqns)
  ids: dict[str, int] = {}
  sig = np.array([ids.setdefault(_signature(e), len(ids)) for e in eqns],
                 dtype=np.int64)
  heavy = np.cumsum([0] + [_heavy(e) for e in eqns])
  taken = np.zeros(n, bool)
  runs = []
  while True:
    best = None  # (cover, -length, start, length, count)
    for length in range(1, (n - int(taken.sum())) // 2 + 1):
      same = (sig[:-length] == sig[length:]) & ~taken[:-length] \
          & ~taken[length:]
      if not same.any():
        continue
      # Maximal stretches of equal equations at this period.
      edges = np.diff(np.concatenate(([0], same.astype(np.int8), [0])))
      starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
      for s, e in zip(starts, ends):
        count = (e - s + length) // length
        if count < 2 or heavy[s + length] == heavy[s]:
          continue
        cand = (count * length, -length, int(s), length, int(count))
        if best is None or cand[:3] > best[:3]:
          best = cand
    if best is None:
      return sorted(runs)
    _, _, s, length, count = best
    runs.append((s, length, count))
    taken[s:s + length * count] = True


def _segments(n: int, runs) -> list[tuple[int, int, bool]]:
  """``[0, n)`` cut into (start, end, is a block) pieces."""
  cuts, at = [], 0
  for s, length, count in sorted(runs):
    if s > at:
      cuts.append((at, s, False))
    cuts += [(s + k * length, s + (k + 1) * length, True)
             for k in range(count)]
    at = s + length * count
  if at < n:
    cuts.append((at, n, False))
  return cuts


def _run_checkpointed(closed, runs, policy, flat_args):
  """``closed`` evaluated on ``flat_args`` with each block of ``runs`` under
  ``jax.checkpoint(policy)``: piece by piece, each piece a jaxpr of its
  equations over the values it reads."""
  jaxpr = closed.jaxpr
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, flat_args))
  pieces = _segments(len(jaxpr.eqns), runs)
  # Which values each piece must hand on: read by a later piece or a result.
  later: set = {v for v in jaxpr.outvars
                if not isinstance(v, jax.extend.core.Literal)}
  wanted = []
  for s, e, _ in reversed(pieces):
    wanted.append(set(later))
    for eqn in jaxpr.eqns[s:e]:
      later.update(v for v in eqn.invars
                   if not isinstance(v, jax.extend.core.Literal))
  wanted.reverse()
  for (s, e, block), want in zip(pieces, wanted):
    eqns = jaxpr.eqns[s:e]
    made = {v for eqn in eqns for v in eqn.outvars}
    ins = list(dict.fromkeys(
        v for eqn in eqns for v in eqn.invars
        if not isinstance(v, jax.extend.core.Literal) and v not in made))
    outs = [v for eqn in eqns for v in eqn.outvars
            if v in want and not isinstance(v, jax.extend.core.DropVar)]
    piece = jax.extend.core.ClosedJaxpr(
        jax.extend.core.Jaxpr([], ins, outs, eqns,
                              effects=jaxpr.effects,
                              debug_info=jaxpr.debug_info), [])
    fn = jax.extend.core.jaxpr_as_fun(piece)
    if block:
      fn = jax.checkpoint(fn, policy=_checkpoint_policy(policy),
                          prevent_cse=True)
    env.update(zip(outs, fn(*[env[v] for v in ins])))
  return [v.val if isinstance(v, jax.extend.core.Literal) else env[v]
          for v in jaxpr.outvars]


def _with_blocks_checkpointed(fun: Callable, policy: str) -> Callable:
  @functools.wraps(fun)
  def run(*args, **kwargs):
    if getattr(_state, "inside", False):  # a grad inside the loss: as is
      return fun(*args, **kwargs)
    # jax.grad hands the arguments it does not differentiate as they are
    # (any Python value): those stay static here too.
    leaves, tree = jax.tree.flatten(args)
    dyn = [i for i, x in enumerate(leaves)
           if isinstance(x, (jax.Array, np.ndarray, np.generic))]

    def flat(*vals):
      full = list(leaves)
      for i, v in zip(dyn, vals):
        full[i] = v
      return fun(*jax.tree.unflatten(tree, full), **kwargs)

    calls = _state.calls  # the trace below must not count the scans
    _state.inside = True
    try:
      closed, shape = jax.make_jaxpr(flat, return_shape=True)(
          *[leaves[i] for i in dyn])
    finally:
      _state.inside, _state.calls = False, calls
    runs = repeated_blocks(closed.jaxpr) if not closed.jaxpr.effects else []
    if not runs:
      return fun(*args, **kwargs)
    _state.blocks += sum(count for _, _, count in runs)
    outs = _run_checkpointed(closed, runs, policy, [leaves[i] for i in dyn])
    return jax.tree.unflatten(jax.tree.structure(shape), outs)
  return run


def _patched(transform: Callable) -> Callable:
  @functools.wraps(transform)
  def patched(fun, *args, **kwargs):
    policy = _state.policy
    if isinstance(policy, str) and policy != NONE:
      fun = _with_blocks_checkpointed(fun, policy)
    return transform(fun, *args, **kwargs)
  return patched
