"""The analytical cost model: communication, compute and memory of a plan.

Per mesh axis ``a`` of size ``p`` with latency ``alpha`` and bandwidth ``beta``
(bytes/s per device), for a tensor of ``n`` bytes within one device group (its
logical size divided by the sizes of the *other* axes on which it is split):

=================  ===============  =========================================
transition on a    collective       time
=================  ===============  =========================================
same               none             0
B -> S, B -> P     local            0
S -> B             all-gather       alpha (p-1) + (p-1)/p   * n/beta
P -> S             reduce-scatter   alpha (p-1) + (p-1)/p   * n/beta
P -> B             all-reduce       2 alpha (p-1) + 2 (p-1)/p * n/beta
S(i) -> S(j)       all-to-all       alpha (p-1) + (p-1)/p^2 * n/beta
S -> P             all-gather       (as S -> B, then local)
=================  ===============  =========================================

Bytes are ring-model bytes *sent per device*. When two nd-SBPs differ on
several axes, the cost is the cheapest order of one-axis steps -- except that
a partial sum on several axes becoming replicated on them is one all-reduce
over their joint group (what XLA emits) at the slowest of their links, then
the rest of the way.

Compute is the op's FLOPs divided by the product of the sizes of the axes on
which its signature splits something (a replicated or partial-only op does the
whole work on every device), over ``peak_flops * flops_efficiency``.

Memory is per device: each tensor's bytes over the axes that split it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._sbp import B_CODE as B, P_CODE as P

INF = float("inf")


def one_axis(src: int, dst: int, n: float, p: int, alpha: float,
             beta: float) -> tuple[float, float, str | None]:
  """(time s, bytes sent per device, collective) of one 1-D transition."""
  if src == dst or p == 1:
    return 0.0, 0.0, None
  if src == B:
    return 0.0, 0.0, None  # B->S slices, B->P zeroes all but one addend
  frac = (p - 1) / p
  if src == P:
    if dst == B:
      return 2 * alpha * (p - 1) + 2 * frac * n / beta, 2 * frac * n, \
          "all-reduce"
    return alpha * (p - 1) + frac * n / beta, frac * n, "reduce-scatter"
  # src is S(i)
  if dst >= 0:
    return alpha * (p - 1) + frac / p * n / beta, frac / p * n, "all-to-all"
  return alpha * (p - 1) + frac * n / beta, frac * n, "all-gather"


def valid_states(shape: Sequence[int], sizes: Sequence[int],
                 allow_p: bool = True) -> list[tuple[int, ...]]:
  """All nd-SBPs of a tensor whose splits divide its dims."""
  rank = len(shape)
  per_axis = []
  for s in sizes:
    opts = [B] + ([P] if allow_p else []) + (list(range(rank)) if s > 1 else [])
    if s == 1:
      opts = [B]
    per_axis.append(opts)
  out = []
  for codes in itertools.product(*per_axis):
    if splits_divide(codes, shape, sizes):
      out.append(codes)
  return out


def splits_divide(codes: Sequence[int], shape: Sequence[int],
                  sizes: Sequence[int]) -> bool:
  div = [1] * len(shape)
  for c, s in zip(codes, sizes):
    if c >= 0:
      if c >= len(shape):
        return False
      div[c] *= s
  return all(d % k == 0 for d, k in zip(shape, div))


def split_factor(codes: Sequence[int], sizes: Sequence[int]) -> int:
  return math.prod(s for c, s in zip(codes, sizes) if c >= 0)


def _path_cost(src, dst, order, nbytes, shape, mi: MeshInfo, steps=None):
  cur = list(src)
  t = b = 0.0
  for a in order:
    other = math.prod(s for i, (c, s) in enumerate(zip(cur, mi.axis_sizes))
                      if i != a and c >= 0)
    dt, db, kind = one_axis(cur[a], dst[a], nbytes / other, mi.axis_sizes[a],
                            mi.alpha[a], mi.beta[a])
    if cur[a] >= 0 and dst[a] == P:  # S -> P goes through B
      dt, db, kind = one_axis(cur[a], B, nbytes / other, mi.axis_sizes[a],
                              mi.alpha[a], mi.beta[a])
    if steps is not None and db > 0:
      steps.append((kind, a, db))
    cur[a] = dst[a]
    if not splits_divide(cur, shape, mi.axis_sizes):
      return INF, INF
    t += dt
    b += db
  return t, b


def joint_all_reduce(src: Sequence[int], dst: Sequence[int], nbytes: float,
                     mi: MeshInfo):
  """A partial sum on several axes made replicated on all of them: XLA emits
  one all-reduce over their joint group, at the slowest of their links (not
  one per axis, which would move the whole tensor once per axis).
  Returns (axes, time, bytes sent per device, state after) or None."""
  axes = tuple(a for a in range(len(src)) if src[a] == P and dst[a] == B)
  if len(axes) < 2:
    return None
  p = math.prod(mi.axis_sizes[a] for a in axes)
  n = nbytes / split_factor(src, mi.axis_sizes)
  frac = (p - 1) / p
  alpha = max(mi.alpha[a] for a in axes)
  beta = min(mi.beta[a] for a in axes)
  mid = tuple(B if a in axes else c for a, c in enumerate(src))
  return axes, 2 * alpha * (p - 1) + 2 * frac * n / beta, 2 * frac * n, mid


Step = tuple[str, "int | tuple[int, ...]", float]


def _cheapest_path(src: tuple[int, ...], dst: tuple[int, ...], nbytes: float,
                   shape: tuple[int, ...], mi: MeshInfo
                   ) -> tuple[float, float, list[Step]]:
  """(time, bytes per device, steps) of the cheapest way from ``src`` to
  ``dst``: a joint all-reduce first for partials on several axes (see
  :func:`joint_all_reduce`), then the cheapest order of one-axis steps; if
  every order passes through a split that does not divide, by way of
  replicated (always valid: gather, then slice or zero locally)."""
  if src == dst:
    return 0.0, 0.0, []
  joint = joint_all_reduce(src, dst, nbytes, mi)
  if joint is not None:  # XLA reduces such partials together: cost that
    axes, jt, jb, mid = joint
    t, b, steps = _cheapest_path(mid, dst, nbytes, shape, mi)
    return jt + t, jb + b, [("all-reduce", axes, jb), *steps]
  diff = [a for a in range(len(src)) if src[a] != dst[a]]
  best: tuple[float, float, list[Step]] = (INF, INF, [])
  for order in itertools.permutations(diff):
    steps: list[Step] = []
    t, b = _path_cost(src, dst, order, nbytes, shape, mi, steps)
    if t < best[0]:
      best = (t, b, steps)
  if best[0] == INF:
    mid = tuple(B for _ in src)
    t1, b1, s1 = _cheapest_path(src, mid, nbytes, shape, mi)
    t2, b2, s2 = _cheapest_path(mid, dst, nbytes, shape, mi)
    best = (t1 + t2, b1 + b2, s1 + s2)
  return best


def transition(src: tuple[int, ...], dst: tuple[int, ...], nbytes: float,
               shape: tuple[int, ...], mi: MeshInfo) -> tuple[float, float]:
  """(time, bytes per device) of the cheapest path (:func:`_cheapest_path`)."""
  t, b, _ = _cheapest_path(src, dst, nbytes, shape, mi)
  return t, b


def transition_steps(src: tuple[int, ...], dst: tuple[int, ...],
                     nbytes: float, shape: tuple[int, ...],
                     mi: MeshInfo) -> list[Step]:
  """The collectives of the path :func:`transition` costs: (kind, mesh axis
  or axes, bytes sent per device) per step."""
  return _cheapest_path(src, dst, nbytes, shape, mi)[2]


def _one_axis_vec(s, d, n, p, alpha, beta):
  """:func:`one_axis` over arrays of (src, dst) codes and group bytes."""
  if p == 1:
    return np.zeros(s.shape), np.zeros(s.shape)
  frac = (p - 1) / p
  gather_t = alpha * (p - 1) + frac * n / beta
  t = np.zeros(s.shape)
  b = np.zeros(s.shape)
  moving = s != d
  from_p = moving & (s == P)
  ar = from_p & (d == B)
  rs = from_p & (d >= 0)
  split = moving & (s >= 0)
  a2a = split & (d >= 0)
  ag = split & (d < 0)  # to B, or to P through B
  t = np.where(ar, 2 * gather_t, t)
  b = np.where(ar, 2 * frac * n, b)
  t = np.where(rs | ag, gather_t, t)
  b = np.where(rs | ag, frac * n, b)
  t = np.where(a2a, alpha * (p - 1) + frac / p * n / beta, t)
  b = np.where(a2a, frac / p * n, b)
  return t, b


def _divides_vec(codes, shape, sizes):
  ok = np.ones(codes.shape[:-1], dtype=bool)
  for d in range(len(shape)):
    k = np.where(codes == d, sizes, 1.0).prod(axis=-1)
    ok &= (shape[d] % k) == 0
  return ok


class StateSpace:
  """The valid nd-SBPs of one tensor type and the transition costs among them."""

  def __init__(self, shape: tuple[int, ...], itemsize: int, mi: MeshInfo):
    self.shape = shape
    self.nbytes = math.prod(shape) * itemsize
    self.states = valid_states(shape, mi.axis_sizes)
    self.index = {s: i for i, s in enumerate(self.states)}
    self.local_bytes = np.array(
        [self.nbytes / split_factor(s, mi.axis_sizes) for s in self.states])
    self._mi = mi
    self._time: np.ndarray | None = None
    self._bytes: np.ndarray | None = None

  def _build(self):
    """All-pairs transition costs, vectorized over pairs for each axis order
    (the same numbers as :func:`transition`, which stays the reference)."""
    mi = self._mi
    st = np.array(self.states, dtype=np.int64).reshape(len(self.states), -1)
    n, n_axes = st.shape
    sizes = np.array(mi.axis_sizes, dtype=np.float64)
    shape = np.array(self.shape, dtype=np.int64)
    best_t = np.full((n, n), INF)
    best_b = np.full((n, n), INF)
    src = np.broadcast_to(st[:, None, :], (n, n, n_axes))
    dst = np.broadcast_to(st[None, :, :], (n, n, n_axes))
    for order in itertools.permutations(range(n_axes)):
      cur = src.copy()
      t = np.zeros((n, n))
      b = np.zeros((n, n))
      ok = np.ones((n, n), dtype=bool)
      for a in order:
        split_other = np.where((cur >= 0) & (np.arange(n_axes) != a),
                               sizes, 1.0).prod(axis=-1)
        nb = self.nbytes / split_other
        s_, d_ = cur[..., a], dst[..., a]
        dt, db = _one_axis_vec(s_, d_, nb, int(sizes[a]), mi.alpha[a],
                               mi.beta[a])
        t += dt
        b += db
        cur[..., a] = d_
        ok &= _divides_vec(cur, shape, sizes)
      better = ok & (t < best_t)
      best_t = np.where(better, t, best_t)
      best_b = np.where(better, b, best_b)
    # No order keeps every step divisible: gather to replicated, then slice.
    bad = ~np.isfinite(best_t)
    if bad.any():
      rep = self.index[tuple(B for _ in range(n_axes))]
      best_t = np.where(bad, best_t[:, rep][:, None], best_t)
      best_b = np.where(bad, best_b[:, rep][:, None], best_b)
    # Partial on several axes -> replicated on them: XLA emits one joint
    # all-reduce, then the rest of the way (few pairs: only sources with two
    # or more P axes).
    for i, src_state in enumerate(self.states):
      if sum(c == P for c in src_state) < 2:
        continue
      for j, dst_state in enumerate(self.states):
        joint = joint_all_reduce(src_state, dst_state, self.nbytes, mi)
        if joint is None:
          continue
        _, jt, jb, mid = joint
        k = self.index[mid]
        best_t[i, j] = jt + best_t[k, j]
        best_b[i, j] = jb + best_b[k, j]
    np.fill_diagonal(best_t, 0.0)
    np.fill_diagonal(best_b, 0.0)
    self._time, self._bytes = best_t, best_b

  @property
  def time(self) -> np.ndarray:
    if self._time is None:
      self._build()
    return self._time

  @property
  def bytes(self) -> np.ndarray:
    if self._bytes is None:
      self._build()
    return self._bytes


@functools.lru_cache(maxsize=4096)
def state_space(shape: tuple[int, ...], itemsize: int,
                mi: MeshInfo) -> StateSpace:
  return StateSpace(shape, itemsize, mi)
