"""The exact optimum of the search's pairwise objective, for small graphs.

The same objective as :func:`~autoddl_jax._search.model.objective`, as a
mixed-integer program -- one binary per (coordinate, candidate), one per
pair of edge states -- solved by scipy's HiGHS. The benchmarks measure the
search's gap to it; nothing in planning depends on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from autoddl_jax._problem import Problem
from autoddl_jax._search.model import objective
from autoddl_jax._search.result import SearchResult


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
      cost[0][x_off[g]:x_off[g + 1]] += prob.node[o]
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
  return SearchResult(choice, objective(prob, choice), "exact", 0,
                      time.perf_counter() - t0)
