"""The search problem: candidates per op, edge costs, and plan evaluation.

Every op of the :class:`~autoddl_jax._graph.OpGraph` gets its n-D candidates:
the product of its 1-D signatures over the mesh axes, keeping only those whose
splits divide the dims they split. A candidate fixes the nd-SBP of each of the
op's slots (inputs, then outputs). Each slot's nd-SBP is stored as an index into
its tensor's :class:`~autoddl_jax._states.StateSpace`, so the cost of an edge
(producer slot -> consumer slot) for any pair of candidates is a lookup in one
shared transition matrix.

A *coordinate* is a group of ops that take one decision together: a parameter's
input op, the output op of its update, and its optimizer moments; every other op
is its own coordinate.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import numpy as np

from autoddl_jax._candidates import candidates
from autoddl_jax._cluster import Cluster, MeshInfo
from autoddl_jax._collectives import latency_steps
from autoddl_jax._cost import transition_steps
from autoddl_jax._states import StateSpace, ensure_all, state_space
from autoddl_jax._opgraph import OpGraph
from autoddl_jax._op_demands import fixed_codes, op_collectives
from autoddl_jax._memory import MEMORY_ALIAS_OPS, MemoryModel
from autoddl_jax._pinned import pinned_dims, slot_pins
from autoddl_jax._sbp import P_CODE



@dataclasses.dataclass
class Edge:
  tensor: int
  prod: int
  prod_slot: int  # index into the producer's slot list (inputs then outputs)
  cons: int
  cons_slot: int
  weight: float
  space: StateSpace


@dataclasses.dataclass(frozen=True)
class PlanCost:
  """Predicted cost of one training step, per device (what
  :meth:`Problem.evaluate` returns and ``Plan.cost`` holds)."""

  time_s: float  # compute_s + comm_s (no overlap assumed)
  comm_bytes: float  # ring-model bytes each device sends
  compute_s: float
  memory_bytes: float  # peak of live tensors under the plan
  comm_s: float = 0.0


# Ops a tensor's value must reach for its all-reduce to be on the step's
# critical path: the next layer's compute. Gradients of weights reach none
# (only the optimizer's update), and XLA's combiners merge their independent
# reductions: measured on the zoo (jax 0.10, CPU), DP's gradient all-reduces
# become one per loop body and one outside, and so do FSDP's gradient
# reduce-scatters (CPU writes each as an all-reduce and a dynamic-slice, and
# combines them; a GPU runs its ReduceScatterCombiner), while all-gathers,
# and reduce-scatters of activations, stay one per tensor.
_COMPUTE = frozenset({"dot_general", "conv_general_dilated"})


def combined_tensors(graph: OpGraph) -> frozenset[int]:
  """Tensors no contraction depends on (through any chain of ops, loops
  included): their all-reduces are combined (``MeshInfo.combined``)."""
  feeds = set()  # tensors some contraction depends on
  stack = [t for op in graph.ops if op.prim in _COMPUTE for t in op.ins
           if t is not None]
  while stack:
    t = stack.pop()
    if t in feeds:
      continue
    feeds.add(t)
    prod = graph.tensors[t].producer
    if prod is not None:
      stack.extend(x for x in graph.ops[prod[0]].ins if x is not None)
  return frozenset(t.id for t in graph.tensors if t.id not in feeds)


class Problem(MemoryModel):
  """Candidates, node costs and edges for one (graph, mesh, cluster)."""

  # Input ops whose buffers the step donates (``jax.jit(donate_argnums=)``):
  # XLA writes a result of the same type and layout into one of them, so
  # that result needs no allocation of its own (:meth:`_allocations`).
  donated: frozenset[int] = frozenset()

  def __init__(self, graph: OpGraph, mi: MeshInfo, cluster: Cluster,
               groups: Sequence[Sequence[int]] = (),
               donated: frozenset[int] = frozenset()):
    self.graph, self.mi, self.cluster = graph, mi, cluster
    self.donated = donated
    rate = cluster.peak_flops * cluster.flops_efficiency
    self.cands: list[list[tuple[tuple[int, ...], ...]]] = []
    self.slot_idx: list[list[np.ndarray | None]] = []
    self.compute: list[np.ndarray] = []
    # Collectives an op runs itself (a pipeline's stage shift; a loop carry
    # held as a partial sum): time and bytes per candidate; ``node``
    # (compute + that time) is what the search charges an op's candidate.
    self.op_comm: list[np.ndarray] = []
    self.op_bytes: list[np.ndarray] = []
    self.op_kind: list[str | None] = []  # the collective of op_bytes
    self.node: list[np.ndarray] = []
    self.out_bytes: list[np.ndarray] = []
    # A pipeline's stage (and replica) dims, held on their axes.
    self.pins = pinned_dims(graph, mi)
    for op in graph.ops:
      slots = [graph.tensors[t].aval if t is not None else a
               for t, a in zip(op.ins, op.in_avals)]
      slots += [graph.tensors[t].aval for t in op.outs]
      literal = tuple([t is None for t in op.ins] + [False] * len(op.outs))
      fixed = fixed_codes(op, slots, mi)
      pinned = slot_pins(op, self.pins)
      # Ops of one structure (signatures, slot shapes and itemsizes, which
      # inputs are literals, ...) share their candidates and slot index
      # arrays, in this problem and across the planner's others.
      cands, slot_idx, spl, ob = candidates(
          tuple(op.sigs),
          tuple((tuple(a.shape), a.dtype.itemsize) for a in slots),
          literal, len(op.ins), op.prim in MEMORY_ALIAS_OPS, mi, fixed,
          pinned)
      self.cands.append(cands)
      self.slot_idx.append(slot_idx)
      self.compute.append(op.flops * op.weight / rate / spl)
      kind, ct, cb = op_collectives(
          op, cands, mi, slots,
          loop_carry=op.prim == "~merge" and op.id in graph.loop_of_link)
      self.op_kind.append(kind)
      self.op_comm.append(ct * op.weight)
      self.op_bytes.append(cb * op.weight)
      self.node.append(self.compute[-1] + self.op_comm[-1])
      self.out_bytes.append(ob)
    # Edges: producer output slot -> consumer input slot.
    self.edges: list[Edge] = []
    self.incident: list[list[int]] = [[] for _ in graph.ops]
    self.combined = combined_tensors(graph)
    mi_combined = dataclasses.replace(mi, combined=True)
    for t in graph.tensors:
      if t.producer is None:
        continue
      p, ps = t.producer
      p_slot = len(graph.ops[p].ins) + ps
      sp = state_space(t.aval.shape, t.aval.dtype.itemsize,
                       mi_combined if t.id in self.combined else mi)
      for c, cs in t.consumers:
        e = Edge(t.id, p, p_slot, c, cs, graph.ops[c].in_weights[cs], sp)
        self.incident[p].append(len(self.edges))
        self.incident[c].append(len(self.edges))
        self.edges.append(e)
    # Each space's transitions among the states these candidates use.
    used: dict[int, tuple[StateSpace, list]] = {}
    for e in self.edges:
      idx = used.setdefault(id(e.space), (e.space, []))[1]
      idx.append(self.slot_idx[e.prod][e.prod_slot])
      idx.append(self.slot_idx[e.cons][e.cons_slot])
    ensure_all([(sp, np.unique(np.concatenate(idx)))
                for sp, idx in used.values()])
    self._set_groups(groups)
    self._liveness()
    self._flatten()

  def for_groups(self, name: str, make):
    """``make()``, kept on this problem under ``name`` for as long as its
    groups stand (what the search derives from a problem's coordinates:
    :meth:`regroup` gives a copy other groups, so the copy makes its own)."""
    got = self.__dict__.get(name)
    if got is None or got[0] is not self.groups:
      got = (self.groups, make())
      setattr(self, name, got)
    return got[1]

  def regroup(self, groups: Sequence[Sequence[int]]) -> Problem:
    """The same problem with other coordinates (shares every array)."""
    new = copy.copy(self)
    new._set_groups(groups)
    return new

  def _set_groups(self, groups: Sequence[Sequence[int]]):
    graph = self.graph
    grouped = set()
    self.groups: list[list[int]] = []
    for g in groups:
      g = sorted(set(g))
      ks = {len(self.cands[o]) for o in g}
      if len(g) > 1 and len(ks) == 1 and not grouped.intersection(g):
        self.groups.append(g)
        grouped.update(g)
    for op in graph.ops:
      if op.id not in grouped:
        self.groups.append([op.id])
    self.groups.sort(key=lambda g: g[0])
    self.group_of = np.zeros(len(graph.ops), dtype=np.int64)
    for gi, g in enumerate(self.groups):
      for o in g:
        self.group_of[o] = gi

  def _flatten(self):
    """Flat arrays so a whole plan is scored with a few numpy gathers."""
    flat = []
    n = 0
    self.slot_off: list[list[int]] = []
    for o, slots in enumerate(self.slot_idx):
      offs = []
      for arr in slots:
        offs.append(n)
        flat.append(arr)
        n += len(arr)
      self.slot_off.append(offs)
    self.cand_state = np.concatenate(flat) if flat else np.zeros(0, np.int32)
    # Each space's block holds the transitions among the states it has
    # computed (a few of its states, mostly: see StateSpace.ensure);
    # ``cand_local`` is ``cand_state`` as an index into that block, for the
    # slots the edges read (a slot holds one tensor, so one space).
    spaces: dict[int, tuple[int, np.ndarray]] = {}
    self.cand_local = np.full(len(self.cand_state), -1, dtype=np.int64)
    t_flat, b_flat, t_off, t_n = [], [], [], []
    pos = 0
    e_space = []
    slots_done: set[int] = set()
    for e in self.edges:
      sp = e.space
      if id(sp) not in spaces:
        done = sp.computed
        remap = np.full(len(sp.states), -1, dtype=np.int64)
        remap[done] = np.arange(len(done))
        spaces[id(sp)] = (len(t_off), remap)
        block = np.ix_(done, done)
        t_flat.append(sp.time[block].ravel())
        b_flat.append(sp.bytes[block].ravel())
        t_off.append(pos)
        t_n.append(len(done))
        pos += len(done) ** 2
      sid, remap = spaces[id(sp)]
      e_space.append(sid)
      for o, s in ((e.prod, e.prod_slot), (e.cons, e.cons_slot)):
        off = self.slot_off[o][s]
        if off not in slots_done:
          slots_done.add(off)
          idx = self.slot_idx[o][s]
          self.cand_local[off:off + len(idx)] = remap[idx]
    self._t_flat = np.concatenate(t_flat) if t_flat else np.zeros(0)
    self._b_flat = np.concatenate(b_flat) if b_flat else np.zeros(0)
    es = np.array(e_space, dtype=np.int64)
    t_off = np.array(t_off, dtype=np.int64)
    t_n = np.array(t_n, dtype=np.int64)
    self.e_tensor = np.array([e.tensor for e in self.edges], dtype=np.int64)
    self.e_prod = np.array([e.prod for e in self.edges], dtype=np.int64)
    self.e_cons = np.array([e.cons for e in self.edges], dtype=np.int64)
    self.e_w = np.array([e.weight for e in self.edges])
    self.e_poff = np.array([self.slot_off[e.prod][e.prod_slot]
                            for e in self.edges], dtype=np.int64)
    self.e_coff = np.array([self.slot_off[e.cons][e.cons_slot]
                            for e in self.edges], dtype=np.int64)
    self.e_toff = t_off[es] if len(es) else np.zeros(0, np.int64)
    self.e_tn = t_n[es] if len(es) else np.zeros(0, np.int64)
    self.node_off = np.cumsum([0] + [len(c) for c in self.cands])[:-1]
    self.compute_flat = np.concatenate(self.compute)
    self.op_comm_flat = np.concatenate(self.op_comm)
    self.op_bytes_flat = np.concatenate(self.op_bytes)
    self.node_flat = np.concatenate(self.node)
    self.out_bytes_flat = np.concatenate(self.out_bytes)

  def edge_costs(self, choice, what: str = "time") -> np.ndarray:
    """Per-edge cost of a whole plan (vectorized)."""
    choice = np.asarray(choice, dtype=np.int64)
    sp = self.cand_local[self.e_poff + choice[self.e_prod]]
    sc = self.cand_local[self.e_coff + choice[self.e_cons]]
    flat = self._t_flat if what == "time" else self._b_flat
    return self.e_w * flat[self.e_toff + sp * self.e_tn + sc]

  # ------------------------------------------------------------- evaluation
  def edge_pair(self, e: Edge, kp, kc, what: str = "time"):
    m = e.space.time if what == "time" else e.space.bytes
    return e.weight * m[self.slot_idx[e.prod][e.prod_slot][kp],
                        self.slot_idx[e.cons][e.cons_slot][kc]]

  def distinct_reshards(self, choice) -> np.ndarray:
    """Indices of the edges that are reshards XLA runs: consumers of one
    tensor that want the same layout (at the same trip count) share one
    reshard -- XLA's partitioner caches it -- so only the first is kept.
    The search's pairwise objective charges each edge: an upper bound."""
    choice = np.asarray(choice, dtype=np.int64)
    sc = self.cand_state[self.e_coff + choice[self.e_cons]]
    keys = np.stack([self.e_tensor, sc, self.e_w]) if len(sc) else \
        np.zeros((3, 0))
    _, first = np.unique(keys, axis=1, return_index=True)
    return np.sort(first)

  def combined_latency(self, choice, keep=None) -> float:
    """The latency XLA's combiners leave, as a correction to the edges' own:
    the combined all-reduces and reduce-scatters (see
    :func:`combined_tensors`, costed without latency) pay it once per loop
    body (trip count), group of mesh axes and kind; all-reduces on the
    critical path (costed with theirs) that do not depend on each other --
    a BatchNorm's mean and mean of squares, the statistics of parallel
    branches -- are merged too, so each one that joins an earlier one gives
    its latency back."""
    ch = np.asarray(choice, dtype=np.int64)
    keep = self.distinct_reshards(ch) if keep is None else keep
    mi, groups, critical = self.mi, {}, {}
    for i in keep:
      e = self.edges[i]
      src = self.cands[e.prod][ch[e.prod]][e.prod_slot]
      dst = self.cands[e.cons][ch[e.cons]][e.cons_slot]
      if P_CODE not in src or src == dst:
        continue
      for kind, axes, _ in transition_steps(src, dst, e.space.nbytes,
                                            e.space.shape, mi):
        if kind not in ("all-reduce", "reduce-scatter"):
          continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        p = int(np.prod([mi.axis_sizes[a] for a in axes]))
        t = latency_steps(kind, p) * max(mi.alpha[a] for a in axes) * e.weight
        if e.tensor in self.combined:
          groups[(e.weight, axes, kind)] = t
        elif kind == "all-reduce":
          critical.setdefault((e.tensor, e.weight, axes), t)
    return float(sum(groups.values())) - self._merged_latency(critical)

  def _merged_latency(self, critical) -> float:
    """The latency given back by merging independent critical all-reduces
    {(tensor, trip count, axes): latency}: in program order, each joins the
    open group of its trip count and axes unless it depends on a member."""
    if len(critical) < 2:
      return 0.0
    bit = {t: 1 << i for i, t in enumerate(sorted({k[0] for k in critical}))}
    dep: dict[int, int] = {}  # tensor -> the reduced tensors it depends on
    for op in self.graph.ops:
      m = 0
      for t in op.ins:
        if t is not None:
          m |= dep.get(t, 0) | bit.get(t, 0)
      for t in op.outs:
        dep[t] = m
    saved, open_groups = 0.0, {}
    order = sorted(critical, key=lambda k: self.graph.tensors[k[0]].producer)
    for key in order:
      t, w, axes = key
      members = open_groups.get((w, axes))
      if members is not None and not dep.get(t, 0) & members:
        saved += critical[key]
        open_groups[(w, axes)] = members | bit[t]
      else:
        open_groups[(w, axes)] = bit[t]
    return saved

  def step_time(self, choice, keep=None, edge_time=None
                ) -> tuple[float, float]:
    """(compute s, communication s) of a plan: each distinct reshard once,
    the combined all-reduces' latency once per group. ``edge_time``: the
    per-edge time to charge instead of :meth:`edge_costs`'s."""
    ch = np.asarray(choice, dtype=np.int64)
    compute = float(self.compute_flat[self.node_off + ch].sum())
    keep = self.distinct_reshards(ch) if keep is None else keep
    t = self.edge_costs(ch) if edge_time is None else edge_time
    comm = float(t[keep].sum()) + self.combined_latency(ch, keep)
    comm += float(self.op_comm_flat[self.node_off + ch].sum())
    return compute, comm

  def evaluate(self, choice: Sequence[int], keep=None,
               edge_costs: tuple[np.ndarray, np.ndarray] | None = None
               ) -> PlanCost:
    """Time, bytes and peak memory of a plan. ``keep`` (the distinct
    reshards) and ``edge_costs`` (per-edge time and bytes) replace what
    the plan's own layouts give (``_propagate.evaluate``: the devices as
    one group)."""
    ch = np.asarray(choice, dtype=np.int64)
    keep = self.distinct_reshards(ch) if keep is None else keep
    t, b = edge_costs if edge_costs is not None else (
        None, self.edge_costs(ch, "bytes"))
    compute, comm = self.step_time(ch, keep, t)
    return PlanCost(time_s=compute + comm, compute_s=compute, comm_s=comm,
                    comm_bytes=float(b[keep].sum()) + float(
                        self.op_bytes_flat[self.node_off + ch].sum()),
                    memory_bytes=self.peak_memory(choice))

  def slot_codes(self, op: int, choice_k: int, slot: int) -> tuple[int, ...]:
    return self.cands[op][choice_k][slot]

  def find_candidate(self, op: int, codes: tuple[int, ...]) -> int | None:
    """The candidate of a source/sink op that gives its tensor ``codes``."""
    for k, c in enumerate(self.cands[op]):
      if c[0] == codes:
        return k
    return None
