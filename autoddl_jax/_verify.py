"""What the plan predicted against what XLA compiled (:meth:`Plan.verify`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

from autoddl_jax import _hlo
from autoddl_jax._collectives import KINDS
from autoddl_jax._cost import transition_steps
from autoddl_jax._program import shard_tree

if TYPE_CHECKING:  # for annotations only: _plan imports this module
  from autoddl_jax._plan import Plan

TOLERANCE = 0.10  # disagreements beyond this are flagged
# What XLA's SPMD partitioner logs when it cannot go from one sharding to
# another but by replicating the whole tensor and slicing it again: the
# program then holds a full copy the plan never made.
REMAT_WARNING = "Involuntary full rematerialization"


@contextlib.contextmanager
def compile_log() -> Iterator[list[str]]:
  """Captures what XLA writes to the process's stderr (file descriptor 2:
  XLA's C++ logging does not go through Python) while the block runs; the
  list it yields holds the text afterwards. The text is written on to the
  real stderr too, so a user still sees every warning. Not thread-safe:
  another thread's stderr output in the meantime is captured as well."""
  sys.stderr.flush()
  saved = os.dup(2)
  out: list[str] = []
  with tempfile.TemporaryFile() as f:
    os.dup2(f.fileno(), 2)
    try:
      yield out
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      data = f.read()
      if data:
        os.write(2, data)
      out.append(data.decode(errors="replace"))


@dataclasses.dataclass(frozen=True)
class Verification:
  """A plan's predictions next to its compiled program, per device per step.

  Bytes are ring-model bytes each device sends; ``by_kind`` maps a collective
  kind to (predicted bytes, emitted bytes). FLOPs and memory come from XLA's
  ``cost_analysis`` and ``memory_analysis`` of the compiled program; XLA
  counts a ``while`` body's FLOPs once, so they are compared with the plan's
  FLOPs counted the same way (``predicted_flops`` has every trip).
  """

  by_kind: dict[str, tuple[float, float]]
  predicted_bytes: float
  emitted_bytes: float
  predicted_comm_s: float
  emitted_comm_s: float  # emitted collectives on the cluster's alpha-beta links
  predicted_flops: float
  predicted_flops_loops_once: float  # loop bodies counted once, as XLA does
  xla_flops: float | None
  predicted_memory: float
  xla_memory: float | None
  collectives: list[_hlo.Collective]
  upcast_bf16: bool  # some f32 collectives stand for bf16 values (CPU)

  @property
  def bytes_ratio(self) -> float:
    """Predicted / emitted collective bytes (1.0 when both are zero)."""
    if self.emitted_bytes == 0:
      return 1.0 if self.predicted_bytes == 0 else math.inf
    return self.predicted_bytes / self.emitted_bytes

  def disagreements(self) -> list[str]:
    """The quantities off by more than :data:`TOLERANCE`."""
    out = []
    for name, p, e in self._rows():
      if e is not None and not _close(p, e):
        out.append(name)
    return out

  def _rows(self):
    rows = [(f"{k} bytes", p, e) for k, (p, e) in self.by_kind.items()]
    rows += [("collective bytes", self.predicted_bytes, self.emitted_bytes),
             ("collective time s", self.predicted_comm_s, self.emitted_comm_s),
             ("FLOPs, loops once", self.predicted_flops_loops_once,
              self.xla_flops),
             ("peak memory bytes", self.predicted_memory, self.xla_memory)]
    return rows

  def __str__(self) -> str:
    lines = [f"{'per device per step':<22} {'predicted':>12} {'XLA':>12} "
             f"{'pred/XLA':>9}"]
    for name, p, e in self._rows():
      ratio = "" if e in (None, 0) else f"{p / e:9.3f}"
      flag = "" if e is None or _close(p, e) else "  <-- off by >10%"
      lines.append(f"{name:<22} {p:12.4g} "
                   f"{'n/a' if e is None else format(e, '12.4g'):>12} "
                   f"{ratio:>9}{flag}")
    if self.upcast_bf16:
      lines.append("note: XLA on CPU moves bf16 values as f32; their bytes "
                   "are counted at bf16")
    return "\n".join(lines)


def _close(p: float, e: float) -> bool:
  if p == e:
    return True
  return abs(p - e) <= TOLERANCE * max(abs(p), abs(e))


def predicted_by_kind(plan: Plan) -> dict[str, float]:
  """Predicted bytes per device per step, by collective kind."""
  prob = plan.problem
  out: dict[str, float] = collections.defaultdict(float)
  for i in prob.distinct_reshards(plan.choice):
    e = prob.edges[i]
    kp, kc = plan.choice[e.prod], plan.choice[e.cons]
    if prob.edge_pair(e, kp, kc, "bytes") <= 0:
      continue
    src = prob.cands[e.prod][kp][e.prod_slot]
    dst = prob.cands[e.cons][kc][e.cons_slot]
    for kind, _, b in transition_steps(src, dst, e.space.nbytes,
                                       e.space.shape, plan.mesh_info):
      out[kind] += e.weight * b
  # Collectives ops run themselves: a pipeline's stage shifts, loop
  # carries held as partial sums.
  for o, kind in enumerate(prob.op_kind):
    if kind is not None:
      sent = float(prob.op_bytes[o][plan.choice[o]])
      if sent:
        out[kind] += sent
  return dict(out)


