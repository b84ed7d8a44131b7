"""The search problem: candidates per op, edge costs, and plan evaluation.

Every op of the :class:`~autoddl_jax._graph.OpGraph` gets its n-D candidates:
the product of its 1-D signatures over the mesh axes, keeping only those whose
splits divide the dims they split. A candidate fixes the nd-SBP of each of the
op's slots (inputs, then outputs). Each slot's nd-SBP is stored as an index into
its tensor's :class:`~autoddl_jax._cost.StateSpace`, so the cost of an edge
(producer slot -> consumer slot) for any pair of candidates is a lookup in one
shared transition matrix.

A *coordinate* is a group of ops that take one decision together: a parameter's
input op, the output op of its update, and its optimizer moments; every other op
is its own coordinate.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from autoddl_jax._cluster import Cluster, MeshInfo
from autoddl_jax._cost import (StateSpace, one_axis, state_space,
                               transition_steps)
from autoddl_jax._graph import ELEMENTWISE_FLOP, OpGraph
from autoddl_jax._sbp import B_CODE as B, P_CODE, spec_to_codes

MEMORY_ALIAS_OPS = ("~link", "~merge", "~barrier")  # outputs alias inputs
# Ops XLA fuses into their consumer (loop fusion): a result of one read by a
# single op is computed inside that op's fusion, not kept (Problem._liveness).
FUSED_OPS = frozenset(ELEMENTWISE_FLOP) | {
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
    "copy", "stop_gradient"}
# Collectives whose result is a new buffer in the consumer's layout
# (Problem._reshard_buffers); an all-reduce runs in place.
NEW_BUFFER = ("all-gather", "all-to-all", "reduce-scatter")


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
class Evaluation:
  time_s: float
  compute_s: float
  comm_s: float
  comm_bytes: float
  memory_bytes: float


def _fixed_codes(op, slots, mi: MeshInfo) -> tuple[int, ...] | None:
  """The nd codes an op's results must have (a user's sharding constraint
  on the plan's mesh), or None. A constraint on another mesh, or one the
  mesh cannot lay out, is left to the plan (and to XLA at run time)."""
  if op.fixed is None:
    return None
  spec, axes = op.fixed
  if tuple(axes) != mi.axis_names:
    return None
  try:
    return spec_to_codes(spec, len(slots[-1].shape), mi.axis_names)
  except ValueError:
    return None


# Ops a tensor's value must reach for its all-reduce to be on the step's
# critical path: the next layer's compute. Gradients of weights reach none
# (only the optimizer's update), and XLA's AllReduceCombiner merges their
# independent all-reduces: measured on the zoo (jax 0.10, CPU), DP's
# gradient all-reduces become one per loop body and one outside, while
# all-gathers and reduce-scatters stay one per tensor.
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


class Problem:
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
    self.out_bytes: list[np.ndarray] = []
    # Ops of the same structure (signatures, slot shapes and dtypes, which
    # inputs are literals) have the same candidates; a transformer repeats a
    # few structures many times, so each is enumerated once.
    structures: dict = {}
    for op in graph.ops:
      slots = [graph.tensors[t].aval if t is not None else a
               for t, a in zip(op.ins, op.in_avals)]
      slots += [graph.tensors[t].aval for t in op.outs]
      literal = tuple([t is None for t in op.ins] + [False] * len(op.outs))
      fixed = _fixed_codes(op, slots, mi)
      key = (tuple(op.sigs), literal,
             tuple((tuple(a.shape), a.dtype.itemsize) for a in slots),
             len(op.ins), op.prim in MEMORY_ALIAS_OPS, fixed)
      if key not in structures:
        structures[key] = self._candidates(op, slots, literal, mi, fixed)
      cands, slot_idx, spl, ob = structures[key]
      self.cands.append(cands)
      self.slot_idx.append(slot_idx)
      self.compute.append(op.flops * op.weight / rate / spl)
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
    self._set_groups(groups)
    self._liveness()
    self._flatten()

  @staticmethod
  def _candidates(op, slots, literal, mi: MeshInfo, fixed=None):
    """(candidates, slot state indices, split factor, output bytes) of an op:
    the product of its 1-D signatures over the mesh axes, keeping those whose
    every slot's nd-SBP is a valid state (splits divide) and whose literal
    inputs stay broadcast; with ``fixed`` (nd codes), only those whose
    results have that layout."""
    spaces = [state_space(a.shape, a.dtype.itemsize, mi) for a in slots]
    all_b = next((i for i, (si, so) in enumerate(op.sigs)
                  if all(c == B for c in (*si, *so))), 0)
    per_axis = [range(len(op.sigs)) if s > 1 else [all_b]
                for s in mi.axis_sizes]
    full = [si + so for si, so in op.sigs]
    seen = {}
    for combo in itertools.product(*per_axis):
      nd = []
      for s in range(len(slots)):
        codes = tuple(full[k][s] for k in combo)
        if codes not in spaces[s].index or (
            literal[s] and any(c != B for c in codes)):
          break
        nd.append(codes)
      else:
        seen.setdefault(tuple(nd), None)
    cands = list(seen)
    if fixed is not None:
      cands = [c for c in cands if all(c[s] == fixed for s in range(
          len(op.ins), len(slots)))] or cands
    if not cands:  # cannot happen with an all-B signature; be safe
      cands = [tuple(tuple(B for _ in range(mi.ndim)) for _ in slots)]
    slot_idx = [np.array([spaces[s].index[c[s]] for c in cands],
                         dtype=np.int32) for s in range(len(slots))]
    # The devices that share the work: the axes some slot is split over.
    split = (np.array(cands, dtype=np.int64) >= 0).any(axis=1)
    spl = np.where(split, np.array(mi.axis_sizes, dtype=np.float64),
                   1.0).prod(axis=1)
    ob = np.zeros(len(cands))
    if op.prim not in MEMORY_ALIAS_OPS:
      for s in range(len(op.ins), len(slots)):
        ob = ob + spaces[s].local_bytes[slot_idx[s]]
    return cands, slot_idx, spl, ob

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
    spaces: dict[int, int] = {}
    t_flat, b_flat, t_off, t_n = [], [], [], []
    pos = 0
    e_space = []
    for e in self.edges:
      sid = spaces.get(id(e.space))
      if sid is None:
        sid = spaces[id(e.space)] = len(t_off)
        t_flat.append(e.space.time.ravel())
        b_flat.append(e.space.bytes.ravel())
        t_off.append(pos)
        t_n.append(len(e.space.states))
        pos += e.space.time.size
      e_space.append(sid)
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
    self.out_bytes_flat = np.concatenate(self.out_bytes)

  def edge_costs(self, choice, what: str = "time") -> np.ndarray:
    """Per-edge cost of a whole plan (vectorized)."""
    choice = np.asarray(choice, dtype=np.int64)
    sp = self.cand_state[self.e_poff + choice[self.e_prod]]
    sc = self.cand_state[self.e_coff + choice[self.e_cons]]
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
    """The latency XLA's AllReduceCombiner leaves, as a correction to the
    edges' own: the combined all-reduces (see :func:`combined_tensors`,
    costed without latency) pay it once per loop body (trip count) and group
    of mesh axes; all-reduces on the critical path (costed with theirs) that
    do not depend on each other -- a BatchNorm's mean and mean of squares,
    the statistics of parallel branches -- are merged too, so each one that
    joins an earlier one gives its latency back."""
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
        if kind == "all-reduce":
          axes = axes if isinstance(axes, tuple) else (axes,)
          p = int(np.prod([mi.axis_sizes[a] for a in axes]))
          t = 2 * (p - 1) * max(mi.alpha[a] for a in axes) * e.weight
          if e.tensor in self.combined:
            groups[(e.weight, axes)] = t
          else:
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
    return compute, comm

  def evaluate(self, choice: Sequence[int], keep=None,
               edge_costs: tuple[np.ndarray, np.ndarray] | None = None
               ) -> Evaluation:
    """Time, bytes and peak memory of a plan. ``keep`` (the distinct
    reshards) and ``edge_costs`` (per-edge time and bytes) replace what
    the plan's own layouts give (``_propagate.evaluate``: the devices as
    one group)."""
    ch = np.asarray(choice, dtype=np.int64)
    keep = self.distinct_reshards(ch) if keep is None else keep
    t, b = edge_costs if edge_costs is not None else (
        None, self.edge_costs(ch, "bytes"))
    compute, comm = self.step_time(ch, keep, t)
    return Evaluation(compute + comm, compute, comm, float(b[keep].sum()),
                      self.peak_memory(choice))

  def _liveness(self):
    """Each buffer's live range in program order, as XLA's fusion leaves
    it. An elementwise op (or a convert, broadcast, reshape) whose result
    one op reads is fused into that op: its result is no buffer of its own
    (a dot reads it from memory, so it is one just there), and its inputs
    live to where it is computed. A result several ops read is computed
    once and kept from its producer to its last reader. Loops read what
    enters them for all their trips and write their stacked results (ys)
    from their first. Measured on the zoo's 144 realistic plans (with
    :meth:`_allocations` and :meth:`_reshard_buffers`, against
    ``memory_analysis`` of the programs benchmarks/fidelity.py compiles):
    within 30% on 142 with this rule, on 115 counting every op's result a
    buffer, on 123 letting several readers each recompute a cheap result
    and keeping only transcendental ones (XLA may duplicate a cheap
    producer; on the ResNet it keeps BatchNorm's x - mean for the backward
    pass instead)."""
    g = self.graph
    n = len(g.ops)
    self._live = []  # (tensor, producer op, slot, start, end)
    live = [op.kind != "eqn" for op in g.ops]  # ops whose work is used
    for op in reversed(g.ops):
      if not live[op.id]:
        live[op.id] = any(live[c] for t in op.outs
                          for c, _ in g.tensors[t].consumers)

    def fusible(o):
      return g.ops[o].kind == "eqn" and g.ops[o].prim in FUSED_OPS

    def pos(c):
      if g.ops[c].kind == "output":
        return n - 1
      # a loop reads what enters its body for as long as it runs
      return g.loop_of_link.get(c, (c, c))[1]

    # demand[t]: the point t's inputs must be live to: where t is computed,
    # which for a fused t is where its one consumer is; filled consumers
    # first (reverse program order).
    demand: dict[int, int] = {}

    def computed_at(c):  # where a fused op's result is computed, last
      return max((demand.get(u, c) for u in g.ops[c].outs), default=c)

    entries, kinds = [], []  # kinds: 0 argument, 1 result, 2 temporary
    for op in reversed(g.ops):
      for ps, tid in enumerate(op.outs):
        t = g.tensors[tid]
        p = op.id
        users = [c for c, _ in t.consumers if live[c]]
        if (fusible(p) and len(users) == 1
            and g.ops[users[0]].kind != "output"):
          c = users[0]
          if fusible(c):  # recomputed inside its consumer's fusion
            demand[tid] = computed_at(c)
            span = None
          else:  # made where its consumer reads it
            demand[tid] = c
            span = (c, pos(c))
        else:
          demand[tid] = p
          # a loop writes its stacked results (ys) as it runs
          first = g.loop_of_link.get(p, (p, p))[0] if op.prim == "~scan_ys" \
              else p
          ends = [computed_at(c) if fusible(c) else pos(c) for c in users]
          span = (first, max([p, *ends]))
        if (span is None or op.prim in MEMORY_ALIAS_OPS
            or op.kind == "const" or not live[p]):
          continue  # no buffer; an alias; dead code (XLA removes it)
        if op.kind == "input":
          span = (0, n - 1)
        result = any(g.ops[c].kind == "output" for c, _ in t.consumers)
        entries.append((tid, p, len(op.ins) + ps, *span))
        kinds.append(0 if op.kind == "input" else 1 if result else 2)
    self._live = entries[::-1]
    self._live_kind = np.array(kinds[::-1], dtype=np.int8)
    # (first, last) point each op reads its operands at: a fused op where
    # its result is (re)computed last; a loop's entry for all the loop.
    self._read_at = np.array(
        [(computed_at(o.id),) * 2 if fusible(o.id) else (o.id, pos(o.id))
         for o in g.ops], dtype=np.int64)

  def _reshard_buffers(self, choice) -> list[tuple[float, int, int]]:
    """(bytes per device, first use, last use) of each reshard's result:
    a gather or an all-to-all makes a new buffer in the consumer's layout,
    shared by the consumers that want that layout (XLA reuses the
    collective's result) and live from the first such use to the last --
    an FSDP weight gathered for the forward pass and kept for the backward
    one. Reductions run in place and a slice fuses into its consumer;
    neither makes one. A result the step returns is counted in its own
    layout (:meth:`_liveness`)."""
    ch = np.asarray(choice, dtype=np.int64)
    groups: dict[tuple, list] = {}
    for e in self.edges:
      if self.graph.ops[e.cons].kind == "output":
        continue
      src = self.slot_idx[e.prod][e.prod_slot][ch[e.prod]]
      dst = self.slot_idx[e.cons][e.cons_slot][ch[e.cons]]
      if src == dst:
        continue
      a, b = e.space.states[src], e.space.states[dst]
      if not any(one_axis(x, y, 1.0, size, 0.0, 1.0)[2] in NEW_BUFFER
                 for x, y, size in zip(a, b, self.mi.axis_sizes)):
        continue
      first, last = (int(x) for x in self._read_at[e.cons])
      g = groups.setdefault((e.tensor, int(dst)), [
          float(e.space.local_bytes[dst]), first, last])
      g[1], g[2] = min(g[1], first), max(g[2], last)
    return [tuple(v) for v in groups.values()]

  def _live_bytes(self, choice: Sequence[int]) -> np.ndarray:
    """Bytes per device of each live-range entry (``self._live``) under
    ``choice``."""
    g = self.graph
    out = np.zeros(len(self._live))
    for i, (tid, p, slot, _, _) in enumerate(self._live):
      a = g.tensors[tid].aval
      sp = state_space(a.shape, a.dtype.itemsize, self.mi)
      out[i] = sp.local_bytes[self.slot_idx[p][slot][choice[p]]]
    return out

  def _allocations(self, choice) -> tuple[float, float, np.ndarray]:
    """(arguments, results, temporaries' curve) as XLA's buffer assignment
    makes allocations of the buffers (``memory_analysis`` = arguments +
    results + temporaries, less donated aliases): every argument and every
    result gets its own allocation for the whole step, except a result
    written into a donated argument of its type and size (:attr:`donated`,
    matched in order, as jax pairs them); a temporary lives in a result's
    allocation when it fits
    there and dies before the result is made (the largest first, each into
    the smallest such allocation, one at a time), else in the pool of
    temporaries, whose size is the peak of what is live in it at once.
    Measured on the zoo's realistic Llama (the search's plan, (8,)): its
    forward scan's stacked (8,2,1024,5632) residuals share the 352 MiB
    allocations of the stacked MLP weights' updates; counting every
    temporary in the pool over-predicts XLA's 13.5 GiB by 4.5 GiB."""
    n = len(self.graph.ops)
    b = self._live_bytes(choice)
    kind = self._live_kind
    live = self._live
    args = float(b[kind == 0].sum())
    free: dict[tuple, int] = {}  # donated buffers by (type, bytes per device)
    for i in np.flatnonzero(kind == 0):
      if live[i][1] in self.donated:
        key = self._buffer_type(live[i][0], b[i])
        free[key] = free.get(key, 0) + 1
    results = []
    for i in np.flatnonzero(kind == 1):
      key = self._buffer_type(live[i][0], b[i]) if free else None
      if free.get(key):
        free[key] -= 1  # aliases a donated argument
      else:
        results.append((b[i], live[i][3]))
    results.sort()
    sizes = np.array([r[0] for r in results])
    busy: list[list[tuple[int, int]]] = [[] for _ in results]
    delta = np.zeros(n + 1)
    temps = [(b[i], live[i][3], live[i][4]) for i in np.flatnonzero(kind == 2)]
    temps += self._reshard_buffers(choice)
    temps.sort(key=lambda x: -x[0])
    for nb, s, e in temps:
      home = None
      for a in range(int(np.searchsorted(sizes, nb)), len(results)):
        if e < results[a][1] and all(e < s2 or e2 < s
                                     for s2, e2 in busy[a]):
          home = a
          break
      if home is None:
        delta[s] += nb
        delta[e + 1] -= nb
      else:
        busy[home].append((s, e))
    return args, float(sizes.sum()), np.cumsum(delta)

  def _buffer_type(self, tid: int, nbytes: float) -> tuple:
    a = self.graph.tensors[tid].aval
    return tuple(a.shape), str(a.dtype), float(nbytes)

  def peak_memory(self, choice: Sequence[int]) -> float:
    if not self.graph.ops:
      return 0.0
    args, results, temps = self._allocations(choice)
    return args + results + float(temps.max())

  def memory_breakdown(self, choice: Sequence[int]) -> dict[str, float]:
    """Bytes per device by allocation (:meth:`_allocations`): ``arguments``
    (the step's inputs: parameters, optimizer state, batch), ``results``
    (what the step returns: the new state) and ``intermediates``
    (activations, gradients and temporaries at their peak, less those
    that live in a result's allocation before the result is made)."""
    cats = ("arguments", "results", "intermediates")
    if not self.graph.ops:
      return dict.fromkeys(cats, 0.0)
    args, results, temps = self._allocations(choice)
    return dict(zip(cats, (args, results, float(temps.max()))))

  def largest_tensors(self, choice: Sequence[int], k: int = 5):
    g = self.graph
    out = [(float(b), g.tensors[tid].name, g.tensors[tid].aval.shape)
           for (tid, _, _, _, _), b in zip(self._live,
                                           self._live_bytes(choice))]
    out.sort(key=lambda x: -x[0])
    return out[:k]

  def slot_codes(self, op: int, choice_k: int, slot: int) -> tuple[int, ...]:
    return self.cands[op][choice_k][slot]

  def find_candidate(self, op: int, codes: tuple[int, ...]) -> int | None:
    """The candidate of a source/sink op that gives its tensor ``codes``."""
    for k, c in enumerate(self.cands[op]):
      if c[0] == codes:
        return k
    return None
