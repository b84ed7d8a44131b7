"""What an op itself demands of the plan: a layout for its results, and the
collectives it runs.

A user's ``with_sharding_constraint`` fixes its result's layout on every
mesh axis; ``ad.pipeline``'s stage shift fixes its stage dim on the stage
axis (the other axes free) and moves each device's block to the next stage,
a collective-permute the problem charges to the op's candidate
(:class:`~autoddl_jax._problem.Problem`'s ``op_comm``/``op_bytes``), as it
charges a loop carry held as a partial sum its reduction on every trip.
"""

from __future__ import annotations

import math

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._collectives import group_bytes, seconds
from autoddl_jax._opgraph import STAGE_SHIFT
from autoddl_jax._sbp import P_CODE, spec_to_codes
from autoddl_jax._states import state_space


def fixed_codes(op, slots, mi: MeshInfo) -> tuple[int | None, ...] | None:
  """The nd codes an op's results must have, None on the axes left free,
  or None: a user's sharding constraint on the plan's mesh (every axis
  fixed), or a pipeline's stage shift (its stage dim on its stage axis,
  a replica dim on the replica axes).
  A constraint on another mesh, or one the mesh cannot lay out, is left to
  the plan (and to XLA at run time)."""
  if op.fixed is None:
    return None
  if op.fixed[0] == STAGE_SHIFT:
    placement = dict(op.fixed[1])
    if not set(placement) <= set(mi.axis_names):
      return None
    return tuple(placement.get(a) for a in mi.axis_names)
  spec, axes = op.fixed
  if tuple(axes) != mi.axis_names:
    return None
  try:
    return spec_to_codes(spec, len(slots[-1].shape), mi.axis_names)
  except ValueError:
    return None


def op_collectives(op, cands, mi: MeshInfo, slots, loop_carry: bool
                   ) -> tuple[str | None, np.ndarray, np.ndarray]:
  """(collective kind or None, time, bytes) per candidate of what an op
  sends itself, once per execution:

  * a stage shift moves each device's block to its neighbour on the axes
    that split its stage dim (one collective-permute, as XLA partitions
    it);
  * a loop's carry (``loop_carry``: a scan's or while's ``~merge``) held as
    a partial sum is all-reduced on every trip: XLA cannot carry one
    across iterations (measured: a pipeline's stage-weight gradients,
    accumulated over its ticks, were reduced once per tick where the plan
    reduced them once after the loop).
  """
  t, b = np.zeros(len(cands)), np.zeros(len(cands))
  if op.prim != STAGE_SHIFT and not loop_carry:
    return None, t, b
  out = len(op.ins)
  space = state_space(slots[out].shape, slots[out].dtype.itemsize, mi)
  if op.prim == STAGE_SHIFT:
    dim = op.fixed[2]
    for k, c in enumerate(cands):
      axes = [a for a, code in enumerate(c[out]) if code == dim]
      if not axes:
        continue
      local = float(space.local_bytes[space.index[c[out]]])
      b[k] = local
      t[k] = seconds("collective-permute", 2, local,
                     max(mi.alpha[a] for a in axes),
                     min(mi.beta[a] for a in axes))
    return "collective-permute", t, b
  for k, c in enumerate(cands):  # a loop carry
    axes = [a for a, code in enumerate(c[out]) if code == P_CODE]
    if not axes:
      continue
    p = math.prod(mi.axis_sizes[a] for a in axes)
    local = float(space.local_bytes[space.index[c[out]]])
    b[k] = group_bytes("all-reduce", p, local)
    t[k] = seconds("all-reduce", p, b[k], max(mi.alpha[a] for a in axes),
                   min(mi.beta[a] for a in axes))
  return "all-reduce", t, b
