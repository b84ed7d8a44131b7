"""The memory model: each device's peak bytes under a plan, as XLA allocates.

:class:`MemoryModel` is the part of :class:`~autoddl_jax._problem.Problem`
that prices memory: buffers' live ranges in program order as XLA's fusion
leaves them (an elementwise op read by one op is fused into it), the
buffers reshards make (a gather's result is new memory; a slice is not),
arguments and results (a result written over a donated argument of its
type and size costs nothing more), and the peak of what is live at once
(:meth:`MemoryModel.peak_memory`), by category
(:meth:`MemoryModel.memory_breakdown`) and by tensor
(:meth:`MemoryModel.largest_tensors`). It reads the problem's graph,
candidates and state spaces; it decides nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoddl_jax._cost import one_axis
from autoddl_jax._states import state_space
from autoddl_jax._rules import ELEMENTWISE_FLOP
from autoddl_jax._sbp import P_CODE

MEMORY_ALIAS_OPS = ("~link", "~merge", "~barrier")  # outputs alias inputs
# Ops XLA fuses into their consumer (loop fusion): a result of one read by a
# single op is computed inside that op's fusion, not kept (MemoryModel._liveness).
FUSED_OPS = frozenset(ELEMENTWISE_FLOP) | {
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
    "copy", "stop_gradient"}
# Collectives whose result is a new buffer in the consumer's layout
# (MemoryModel._reshard_buffers); an all-reduce runs in place.
NEW_BUFFER = ("all-gather", "all-to-all", "reduce-scatter")


class MemoryModel:
  """Peak memory of a plan (mixed into :class:`Problem`)."""

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
    return [tuple(v) for v in groups.values()] + self._combined_buffers(ch)

  def _combined_buffers(self, ch) -> list[tuple[float, int, int]]:
    """A gradient's reduce-scatter is combined with the others of its loop
    body (``Problem.combined``; the lowering writes it as a psum and a
    slice, which XLA merges into one all-reduce): each whole partial sum
    waits for that one collective, after the body's last gradient, not for
    its own. (bytes, from its reduction, to the group's last) per
    reduction; a reduction to replicated keeps the whole tensor anyway."""
    red = []
    for e in self.edges:
      if e.tensor not in self.combined or \
          self.graph.ops[e.cons].kind == "output":
        continue
      k = self.slot_idx[e.prod][e.prod_slot][ch[e.prod]]
      src = e.space.states[k]
      dst = e.space.states[self.slot_idx[e.cons][e.cons_slot][ch[e.cons]]]
      if any(a == P_CODE and b >= 0 for a, b in zip(src, dst)):
        at = int(self._read_at[e.cons][0])
        red.append((e.weight, e.tensor, float(e.space.local_bytes[k]), at))
    end: dict[float, int] = {}
    for w, _, _, at in red:
      end[w] = max(end.get(w, at), at)
    seen, out = set(), []
    for w, t, nb, at in red:
      if t not in seen and end[w] > at:
        seen.add(t)
        out.append((nb, at, end[w]))
    return out

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

  def peak_lower_bound(self) -> float:
    """Bytes under which no plan's :meth:`peak_memory` falls: the
    arguments, and the temporaries live at the program's busiest point,
    each at the fewest bytes any candidate of its producer gives it. (A
    temporary sits in the pool of temporaries or in a result's allocation
    no smaller than it, so what is live at one point never exceeds the
    pool's peak and the results together; reshards' buffers only add.)
    A variant whose bound is over the budget cannot fit it: the planner
    does not search it where another plan fits (``_planner``)."""
    if not self.graph.ops:
      return 0.0
    g = self.graph
    least = np.zeros(len(self._live))
    for i, (tid, p, slot, _, _) in enumerate(self._live):
      a = g.tensors[tid].aval
      sp = state_space(a.shape, a.dtype.itemsize, self.mi)
      least[i] = sp.local_bytes[self.slot_idx[p][slot]].min()
    delta = np.zeros(len(g.ops) + 1)
    for i in np.flatnonzero(self._live_kind == 2):
      delta[self._live[i][3]] += least[i]
      delta[self._live[i][4] + 1] -= least[i]
    return float(least[self._live_kind == 0].sum() +
                 np.cumsum(delta).max())

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
