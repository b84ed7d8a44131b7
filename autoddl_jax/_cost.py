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

A tensor no contraction waits on (a weight's gradient: ``Problem.combined``)
is reduced by collectives XLA combines with the others of their loop body:
its all-reduces and reduce-scatters pay bandwidth only here, and each group
(trip count, mesh axes, kind) pays one latency (``Problem.combined_latency``).

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


from autoddl_jax._cluster import MeshInfo
from autoddl_jax._collectives import group_bytes, latency_steps, ring_bytes
from autoddl_jax._collectives import seconds
from autoddl_jax._sbp import B_CODE as B, P_CODE as P

INF = float("inf")
# The kinds XLA's combiners merge for the tensors no contraction waits on (a
# gradient's reduction; ``MeshInfo.combined``): each pays its latency once
# per loop body and group (``Problem.combined_latency``), not per tensor.
_COMBINED_KINDS = ("all-reduce", "reduce-scatter")


def one_axis(src: int, dst: int, n: float, p: int, alpha: float,
             beta: float) -> tuple[float, float, str | None]:
  """(time s, bytes sent per device, collective) of one 1-D transition."""
  if src == dst or p == 1:
    return 0.0, 0.0, None
  if src == B:
    return 0.0, 0.0, None  # B->S slices, B->P zeroes all but one addend
  if src == P:
    kind = "all-reduce" if dst == B else "reduce-scatter"
  else:  # src is S(i)
    kind = "all-to-all" if dst >= 0 else "all-gather"
  sent = group_bytes(kind, p, n)
  return seconds(kind, p, sent, alpha, beta), sent, kind


def valid_states(shape: Sequence[int], sizes: Sequence[int],
                 allow_p: bool = True) -> list[tuple[int, ...]]:
  """All nd-SBPs of a tensor whose splits divide its dims."""
  return list(_valid_states(tuple(shape), tuple(sizes), allow_p))


@functools.lru_cache(maxsize=4096)  # a shape's spaces: plain and combined
def _valid_states(shape: tuple[int, ...], sizes: tuple[int, ...],
                  allow_p: bool) -> tuple[tuple[int, ...], ...]:
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
  return tuple(out)


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


def all_to_all_over(axes: Sequence[int], local: float, mi: MeshInfo
                     ) -> tuple[float, float]:
  """(time, bytes per device) of an all-to-all of ``local`` bytes per device
  over the joint group of ``axes``, at the slowest of their links."""
  p = math.prod(mi.axis_sizes[x] for x in axes)
  b = ring_bytes("all-to-all", p, local, local)
  return seconds("all-to-all", p, b, max(mi.alpha[x] for x in axes),
                 min(mi.beta[x] for x in axes)), b


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
    if mi.combined and kind in _COMBINED_KINDS:
      dt -= latency_steps(kind, mi.axis_sizes[a]) * mi.alpha[a]
    before = nbytes / split_factor(cur, mi.axis_sizes)
    group = _wide_all_to_all(cur, a, s, d)
    if group:
      dt, db = all_to_all_over(group, before, mi)
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
                     mi: MeshInfo, shape: Sequence[int]):
  """A partial sum on several axes made replicated on all of them: XLA emits
  one all-reduce over their joint group, at the slowest of their links (not
  one per axis, which would move the whole tensor once per axis).
  Free slices the target makes (B -> S on the device, in tile order) come
  first, so the all-reduce moves the smaller blocks -- each where the
  block still divides ``shape`` with it (on 4 axes a slice of the target
  and a split the source keeps may cut one dim finer than it divides).
  Returns (axes, time, bytes sent per device, state after) or None."""
  axes = tuple(a for a in range(len(src)) if src[a] == P and dst[a] == B)
  if len(axes) < 2:
    return None
  k = len(src)
  pre = tuple(src)
  for a in range(k):
    if src[a] == B and dst[a] >= 0 and not any(
        dst[a] in (src[b], dst[b]) for b in range(a + 1, k)):
      sliced = pre[:a] + (dst[a],) + pre[a + 1:]
      if splits_divide(sliced, shape, mi.axis_sizes):
        pre = sliced
  p = math.prod(mi.axis_sizes[a] for a in axes)
  n = nbytes / split_factor(pre, mi.axis_sizes)
  alpha = 0.0 if mi.combined else max(mi.alpha[a] for a in axes)
  beta = min(mi.beta[a] for a in axes)
  mid = tuple(B if a in axes else c for a, c in enumerate(pre))
  sent = group_bytes("all-reduce", p, n)
  return axes, seconds("all-reduce", p, sent, alpha, beta), sent, mid


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
  joint = joint_all_reduce(src, dst, nbytes, mi, shape)
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
