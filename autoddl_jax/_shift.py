"""The stage shift of :mod:`autoddl_jax.pipeline`: a primitive that moves
blocks one stage along a dim (GPipe) or round a ring (circular stages),
which XLA partitions into one collective-permute on the stage axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad as jad
from jax.interpreters import batching, mlir

stage_shift_p = jcore.Primitive("stage_shift")
"""``stage_shift(x, shift, axis, placement)``: ``x`` moved ``shift`` (+1 or
-1) places along dim ``axis``, zeros coming in. ``placement`` holds the
(mesh axis, dim) pairs the plan must split ``x`` by (the stage dim over the
stage axis, a replica dim over the replica axes; the graph holds them
fixed). The rule is elementwise; the cost model charges a collective-permute
of each device's block wherever ``axis`` is split."""


def _shift_impl(x, *, shift: int, axis: int, placement, ring: bool = False):
  del placement
  if ring:  # the last block comes round to the first: one permute ring
    return jnp.roll(x, shift, axis)
  pad = [(0, 0, 0)] * x.ndim
  pad[axis] = (shift, -shift, 0)  # negative padding drops the far end
  return lax.pad(x, jnp.zeros((), x.dtype), pad)


def _shift_batch(args, dims, *, shift, axis, placement, ring=False):
  (x,), (d,) = args, dims
  if d is not batching.not_mapped:
    axis += d <= axis
    placement = tuple((a, k + (d <= k)) for a, k in placement)
  return _bind_shift(x, shift, axis, placement, ring), d


def _shift_transpose(ct, x, *, shift, axis, placement, ring=False):
  del x
  if type(ct) is jad.Zero:
    return (ct,)
  return (_bind_shift(ct, -shift, axis, placement, ring),)


def _bind_shift(x, shift, axis, placement, ring):
  # A GPipe shift binds no ``ring`` param: its jaxpr stays as it was.
  extra = {"ring": True} if ring else {}
  return stage_shift_p.bind(x, shift=shift, axis=axis, placement=placement,
                            **extra)


stage_shift_p.def_impl(_shift_impl)
stage_shift_p.def_abstract_eval(lambda x, **_: x)
jad.deflinear2(stage_shift_p, _shift_transpose)
batching.primitive_batchers[stage_shift_p] = _shift_batch
mlir.register_lowering(stage_shift_p, mlir.lower_fun(
    _shift_impl, multiple_results=False))


def stage_shift(x: jax.Array, mesh_axis: str, shift: int = 1,
                axis: int = 0, replicas: tuple[str, ...] = (),
                replica_dim: int | None = None, ring: bool = False
                ) -> jax.Array:
  """``x`` moved ``shift`` places along ``axis`` (stage ``s`` gets stage
  ``s - shift``'s block), zeros coming in (``ring``: the block moved off
  the end comes in); the plan splits ``axis`` over ``mesh_axis`` and
  ``replica_dim`` over the ``replicas`` axes."""
  if shift not in (1, -1):
    raise ValueError(f"stage_shift moves one stage (+1 or -1), got {shift}")
  axis %= x.ndim
  placement = ((mesh_axis, axis),) + tuple(
      (a, replica_dim % x.ndim) for a in replicas)
  return _bind_shift(x, shift, axis, placement, ring)
