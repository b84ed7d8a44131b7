"""The pairwise model the search minimises, and exact eliminations.

:class:`Mrf` holds one node per *coordinate* of a
:class:`~autoddl_jax._problem.Problem` (a parameter's layout, tied across its
use, gradient, moments and update; or one op's signature): a cost vector
per node (compute, and a memory penalty) and a cost matrix per pair of
adjacent nodes (the collectives between them). :func:`eliminate` folds what
is cheap to solve exactly, as OneFlow does -- a node with one neighbour
into it, a node with two into the edge between them (its best value for
each pair of theirs remembered) -- leaving a small *core*; :func:`unfold`
reads the folded nodes back. :func:`objective` is the pairwise cost the
moves minimise; :func:`score` the plan's cost as ``plan.cost`` reports it
(one reshard per tensor and target layout, combined latencies), by which
finished candidates are compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from autoddl_jax._problem import Problem

EPS = 1e-12  # ties: a move must gain more than this, relatively
MAX_FOLD = 4_000_000  # largest K_a*K_v*K_b tensor a degree-2 fold may build


class Mrf:
  """Unary vectors and pairwise matrices over the problem's coordinates."""

  def __init__(self, prob: Problem, mem_weight: float = 0.0):
    self.prob = prob
    self.K = [len(prob.cands[m[0]]) for m in prob.groups]
    self.U: list[np.ndarray] = []
    for m in prob.groups:
      u = np.zeros(self.K[len(self.U)])
      for o in m:
        u = u + prob.node[o] + mem_weight * prob.out_bytes[o]
      self.U.append(u)
    inner, pairs, adj = _pairs(prob)
    for a, costs in inner:  # in edge order, as they were summed before
      for c in costs:
        self.U[a] = self.U[a] + c
    # Copies that eliminations may change (the arrays are never mutated).
    self.M: dict[tuple[int, int], np.ndarray] = dict(pairs)
    self.adj: list[set[int]] = [set(x) for x in adj]

  def copy(self) -> Mrf:
    """A copy that eliminations may change (arrays are never mutated in
    place, so they are shared)."""
    new = object.__new__(Mrf)
    new.prob, new.K = self.prob, self.K
    new.U = list(self.U)
    new.M = dict(self.M)
    new.adj = [set(a) for a in self.adj]
    return new

  def add_pair(self, a: int, b: int, m: np.ndarray):
    if a > b:
      a, b, m = b, a, m.T
    old = self.M.get((a, b))
    self.M[(a, b)] = m if old is None else old + m

  def pair(self, a: int, b: int) -> np.ndarray:
    return self.M[(a, b)] if a < b else self.M[(b, a)].T

  def vector(self, g: int, choice: np.ndarray) -> np.ndarray:
    v = self.U[g]
    for nb in self.adj[g]:
      v = v + self.pair(g, nb)[:, choice[nb]]
    return v

  def objective(self, choice: np.ndarray, nodes=None) -> float:
    nodes = range(len(self.U)) if nodes is None else nodes
    tot = sum(float(self.U[g][choice[g]]) for g in nodes)
    alive = set(nodes)
    for (a, b), m in self.M.items():
      if a in alive and b in alive:
        tot += float(m[choice[a], choice[b]])
    return tot


def _pairs(prob: Problem):
  """What every :class:`Mrf` of ``prob`` shares whatever its memory
  weight (budget fitting searches one problem several times): the edge
  costs within each coordinate ([(group, [cost vector, ...])], in edge
  order), the pair matrices between coordinates, and the adjacency.
  Kept on the problem for its groups (:meth:`Problem.for_groups`)."""
  return prob.for_groups("_mrf_pairs", lambda: _make_pairs(prob))


def _make_pairs(prob: Problem):
  inner: dict[int, list[np.ndarray]] = {}
  pairs: dict[tuple[int, int], np.ndarray] = {}
  # Ops of one structure share their slot index arrays (see Problem), so
  # repeated layers look up the same transition sub-matrix: cut it once.
  subs: dict[tuple[int, int, int], np.ndarray | None] = {}
  for e in prob.edges:
    a, b = int(prob.group_of[e.prod]), int(prob.group_of[e.cons])
    pi = prob.slot_idx[e.prod][e.prod_slot]
    ci = prob.slot_idx[e.cons][e.cons_slot]
    if a == b:
      inner.setdefault(a, []).append(e.weight * e.space.time[pi, ci])
      continue
    key = (id(e.space), id(pi), id(ci))
    if key not in subs:
      sub = e.space.time[pi[:, None], ci[None, :]]
      subs[key] = sub if sub.any() else None
    if subs[key] is not None:
      m = e.weight * subs[key]
      if a > b:
        a, b, m = b, a, m.T
      old = pairs.get((a, b))
      pairs[(a, b)] = m if old is None else old + m
  adj: list[set[int]] = [set() for _ in prob.groups]
  for a, b in pairs:
    adj[a].add(b)
    adj[b].add(a)
  return sorted(inner.items()), pairs, adj


@dataclasses.dataclass
class Fold:
  node: int
  kind: str  # "fixed" | "free" | "leaf" | "pair"
  others: tuple[int, ...]
  table: np.ndarray | int


