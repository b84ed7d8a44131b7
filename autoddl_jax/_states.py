"""State spaces: every nd-SBP a tensor may take, and the cost between each
pair.

A :class:`StateSpace` lists a tensor's valid nd-SBPs on a mesh (splits that
divide its dims) and holds the transition time and bytes between every pair
-- one-axis moves vectorised over the pairs (:func:`_one_axis_vec`), the
same numbers as :func:`autoddl_jax._cost.transition`. Tensors of one shape,
type and mesh share one space (:func:`state_space` is cached), so an edge's
cost for any pair of candidates is a lookup in one matrix. A problem costs
the pairs its candidates use in all its spaces at once
(:func:`ensure_all`).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._collectives import latency_steps
from autoddl_jax._cost import INF, all_to_all_over, joint_all_reduce
from autoddl_jax._cost import split_factor, valid_states
from autoddl_jax._sbp import B_CODE as B, P_CODE as P


def _one_axis_vec(s, d, n, p, alpha, beta, combined=False):
  """:func:`one_axis` over arrays of (src, dst) codes and group bytes
  (``combined``: all-reduces and reduce-scatters without their latency,
  see MeshInfo). Each pair's kind of move indexes small tables of its
  latency and bytes factor: the same arithmetic as :func:`seconds` and
  :func:`group_bytes` per pair, without a pass over every pair per kind."""
  if p == 1:
    return np.zeros(s.shape), np.zeros(s.shape)
  moving = s != d
  from_p = moving & (s == P)
  split = moving & (s >= 0)
  to_split = d >= 0
  # 0: stays; 1: all-reduce (P -> B); 2: reduce-scatter (P -> S);
  # 3: all-to-all (S -> S); 4: all-gather (S -> B, or to P through B).
  kind = ((from_p & (d == B)).view(np.int8)
          + (from_p & to_split).view(np.int8) * np.int8(2)
          + (split & to_split).view(np.int8) * np.int8(3)
          + (split & ~to_split).view(np.int8) * np.int8(4))
  frac = (p - 1) / p
  factor = np.array([0.0, 2 * frac, frac, frac / p, frac])
  steps = np.array([0.0] + [latency_steps(k, p) * alpha for k in (
      "all-reduce", "reduce-scatter", "all-to-all", "all-gather")])
  less = np.array([0.0, 2 * alpha * (p - 1) if combined else 0.0,
                   alpha * (p - 1) if combined else 0.0, 0.0, 0.0])
  b = factor[kind] * n
  t = (steps[kind] + b / beta) - less[kind]
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
    ensure_all([(self, used)])

  def _wanted(self, used) -> np.ndarray | None:
    """The states :meth:`ensure` computes among (a mask, holding those done
    already), or None where they are done."""
    n = len(self.states)
    want = np.zeros(n, dtype=bool)
    if used is None:
      want[:] = True
    else:
      want[np.asarray(list(used), dtype=np.int64)] = True
    rep = self.index[tuple(B for _ in self._mi.axis_sizes)]
    want[rep] = True
    if (want <= self._done).all():
      return None  # (done is closed under what costs go through)
    want |= self._done
    codes = np.array(self.states, dtype=np.int64).reshape(n, -1)
    grow = True
    while grow:  # the joint all-reduces' states after, transitively
      grow = False
      cols = np.flatnonzero(want)
      for i, js in _joint_pairs(codes, cols):
        if not want[i]:
          continue
        for j in js:
          joint = joint_all_reduce(self.states[i], self.states[j],
                                   self.nbytes, self._mi, self.shape)
          if not want[self.index[joint[3]]]:
            want[self.index[joint[3]]] = grow = True
    return None if (want <= self._done).all() else want

  def _store(self, want: np.ndarray, t: np.ndarray, b: np.ndarray) -> None:
    n = len(self.states)
    if self._time is None:
      self._time = np.full((n, n), np.nan)
      self._bytes = np.full((n, n), np.nan)
    sub = np.flatnonzero(want)
    self._time[np.ix_(sub, sub)] = t
    self._bytes[np.ix_(sub, sub)] = b
    self._done = want

  @property
  def computed(self) -> np.ndarray:
    """The indices of the states whose transitions among each other are
    computed (all of them, once :attr:`time` computed a space whole)."""
    if self._time is None:
      self.ensure()
    return np.flatnonzero(self._done)

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


# Pairs costed in one batch of :func:`_build` (its arrays hold a few
# dozen bytes per pair per mesh axis).
MAX_PAIRS = 1 << 20


def ensure_all(requests) -> None:
  """:meth:`StateSpace.ensure` for each (space, used states) of
  ``requests``, the pairs of every space on one mesh costed in one batch:
  a problem asks for hundreds of spaces, most of a few dozen states, and
  the numpy calls per space, not the pairs, dominated costing them one
  space at a time."""
  by_mesh: dict[MeshInfo, list] = {}
  for sp, used in requests:
    want = sp._wanted(used)
    if want is not None:
      by_mesh.setdefault(sp._mi, []).append((sp, want))
  for mi, todo in by_mesh.items():
    batch, pairs = [], 0
    for k, (sp, want) in enumerate(todo):
      batch.append((sp, want))
      pairs += int(want.sum()) ** 2
      if pairs >= MAX_PAIRS or k == len(todo) - 1:
        costs = _build(mi, [(sp, np.flatnonzero(w)) for sp, w in batch])
        for (sp, w), (t, b) in zip(batch, costs):
          sp._store(w, t, b)
        batch, pairs = [], 0


def _build(mi: MeshInfo, items) -> list[tuple[np.ndarray, np.ndarray]]:
  """Transition costs among the states ``sub`` of each (space, sub) of
  ``items`` (spaces on ``mi``; ``sub`` holds the states
  :meth:`StateSpace.ensure` adds), vectorized over every pair of every
  space for each axis order (the same numbers as :func:`transition`,
  which stays the reference)."""
  n_axes = len(mi.axis_sizes)
  sizes = np.array(mi.axis_sizes, dtype=np.float64)
  # Per-state tables, indexed by a state's code in base rank+2 (kept up
  # to date as one axis moves at a time): whether its splits divide (per
  # space: offset by the space's slot), its split factor, whether it holds
  # a partial sum. The pairs are many (a rank-6 tensor on 3 axes: 512
  # states, 262k pairs) and these were the reductions over the axis dim
  # that dominated building a space.
  radix = max(len(sp.shape) for sp, _ in items) + 2
  weight = radix ** np.arange(n_axes)
  combos = np.array(list(itertools.product(
      range(-2, radix - 2), repeat=n_axes)), dtype=np.int64)
  combos = combos[:, ::-1]  # product varies the last fastest: axis 0
  table_key = ((combos + 2) * weight).sum(-1)
  width = radix ** n_axes
  divides = np.zeros((len(items), width), dtype=bool)
  for k, (sp, _) in enumerate(items):  # codes past a space's rank: unused
    divides[k, table_key] = _divides_vec(
        combos, np.array(sp.shape, dtype=np.int64), sizes)
  divides = divides.ravel()
  factor = np.ones(width)
  factor[table_key] = np.where(combos >= 0, sizes, 1.0).prod(axis=-1)
  partial = np.zeros(width, dtype=bool)
  partial[table_key] = (combos == P).any(-1)
  # Every pair of every space, flat (source-major within a space), one
  # array per mesh axis: reductions over a short last axis cost numpy
  # far more than the elementwise work.
  src, dst, nbytes, offset = [], [], [], []
  for k, (sp, sub) in enumerate(items):
    st = np.array([sp.states[i] for i in sub],
                  dtype=np.int64).reshape(len(sub), n_axes)
    src.append(np.repeat(st, len(sub), axis=0))
    dst.append(np.tile(st, (len(sub), 1)))
    nbytes.append(np.full(len(sub) ** 2, float(sp.nbytes)))
    offset.append(np.full(len(sub) ** 2, k * width, dtype=np.int64))
  src, dst = np.concatenate(src), np.concatenate(dst)
  nbytes, offset = np.concatenate(nbytes), np.concatenate(offset)
  src_c = [np.ascontiguousarray(src[:, a]) for a in range(n_axes)]
  dst_c = [np.ascontiguousarray(dst[:, a]) for a in range(n_axes)]
  n_pairs = len(src)
  best_t = np.full(n_pairs, INF)
  best_b = np.full(n_pairs, INF)
  key0 = sum((src_c[a] + 2) * weight[a] for a in range(n_axes))

  def any_equal(cols, v):
    out = np.zeros(n_pairs, dtype=bool)
    for c in cols:
      out |= c == v
    return out

  for order in itertools.permutations(range(n_axes)):
    cur = list(src_c)
    key = key0.copy()
    t = np.zeros(n_pairs)
    b = np.zeros(n_pairs)
    ok = np.ones(n_pairs, dtype=bool)
    moved = np.zeros(n_pairs, dtype=bool)
    disordered = np.zeros(n_pairs, dtype=bool)
    for a in order:
      s_, d_ = cur[a], dst_c[a]
      ok &= ~((s_ == P) & (s_ != d_) & moved)  # partials reduce first
      split_cur = factor[key]
      split_other = split_cur / np.where(s_ >= 0, sizes[a], 1.0)
      nb = nbytes / split_other
      dt, db = _one_axis_vec(s_, d_, nb, int(sizes[a]), mi.alpha[a],
                             mi.beta[a], mi.combined)
      before = nbytes / split_cur
      # All-to-alls XLA widens over the target dim's axes
      # (_wide_all_to_all), grouped by the axes they span.
      others = [cur[x] for x in range(n_axes) if x != a]
      wide = ((s_ >= 0) & (d_ >= 0) & (s_ != d_) & any_equal(others, d_)
              & any_equal(others, s_))
      if wide.any():
        code = np.full(n_pairs, 1 << a, dtype=np.int64)
        for x in range(n_axes):
          if x != a:
            code |= (cur[x] == d_).astype(np.int64) << x
        for m in np.unique(code[wide]):
          axes = [x for x in range(n_axes) if m >> x & 1]
          sel = wide & (code == m)
          wt, wb = all_to_all_over(axes, before, mi)
          dt = np.where(sel, wt, dt)
          db = np.where(sel, wb, db)
      # Moves against the tile order pay XLA's collective-permute.
      later = cur[a + 1:]
      mov = (s_ != d_) & (s_ != P) & (s_ != B)
      bad_order = (s_ != d_) & (((s_ >= 0) & any_equal(later, s_)) |
                                ((d_ >= 0) & any_equal(later, d_)))
      reducing = partial[key]
      cur[a] = d_
      key += (d_ - s_) * weight[a]
      after = nbytes / factor[key]
      # As _path_cost: one permute at the end of reducing partial sums.
      disordered |= reducing & bad_order
      done = reducing & disordered & ~partial[key]
      pb = np.where(reducing, np.where(done, after, 0.0),
                    np.where(bad_order, np.minimum(before, after), 0.0))
      disordered &= ~done
      t += dt + np.where(pb > 0, mi.alpha[a] + pb / mi.beta[a], 0.0)
      b += db + pb
      moved |= mov
      ok &= divides[offset + key]
    better = ok & (t < best_t)
    best_t = np.where(better, t, best_t)
    best_b = np.where(better, b, best_b)
  out, at = [], 0
  for sp, sub in items:
    n = len(sub)
    out.append(_finish(sp, sub, best_t[at:at + n * n].reshape(n, n),
                       best_b[at:at + n * n].reshape(n, n)))
    at += n * n
  return out


def _finish(sp: StateSpace, sub: np.ndarray, best_t: np.ndarray,
            best_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The costs :func:`_build`'s orders of one-axis moves leave to the
  joint all-reduces and the way through replicated, for one space."""
  mi = sp._mi
  states = [sp.states[i] for i in sub]
  index = {s: i for i, s in enumerate(states)}
  n_axes = len(mi.axis_sizes)
  # Partial on several axes -> replicated on them: XLA emits one joint
  # all-reduce, then the rest of the way (few pairs: only sources with two
  # or more P axes). The way to replicated first: the fallback below goes
  # through it.
  rep = index[tuple(B for _ in range(n_axes))]
  codes = np.array(states, dtype=np.int64).reshape(len(states), n_axes)

  def joint_fix(cols):
    for i, js in _joint_pairs(codes, cols):
      for j in js:
        joint = joint_all_reduce(states[i], states[j], sp.nbytes, mi,
                                 sp.shape)
        k = index[joint[3]]
        best_t[i, j] = joint[1] + best_t[k, j]
        best_b[i, j] = joint[2] + best_b[k, j]

  joint_fix(np.array([rep]))
  # No order keeps every step divisible: gather to replicated, then slice.
  bad = ~np.isfinite(best_t)
  if bad.any():
    best_t = np.where(bad, best_t[:, rep][:, None], best_t)
    best_b = np.where(bad, best_b[:, rep][:, None], best_b)
  joint_fix(np.arange(len(states)))
  np.fill_diagonal(best_t, 0.0)
  np.fill_diagonal(best_b, 0.0)
  return best_t, best_b


def _joint_pairs(codes: np.ndarray, cols: np.ndarray):
  """(i, the states of ``cols`` j) for every state i partial on two or
  more axes and the j replicated on two or more of them: the pairs
  :func:`joint_all_reduce` gives a joint all-reduce (None for the rest).
  ``codes``: the states, one row each."""
  partial = codes == P
  for i in np.flatnonzero(partial.sum(1) >= 2):
    js = cols[(codes[cols][:, partial[i]] == B).sum(1) >= 2]
    if len(js):
      yield int(i), js
