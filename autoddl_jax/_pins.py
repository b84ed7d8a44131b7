"""The pins that make XLA run a plan as planned: built from a program and
a choice.

:func:`pins` gives :mod:`autoddl_jax._lower` what to pin where: each op's
result in the layout its candidate makes, each operand the plan reshards
staged along the cost model's path (:func:`_cost.transition_states`), the
layouts at a loop's entry, exit and stacked results, and the partial-sum
regions (:class:`_regions.Region`): the ops joined by tensors a consumer
takes as a partial sum, run on each device's blocks and reduced where the
plan reduces them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from jax.sharding import Mesh

from autoddl_jax import _lower, _regions
from autoddl_jax._cost import transition_states
from autoddl_jax._program import Program
from autoddl_jax._sbp import B_CODE as B, P_CODE as P


def pins(program: Program, choice: Sequence[int], mesh: Mesh,
         inputs_too: bool = True) -> _lower.Pins:
  """The pins of ``choice`` on ``program`` for ``mesh`` (Auto axes);
  ``inputs_too``: operands and loop boundaries too, not only op results."""
  return _Pinning(program, choice).pins(mesh, inputs_too)


def regions(program: Program, choice: Sequence[int]
            ) -> dict[tuple, _regions.Region]:
  """The partial-sum regions of ``choice``, by equation address."""
  return _Pinning(program, choice)._regions()  # noqa: SLF001


class _Pinning:
  """One program and choice; the methods build its pins and regions."""

  def __init__(self, program: Program, choice: Sequence[int]):
    self.graph, self.problem = program.graph, program.problem
    self.mesh_info = program.mesh_info
    self.choice = list(choice)

  def pins(self, mesh: Mesh, inputs_too: bool = True) -> _lower.Pins:
    g, prob = self.graph, self.problem
    produced: dict[int, tuple[int, ...]] = {}
    for op in g.ops:
      k = self.choice[op.id]
      for s, t in enumerate(op.outs):
        produced[t] = prob.cands[op.id][k][len(op.ins) + s]
    splits = lambda c: c is not None and all(x >= B for x in c)  # noqa: E731
    outputs, bodies = {}, {}
    for (ctx, var), t in g.var_tensor.items():
      codes = produced.get(t)
      if not splits(codes):
        continue
      prod = g.ops[g.tensors[t].producer[0]]
      if prod.kind == "eqn":
        outputs[(ctx, var)] = codes
      elif prod.kind == "link":
        # A link's tensor is a body's argument (pinned as the body starts)
        # or a loop's or branch's result (pinned as the loop returns: the
        # reshard the plan puts at a loop's exit has no other pin, and XLA
        # left alone moves it elsewhere, e.g. a scatter of the backward
        # loop's sharded carry and an all-reduce of the whole table).
        bodies[(ctx, var)] = codes
        outputs[(ctx, var)] = codes
    inputs = {}

    def staged(t, want):
      """The layouts to pin, in turn, to take tensor ``t`` to ``want``:
      every layout of the cost model's path, so that XLA takes the path the
      plan was costed by (a multi-axis reshard left to XLA is often
      replicate-then-slice; benchmarks/transitions.py); None if nothing."""
      have = produced.get(t)
      if want == have or not splits(want):
        return None
      if have is None:
        return (want,)
      aval = g.tensors[t].aval
      path = transition_states(have, want, g.tensors[t].nbytes,
                               tuple(aval.shape), self.mesh_info)
      return tuple(c for c in path if splits(c)) or (want,)

    # Operands entering a scan body: the reshard into the body's layout is
    # staged before the loop (else XLA makes it at the loop's boundary in
    # one go, often replicating the carry).
    for ctx, links in (g.entry_links.items() if inputs_too else ()):
      carry = 0
      for j, lid in enumerate(links):
        link = g.ops[lid]
        path = staged(link.ins[0], prob.cands[lid][self.choice[lid]][0])
        if path:
          inputs[(ctx, j)] = path
        if link.prim == "~merge":  # and the carry's way back, per iteration
          path = staged(link.ins[1], prob.cands[lid][self.choice[lid]][1])
          if path:
            inputs[(ctx, ("carry", carry))] = path
          carry += 1
    # A scan's stacked results: the reshard into the layout they are
    # stacked in is staged inside the body, per iteration, as costed (left
    # to XLA, it stacks them as made and reshards the whole stack after the
    # loop, on top of the per-iteration reshard another consumer needs).
    for ctx, links in (g.exit_links.items() if inputs_too else ()):
      for j, lid in enumerate(links):
        path = staged(g.ops[lid].ins[0], prob.cands[lid][self.choice[lid]][0])
        if path:
          inputs[(ctx, ("ys", j))] = path
    # A loop's carried results: the reshard from the layout the loop carries
    # them in to the layout the plan gives the result is staged at the
    # loop's exit (one constraint there is often replicate-then-slice:
    # "Involuntary full rematerialization" for a scanned GPT's activations).
    # The path starts at the carried layout itself: pinned as the loop
    # returns, it keeps XLA from carrying the value in the result's layout
    # instead (the Llama's Megatron backward loop carried its cotangent
    # split over the sequence, as the result leaves, and gathered it back
    # every iteration).
    for ctx, pairs in (g.result_links.items() if inputs_too else ()):
      for j, (carried, lid) in enumerate(pairs):
        path = staged(carried, prob.cands[lid][self.choice[lid]][0])
        if path:
          first = produced.get(carried)
          inputs[(ctx, ("out", j))] = ((first,) if splits(first) else ()) \
              + tuple(path)
    # The step's results: the reshard into the layout they leave the jit in
    # is staged inside it (left to the out_shardings it is one step, and
    # XLA may replicate the whole result to make it).
    for j, oid in enumerate(g.output_ops if inputs_too else ()):
      t = g.ops[oid].ins[0]
      path = staged(t, prob.cands[oid][self.choice[oid]][0]) \
          if t is not None else None
      if path:
        inputs[((), ("result", j))] = path
    for ctx, oid in (g.eqn_op.items() if inputs_too else ()):
      op = g.ops[oid]
      k = self.choice[oid]
      for s, t in enumerate(op.ins):
        if t is None:
          continue
        path = staged(t, prob.cands[oid][k][s])
        if path:
          inputs[(ctx, s)] = path
    return _lower.Pins(mesh, outputs, inputs, bodies,
                       self._regions() if inputs_too else {})

  def _regions(self) -> dict[tuple, _regions.Region]:
    """The partial-sum regions the lowering runs on local blocks
    (:class:`_regions.Region`): the ops joined by tensors a consumer takes as
    a partial sum, from the dots that make them to where the plan reduces
    them. Each result used outside goes to the layout most of its outside
    consumers want, by the cost model's path. A region the lowering cannot
    write (an op it cannot run on blocks, a partial sum entering from
    outside or crossing a loop boundary, a result used before the region's
    last op) is left to XLA, which then reduces at the op that made it."""
    g, prob, ch = self.graph, self.problem, self.choice
    key_of = {oid: key for key, oid in g.eqn_op.items()}

    def codes(oid, slot):
      return prob.cands[oid][ch[oid]][slot]

    parent: dict[int, int] = {}

    def find(x):
      while parent.setdefault(x, x) != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
      return x

    for op in g.ops:
      if op.kind != "eqn":
        continue
      n_in = len(op.ins)
      if any(P in codes(op.id, n_in + s) for s in range(len(op.outs))):
        find(op.id)
      for j, t in enumerate(op.ins):
        if t is None or P not in codes(op.id, j):
          continue
        prod, ps = g.tensors[t].producer
        # A whole value taken as a partial sum (one device's share) comes in
        # from outside: its producer need not run on blocks (the ViT's
        # class-token pad under Megatron).
        if P in codes(prod, len(g.ops[prod].ins) + ps):
          parent[find(op.id)] = find(prod)
    comps: dict[int, list[int]] = collections.defaultdict(list)
    for x in list(parent):
      comps[find(x)].append(x)
    regions: dict[tuple, _regions.Region] = {}
    for ids in comps.values():
      for region in self._chain(sorted(ids), key_of, codes) or ():
        regions.update({k: region for k in region.members})
    return regions

  def _inner_steps(self, have, want) -> tuple[_regions.Reduction, ...] | None:
    """The local steps that take a partial sum made inside a chain from
    ``have`` to the layout ``want`` of a consumer inside it: free slices
    (and shares: B -> P) of replicated axes first, then reductions of the
    partial axes it no longer keeps (``psum``, ``psum_scatter``), then
    moves of a split dim to another (``all_to_all``), then
    gathers of dims split on one axis alone (``all_gather``: the other
    axes may keep their partial sums), as the cost model's path takes
    them; None if it takes more (or a split of a dim that is split
    already: out of tile order)."""
    names = self.mesh_info.axis_names
    cut, red, swap, gather = [], [], [], []
    for a, (h, w) in enumerate(zip(have, want)):
      if h == w:
        continue
      if w >= 0 and w in have:
        return None
      if h == B and w >= 0:
        cut.append(("slice", (names[a],), w))
      elif h == B and w == P:
        cut.append(("own", (names[a],), None))
      elif h == P and w == B:
        red.append(("psum", (names[a],), None))
      elif h == P and w >= 0:
        red.append(("psum_scatter", (names[a],), w))
      elif h >= 0 and w == B and list(have).count(h) == 1:
        # a dim split on this axis alone, gathered while another axis keeps
        # the partial sum (the MoE's expert activations under FSDP)
        gather.append(("all_gather", (names[a],), h))
      elif h >= 0 and w >= 0 and list(have).count(h) == 1:
        # S(h) -> S(w) on this axis alone while another keeps the partial
        # sum: one all-to-all, as the model charges it (the MoE's Megatron
        # and the Llama's FSDP on (4, 2) moved these; left to XLA, the whole
        # chain was reduced where its dots made it)
        swap.append(("all_to_all", (names[a],), (h, w)))
      else:
        return None
    return (*cut, *red, *swap, *gather)

  def _chain(self, ids, key_of, codes) -> list[_regions.Region] | None:
    """A chain of partial-sum ops as regions in program order: a region
    ends before the op that would make one of its results wanted before the
    region's last op runs; partial sums a later region takes are handed to
    it stacked. None if the lowering cannot write the chain."""
    g, prob, ch = self.graph, self.problem, self.choice
    members = set(ids)
    ops = [g.ops[i] for i in ids]
    if any(o.kind != "eqn" or o.id not in key_of or not _regions.runs_local(
        o.prim, prob.cands[o.id][ch[o.id]]) for o in ops):
      return None
    if len({key_of[o.id][:-1] for o in ops}) != 1:
      return None  # members in different jaxprs
    for o in ops:  # partial sums come in only as a replicated value's share
      for j, t in enumerate(o.ins):
        if t is None:
          continue
        prod, ps = g.tensors[t].producer
        have = codes(prod, len(g.ops[prod].ins) + ps)
        if prod in members:
          if self._inner_steps(have, codes(o.id, j)) is None:
            return None
        elif any(w == P and h != B for h, w in zip(have, codes(o.id, j))):
          return None
      for t in o.outs:
        if any(P in codes(c, cs) for c, cs in g.tensors[t].consumers
               if c not in members):
          return None
    # Segments: extend while every result used outside the segment is used
    # after the segment's last op (a segment of one op always is).
    segments, cur = [], []
    for o in ids:
      seg = set(cur + [o])
      first = min((c for m in seg for t in g.ops[m].outs
                   for c, _ in g.tensors[t].consumers if c not in seg),
                  default=float("inf"))
      if cur and first < o:
        segments.append(cur)
        cur = [o]
      else:
        cur = cur + [o]
    segments.append(cur)
    regions = []
    for seg_ids in segments:
      r = self._segment(seg_ids, members, key_of, codes)
      if r is None:
        return None
      regions.append(r)
    return regions

  def _segment(self, ids, members, key_of, codes) -> _regions.Region | None:
    """One region of a chain (``members``): ``ids`` in program order, each
    result used outside them used after the last (:meth:`_chain` cuts the
    segments so)."""
    g = self.graph
    seg = set(ids)
    in_codes, stacked_in, slices = {}, {}, {}
    out_codes, reduce, stacked_out, gather_codes = {}, {}, {}, {}
    for oid in ids:
      o = g.ops[oid]
      key, n_in = key_of[oid], len(o.ins)
      if o.prim == "gather":
        gather_codes[key] = codes(oid, 0)
      for j, t in enumerate(o.ins):
        if t is None:
          continue
        prod, ps = g.tensors[t].producer
        want = codes(oid, j)
        have = codes(prod, len(g.ops[prod].ins) + ps)
        if prod not in seg and (prod not in members or P not in have):
          # A whole value (from outside, or handed on by an earlier region)
          # comes in; a partial want takes one device's share of it.
          whole = tuple(B if w == P else w for w in want)
          in_codes[(key, j)] = whole
          steps = self._inner_steps(whole, want)
          if steps:
            slices[(key, j)] = steps
          continue
        if prod not in seg:
          stacked_in[(key, j)] = have
        steps = self._inner_steps(have, want)
        if steps:
          slices[(key, j)] = steps
      for s, t in enumerate(o.outs):
        have = codes(oid, n_in + s)
        out_codes[(key, s)] = have
        consumers = g.tensors[t].consumers
        later = any(c in members and c not in seg for c, _ in consumers)
        outside = [(c, cs) for c, cs in consumers if c not in members]
        if P not in have:  # whole already: handed on as it is
          if later or outside:
            reduce[(key, s)] = ([], have)
          continue
        if later:
          stacked_out[(key, s)] = have
        if not outside:
          continue
        wants = [codes(c, cs) for c, cs in outside]
        target = collections.Counter(wants).most_common(1)[0][0]
        aval = g.tensors[t].aval
        r = _regions.reductions(have, target, g.tensors[t].nbytes,
                              tuple(aval.shape), self.mesh_info,
                              t in self.problem.combined)
        if r is None:
          return None
        reduce[(key, s)] = r
    if not reduce and not stacked_out:
      return None
    return _regions.Region(tuple(key_of[i] for i in ids), in_codes, out_codes,
                         reduce, stacked_in, slices, stacked_out,
                         gather_codes)