def eliminate(mrf: Mrf, pins: Mapping[int, int],
              nodes: Sequence[int] | None = None,
              keep: Sequence[int] = ()) -> tuple[list[int], list[Fold]]:
  """Folds pinned nodes, leaves and degree-2 nodes away (exactly).

  Only ``nodes`` (default: all) are alive; nodes in ``keep`` are never folded
  (so a later call can still pin them). Modifies ``mrf`` in place; returns
  the core nodes and the fold records.
  """
  folds: list[Fold] = []
  alive = [False] * len(mrf.U)
  for v in (range(len(mrf.U)) if nodes is None else nodes):
    alive[v] = True
  keep = set(keep)

  def drop(v):
    for nb in list(mrf.adj[v]):
      mrf.adj[nb].discard(v)
      mrf.M.pop((min(v, nb), max(v, nb)), None)
    mrf.adj[v] = set()
    alive[v] = False

  for v, k in sorted(pins.items()):
    for nb in mrf.adj[v]:
      mrf.U[nb] = mrf.U[nb] + mrf.pair(nb, v)[:, k]
    drop(v)
    folds.append(Fold(v, "fixed", (), k))
  queue = [v for v in range(len(mrf.U)) if alive[v] and len(mrf.adj[v]) <= 2]
  while queue:
    nxt = []
    for v in queue:
      if not alive[v] or v in keep:
        continue
      nbs = sorted(mrf.adj[v])
      if len(nbs) == 0:
        folds.append(Fold(v, "free", (), int(np.argmin(mrf.U[v]))))
        alive[v] = False
      elif len(nbs) == 1:
        (u,) = nbs
        t = mrf.pair(u, v) + mrf.U[v][None, :]
        arg = np.argmin(t, axis=1)
        mrf.U[u] = mrf.U[u] + t[np.arange(len(arg)), arg]
        drop(v)
        folds.append(Fold(v, "leaf", (u,), arg))
        nxt.append(u)
      elif len(nbs) == 2:
        a, b = nbs
        if mrf.K[a] * mrf.K[v] * mrf.K[b] > MAX_FOLD:
          continue
        # t[i, k, j]: cost of (a=i, v=j, b=k) -- v last, so the reduction
        # over it runs along contiguous memory (several times faster).
        t = ((mrf.pair(a, v) + mrf.U[v][None, :])[:, None, :] +
             np.ascontiguousarray(mrf.pair(b, v))[None, :, :])
        arg = t.argmin(axis=2)
        best = np.take_along_axis(t, arg[:, :, None], axis=2)[:, :, 0]
        drop(v)
        mrf.add_pair(a, b, best)
        mrf.adj[a].add(b)
        mrf.adj[b].add(a)
        folds.append(Fold(v, "pair", (a, b), arg))
        nxt += [a, b]
    queue = [v for v in dict.fromkeys(nxt) if alive[v] and
             len(mrf.adj[v]) <= 2]
  core = [v for v in range(len(mrf.U)) if alive[v]]
  return core, folds


def unfold(choice: np.ndarray, folds: Sequence[Fold]) -> np.ndarray:
  for f in reversed(folds):
    if f.kind in ("fixed", "free"):
      choice[f.node] = f.table
    elif f.kind == "leaf":
      choice[f.node] = f.table[choice[f.others[0]]]
    else:
      a, b = f.others
      choice[f.node] = f.table[choice[a], choice[b]]
  return choice


@dataclasses.dataclass
class Reduced:
  """A problem with some nodes folded away: what remains is ``core``."""
  mrf: Mrf
  core: list[int]
  folds: list[Fold]

  @classmethod
  def of(cls, mrf: Mrf, pins: Mapping[int, int], keep=()) -> Reduced:
    mrf = mrf.copy()
    core, folds = eliminate(mrf, pins, keep=keep)
    return cls(mrf, core, folds)

  def pin(self, pins: Mapping[int, int]) -> Reduced:
    """Pins some core nodes and folds what that makes foldable."""
    mrf = self.mrf.copy()
    alive = set(self.core)
    core, folds = eliminate(mrf, {g: k for g, k in pins.items() if g in alive},
                            nodes=self.core)
    return Reduced(mrf, core, self.folds + folds)

  def unfold(self, choice: np.ndarray) -> np.ndarray:
    return unfold(choice, self.folds)


def expand(prob: Problem, gchoice: np.ndarray) -> np.ndarray:
  """Each op's candidate from its group's (every op is in one group)."""
  return np.asarray(gchoice, dtype=np.int64)[prob.group_of]


def groups_of(prob: Problem, choice: np.ndarray) -> np.ndarray:
  return np.array([choice[m[0]] for m in prob.groups], dtype=np.int64)


def objective(prob: Problem, choice, mem_weight: float = 0.0) -> float:
  ch = np.asarray(choice, dtype=np.int64)
  node = prob.node_flat[prob.node_off + ch].sum()
  if mem_weight:
    node += mem_weight * prob.out_bytes_flat[prob.node_off + ch].sum()
  return float(node + prob.edge_costs(ch).sum())


def score(prob: Problem, choice, mem_weight: float = 0.0) -> float:
  """A plan's cost as ``plan.cost`` reports it (consumers that want one
  layout share a reshard; combined all-reduces pay their latency once),
  plus the memory penalty: how the search's candidates are compared in the
  end. The pairwise :func:`objective` the moves minimise charges every
  consumer its reshard and no combined latency, so it can rank two plans
  the other way round."""
  ch = np.asarray(choice, dtype=np.int64)
  t = sum(prob.step_time(ch))
  if mem_weight:
    t += mem_weight * prob.out_bytes_flat[prob.node_off + ch].sum()
  return float(t)