def _first(analysis: Any) -> Any:
  if isinstance(analysis, (list, tuple)):
    return analysis[0] if analysis else None
  return analysis


def peak_bytes(mem: Any) -> float:
  """Peak device memory of a compiled program from its memory analysis:
  arguments + results + temporaries - what results alias (donated inputs).

  ``peak_memory_in_bytes`` is not used: on the CPU backend (jax 0.10) it is
  arguments + results only and leaves out every temporary -- measured, a
  sharded ViT-B train step reads 1.9 GiB there against 16.3 GiB in all
  (``tests/test_verify.py``). ``temp_size_in_bytes`` is already the buffer
  assignment's peak of temporaries (buffers reused over their live ranges),
  so the sum is the program's footprint, not a sum of every intermediate.
  """
  return float(mem.argument_size_in_bytes + mem.output_size_in_bytes +
               mem.temp_size_in_bytes - mem.alias_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class CompiledScore:
  """A compiled program scored on a cluster, per device per step: its FLOPs
  (every loop trip) at the sustained rate plus its emitted collectives on
  the alpha-beta links of the groups they span, and its peak memory by
  ``memory_analysis``. This is what plan selection compares."""

  time_s: float
  compute_s: float
  comm_s: float
  comm_bytes: float
  flops: float
  memory_bytes: float | None
  # "Involuntary full rematerialization" lines in the compile log (None: the
  # log was not read)
  remat_warnings: int | None = None

  @classmethod
  def of(cls, compiled: Any, mesh: Any, mi: Any, cluster: Any,
         log: str | None = None) -> CompiledScore:
    cols = _hlo.collectives(compiled, mesh)
    cost = _first(compiled.cost_analysis())
    flops = float(cost.get("flops", 0.0)) if cost else 0.0
    flops += _hlo.loop_flops(compiled.as_text())
    mem = compiled.memory_analysis()
    compute = flops / (cluster.peak_flops * cluster.flops_efficiency)
    comm = _hlo.emitted_seconds(cols, mi)
    return cls(time_s=compute + comm, compute_s=compute, comm_s=comm,
               comm_bytes=sum(c.total_bytes_per_device for c in cols),
               flops=flops,
               memory_bytes=None if mem is None else peak_bytes(mem),
               remat_warnings=None if log is None else
               log.count(REMAT_WARNING))


def compile_plan(plan: Plan, pin_inputs: bool = True,
                 compiler_options: dict[str, Any] | None = None
                 ) -> tuple[Any, Any]:
  """(compiled program, its Auto-axes mesh) of ``plan.jit()`` for abstract
  arguments placed as the plan says (nothing allocated)."""
  mesh = plan.program.auto_mesh()
  tr = plan.traced
  in_sh = shard_tree(plan.in_specs, mesh)
  flat_sh = jax.tree_util.tree_leaves(
      in_sh, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
          for a, s in zip(tr.in_avals, flat_sh)]
  args = jax.tree_util.tree_unflatten(tr.in_tree, args)
  lowered = plan.jit(pin_inputs=pin_inputs).lower(*args)
  return lowered.compile(compiler_options), mesh


def verify(plan: Plan, pin_inputs: bool = True) -> Verification:
  return compare_compiled(plan, *compile_plan(plan, pin_inputs))


def compare_compiled(plan: Plan, compiled: Any, mesh: Any) -> Verification:
  """:meth:`Plan.verify` for a program already compiled from the plan."""
  cols = _hlo.collectives(compiled, mesh)
  pred = predicted_by_kind(plan)
  emitted: dict[str, float] = collections.defaultdict(float)
  for c in cols:
    emitted[c.kind] += c.total_bytes_per_device
  by_kind = {k: (pred.get(k, 0.0), emitted.get(k, 0.0)) for k in KINDS
             if pred.get(k) or emitted.get(k)}
  cost = _first(compiled.cost_analysis())
  flops = None if not cost or "flops" not in cost else float(cost["flops"])
  mem = compiled.memory_analysis()
  xla_mem = None if mem is None else peak_bytes(mem)
  cl = plan.cluster
  rate = cl.peak_flops * cl.flops_efficiency
  prob = plan.problem
  once = sum(float(prob.compute[o.id][plan.choice[o.id]]) / o.weight
             for o in plan.graph.ops if o.weight > 0) * rate
  return Verification(
      by_kind=by_kind,
      predicted_bytes=plan.cost.comm_bytes,
      emitted_bytes=sum(c.total_bytes_per_device for c in cols),
      predicted_comm_s=plan.cost.comm_s,
      emitted_comm_s=_hlo.emitted_seconds(cols, plan.mesh_info),
      predicted_flops=plan.cost.compute_s * rate,
      predicted_flops_loops_once=once,
      xla_flops=flops,
      predicted_memory=plan.cost.memory_bytes,
      xla_memory=xla_mem,
      collectives=cols,
      upcast_bf16=any(c.upcast for c in cols))
