"""Coordinate descent over SBP signatures (the AutoDDL search), and an exact
solver for small graphs.

Coordinate descent, in brief:
  1. A coordinate is one decision: a parameter's nd-SBP (tied across its use,
     gradient, optimizer moments and update) or one op's signature.
  2. Seeds fix the program's inputs (data-parallel, FSDP, tensor-parallel, ...)
     and fill every other op greedily in program order.
  3. A sweep sets each coordinate to its cheapest value with all others fixed
     (node cost + every incident edge), in program order, then in reverse.
  4. Block moves re-decide a whole spanning tree of coordinates exactly (dynamic
     programming), the edges off the tree held at their current values.
  5. Sweeps and block moves repeat until none improves; the best seed wins.
Everything is deterministic: ties keep the current value, then the lowest index.

The exact solver minimises the same objective as a mixed-integer program
(one binary per candidate, one per pair of edge states) with scipy's HiGHS.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from autoddl_jax._problem import Problem

_EPS = 1e-12


@dataclasses.dataclass
class SearchResult:
  choice: list[int]
  objective: float
  seed: str
  sweeps: int
  seconds: float


class _Cd:
  """Coordinate-descent state over a Problem."""

  def __init__(self, prob: Problem, mem_weight: float = 0.0):
    self.p = prob
    self.mem_weight = mem_weight
    self.node = [prob.compute[o] + mem_weight * prob.out_bytes[o]
                 for o in range(len(prob.cands))]
    self._nb: dict[int, list[int]] = {}

  def group_vector(self, g: int, choice: np.ndarray,
                   assigned: np.ndarray | None = None) -> np.ndarray:
    p = self.p
    members = p.groups[g]
    vec = np.zeros(len(p.cands[members[0]]))
    mset = set(members)
    seen = set()
    for o in members:
      vec = vec + self.node[o]
      for ei in p.incident[o]:
        if ei in seen:
          continue
        seen.add(ei)
        e = p.edges[ei]
        m = e.space.time
        pi = p.slot_idx[e.prod][e.prod_slot]
        ci = p.slot_idx[e.cons][e.cons_slot]
        if e.prod in mset and e.cons in mset:
          vec = vec + e.weight * m[pi, ci]  # same k on both ends
        elif e.prod in mset:
          if assigned is not None and not assigned[e.cons]:
            continue
          vec = vec + e.weight * m[pi, ci[choice[e.cons]]]
        else:
          if assigned is not None and not assigned[e.prod]:
            continue
          vec = vec + e.weight * m[pi[choice[e.prod]], ci]
    return vec

  def objective(self, choice: np.ndarray) -> float:
    p = self.p
    ch = np.asarray(choice, dtype=np.int64)
    node = p.compute_flat[p.node_off + ch].sum()
    if self.mem_weight:
      node += self.mem_weight * p.out_bytes_flat[p.node_off + ch].sum()
    return float(node + p.edge_costs(ch).sum())

  def set_group(self, g: int, k: int, choice: np.ndarray):
    for o in self.p.groups[g]:
      choice[o] = k

  def fill(self, choice: np.ndarray, fixed: np.ndarray,
           lazy: bool = False) -> np.ndarray:
    """Greedy program-order assignment of every coordinate not fixed.

    ``lazy`` counts communication only, ties going to the lowest candidate
    (all-B first, then the signatures in rule order): layouts then flow from
    the inputs the way sharding propagation would carry them.
    """
    assigned = fixed.copy()
    node = self.node
    if lazy:
      self.node = [np.zeros_like(v) for v in node]
    for g, members in enumerate(self.p.groups):
      if assigned[members[0]]:
        continue
      vec = self.group_vector(g, choice, assigned)
      self.set_group(g, int(np.argmin(vec)), choice)
      for o in members:
        assigned[o] = True
    self.node = node
    return choice

  def descend(self, choice: np.ndarray, fixed: np.ndarray,
              max_sweeps: int = 100,
              progress: Callable[[int, float], None] | None = None) -> int:
    """Sweeps (forward, then backward, ...) over the coordinates whose
    neighbourhood changed since they were last set, until none moves."""
    p = self.p
    free = np.array([not fixed[m[0]] and len(p.cands[m[0]]) > 1
                     for m in p.groups])
    dirty = free.copy()
    sweeps = 0
    for sweeps in range(1, max_sweeps + 1):
      order = np.nonzero(dirty)[0]
      if not len(order):
        break
      dirty[:] = False
      if sweeps % 2 == 0:
        order = order[::-1]
      moved = False
      for g in order:
        vec = self.group_vector(int(g), choice)
        cur = choice[p.groups[g][0]]
        k = int(np.argmin(vec))
        if vec[k] < vec[cur] - _EPS * max(1.0, abs(vec[cur])):
          self.set_group(int(g), k, choice)
          moved = True
          for nb in self.neighbours(int(g)):
            if free[nb]:
              dirty[nb] = True
      if progress is not None:
        progress(sweeps, self.objective(choice))
      if not moved:
        break
    return sweeps

  def neighbours(self, g: int) -> list[int]:
    nb = self._nb.get(g)
    if nb is None:
      p = self.p
      s = set()
      for o in p.groups[g]:
        for ei in p.incident[o]:
          e = p.edges[ei]
          s.add(int(p.group_of[e.prod]))
          s.add(int(p.group_of[e.cons]))
      s.discard(g)
      nb = self._nb[g] = sorted(s)
    return nb


class _TreeMove:
  """Exact minimisation over a spanning tree of coordinates, by dynamic
  programming, with the edges off the tree held at their current values.

  Single-coordinate moves stall where a whole chain must change together (a
  run of ops that should all stay replicated, say): each op alone only moves an
  all-gather one step. A tree move re-decides every coordinate at once, exact on
  the chains and branches of the tree (OneFlow's eliminations do the same for
  series-parallel parts). The result is kept only if the true objective drops.
  """

  def __init__(self, cd: _Cd, order: str, cache: dict | None = None):
    p = cd.p
    self.cd = cd
    self.cache = {} if cache is None else cache
    ng = len(p.groups)
    self.unary = []
    for g, members in enumerate(p.groups):
      vec = np.zeros(len(p.cands[members[0]]))
      for o in members:
        vec = vec + cd.node[o]
      self.unary.append(vec)
    pairs: dict[tuple[int, int], list[int]] = {}
    for ei, e in enumerate(p.edges):
      a, b = int(p.group_of[e.prod]), int(p.group_of[e.cons])
      if a == b:
        pi = p.slot_idx[e.prod][e.prod_slot]
        ci = p.slot_idx[e.cons][e.cons_slot]
        self.unary[a] = self.unary[a] + e.weight * e.space.time[pi, ci]
      else:
        pairs.setdefault((min(a, b), max(a, b)), []).append(ei)
    self.pairs = pairs
    keys = sorted(pairs)
    if order == "heavy":
      heavy = {k: max(p.edges[ei].space.nbytes * p.edges[ei].weight
                      for ei in pairs[k]) for k in keys}
      keys.sort(key=lambda k: (-heavy[k], k))
    parent = list(range(ng))

    def find(i):
      while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
      return i

    self.tree: set[tuple[int, int]] = set()
    self.adj: list[list[int]] = [[] for _ in range(ng)]
    for a, b in keys:
      ra, rb = find(a), find(b)
      if ra != rb:
        parent[ra] = rb
        self.tree.add((a, b))
        self.adj[a].append(b)
        self.adj[b].append(a)

  def matrix(self, a: int, b: int) -> np.ndarray:
    """Cost of the edges between groups a and b, indexed [k_a, k_b]."""
    lo, hi = min(a, b), max(a, b)
    m = self.cache.get((lo, hi))
    if m is None:
      m = self._matrix(lo, hi)
      if len(self.cache) < 50_000 and m.size < 1_000_000:
        self.cache[(lo, hi)] = m
    return m if a == lo else m.T

  def _matrix(self, lo: int, hi: int) -> np.ndarray:
    p = self.cd.p
    m = None
    for ei in self.pairs[(lo, hi)]:
      e = p.edges[ei]
      pi = p.slot_idx[e.prod][e.prod_slot]
      ci = p.slot_idx[e.cons][e.cons_slot]
      mm = e.weight * e.space.time[np.ix_(pi, ci)]
      if int(p.group_of[e.prod]) != lo:
        mm = mm.T
      m = mm if m is None else m + mm
    return m

  def run(self, choice: np.ndarray, fixed: np.ndarray,
          condition: bool = True) -> np.ndarray:
    p = self.cd.p
    ng = len(p.groups)
    cur = np.array([choice[m[0]] for m in p.groups])
    unary = []
    for g in range(ng):
      u = self.unary[g].copy()
      if fixed[p.groups[g][0]]:
        keep = u[cur[g]]
        u[:] = np.inf
        u[cur[g]] = keep
      unary.append(u)
    for (a, b), _ in self.pairs.items():
      if (a, b) in self.tree or not condition:
        continue
      m = self.matrix(a, b)
      unary[a] = unary[a] + 0.5 * m[:, cur[b]]
      unary[b] = unary[b] + 0.5 * m[cur[a], :]
    new = cur.copy()
    seen = np.zeros(ng, dtype=bool)
    for root in range(ng):
      if seen[root]:
        continue
      order, par = [root], {root: -1}
      seen[root] = True
      i = 0
      while i < len(order):
        v = order[i]
        i += 1
        for w in self.adj[v]:
          if not seen[w]:
            seen[w] = True
            par[w] = v
            order.append(w)
      acc = {v: unary[v] for v in order}
      back = {}
      for v in reversed(order[1:]):
        u = par[v]
        tot = self.matrix(u, v) + acc[v][None, :]
        back[v] = np.argmin(tot, axis=1)
        acc[u] = acc[u] + tot[np.arange(tot.shape[0]), back[v]]
      new[root] = int(np.argmin(acc[root]))
      for v in order[1:]:
        new[v] = back[v][new[par[v]]]
    out = choice.copy()
    for g, m in enumerate(p.groups):
      for o in m:
        out[o] = new[g]
    return out


def _improve(cd: _Cd, choice: np.ndarray, fixed: np.ndarray, trees,
             progress=None, max_rounds: int = 20) -> int:
  """Alternates coordinate sweeps and tree moves until neither helps."""
  sweeps = cd.descend(choice, fixed, progress=progress)
  best = cd.objective(choice)
  for _ in range(max_rounds):
    improved = False
    for tree, condition in itertools.product(trees, (True, False)):
      cand = tree.run(choice, fixed, condition)
      obj = cd.objective(cand)
      if obj < best - _EPS * max(1.0, abs(best)):
        choice[:] = cand
        sweeps += cd.descend(choice, fixed, progress=progress)
        best = cd.objective(choice)
        improved = True
    if not improved:
      break
  return sweeps


def coordinate_descent(prob: Problem, seeds: Mapping[str, Mapping[int, int]],
                       fixed_ops: Sequence[int] = (), mem_weight: float = 0.0,
                       progress: Callable[[str, int, float], None] | None = None,
                       polish: Problem | None = None, polish_top: int = 8
                       ) -> SearchResult:
  """Runs CD from each seed; returns the best plan.

  ``seeds`` maps a seed name to {op id: candidate} for the ops it pins (the
  program's inputs, usually). Ops in ``fixed_ops`` keep their seed value for the
  whole search (used to score a hand plan); other seeded ops are freed after a
  first descent with them pinned.
  """
  t0 = time.perf_counter()
  cd = _Cd(prob, mem_weight)
  cache: dict = {}
  trees = [_TreeMove(cd, "heavy", cache), _TreeMove(cd, "program", cache)]
  n = len(prob.cands)
  results: list[SearchResult] = []
  for name, pins in seeds.items():
    choice = np.zeros(n, dtype=np.int64)
    fixed = np.zeros(n, dtype=bool)
    for o, k in pins.items():
      for m in prob.groups[prob.group_of[o]]:
        choice[m] = k
        fixed[m] = True
    # Start from the best of: a greedy program-order fill, a lazy one
    # (propagation), and exact solutions on spanning trees.
    starts = [cd.fill(choice.copy(), fixed), cd.fill(choice.copy(), fixed,
                                                     lazy=True)]
    starts += [t.run(starts[0], fixed, condition=False) for t in trees]
    choice = min(starts, key=cd.objective)
    cb = None if progress is None else (lambda s, c, nm=name: progress(nm, s, c))
    sweeps = _improve(cd, choice, fixed, trees, cb)
    hard = np.zeros(n, dtype=bool)
    hard[list(fixed_ops)] = True
    if not (fixed == hard).all():
      sweeps += _improve(cd, choice, hard, trees, cb)
    results.append(SearchResult([int(c) for c in choice],
                                cd.objective(choice), name, sweeps, 0.0))
  results.sort(key=lambda r: r.objective)  # stable: seed order breaks ties
  if polish is not None:
    pcd = _Cd(polish, mem_weight)
    ptrees = [_TreeMove(pcd, "heavy"), _TreeMove(pcd, "program")]
    hard = np.zeros(n, dtype=bool)
    hard[list(fixed_ops)] = True
    polished = []
    for r in results[:polish_top]:
      choice = np.array(r.choice, dtype=np.int64)
      sweeps = _improve(pcd, choice, hard, ptrees)
      polished.append(SearchResult([int(c) for c in choice],
                                   pcd.objective(choice), r.seed,
                                   r.sweeps + sweeps, 0.0))
    results = sorted(polished, key=lambda r: r.objective)
  best = results[0]
  best.seconds = time.perf_counter() - t0
  return best


def exact(prob: Problem, pins: Mapping[int, int] | None = None,
          time_limit: float = 60.0) -> SearchResult | None:
  """The optimum of the same objective by MILP; None if not solved in time."""
  from scipy.optimize import Bounds, LinearConstraint, milp
  from scipy.sparse import coo_matrix

  t0 = time.perf_counter()
  pins = dict(pins or {})
  ng = len(prob.groups)
  # x variables: one per (group, candidate).
  x_off = np.zeros(ng + 1, dtype=np.int64)
  for g, m in enumerate(prob.groups):
    x_off[g + 1] = x_off[g] + len(prob.cands[m[0]])
  cost = [np.zeros(int(x_off[-1]))]
  for g, m in enumerate(prob.groups):
    for o in m:
      cost[0][x_off[g]:x_off[g + 1]] += prob.compute[o]
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0

  def add_row(entries, lb, ub):
    nonlocal r
    for c, v in entries:
      rows.append(r)
      cols.append(c)
      vals.append(v)
    lo.append(lb)
    hi.append(ub)
    r += 1

  for g in range(ng):
    add_row([(int(x_off[g] + k), 1.0) for k in range(x_off[g + 1] - x_off[g])],
            1, 1)
  nvar = int(x_off[-1])
  for e in prob.edges:
    gp, gc = prob.group_of[e.prod], prob.group_of[e.cons]
    pi = prob.slot_idx[e.prod][e.prod_slot]
    ci = prob.slot_idx[e.cons][e.cons_slot]
    m = e.weight * e.space.time
    if gp == gc:
      cost[0][x_off[gp]:x_off[gp + 1]] += m[pi, ci]
      continue
    us, vs = np.unique(pi), np.unique(ci)
    sub = m[np.ix_(us, vs)]
    if not sub.any():
      continue
    base = nvar
    nvar += len(us) * len(vs)
    cost.append(sub.ravel())
    for a, u in enumerate(us):  # sum_v y_uv = sum_{k: pi[k]=u} x_pk
      ent = [(base + a * len(vs) + b, 1.0) for b in range(len(vs))]
      ent += [(int(x_off[gp] + k), -1.0) for k in np.nonzero(pi == u)[0]]
      add_row(ent, 0, 0)
    for b, v in enumerate(vs):
      ent = [(base + a * len(vs) + b, 1.0) for a in range(len(us))]
      ent += [(int(x_off[gc] + k), -1.0) for k in np.nonzero(ci == v)[0]]
      add_row(ent, 0, 0)
  c = np.concatenate(cost)
  lb = np.zeros(nvar)
  ub = np.ones(nvar)
  for o, k in pins.items():
    g = prob.group_of[o]
    ub[x_off[g]:x_off[g + 1]] = 0
    ub[x_off[g] + k] = 1
    lb[x_off[g] + k] = 1
  a = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
  integrality = np.zeros(nvar)
  integrality[:int(x_off[-1])] = 1
  scale = 1.0 / max(float(np.abs(c).max()), 1e-30)
  res = milp(c * scale, constraints=LinearConstraint(a, lo, hi),
             integrality=integrality, bounds=Bounds(lb, ub),
             options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
  if res.x is None or res.status not in (0,):
    return None
  choice = [0] * len(prob.cands)
  for g, m in enumerate(prob.groups):
    k = int(np.argmax(res.x[x_off[g]:x_off[g + 1]]))
    for o in m:
      choice[o] = k
  obj = _Cd(prob).objective(np.array(choice))
  return SearchResult(choice, obj, "exact", 0, time.perf_counter() - t0)
