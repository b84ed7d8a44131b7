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
several axes, the cost is the cheapest order of one-axis steps (the lowering
pins each step, so XLA takes the same path), as XLA runs them -- the ground
truth is ``benchmarks/transitions.py``, every pair of nd-SBPs of rank-2 and
rank-3 tensors on 1-, 2- and 3-axis meshes compiled alone:

* a partial sum on several axes becoming replicated on them is one
  all-reduce over their joint group, at the slowest of their links;
* partial sums are reduced before anything moves except free slices;
* a dim split over several axes is tiled mesh-major, so only its minor-most
  axis is gathered or sliced in place: a move against that order pays the
  collective-permute XLA adds (each device's smaller block; once, at the
  end, while partial sums are being reduced);
* an all-to-all that leaves another axis on its source dim, into a dim
  split already, spans that dim's axes too (XLA's grouping on 3-axis
  meshes).

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


def _out_of_order(cur: Sequence[int], a: int, src: int, dst: int) -> bool:
  """Whether a one-axis move on mesh axis ``a`` breaks XLA's tile order.

  A dim split over several mesh axes is tiled mesh-major (the spec lists
  them in mesh order), so only its minor-most axis can be gathered, or added
  by a local slice, without reordering the blocks: S(0) on ``y`` -> S(0) on
  ``(x, y)`` of an (x, y) mesh is not a slice of what each device holds, and
  XLA moves every block with a collective-permute (measured,
  ``benchmarks/transitions.py``)."""
  later = cur[a + 1:]
  return (src >= 0 and src in later) or (dst >= 0 and dst in later)


def _wide_all_to_all(cur: Sequence[int], a: int, src: int, dst: int
                     ) -> tuple[int, ...]:
  """The mesh axes XLA's all-to-all spans when S(src) -> S(dst) on axis
  ``a`` leaves another axis on dim ``src`` and dim ``dst`` is split already:
  ``a`` and the axes on ``dst`` (measured on 3-axis meshes; otherwise ``()``,
  the all-to-all is over ``a`` alone)."""
  if src < 0 or dst < 0 or src == dst:
    return ()
  others = [b for b in range(len(cur)) if b != a]
  on_dst = tuple(b for b in others if cur[b] == dst)
  if on_dst and any(cur[b] == src for b in others):
    return tuple(sorted((a, *on_dst)))
  return ()


def _all_to_all_over(axes: Sequence[int], local: float, mi: MeshInfo
                     ) -> tuple[float, float]:
  """(time, bytes per device) of an all-to-all of ``local`` bytes per device
  over the joint group of ``axes``, at the slowest of their links."""
  p = math.prod(mi.axis_sizes[x] for x in axes)
  b = (p - 1) / p * local
  return (max(mi.alpha[x] for x in axes) * (p - 1)
          + b / min(mi.beta[x] for x in axes)), b


def _path_cost(src, dst, order, nbytes, shape, mi: MeshInfo, steps=None,
               states=None):
  """(time, bytes) of taking ``src`` to ``dst`` one mesh axis at a time in
  ``order``; INF where XLA would not do it that way: a partial sum is reduced
  before anything moves but free slices (B -> S on the device; the lowering
  reduces it right after the op, XLA where the first constraint after it
  stands), and every intermediate must divide.
  A move against the tile order (:func:`_out_of_order`) pays the
  collective-permute XLA adds: each device's smaller block once."""
  cur = list(src)
  t = b = 0.0
  moved = disordered = False
  for a in order:
    s, d = cur[a], dst[a]
    if s == P and moved:
      return INF, INF
    other = math.prod(sz for i, (c, sz) in enumerate(zip(cur, mi.axis_sizes))
                      if i != a and c >= 0)
    n = nbytes / other
    dt, db, kind = one_axis(s, B if (s >= 0 and d == P) else d, n,
                            mi.axis_sizes[a], mi.alpha[a], mi.beta[a])
    if kind == "all-reduce" and mi.combined:
      dt -= 2 * mi.alpha[a] * (mi.axis_sizes[a] - 1)
    before = nbytes / split_factor(cur, mi.axis_sizes)
    group = _wide_all_to_all(cur, a, s, d)
    if group:
      dt, db = _all_to_all_over(group, before, mi)
    if steps is not None and db > 0:
      steps.append((kind, group or a, db))
    permute = s != d and _out_of_order(cur, a, s, d)
    reducing = P in cur
    cur[a] = d
    if not splits_divide(cur, shape, mi.axis_sizes):
      return INF, INF
    after = nbytes / split_factor(cur, mi.axis_sizes)
    # While partial sums are reduced (on the device, then scattered), tiles
    # out of mesh order are put right by one permute of the blocks at the
    # end; after that, each move against the order pays its own.
    pb = 0.0
    if reducing:
      disordered = disordered or permute
      if disordered and P not in cur:
        pb, disordered = after, False
    elif permute:
      pb = min(before, after)
    if pb:
      dt += mi.alpha[a] + pb / mi.beta[a]
      db += pb
      if steps is not None:
        steps.append(("collective-permute", a, pb))
    if states is not None:
      states.append(tuple(cur))
    moved = moved or (s not in (P, B) and s != d)
    t += dt
    b += db
  return t, b


