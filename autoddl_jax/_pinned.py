"""Dims a pipeline schedule pins to mesh axes, followed through the graph.

A pipelined :func:`autoddl_jax.pipeline.scan` splits its stage dim over the
stage axis: its stage shifts hold that placement fixed
(:func:`autoddl_jax._op_demands.fixed_codes`). Every
value the stages compute carries the same dim -- the activations, the
stacked per-layer residuals, the stage weights and their gradients, the
optimizer state of the stacked layers -- and a plan that laid it out any
other way on that axis would run every stage on every device of the axis or
gather a whole stage's weights. So the axis has one sensible value for such
a tensor, and the candidates that give it another are dropped
(:class:`~autoddl_jax._problem.Problem`): on the 175B GPT's 3-axis mesh a
stage op had up to 252 candidates, of which the stage axis allowed one in
six or fewer. (The replica axes a stage shift also fixes stay free.)

:func:`pinned_dims` follows the pins from the stage shifts through the
ops' 1-D signatures: where every signature that keeps an op's pinned slots
on their dims gives another slot one and the same split, that slot's tensor
is pinned too. A slot that may be replicated, partial or split on several
dims stays free, and an op whose signatures cannot keep its pins keeps all
its candidates (the reshard into it is then planned and costed as any
other). Chains that only lead to where the dim ends (a sum over the
stages) are freed again: the plan may move the axis before the end.
"""

from __future__ import annotations

from collections import deque

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._opgraph import STAGE_SHIFT, OpGraph


def pinned_dims(graph: OpGraph, mi: MeshInfo) -> dict[int, dict[int, int]]:
  """{tensor id: {mesh axis index: the dim it must split}}."""
  pins: dict[int, dict[int, int]] = {}
  queue: deque[int] = deque()

  def pin(t: int, axis: int, dim: int) -> None:
    shape = graph.tensors[t].aval.shape
    if axis in pins.get(t, {}) or mi.axis_sizes[axis] == 1 or \
        shape[dim] % mi.axis_sizes[axis]:
      return
    pins.setdefault(t, {})[axis] = dim
    prod = graph.tensors[t].producer
    if prod is not None:
      queue.append(prod[0])
    queue.extend(c for c, _ in graph.tensors[t].consumers)

  for op in graph.ops:
    if op.prim == STAGE_SHIFT and op.fixed is not None:
      # The stage axis only: a replica dim pinned over its axes too kept
      # the 175B's summed stage gradients from the cheaper layouts the
      # search finds for them (its budgeted plan 0.45% slower).
      for name, dim in op.fixed[1][:1]:
        if name in mi.axis_names:
          for t in (*op.ins, *op.outs):
            if t is not None:
              pin(t, mi.axis_names.index(name), dim)
  while queue:
    op = graph.ops[queue.popleft()]
    slots = [*op.ins, *op.outs]
    full = [si + so for si, so in op.sigs]
    axes = {a for t in slots if t is not None for a in pins.get(t, {})}
    for a in sorted(axes):
      held = [(s, pins[t][a]) for s, t in enumerate(slots)
              if t is not None and a in pins.get(t, {})]
      keep = [sig for sig in full if all(sig[s] == d for s, d in held)]
      if not keep:
        continue  # the op cannot keep its pins: left free
      for s, t in enumerate(slots):
        if t is None or a in pins.get(t, {}):
          continue
        codes = {sig[s] for sig in keep}
        if len(codes) == 1 and (d := codes.pop()) >= 0:
          pin(t, a, d)
  _release_ends(graph, pins)
  return pins


def _release_ends(graph: OpGraph, pins: dict[int, dict[int, int]]) -> None:
  """Frees the chains that only lead to where a pinned dim ends: a tensor
  every consumer of which keeps none of its results on the axis (a sum
  over the stage dim -- the last stage's output taken out of the loop, a
  microbatch's cotangent -- or an op that could not keep its pins). The
  plan may move the axis to another dim before the end (an all-to-all
  where a partial sum would be reduced on every tick)."""
  def ends(op, a: int) -> bool:
    return op.kind != "output" and op.prim != STAGE_SHIFT and bool(
        op.outs) and not any(a in pins.get(t, {}) for t in op.outs)

  queue = deque((t, a) for t, ps in pins.items() for a in ps)
  while queue:
    t, a = queue.popleft()
    if a not in pins.get(t, {}):
      continue
    users = graph.tensors[t].consumers
    if users and all(ends(graph.ops[c], a) for c, _ in users):
      del pins[t][a]
      prod = graph.tensors[t].producer
      if prod is not None:  # its inputs may now lead only to ends
        queue.extend((x, a) for x in graph.ops[prod[0]].ins
                     if x is not None)
  for t in [t for t, ps in pins.items() if not ps]:
    del pins[t]


def slot_pins(op, pins: dict[int, dict[int, int]]
              ) -> tuple[tuple[tuple[int, int], ...], ...]:
  """Per slot of ``op`` (inputs, then outputs): its ((axis, dim), ...)."""
  return tuple(tuple(sorted(pins.get(t, {}).items())) if t is not None
               else () for t in (*op.ins, *op.outs))
