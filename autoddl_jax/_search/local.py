"""Local moves on the core, and polishing by the plan's own cost.

:class:`Core` improves a labelling of the core: coordinate descent (each
node to its best value with the others fixed), alternated with exact
dynamic programming over spanning trees (edges off the tree held), and at
higher effort block moves (small groups of nodes re-decided jointly).
:func:`polish_by_score` descends on :func:`~autoddl_jax._search.model.score`
instead, one op group at a time: consumers that want one layout share one
reshard there, which the pairwise moves cannot see.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoddl_jax._problem import Problem

from autoddl_jax._search.model import EPS, Mrf


class Core:
  """Coordinate descent, spanning-tree DP and block moves on the core."""

  def __init__(self, mrf: Mrf, core: Sequence[int]):
    self.mrf = mrf
    self.core = list(core)
    # A search improves several labellings of one reduced problem (each
    # start's, then the finalists'): its trees are built once.
    memo = getattr(mrf, "_trees", None)
    if memo is not None and memo[0] == self.core:
      self.trees = memo[1]
    else:
      self.trees = [self._spanning_tree("heavy"),
                    self._spanning_tree("order")]
      mrf._trees = (self.core, self.trees)  # noqa: SLF001

  def objective(self, choice) -> float:
    return self.mrf.objective(choice, self.core)

  def descend(self, choice: np.ndarray, start=None,
              max_sweeps: int = 200) -> int:
    mrf = self.mrf
    dirty = dict.fromkeys(self.core if start is None else start)
    sweeps = 0
    while dirty and sweeps < max_sweeps:
      sweeps += 1
      order = list(dirty)
      dirty = {}
      if sweeps % 2 == 0:
        order.reverse()
      for g in order:
        if mrf.K[g] < 2:
          continue
        v = mrf.vector(g, choice)
        cur = choice[g]
        k = int(np.argmin(v))
        if v[k] < v[cur] - EPS * max(1.0, abs(v[cur])):
          choice[g] = k
          for nb in mrf.adj[g]:
            dirty[nb] = None
    return sweeps

  def _spanning_tree(self, order: str):
    mrf = self.mrf
    keys = sorted(mrf.M)
    if order == "heavy":
      keys.sort(key=lambda k: (-float(np.ptp(mrf.M[k])), k))
    parent = {g: g for g in self.core}

    def find(i):
      while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
      return i

    adj: dict[int, list[int]] = {g: [] for g in self.core}
    tree = set()
    for a, b in keys:
      ra, rb = find(a), find(b)
      if ra != rb:
        parent[ra] = rb
        tree.add((a, b))
        adj[a].append(b)
        adj[b].append(a)
    # Breadth-first order and parents of each component, computed once.
    orders, seen = [], set()
    for root in self.core:
      if root in seen:
        continue
      order, par = [root], {root: -1}
      seen.add(root)
      i = 0
      while i < len(order):
        v = order[i]
        i += 1
        for w in adj[v]:
          if w not in seen:
            seen.add(w)
            par[w] = v
            order.append(w)
      orders.append((order, par))
    return tree, orders

  def tree_move(self, tree, choice: np.ndarray,
                condition: bool = True) -> np.ndarray:
    """Exact DP over a spanning tree; off-tree edges held at ``choice``."""
    mrf = self.mrf
    edges, orders = tree
    unary = {g: mrf.U[g] for g in self.core}
    if condition:
      for (a, b), m in mrf.M.items():
        if (a, b) not in edges:
          unary[a] = unary[a] + 0.5 * m[:, choice[b]]
          unary[b] = unary[b] + 0.5 * m[choice[a], :]
    new = choice.copy()
    for order, par in orders:
      acc = {v: unary[v] for v in order}
      back = {}
      for v in reversed(order[1:]):
        u = par[v]
        tot = mrf.pair(u, v) + acc[v][None, :]
        back[v] = b = tot.argmin(axis=1)
        acc[u] = acc[u] + tot[np.arange(tot.shape[0]), b]
      new[order[0]] = int(acc[order[0]].argmin())
      for v in order[1:]:
        new[v] = back[v][new[par[v]]]
    return new

  def block_move(self, block: Sequence[int], choice: np.ndarray) -> bool:
    """Sets a few adjacent nodes to their jointly best values (exhaustive)."""
    mrf = self.mrf
    n = len(block)
    pos = {g: i for i, g in enumerate(block)}
    shape = [mrf.K[g] for g in block]
    tot = np.zeros(shape)
    for i, g in enumerate(block):
      u = mrf.U[g].copy()
      for nb in mrf.adj[g]:
        if nb not in pos:
          u = u + mrf.pair(g, nb)[:, choice[nb]]
      view = [1] * n
      view[i] = shape[i]
      tot = tot + u.reshape(view)
      for nb in mrf.adj[g]:
        j = pos.get(nb)
        if j is not None and j > i:
          view = [1] * n
          view[i], view[j] = shape[i], shape[j]
          tot = tot + mrf.pair(g, nb).reshape(view)
    cur = tuple(choice[g] for g in block)
    k = np.unravel_index(int(np.argmin(tot)), tot.shape)
    if tot[k] < tot[cur] - EPS * max(1.0, abs(tot[cur])):
      for g, kk in zip(block, k):
        choice[g] = int(kk)
      return True
    return False

  def block_moves(self, choice: np.ndarray, limit: int = 50_000) -> bool:
    """OneFlow-style local search: each node with as many of its neighbours
    as fit in ``limit`` joint values, re-decided together."""
    mrf = self.mrf
    size = 1
    for g in self.core:
      size *= mrf.K[g]
      if size > limit:
        break
    if self.core and size <= limit:
      return self.block_move(self.core, choice)
    improved = False
    for g in self.core:
      block, size = [g], mrf.K[g]
      for nb in sorted(mrf.adj[g], key=lambda x: (mrf.K[x], x)):
        if size * mrf.K[nb] > limit:
          break
        block.append(nb)
        size *= mrf.K[nb]
      if len(block) > 1 and self.block_move(block, choice):
        improved = True
    return improved

  def improve(self, choice: np.ndarray, max_rounds: int = 30,
              progress=None, effort: int = 1) -> int:
    """Moves until none helps. ``effort`` 0: descent and conditioned tree
    moves; 1: also unconditioned tree moves and block moves."""
    sweeps = self.descend(choice)
    best = self.objective(choice)
    for _ in range(max_rounds):
      improved = False
      for tree in (self.trees if effort >= 1 else self.trees[1:]):
        for condition in ((True, False) if effort >= 1 else (True,)):
          cand = self.tree_move(tree, choice, condition=condition)
          obj = self.objective(cand)
          if obj < best - EPS * max(1.0, abs(best)):
            choice[:] = cand
            sweeps += self.descend(choice)
            best = self.objective(choice)
            improved = True
      if not improved and effort >= 1 and self.block_moves(choice):
        self.descend(choice)
        best = self.objective(choice)
        improved = True
      if progress is not None:
        progress(sweeps, best)
      if not improved:
        break
    return sweeps


def polish_by_score(prob: Problem, choice, mem_weight: float = 0.0,
                    sweeps: int = 3) -> np.ndarray:
  """Coordinate descent on :func:`score`'s reshards, one op group at a time:
  for each candidate of the group, the reshards of every tensor it touches,
  consumers that want one layout sharing one (the pairwise moves charge
  each); every candidate of a group is scored in one vectorised pass."""
  ch = np.array(choice, dtype=np.int64)
  n_w, per_group = _polish_groups(prob)
  for _ in range(sweeps):
    moved = False
    for (g, n_k, n_t, prod, cons, own_p, own_c, poff, coff, w, toff, tn,
         t_loc, wid, node, out) in per_group:
      kk = np.arange(n_k)[:, None]
      at_p = poff + np.where(own_p, kk, ch[prod])
      at_c = coff + np.where(own_c, kk, ch[cons])
      sc = prob.cand_state[at_c]
      cost = w * prob._t_flat[  # noqa: SLF001
          toff + prob.cand_local[at_p] * tn + prob.cand_local[at_c]]
      # One reshard per (tensor, target layout, trip count), per candidate.
      n_s = int(sc.max()) + 1
      key = ((kk * n_t + t_loc) * n_s + sc) * n_w + wid
      _, first = np.unique(key.ravel(), return_index=True)
      rows = first // len(prod)
      comm = np.bincount(rows, cost.ravel()[first], minlength=n_k)
      if mem_weight:
        node = node + mem_weight * out
      total = comm + node
      cur = int(ch[g[0]])
      best = int(np.argmin(total))
      if total[best] < total[cur] - EPS * max(1.0, abs(total[cur])):
        ch[g] = best
        moved = True
    if not moved:
      break
  return ch


def _polish_groups(prob: Problem):
  """What :func:`polish_by_score` reads per op group, whatever the plan:
  (the number of trip counts, [per group of more than one candidate that
  touches a tensor: the group, its candidates, its tensors, and per edge
  of those tensors its ends, whether each is the group's, their slots'
  offsets, weight, transition block, tensor, trip count; the group's node
  costs and output bytes]). Kept on the problem for its groups
  (:meth:`Problem.for_groups`)."""
  return prob.for_groups("_polish_memo", lambda: _make_polish_groups(prob))


def _make_polish_groups(prob: Problem):
  by_tensor: dict[int, list[int]] = {}
  for i, t in enumerate(prob.e_tensor.tolist()):
    by_tensor.setdefault(t, []).append(i)
  w_ids = {w: i for i, w in enumerate(np.unique(prob.e_w).tolist())}
  e_wid = np.array([w_ids[w] for w in prob.e_w.tolist()], dtype=np.int64)
  per_group = []
  for g in prob.groups:
    n_k = len(prob.cands[g[0]])
    if n_k <= 1:
      continue
    ts = sorted({int(prob.e_tensor[i]) for o in g for i in prob.incident[o]})
    if not ts:
      continue
    e = np.concatenate([by_tensor[t] for t in ts])
    in_g = np.zeros(len(prob.cands), dtype=bool)
    in_g[g] = True
    prod, cons = prob.e_prod[e], prob.e_cons[e]
    per_group.append((
        g, n_k, len(ts), prod, cons, in_g[prod], in_g[cons], prob.e_poff[e],
        prob.e_coff[e], prob.e_w[e], prob.e_toff[e], prob.e_tn[e],
        np.searchsorted(ts, prob.e_tensor[e]), e_wid[e],
        sum(prob.node[o] for o in g), sum(prob.out_bytes[o] for o in g)))
  return max(len(w_ids), 1), per_group
