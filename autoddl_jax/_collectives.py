"""Collectives on ring links: their kinds, bytes and alpha-beta time.

One place for the formulas the cost model charges (:mod:`autoddl_jax._cost`),
the HLO reader counts XLA's emitted collectives by (:mod:`autoddl_jax._hlo`)
and reports name (``verify``, ``explain``). On a group of ``p`` devices, each
sending over a link of latency ``alpha`` and bandwidth ``beta`` (bytes/s):

==================  ======================  ============  ================
collective          bytes sent per device   latency steps  of the
==================  ======================  ============  ================
all-reduce          2 (p-1)/p * n           2 (p-1)        whole tensor n
reduce-scatter      (p-1)/p * n             p-1            whole operand n
all-gather          (p-1)/p * n             p-1            whole result n
all-to-all          (p-1)/p^2 * n           p-1            whole tensor n
collective-permute  the block moved         1
==================  ======================  ============  ================

and the time is ``steps * alpha + bytes / beta``.
"""

from __future__ import annotations

# In the order reports list them.
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
         "collective-permute")


def latency_steps(kind: str, p: int) -> int:
  """Message rounds of a ring collective on ``p`` devices."""
  if kind == "all-reduce":
    return 2 * (p - 1)
  if kind == "collective-permute":
    return 1
  return p - 1


def group_bytes(kind: str, p: int, n):
  """Bytes each device sends for a collective over ``p`` devices of a tensor
  whose whole (within the group) is ``n`` bytes (a float or an array)."""
  frac = (p - 1) / p
  if kind == "all-reduce":
    return 2 * frac * n
  if kind == "all-to-all":
    return frac / p * n
  return frac * n  # all-gather, reduce-scatter


def ring_bytes(kind: str, p: int, result_bytes: float,
               operand_bytes: float) -> float:
  """Bytes each device sends for an emitted collective, from its buffers on
  one device (the result's and the operand's)."""
  if kind == "collective-permute":
    return result_bytes
  if p <= 1:
    return 0.0
  frac = (p - 1) / p
  if kind == "all-reduce":
    return 2 * frac * result_bytes
  if kind == "reduce-scatter":
    return frac * operand_bytes
  return frac * result_bytes  # all-gather, all-to-all


def seconds(kind: str, p: int, sent, alpha: float, beta: float):
  """Alpha-beta time of a collective on ``p`` devices that sends ``sent``
  bytes per device (a float or an array)."""
  return latency_steps(kind, p) * alpha + sent / beta
