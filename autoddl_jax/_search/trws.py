"""Sequential tree-reweighted message passing (TRW-S) on the core.

Why message passing: coordinate descent alone stalls where a layout only pays
once many ops switch together (an attention block moving from batch- to
head-split); message passing weighs every node's neighbours at once. The
tree weights are over-relaxed towards loopy belief propagation
(:class:`Passing.relax`), which reaches TRW-S's labellings in fewer
iterations (``benchmarks/search_quality.py`` measures both). Each iteration
decodes a labelling; the best one is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


from autoddl_jax._search.model import EPS, Mrf


@dataclasses.dataclass(frozen=True)
class Passing:
  """How one start runs message passing: ``relax`` scales TRW-S's tree
  weights (1: TRW-S; larger: towards loopy belief propagation); it stops
  after ``max_iters`` iterations or ``patience`` without a better labelling."""
  relax: float
  max_iters: int
  patience: int


def trws(mrf: Mrf, core: Sequence[int], max_iters: int = 100,
         patience: int = 10, relax: float = 1.0,
         stats: dict | None = None) -> np.ndarray:
  """Sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006).

  Min-sum messages along the core's order, forward then backward; after each
  pass pair the labels greedily in order, each node taking the best value
  given the nodes already labelled and the messages from the rest. Returns
  the best labelling seen; stops after ``patience`` iterations without a
  better one. Deterministic. On sharding problems the messages capture what
  local moves cannot: a layout change only pays once many ops change with it.

  ``relax`` multiplies each node's weight (capped at 1, which is loopy belief
  propagation). TRW-S's lower bound then no longer holds, but only the
  labellings are used here, and on sharding problems they reach their best
  several times sooner (``benchmarks/search_quality.py``).

  The loop is Python over numpy, one message at a time, so it is written for
  few calls per message: beliefs and messages are kept by position, a
  message is not normalised when sent (the whole set is, now and then: a
  constant shift of a message leaves labels and decodings unchanged), and a
  labelling's energy is summed once at the end of its decoding.
  """
  order = list(core)
  n = len(order)
  pos = {g: i for i, g in enumerate(order)}
  nbrs = [sorted(pos[nb] for nb in mrf.adj[g] if nb in pos) for g in order]
  eid: dict[tuple[int, int], int] = {}
  for i in range(n):
    for j in nbrs[i]:
      eid[(i, j)] = len(eid)
  dst = [j for (_, j) in eid]
  msgs = [np.zeros(mrf.K[order[j]]) for j in dst]
  belief = [np.array(mrf.U[g], dtype=np.float64) for g in order]
  # Per position: (neighbour, pair matrix oriented (node, neighbour), id of
  # the edge in, id of the edge out), for the neighbours after it in the
  # order and for those before it.
  later, earlier, gamma = [], [], []
  for i, g in enumerate(order):
    ends = [(j, np.ascontiguousarray(mrf.pair(g, order[j])), eid[(j, i)],
             eid[(i, j)]) for j in nbrs[i]]
    earlier.append([x for x in ends if x[0] < i])
    later.append([x for x in ends if x[0] > i])
    gamma.append(min(1.0, relax / max(len(earlier[-1]), len(later[-1]), 1)))
  forward = [(i, gamma[i], later[i]) for i in range(n) if later[i]]
  backward = [(i, gamma[i], earlier[i]) for i in reversed(range(n))
              if earlier[i]]
  minimum = np.minimum.reduce

  def sweep(schedule):
    for i, gm, targets in schedule:
      scaled = gm * belief[i]
      for j, m, e_in, e_out in targets:
        new = minimum((scaled - msgs[e_in])[:, None] + m, axis=0)
        b = belief[j]
        b += new
        b -= msgs[e_out]
        msgs[e_out] = new

  def normalise():
    for e, j in enumerate(dst):
      c = msgs[e].min()
      msgs[e] = msgs[e] - c
      belief[j] -= c

  def decode():
    """Labels in order; returns them (by node) and their exact energy on
    the core."""
    x = [0] * n
    for i in range(n):
      if earlier[i]:
        v = belief[i].copy()
        for j, m, e_in, _ in earlier[i]:
          v += m[:, x[j]]
          v -= msgs[e_in]
        x[i] = int(v.argmin())
      else:
        x[i] = int(belief[i].argmin())
    labels = np.zeros(len(mrf.U), dtype=np.int64)
    labels[order] = x
    return labels, mrf.objective(labels, order)

  best, best_obj, stale, best_it, it = None, np.inf, 0, 0, 0
  for it in range(1, max_iters + 1):
    if it % 32 == 0:
      normalise()
    sweep(forward)
    sweep(backward)
    x, obj = decode()
    if best is None or obj < best_obj - EPS * max(1.0, abs(best_obj)):
      best, best_obj, stale, best_it = x, obj, 0, it
    else:
      stale += 1
      if stale >= patience:
        break
  if best is None:
    best = decode()[0]
  if stats is not None:
    stats.update(iterations=it, best_iteration=best_it)
  return best
