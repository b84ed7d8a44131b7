"""An op's n-D candidates: its 1-D signatures taken over the mesh axes.

A candidate fixes the nd-SBP of each of the op's slots (inputs, then
outputs): one 1-D signature per mesh axis, kept where every slot's nd-SBP
is a valid state of its tensor (the splits divide its dims), literal
operands stay broadcast, a layout the step demands of the result holds,
and a pipeline's pinned stage dim (:mod:`autoddl_jax._pinned`) stays on
its axis.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._sbp import B_CODE as B
from autoddl_jax._states import state_space


# Kept across problems: the planner builds one problem per pipeline
# schedule and remat variant, of the same few op structures (a transformer
# repeats a few many times). Callers share the result, slot index arrays
# included, and must not change it.
@functools.lru_cache(maxsize=1 << 16)
def candidates(sigs, slots, literal, n_ins: int, aliases: bool,
               mi: MeshInfo, fixed=None, pinned=()):
  """(candidates, slot state indices, split factor, output bytes) of an op
  of 1-D signatures ``sigs`` (a tuple), ``n_ins`` inputs and slots
  ``slots`` ((shape, itemsize) per input, then per output): the product of
  its signatures over the mesh axes, keeping those whose every slot's
  nd-SBP is a valid state (splits divide) and whose literal inputs stay
  broadcast; with ``fixed`` (nd codes), only those whose results have that
  layout; with ``pinned`` (per slot, ((axis, dim), ...):
  :mod:`autoddl_jax._pinned`), on each pinned axis only the signatures
  that keep every pinned slot on its dim, where one does. ``aliases``: the
  op's result is its input's buffer (no output bytes of its own)."""
  spaces = [state_space(shape, itemsize, mi) for shape, itemsize in slots]
  all_b = next((i for i, (si, so) in enumerate(sigs)
                if all(c == B for c in (*si, *so))), 0)
  full = [si + so for si, so in sigs]
  free = [range(len(sigs)) if s > 1 else [all_b]
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
        f is None or c[s][a] == f for s in range(n_ins, len(slots))
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
  if not aliases:
    for s in range(n_ins, len(slots)):
      ob = ob + spaces[s].local_bytes[slot_idx[s]]
  return cands, slot_idx, spl, ob

