"""A boundary completed the way XLA's sharding propagation completes it.

A user who writes data parallelism gives ``jax.jit`` the boundary only
(parameters replicated, the batch split over every device) and XLA
propagates the rest: each op takes the layout its operands already have, a
partial sum made by a contraction is reduced where the next op needs a
concrete layout, and the devices act as one group -- the same program for an
(8,), a (2, 4) or a (4, 2) mesh (measured on the zoo, jax 0.10). The search's
completion of the same boundary (:func:`autoddl_jax._search.complete`) is a
better plan than that: it gathers a small batch to compute replicated, or
reduces gradients hierarchically, which is no longer the textbook plan a
baseline must name. :func:`propagate` is the plan XLA builds:

* ops are visited in program order; each takes, among its candidates whose
  every slot is split the same way on every mesh axis (the devices as one
  group), by priority: a partial sum it receives reduced to replicated (as
  GSPMD reduces at the op that made it), the fewest split operands moved,
  the fewest replicated operands sliced (a replicated operand adapts to a
  split one, not the reverse), the cheapest by compute and resharding from
  its decided neighbours, and the fewest split results (sources of values
  -- constants, iotas, zeros -- stay replicated and are sliced for free by
  their users);
* pinned ops (the boundary) and their coordinates keep their candidates.

:func:`evaluate` costs such a plan with the devices as one group: a reshard
of a layout split alike on every axis runs over all of them at once, at the
slowest link (XLA's program for DP is one program, whatever the mesh's
axes), not axis by axis as a plan's pinned path runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._cost import transition
from autoddl_jax._problem import PlanCost, Problem
from autoddl_jax._sbp import B_CODE as B, P_CODE as P


def _uniform(codes) -> bool:
  return all(c == codes[0] for c in codes)


def _candidate_traits(memo: dict, cands, n_ins: int):
  """(whether each candidate splits every slot alike on every axis -- all
  True where none does --, each candidate's number of split results)."""
  if id(cands) not in memo:
    ok = np.array([all(_uniform(c) for c in cand) for cand in cands])
    if not ok.any():
      ok[:] = True
    split_outs = np.array([sum(any(c != B for c in cand[s])
                               for s in range(n_ins, len(cand)))
                           for cand in cands])
    memo[id(cands)] = ok, split_outs
  return memo[id(cands)]


def _replicated_states(memo: dict, space) -> np.ndarray:
  """Whether each state of ``space`` is replicated on every axis."""
  if id(space) not in memo:
    memo[id(space)] = np.array(
        [all(c == B for c in st) for st in space.states], dtype=bool)
  return memo[id(space)]


def propagate(prob: Problem, pins: Mapping[int, int]) -> list[int]:
  """The choice XLA's propagation makes from ``pins`` {op id: candidate}
  (see the module docstring)."""
  graph = prob.graph
  n = len(graph.ops)
  choice = np.full(n, -1, dtype=np.int64)
  for o, k in pins.items():
    for m in prob.groups[int(prob.group_of[o])]:
      choice[m] = k
  states = [e.space.states for e in prob.edges]
  # Ops of one structure share their candidate list (Problem), and edges of
  # one tensor type their state space: what propagation asks of each is
  # computed once per list and per space, not per op and per edge, and
  # kept on the problem for its other calls (one per seed; keyed by id:
  # the problem, and the copies ``regroup`` makes, hold every list and
  # space as long as the memo).
  traits, rep = prob.__dict__.setdefault("_propagate_memo", ({}, {}))
  for op in graph.ops:
    if choice[op.id] >= 0:
      continue
    members = prob.groups[int(prob.group_of[op.id])]
    cands = prob.cands[op.id]
    ok, split_outs = _candidate_traits(traits, cands, len(op.ins))
    nk = len(cands)
    bad = np.zeros(nk)  # a partial sum taken to anything but replicated
    moved = np.zeros(nk)  # split operands whose layout changes
    sliced = np.zeros(nk)  # replicated operands sliced
    cost = np.zeros(nk)
    for m in members:
      cost += prob.node[m]
      for ei in prob.incident[m]:
        e = prob.edges[ei]
        if e.cons == m and choice[e.prod] >= 0 and e.prod not in members:
          src = prob.slot_idx[e.prod][e.prod_slot][choice[e.prod]]
          dst = prob.slot_idx[m][e.cons_slot]
          cost += e.weight * e.space.time[src, dst]
          replicated = _replicated_states(rep, e.space)
          if P in states[ei][src]:
            bad += ~replicated[dst]
          elif replicated[src]:
            sliced += dst != src
          else:
            moved += dst != src
        elif e.prod == m and choice[e.cons] >= 0 and e.cons not in members:
          src = prob.slot_idx[m][e.prod_slot]
          dst = prob.slot_idx[e.cons][e.cons_slot][choice[e.cons]]
          cost += e.weight * e.space.time[src, dst]
    order = np.lexsort((split_outs, cost, sliced, moved, bad, ~ok))
    k = int(order[0])
    for m in members:
      choice[m] = k
  return [int(c) for c in choice]


def _one_group(mi: MeshInfo) -> MeshInfo:
  """The mesh's devices as one axis, at the slowest of its links."""
  links = set(mi.link)
  return dataclasses.replace(
      mi, axis_names=("+".join(mi.axis_names),),
      axis_sizes=(math.prod(mi.axis_sizes),), alpha=(max(mi.alpha),),
      beta=(min(mi.beta),),
      link=(links.pop() if len(links) == 1 else "mixed",))


def evaluate(prob: Problem, choice: Sequence[int]) -> PlanCost:
  """``prob.evaluate(choice)`` with the devices as one group (see the
  module docstring)."""
  ch = np.asarray(choice, dtype=np.int64)
  keep = prob.distinct_reshards(ch)
  t, b = prob.edge_costs(ch), prob.edge_costs(ch, "bytes")
  mi = prob.mi
  if mi.ndim > 1:
    flat = _one_group(mi)
    flat_combined = dataclasses.replace(flat, combined=True)
    for i in keep:
      if b[i] <= 0:
        continue
      e = prob.edges[i]
      src = prob.cands[e.prod][ch[e.prod]][e.prod_slot]
      dst = prob.cands[e.cons][ch[e.cons]][e.cons_slot]
      if _uniform(src) and _uniform(dst):
        m = flat_combined if e.tensor in prob.combined else flat
        ti, bi = transition((src[0],), (dst[0],), e.space.nbytes,
                            e.space.shape, m)
        t[i], b[i] = e.weight * ti, e.weight * bi
  return prob.evaluate(ch, keep, (t, b))
