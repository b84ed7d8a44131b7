"""The op graph the planner searches over: tensors, ops, and where each
jaxpr variable went (:mod:`autoddl_jax._graph` builds it)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from autoddl_jax._factors import Aval, Sig


@dataclasses.dataclass
class Tensor:
  id: int
  aval: Aval
  name: str
  producer: tuple[int, int] | None = None  # (op id, output slot)
  consumers: list[tuple[int, int]] = dataclasses.field(default_factory=list)

  @property
  def nbytes(self) -> int:
    return math.prod(self.aval.shape) * self.aval.dtype.itemsize


# The primitive of ``ad.pipeline``'s stage shift (``pipeline.stage_shift_p``):
# its op's ``fixed`` is ``(STAGE_SHIFT, ((mesh axis, dim), ...), shifted dim)``.
STAGE_SHIFT = "stage_shift"


@dataclasses.dataclass
class Op:
  id: int
  prim: str
  kind: str  # "eqn" | "input" | "output" | "const" | "link"
  ins: list[int | None]  # tensor ids; None for a literal operand
  in_avals: list[Aval]
  outs: list[int]
  sigs: list[Sig]  # 1-D signatures
  weight: float = 1.0  # executions per step (trip counts multiplied)
  in_weights: list[float] = dataclasses.field(default_factory=list)
  flops: float = 0.0
  name: str = ""
  leaf: int | None = None  # flat leaf index, for input/output ops
  key: Any = None  # same key = the same op of a repeated (unrolled) block
  # A layout the step itself demands of this op's result (a user's
  # ``with_sharding_constraint``): (PartitionSpec, mesh axis names). The
  # problem holds it fixed, so the reshard into it is planned and costed.
  # A pipeline's stage shift: (STAGE_SHIFT, ((mesh axis, dim), ...), the
  # shifted dim): those dims split over those axes, the other axes free.
  fixed: Any = None

  def __post_init__(self):
    if not self.in_weights:
      self.in_weights = [self.weight] * len(self.ins)


@dataclasses.dataclass
class OpGraph:
  tensors: list[Tensor]
  ops: list[Op]
  # (call context, jaxpr var) -> tensor id; a context is a tuple of eqn indices.
  var_tensor: dict[tuple[tuple, Any], int]
  input_ops: list[int]  # one per flat argument leaf
  output_ops: list[int]  # one per flat result leaf
  unsupported: dict[str, int]  # primitive -> number of fallback ops
  eqn_op: dict[tuple, int]  # call context + eqn index -> op id
  # call context + eqn index of a scan -> the link op each operand enters
  # the body through (the lowering stages the reshard into it)
  entry_links: dict[tuple, list[int]] = dataclasses.field(
      default_factory=dict)
  # ... and the link each of its stacked results (ys) leaves the body by
  # (the lowering stages the reshard into it inside the body)
  exit_links: dict[tuple, list[int]] = dataclasses.field(
      default_factory=dict)
  # call context + eqn index of a scan or while -> (the carry's tensor in
  # the body, the link op the final carry leaves by), per carry: the
  # lowering stages the reshard from the loop's layout to the result's
  result_links: dict[tuple, list[tuple[int, int]]] = dataclasses.field(
      default_factory=dict)
  # link op entering or leaving a scan's or while's body -> (first, last)
  # op id of the loop, links included: the loop's buffers (stacked xs and
  # ys, carries, consts) live for all of it (the memory model)
  loop_of_link: dict[int, tuple[int, int]] = dataclasses.field(
      default_factory=dict)
