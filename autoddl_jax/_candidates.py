"""An op's n-D candidates: its 1-D signatures taken over the mesh axes.

A candidate fixes the nd-SBP of each of the op's slots (inputs, then
outputs): one 1-D signature per mesh axis, kept where every slot's nd-SBP
is a valid state of its tensor (the splits divide its dims), literal
operands stay broadcast, a layout the step demands of the result holds,
and a pipeline's pinned stage dim (:mod:`autoddl_jax._pinned`) stays on
its axis.
"""

from __future__ import annotations

import itertools

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._memory import MEMORY_ALIAS_OPS
from autoddl_jax._sbp import B_CODE as B
from autoddl_jax._states import state_space


def candidates(op, slots, literal, mi: MeshInfo, fixed=None, pinned=()):
  """(candidates, slot state indices, split factor, output bytes) of an op:
  the product of its 1-D signatures over the mesh axes, keeping those whose
  every slot's nd-SBP is a valid state (splits divide) and whose literal
  inputs stay broadcast; with ``fixed`` (nd codes), only those whose
  results have that layout; with ``pinned`` (per slot, ((axis, dim),
  ...): :mod:`autoddl_jax._pinned`), on each pinned axis only the
  signatures that keep every pinned slot on its dim, where one does."""
  spaces = [state_space(a.shape, a.dtype.itemsize, mi) for a in slots]
  all_b = next((i for i, (si, so) in enumerate(op.sigs)
                if all(c == B for c in (*si, *so))), 0)
  full = [si + so for si, so in op.sigs]
  free = [range(len(op.sigs)) if s > 1 else [all_b]
          for s in mi.axis_sizes]
  held = [[] for _ in mi.axis_sizes]
  for s, ps in enumerate(pinned):
    for a, d in ps:
      held[a].append((s, d))
  pins = [[k for k, sig in enumerate(full)
           if all(sig[s] == d for s, d in held[a])] or free[a]
          if held[a] else free[a] for a in range(mi.ndim)]

  def enumerate_(per_axis):
    seen = {}
    for combo in itertools.product(*per_axis):
      nd = []
      for s in range(len(slots)):
        codes = tuple(full[k][s] for k in combo)
        if codes not in spaces[s].index or (
            literal[s] and any(c != B for c in codes)):
          break
        nd.append(codes)
      else:
        seen.setdefault(tuple(nd), None)
    return list(seen)

  # Where the pins leave no valid candidate (a split that does not
  # divide together with another axis'), the op is left free.
  cands = (any(pinned) and enumerate_(pins)) or enumerate_(free)
  if fixed is not None:
    cands = [c for c in cands if all(
        f is None or c[s][a] == f for s in range(len(op.ins), len(slots))
        for a, f in enumerate(fixed))] or cands
  if not cands:  # cannot happen with an all-B signature; be safe
    cands = [tuple(tuple(B for _ in range(mi.ndim)) for _ in slots)]
  slot_idx = [np.array([spaces[s].index[c[s]] for c in cands],
                       dtype=np.int32) for s in range(len(slots))]
  # The devices that share the work: the axes some slot is split over.
  split = (np.array(cands, dtype=np.int64) >= 0).any(axis=1)
  spl = np.where(split, np.array(mi.axis_sizes, dtype=np.float64),
                 1.0).prod(axis=1)
  ob = np.zeros(len(cands))
  if op.prim not in MEMORY_ALIAS_OPS:
    for s in range(len(op.ins), len(slots)):
      ob = ob + spaces[s].local_bytes[slot_idx[s]]
  return cands, slot_idx, spl, ob


# :func:`candidates` by op structure and mesh, kept across problems: the
# planner builds one problem per pipeline schedule and remat variant, of
# the same few structures (a transformer repeats a few many times).
_MEMO: dict = {}
MEMO_SIZE = 1 << 16


def structure_candidates(op, slots, literal, mi: MeshInfo, fixed=None,
                         pinned=()):
  """:func:`candidates`, computed once per structure (signatures, slot
  shapes and itemsizes, which inputs are literals, whether the op aliases
  its input, demanded layout, pins) and mesh. Callers share the result,
  slot index arrays included, and must not change it."""
  key = (tuple(op.sigs), literal,
         tuple((tuple(a.shape), a.dtype.itemsize) for a in slots),
         len(op.ins), op.prim in MEMORY_ALIAS_OPS, fixed, pinned, mi)
  got = _MEMO.get(key)
  if got is None:
    if len(_MEMO) >= MEMO_SIZE:
      _MEMO.clear()
    got = _MEMO[key] = candidates(op, slots, literal, mi, fixed, pinned)
  return got
