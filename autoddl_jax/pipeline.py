"""Pipeline stages over a stack of layers: :func:`scan`.

``ad.pipeline.scan(f, init, xs)`` is a drop-in for ``jax.lax.scan(f, init,
xs)`` over a stack of layers (``xs``: the stacked layer parameters, ``init``:
the activations, ``f(carry, x) -> (carry, None)``). Outside planning, and
whenever a plan uses one stage, it *is* ``lax.scan``. When the planner
traces the step for ``S`` stages and ``M`` microbatches
(``ad.plan(..., pipeline=...)``) it runs a GPipe (or circular) schedule
in plain JAX:

* the stack's layer dim ``L`` becomes ``(S, L/S)`` -- stage ``s`` holds layers
  ``s*L/S .. (s+1)*L/S - 1`` -- and the batch (``batch_axis`` of every carry
  leaf) is dealt into ``M`` microbatches (row ``i`` goes to microbatch ``i %
  M``, so a batch split over devices stays split without communication);
* ``M + S - 1`` ticks (a ``lax.scan``): at each, every stage runs its layers
  on the microbatch it holds (the stage dim ``vmap``-ed; the plan splits it
  over the stage mesh axis, so each device group computes one stage), then
  the activations move one stage on (:data:`stage_shift_p`, which XLA
  partitions into one collective-permute on the stage axis) and stage 0
  takes the next microbatch; the last stage's output is kept;
* autodiff gives the backward pass (the transposed shift is the permute the
  other way); the first and last ``S - 1`` ticks of each stage run on zeros
  (the bubble, ``(S-1)/(M+S-1)`` of the loop), whose results are masked out;
* with ``Schedule.replicas``, the stage weights get a replica dim split over
  those axes (data parallelism inside a stage) and each microbatch is dealt
  over it: each replica's weight gradient is accumulated apart over the
  ticks and summed once after the loop, where a gradient accumulated as a
  partial sum would be reduced by XLA on every tick;
* with ``Schedule.repeats = V > 1`` (circular, interleaved stages), the
  layers become ``(S, V, L/S/V)`` -- chunk ``v`` of stage ``s`` is the stack's
  ``(v*S + s)``-th -- the shift is a ring (stage ``S-1``'s result comes round
  to stage 0, still one collective-permute), and each microbatch goes round
  it ``V`` times: ``V*M + S - 1`` ticks, a bubble of ``(S-1)/(V*M+S-1)``.
  Stage ``s`` at tick ``t`` works on round ``(t - s) // M``; a microbatch
  back on stage 0 waits ``M - S`` ticks in a queue (so ``M >= S``) until
  its next round starts. Each layer reads its weights from the round's
  chunk inside the layer, so the weights stay loop-invariant: read once
  per tick outside it, they would be kept for every tick as residuals.

The schedule computes the same function as ``lax.scan`` (tests hold loss and
gradients to the unsharded step at rel 1e-5). The cost model needs nothing
special for it: the traced schedule's FLOPs (bubble ticks included), its
stacked per-tick residuals, the permute and the gradient reduction over the
smaller data-parallel group are in the program the planner costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from autoddl_jax import _remat
from autoddl_jax._shift import stage_shift, stage_shift_p  # noqa: F401 (re-exported)

__all__ = ["Schedule", "scan", "stage_shift"]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How a pipelined :func:`scan` runs: ``stages`` over mesh axis ``axis``,
  the batch in ``microbatches``, the stage weights in ``replica_count``
  replicas over the ``replicas`` axes."""

  stages: int
  microbatches: int
  axis: str  # the mesh axis (of the plan's mesh) the stage dim is split over
  # The user's mesh axis that ``axis`` was split from (its major part,
  # autoddl_jax._stages.stage_mesh), or None: ``axis`` is the user's own.
  split_from: str | None = None
  # Mesh axes a replica dim of the stage weights is split over: data
  # parallelism inside a stage whose gradients stay apart per replica over
  # the ticks (a partial sum carried by a loop is reduced by XLA on every
  # trip) and are summed once after the loop. () : none.
  replicas: tuple[str, ...] = ()
  replica_count: int = 1  # the product of the replica axes' sizes
  # Circular (interleaved) stages: each stage holds ``repeats`` chunks of
  # the stack, and every microbatch goes round the ring of stages that
  # many times (1: GPipe). Needs microbatches >= stages.
  repeats: int = 1

  def __post_init__(self):
    object.__setattr__(self, "replicas", tuple(self.replicas))
    for name in ("stages", "microbatches", "replica_count", "repeats"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Schedule.{name} must be an int >= 1, got {v!r}")

  @property
  def ticks(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of each stage's ticks spent on no microbatch."""
    return (self.stages - 1) / self.ticks


@dataclasses.dataclass(frozen=True)
class Call:
  """One :func:`scan` call, as a traced program shows it (:func:`calls`)."""

  layers: int  # the stack's leading dim
  batch: int | None  # the carry's batch size (None: no common batch dim)
  has_ys: bool  # f returns per-layer outputs (a pipeline cannot)


class _State(threading.local):
  schedule: Schedule | None = None


_STATE = _State()
_LAX_SCAN = lax.scan  # as imported: autoddl_jax._remat patches lax.scan
# The name scope a plain (one-stage) scan runs in: how :func:`calls` finds
# it in a traced program, cached traces included.
_SCOPE = "autoddl_pipeline_scan"


@contextlib.contextmanager
def scheduled(schedule: Schedule | None) -> Iterator[None]:
  """Within: every :func:`scan` runs ``schedule`` (None, or one stage:
  ``lax.scan``)."""
  if schedule is None or schedule.stages == 1:
    yield
    return
  if _STATE.schedule is not None:
    raise RuntimeError("pipeline schedules do not nest")
  # jax caches traced functions by identity: a step traced before (as a
  # plain scan) would be reused here, and this one reused after.
  jax.clear_caches()
  _STATE.schedule = schedule
  try:
    yield
  finally:
    _STATE.schedule = None
    jax.clear_caches()


_TAG = re.compile(_SCOPE + r"_L(\d+)_B(\d+|none)_Y([01])")


def calls(jaxpr) -> list[Call]:
  """The distinct :func:`scan` calls of a program traced without a
  schedule (read from the name scope each one runs in, so a cached trace
  shows them too)."""
  found: dict[str, Call] = {}

  def walk(j):
    for eqn in j.eqns:
      for m in _TAG.finditer(str(eqn.source_info.name_stack)):
        if m.group(0) not in found:
          batch = None if m.group(2) == "none" else int(m.group(2))
          found[m.group(0)] = Call(int(m.group(1)), batch, m.group(3) == "1")
      for sub in jcore.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr)
  return list(found.values())


# -------------------------------------------------------------- the scan
def _layers(xs) -> int:
  leaves = jax.tree_util.tree_leaves(xs)
  if not leaves:
    raise ValueError("ad.pipeline.scan needs xs: the stacked layer "
                     "parameters (a pytree of arrays with a leading layer "
                     "dim)")
  sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError("ad.pipeline.scan: every leaf of xs must have the same "
                     f"leading (layer) dim, got {sorted(map(str, sizes))}")
  return sizes.pop()


def _batch(init, batch_axis: int) -> int | None:
  sizes = set()
  for a in jax.tree_util.tree_leaves(init):
    if jnp.ndim(a) <= batch_axis:
      return None
    sizes.add(jnp.shape(a)[batch_axis])
  return sizes.pop() if len(sizes) == 1 else None


def scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, *,
         batch_axis: int = 0) -> tuple[Any, Any]:
  """``jax.lax.scan(f, init, xs)`` over a stack of layers, pipelined where
  the plan puts its stages over a mesh axis (module docstring).

  Args:
    f: one layer, ``f(carry, x) -> (carry, ys)``; a pipelined scan needs
      ``ys`` to be None (or an empty pytree).
    init: the activations: a pytree whose every leaf has the batch at
      ``batch_axis``.
    xs: the stacked layer parameters (every leaf's leading dim is the layer
      count).
    batch_axis: the batch dim of ``init``'s leaves, dealt into microbatches.

  Returns:
    ``(carry, ys)`` as ``lax.scan`` returns them.
  """
  if isinstance(batch_axis, bool) or not isinstance(batch_axis, int) or \
      batch_axis < 0:
    raise ValueError(f"batch_axis must be an int >= 0, got {batch_axis!r}")
  layers = _layers(xs)
  sched = _STATE.schedule
  shape = lambda a, k=0: jax.ShapeDtypeStruct(  # noqa: E731
      jnp.shape(a)[k:], jnp.result_type(a))
  ys_shape = jax.eval_shape(f, jax.tree_util.tree_map(shape, init),
                            jax.tree_util.tree_map(lambda a: shape(a, 1), xs)
                            )[1]
  has_ys = bool(jax.tree_util.tree_leaves(ys_shape))
  if sched is None:
    # The scope tags the scan for the planner (:func:`calls`).
    batch = _batch(init, batch_axis)
    with jax.named_scope(f"{_SCOPE}_L{layers}_B{batch or 'none'}_Y"
                         f"{int(has_ys)}"):
      return lax.scan(f, init, xs)
  if has_ys:
    raise ValueError("ad.pipeline.scan: f returns per-layer outputs (ys); a "
                     "pipelined scan needs f(carry, x) -> (carry, None). "
                     "Plan with pipeline=1, or return them in the carry.")
  return _pipelined(f, init, xs, batch_axis, layers, sched), None