def joint_all_reduce(src: Sequence[int], dst: Sequence[int], nbytes: float,
                     mi: MeshInfo):
  """A partial sum on several axes made replicated on all of them: XLA emits
  one all-reduce over their joint group, at the slowest of their links (not
  one per axis, which would move the whole tensor once per axis).
  Free slices the target makes (B -> S on the device, in tile order) come
  first, so the all-reduce moves the smaller blocks.
  Returns (axes, time, bytes sent per device, state after) or None."""
  axes = tuple(a for a in range(len(src)) if src[a] == P and dst[a] == B)
  if len(axes) < 2:
    return None
  k = len(src)
  sliced = [a for a in range(k) if src[a] == B and dst[a] >= 0 and not any(
      dst[a] in (src[b], dst[b]) for b in range(a + 1, k))]
  pre = tuple(dst[a] if a in sliced else c for a, c in enumerate(src))
  p = math.prod(mi.axis_sizes[a] for a in axes)
  n = nbytes / split_factor(pre, mi.axis_sizes)
  frac = (p - 1) / p
  alpha = 0.0 if mi.combined else max(mi.alpha[a] for a in axes)
  beta = min(mi.beta[a] for a in axes)
  mid = tuple(B if a in axes else c for a, c in enumerate(pre))
  return axes, 2 * alpha * (p - 1) + 2 * frac * n / beta, 2 * frac * n, mid


Step = tuple[str, "int | tuple[int, ...]", float]


def _cheapest_path(src: tuple[int, ...], dst: tuple[int, ...], nbytes: float,
                   shape: tuple[int, ...], mi: MeshInfo
                   ) -> tuple[float, float, list[Step], list[tuple[int, ...]]]:
  """(time, bytes per device, steps, states) of the cheapest way from
  ``src`` to ``dst``: a joint all-reduce first for partials on several axes
  (see :func:`joint_all_reduce`), then the cheapest order of one-axis moves
  (:func:`_path_cost`); if every order passes through a split that does not
  divide, by way of replicated (always valid: gather, then slice or zero
  locally). ``states`` are the layouts after each move, ``dst`` last: the
  lowering pins them in turn so that XLA takes this path."""
  if src == dst:
    return 0.0, 0.0, [], []
  joint = joint_all_reduce(src, dst, nbytes, mi)
  if joint is not None:  # XLA reduces such partials together: cost that
    axes, jt, jb, mid = joint
    t, b, steps, states = _cheapest_path(mid, dst, nbytes, shape, mi)
    return jt + t, jb + b, [("all-reduce", axes, jb), *steps], [mid, *states]
  diff = [a for a in range(len(src)) if src[a] != dst[a]]
  best: tuple[float, float, list[Step], list] = (INF, INF, [], [])
  for order in itertools.permutations(diff):
    steps: list[Step] = []
    states: list[tuple[int, ...]] = []
    t, b = _path_cost(src, dst, order, nbytes, shape, mi, steps, states)
    if t < best[0]:
      best = (t, b, steps, states)
  if best[0] == INF:
    mid = tuple(B for _ in src)
    t1, b1, s1, q1 = _cheapest_path(src, mid, nbytes, shape, mi)
    t2, b2, s2, q2 = _cheapest_path(mid, dst, nbytes, shape, mi)
    best = (t1 + t2, b1 + b2, s1 + s2, q1 + q2)
  return best


def transition(src: tuple[int, ...], dst: tuple[int, ...], nbytes: float,
               shape: tuple[int, ...], mi: MeshInfo) -> tuple[float, float]:
  """(time, bytes per device) of the cheapest path (:func:`_cheapest_path`)."""
  t, b, _, _ = _cheapest_path(src, dst, nbytes, shape, mi)
  return t, b


def transition_steps(src: tuple[int, ...], dst: tuple[int, ...],
                     nbytes: float, shape: tuple[int, ...],
                     mi: MeshInfo) -> list[Step]:
  """The collectives of the path :func:`transition` costs: (kind, mesh axis
  or axes, bytes sent per device) per step."""
  return _cheapest_path(src, dst, nbytes, shape, mi)[2]


