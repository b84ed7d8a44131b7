"""State spaces: every nd-SBP a tensor may take, and the cost between each
pair.

A :class:`StateSpace` lists a tensor's valid nd-SBPs on a mesh (splits that
divide its dims) and holds the transition time and bytes between every pair
-- one-axis moves vectorised over the pairs (:func:`_one_axis_vec`), the
rest by :func:`autoddl_jax._cost.transition`. Tensors of one shape, type
and mesh share one space (:func:`state_space` is cached), so an edge's cost
for any pair of candidates is a lookup in one matrix.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._collectives import group_bytes, seconds
from autoddl_jax._cost import INF, all_to_all_over, joint_all_reduce
from autoddl_jax._cost import split_factor, valid_states
from autoddl_jax._sbp import B_CODE as B, P_CODE as P


def _one_axis_vec(s, d, n, p, alpha, beta, combined=False):
  """:func:`one_axis` over arrays of (src, dst) codes and group bytes
  (``combined``: all-reduces and reduce-scatters without their latency,
  see MeshInfo)."""
  if p == 1:
    return np.zeros(s.shape), np.zeros(s.shape)
  gather_b = group_bytes("all-gather", p, n)
  gather_t = seconds("all-gather", p, gather_b, alpha, beta)
  t = np.zeros(s.shape)
  b = np.zeros(s.shape)
  moving = s != d
  from_p = moving & (s == P)
  ar = from_p & (d == B)
  rs = from_p & (d >= 0)
  split = moving & (s >= 0)
  a2a = split & (d >= 0)
  ag = split & (d < 0)  # to B, or to P through B
  ar_b = group_bytes("all-reduce", p, n)
  t = np.where(ar, seconds("all-reduce", p, ar_b, alpha, beta)
               - (2 * alpha * (p - 1) if combined else 0.0), t)
  b = np.where(ar, ar_b, b)
  t = np.where(ag, gather_t, t)
  t = np.where(rs, gather_t - (alpha * (p - 1) if combined else 0.0), t)
  b = np.where(rs | ag, gather_b, b)
  a2a_b = group_bytes("all-to-all", p, n)
  t = np.where(a2a, seconds("all-to-all", p, a2a_b, alpha, beta), t)
  b = np.where(a2a, a2a_b, b)
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
    # Transition costs are computed for the pairs among the states some
    # problem's candidates use (:meth:`ensure`): a 3-axis mesh gives a
    # rank-6 tensor 512 states, of which a pipeline's pinned stage dim
    # leaves a few dozen in use. Pairs not computed hold NaN.
    self._time: np.ndarray | None = None
    self._bytes: np.ndarray | None = None
    self._done = np.zeros(len(self.states), dtype=bool)

  def ensure(self, used=None) -> None:
    """Computes the transitions among ``used`` (state indices; None: all
    states) and the states their costs go through (replicated, where a
    pair no order of one-axis moves keeps divisible goes; the state after
    a joint all-reduce of several partial axes)."""
    n = len(self.states)
    want = np.zeros(n, dtype=bool)
    if used is None:
      want[:] = True
    else:
      want[np.asarray(list(used), dtype=np.int64)] = True
    rep = self.index[tuple(B for _ in self._mi.axis_sizes)]
    want[rep] = True
    if (want <= self._done).all():
      return  # (done is closed under what costs go through)
    want |= self._done
    multi = [i for i, st in enumerate(self.states)
             if sum(c == P for c in st) >= 2]
    grow = True
    while grow:  # the joint all-reduces' states after, transitively
      grow = False
      cols = np.flatnonzero(want)
      for i in multi:
        if not want[i]:
          continue
        for j in cols:
          joint = joint_all_reduce(self.states[i], self.states[j],
                                   self.nbytes, self._mi, self.shape)
          if joint is not None and not want[self.index[joint[3]]]:
            want[self.index[joint[3]]] = grow = True
    if (want <= self._done).all():
      return
    if self._time is None:
      self._time = np.full((n, n), np.nan)
      self._bytes = np.full((n, n), np.nan)
    sub = np.flatnonzero(want)
    t, b = self._build(sub)
    self._time[np.ix_(sub, sub)] = t
    self._bytes[np.ix_(sub, sub)] = b
    self._done = want

  def _build(self, sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Transition costs among the states ``sub`` (indices, holding those
    :meth:`ensure` adds), vectorized over pairs for each axis order (the
    same numbers as :func:`transition`, which stays the reference)."""
    mi = self._mi
    states = [self.states[i] for i in sub]
    index = {s: i for i, s in enumerate(states)}
    st = np.array(states, dtype=np.int64).reshape(len(states), -1)
    n, n_axes = st.shape
    sizes = np.array(mi.axis_sizes, dtype=np.float64)
    shape = np.array(self.shape, dtype=np.int64)
    best_t = np.full((n, n), INF)
    best_b = np.full((n, n), INF)
    src = np.broadcast_to(st[:, None, :], (n, n, n_axes))
    dst = np.broadcast_to(st[None, :, :], (n, n, n_axes))
    # Per-state tables, indexed by a state's code in base rank+2 (kept up
    # to date as one axis moves at a time): whether its splits divide, its
    # split factor, whether it holds a partial sum. The pairs are many (a
    # rank-6 tensor on 3 axes: 512 states, 262k pairs) and these were the
    # reductions over the axis dim that dominated building a space.
    radix = len(self.shape) + 2
    weight = radix ** np.arange(n_axes)
    combos = np.array(list(itertools.product(
        range(-2, len(self.shape)), repeat=n_axes)), dtype=np.int64)
    combos = combos[:, ::-1]  # product varies the last fastest: axis 0
    table_key = ((combos + 2) * weight).sum(-1)
    divides = np.zeros(radix ** n_axes, dtype=bool)
    divides[table_key] = _divides_vec(combos, shape, sizes)
    factor = np.ones(radix ** n_axes)
    factor[table_key] = np.where(combos >= 0, sizes, 1.0).prod(axis=-1)
    partial = np.zeros(radix ** n_axes, dtype=bool)
    partial[table_key] = (combos == P).any(-1)
    key0 = ((src + 2) * weight).sum(-1)
    for order in itertools.permutations(range(n_axes)):
      cur = src.copy()
      key = key0.copy()
      t = np.zeros((n, n))
      b = np.zeros((n, n))
      ok = np.ones((n, n), dtype=bool)
      moved = np.zeros((n, n), dtype=bool)
      disordered = np.zeros((n, n), dtype=bool)
      for a in order:
        s_, d_ = cur[..., a].copy(), dst[..., a]
        ok &= ~((s_ == P) & (s_ != d_) & moved)  # partials reduce first
        split_cur = factor[key]
        split_other = split_cur / np.where(s_ >= 0, sizes[a], 1.0)
        nb = self.nbytes / split_other
        dt, db = _one_axis_vec(s_, d_, nb, int(sizes[a]), mi.alpha[a],
                               mi.beta[a], mi.combined)
        before = self.nbytes / split_cur
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
            wt, wb = all_to_all_over(axes, before, mi)
            dt = np.where(sel, wt, dt)
            db = np.where(sel, wb, db)
        # Moves against the tile order pay XLA's collective-permute.
        later = cur[..., a + 1:]
        mov = (s_ != d_) & (s_ != P) & (s_ != B)
        bad_order = (s_ != d_) & (
            ((s_ >= 0) & (later == s_[..., None]).any(-1)) |
            ((d_ >= 0) & (later == d_[..., None]).any(-1)))
        reducing = partial[key]
        cur[..., a] = d_
        key += (d_ - s_) * weight[a]
        after = self.nbytes / factor[key]
        # As _path_cost: one permute at the end of reducing partial sums.
        disordered |= reducing & bad_order
        done = reducing & disordered & ~partial[key]
        pb = np.where(reducing, np.where(done, after, 0.0),
                      np.where(bad_order, np.minimum(before, after), 0.0))
        disordered &= ~done
        t += dt + np.where(pb > 0, mi.alpha[a] + pb / mi.beta[a], 0.0)
        b += db + pb
        moved |= mov
        ok &= divides[key]
      better = ok & (t < best_t)
      best_t = np.where(better, t, best_t)
      best_b = np.where(better, b, best_b)
    # Partial on several axes -> replicated on them: XLA emits one joint
    # all-reduce, then the rest of the way (few pairs: only sources with two
    # or more P axes). The way to replicated first: the fallback below goes
    # through it.
    rep = index[tuple(B for _ in range(n_axes))]
    multi_p = [i for i, st_ in enumerate(states)
               if sum(c == P for c in st_) >= 2]

    def joint_fix(cols):
      for i in multi_p:
        for j in cols:
          joint = joint_all_reduce(states[i], states[j], self.nbytes, mi,
                                   self.shape)
          if joint is not None:
            k = index[joint[3]]
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
    return best_t, best_b

  @property
  def time(self) -> np.ndarray:
    """Transition seconds [from state, to state] (NaN where not computed;
    a space no one ensured is computed whole)."""
    if self._time is None:
      self.ensure()
    return self._time

  @property
  def bytes(self) -> np.ndarray:
    """Transition bytes per device, as :attr:`time`."""
    if self._bytes is None:
      self.ensure()
    return self._bytes


@functools.lru_cache(maxsize=4096)
def state_space(shape: tuple[int, ...], itemsize: int,
                mi: MeshInfo) -> StateSpace:
  return StateSpace(shape, itemsize, mi)