def _pipelined(f, init, xs, batch_axis: int, layers: int,
               sched: Schedule):
  S, M, V = sched.stages, sched.microbatches, sched.repeats
  batch = _batch(init, batch_axis)
  if layers % (S * V):
    raise ValueError(f"ad.pipeline.scan: {layers} layers do not split into "
                     f"{S} stages" + (f" of {V} circular chunks" if V > 1
                                      else "")
                     + "; use a stage count that divides them")
  if V > 1 and M < S:
    raise ValueError(f"ad.pipeline.scan: circular stages need at least as "
                     f"many microbatches as stages, got {M} for {S}")
  if batch is None or batch % M:
    raise ValueError(
        f"ad.pipeline.scan: the carry's batch dim {batch_axis} "
        + ("differs between its leaves (or some leaf lacks it)"
           if batch is None else f"of size {batch}")
        + f" cannot be dealt into {M} microbatches; every leaf of init needs "
        "the same batch size, divisible by the microbatch count")
  R = sched.replica_count
  if (batch // M) % R:
    raise ValueError(f"ad.pipeline.scan: a microbatch of {batch // M} rows "
                     f"does not split into {R} replicas")
  tmap = jax.tree_util.tree_map
  T = sched.ticks
  if V == 1:  # (S, L/S, ...): stage s holds layers s*L/S ..
    stages = tmap(lambda a: a.reshape(S, layers // S, *a.shape[1:]), xs)
  else:  # (S, V, L/S/V, ...): chunk v of stage s is the (v*S + s)-th
    stages = tmap(lambda a: jnp.swapaxes(a.reshape(
        V, S, layers // S // V, *a.shape[1:]), 0, 1), xs)
  if R > 1:  # (S, R, ...): each replica's copy, its gradient its own
    stages = tmap(lambda a: jnp.broadcast_to(
        a[:, None], (S, R, *a.shape[1:])), stages)

  def deal(a):  # (..., B at batch_axis, ...) -> (M, [R,] B/M/R, ...)
    a = jnp.moveaxis(a, batch_axis, 0)
    a = a.reshape(batch // M, M, *a.shape[1:])  # row i -> microbatch i % M
    a = jnp.swapaxes(a, 0, 1)
    # a batch split in blocks over devices stays split: replica r holds
    # the r-th block of each microbatch
    return a.reshape(M, R, batch // M // R, *a.shape[2:]) if R > 1 else a

  def gather(a):  # the inverse of deal
    a = a.reshape(M, batch // M, *a.shape[2 + (R > 1):])
    a = jnp.swapaxes(a, 0, 1).reshape(batch, *a.shape[2:])
    return jnp.moveaxis(a, 0, batch_axis)

  micro = tmap(deal, init)
  feed = tmap(lambda a: jnp.concatenate(
      [a, jnp.zeros((T - M, *a.shape[1:]), a.dtype)]), micro)

  def stage(params, h, v=None):  # one stage's layers on one microbatch
    h = tmap(lambda a: jnp.moveaxis(a, 0, batch_axis), h)
    if v is None:
      h, _ = lax.scan(f, h, params)  # remat (autoddl_jax._remat) applies
    else:
      # Layer j of this round's chunk v, read inside the layer: the weights
      # stay loop-invariant (a remat policy recomputes the read), where a
      # chunk read per tick would be kept as a residual of every tick --
      # the stage's weights again for each (357 GiB per device on the 175B
      # GPT at 16 stages of 2 chunks, M=128, against 15 GiB for GPipe).
      def layer(h, j):
        return f(h, tmap(lambda a: a[v, j], params))
      h, _ = lax.scan(layer, h, jnp.arange(layers // S // V))
    return tmap(lambda a: jnp.moveaxis(a, batch_axis, 0), h)

  if V == 1:
    vmapped = jax.vmap(jax.vmap(stage)) if R > 1 else jax.vmap(stage)
  else:
    vmapped = jax.vmap(jax.vmap(stage, in_axes=(0, 0, None))) if R > 1 \
        else jax.vmap(stage)

  def run(*a):
    # A remat policy that saves the layers' weight matmuls tells them from
    # the attention's batched ones past these vmaps' batch dims.
    with _remat.stage_vmaps(2 if R > 1 else 1):
      return vmapped(*a)

  def where_stage(s, a, b):
    idx = lax.broadcasted_iota(jnp.int32, b.shape, 0)
    return jnp.where(idx == s, a, b)

  # Circular: stage S-1's result comes round to stage 0 (the ring shift),
  # which takes it up D = M - S ticks later, when that microbatch's next
  # round starts (a first-in first-out queue of D slots on every stage,
  # read on stage 0).
  D = M - S

  def tick(carry, step):
    # GPipe's loop carries the stages' state alone and reads the feed;
    # a circular one a queue too, and the tick's index.
    (state, queue), (mb, t) = (carry, step) if V > 1 else \
        ((carry, None), (step, None))
    moved = tmap(lambda a: stage_shift(
        a, sched.axis, replicas=sched.replicas if R > 1 else (),
        replica_dim=1, ring=V > 1), state)
    if V == 1:
      inp = tmap(lambda m, a: where_stage(
          0, jnp.broadcast_to(m[None], a.shape), a), mb, moved)
    else:
      back = moved
      if D:
        back = tmap(lambda q: q[:, 0], queue)
        queue = tmap(lambda q, a: jnp.concatenate([q[:, 1:], a[:, None]], 1),
                     queue, moved)
      # stage 0 takes a new microbatch for the first M ticks, then one
      # coming round
      inp = tmap(lambda m, b, a: where_stage(0, jnp.where(
          t < M, jnp.broadcast_to(m[None], a.shape), b), a), mb, back, moved)
    if V == 1:
      out = run(stages, inp)
    else:  # stage s works on item t - s: round (t - s) // M of it
      out = run(stages, inp, jnp.clip((t - jnp.arange(S)) // M, 0, V - 1))
    # The last stage's result, as a sum over the stage dim with the others
    # masked: a partial sum over the stage axis, reduced once after the loop.
    last = tmap(lambda a: where_stage(S - 1, a, jnp.zeros_like(a)).sum(0),
                out)
    return ((out, queue) if V > 1 else out), last

  state0 = tmap(lambda a: jnp.zeros((S, *a.shape[1:]), a.dtype), micro)
  queue0 = tmap(lambda a: jnp.zeros((S, D, *a.shape[1:]), a.dtype), micro) \
      if V > 1 and D else None
  # The tick loop as jax wrote it: a remat policy recomputes the layers
  # (the scan in ``stage``), not whole stages on top of that.
  if V == 1:
    _, ys = _LAX_SCAN(tick, state0, feed)
  else:
    _, ys = _LAX_SCAN(tick, (state0, queue0),
                      (feed, jnp.arange(T, dtype=jnp.int32)))
  # the last round's results: microbatch m leaves at (V-1)*M + S-1 + m
  return tmap(lambda a: gather(a[T - M:]), ys)