def transition_states(src: tuple[int, ...], dst: tuple[int, ...],
                      nbytes: float, shape: tuple[int, ...],
                      mi: MeshInfo) -> list[tuple[int, ...]]:
  """The layouts the path of :func:`transition` passes through, ``dst``
  last (``[]`` when ``src == dst``)."""
  return _cheapest_path(src, dst, nbytes, shape, mi)[3]


def _one_axis_vec(s, d, n, p, alpha, beta, combined=False):
  """:func:`one_axis` over arrays of (src, dst) codes and group bytes
  (``combined``: all-reduces without their latency, see MeshInfo)."""
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
  t = np.where(ar, 2 * gather_t - (2 * alpha * (p - 1) if combined else 0.0),
               t)
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
    split_all = lambda c: np.where(c >= 0, sizes, 1.0).prod(axis=-1)  # noqa
    for order in itertools.permutations(range(n_axes)):
      cur = src.copy()
      t = np.zeros((n, n))
      b = np.zeros((n, n))
      ok = np.ones((n, n), dtype=bool)
      moved = np.zeros((n, n), dtype=bool)
      disordered = np.zeros((n, n), dtype=bool)
      for a in order:
        s_, d_ = cur[..., a].copy(), dst[..., a]
        ok &= ~((s_ == P) & (s_ != d_) & moved)  # partials reduce first
        split_other = np.where((cur >= 0) & (np.arange(n_axes) != a),
                               sizes, 1.0).prod(axis=-1)
        nb = self.nbytes / split_other
        dt, db = _one_axis_vec(s_, d_, nb, int(sizes[a]), mi.alpha[a],
                               mi.beta[a], mi.combined)
        before = self.nbytes / split_all(cur)
        # All-to-alls XLA widens over the target dim's axes
        # (_wide_all_to_all), grouped by the axes they span.
        others = np.arange(n_axes) != a
        on_dst = (cur == d_[..., None]) & others
        wide = ((s_ >= 0) & (d_ >= 0) & (s_ != d_) & on_dst.any(-1)
                & ((cur == s_[..., None]) & others).any(-1))
        if wide.any():
          code = (on_dst * (1 << np.arange(n_axes))).sum(-1) | (1 << a)
          for m in np.unique(code[wide]):
            axes = [x for x in range(n_axes) if m >> x & 1]
            sel = wide & (code == m)
            wt, wb = _all_to_all_over(axes, before, mi)
            dt = np.where(sel, wt, dt)
            db = np.where(sel, wb, db)
        # Moves against the tile order pay XLA's collective-permute.
        later = cur[..., a + 1:]
        mov = (s_ != d_) & (s_ != P) & (s_ != B)
        bad_order = (s_ != d_) & (
            ((s_ >= 0) & (later == s_[..., None]).any(-1)) |
            ((d_ >= 0) & (later == d_[..., None]).any(-1)))
        reducing = (cur == P).any(-1)
        cur[..., a] = d_
        after = self.nbytes / split_all(cur)
        # As _path_cost: one permute at the end of reducing partial sums.
        disordered |= reducing & bad_order
        done = reducing & disordered & ~(cur == P).any(-1)
        pb = np.where(reducing, np.where(done, after, 0.0),
                      np.where(bad_order, np.minimum(before, after), 0.0))
        disordered &= ~done
        t += dt + np.where(pb > 0, mi.alpha[a] + pb / mi.beta[a], 0.0)
        b += db + pb
        moved |= mov
        ok &= _divides_vec(cur, shape, sizes)
      better = ok & (t < best_t)
      best_t = np.where(better, t, best_t)
      best_b = np.where(better, b, best_b)
    # Partial on several axes -> replicated on them: XLA emits one joint
    # all-reduce, then the rest of the way (few pairs: only sources with two
    # or more P axes). The way to replicated first: the fallback below goes
    # through it.
    rep = self.index[tuple(B for _ in range(n_axes))]
    multi_p = [i for i, st_ in enumerate(self.states)
               if sum(c == P for c in st_) >= 2]

    def joint_fix(cols):
      for i in multi_p:
        for j in cols:
          joint = joint_all_reduce(self.states[i], self.states[j],
                                   self.nbytes, mi)
          if joint is not None:
            k = self.index[joint[3]]
            best_t[i, j] = joint[1] + best_t[k, j]
            best_b[i, j] = joint[2] + best_b[k, j]

    joint_fix([rep])
    # No order keeps every step divisible: gather to replicated, then slice.
    bad = ~np.isfinite(best_t)
    if bad.any():
      best_t = np.where(bad, best_t[:, rep][:, None], best_t)
      best_b = np.where(bad, best_b[:, rep][:, None], best_b)
    joint_fix(range(n))
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
