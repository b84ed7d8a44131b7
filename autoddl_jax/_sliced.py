"""Which results of a CPU all-reduce each device only slices: XLA:CPU writes
a reduce-scatter as an all-reduce whose every reader keeps the device's part
(a dynamic-slice indexed by the partition id), and its combiner merges such
all-reduces with plain ones into one tuple. :func:`sliced_elements` reads
each element of one by what its readers keep (:mod:`autoddl_jax._hlo`
counts it as the reduce-scatter a GPU emits). What is kept must be the value
itself, cut to its 1/group-size part: XLA fuses the reduced value with
other operands, and a fusion may slice one of *those* by the device's index
(a moment split over another axis) while it reads the reduced value whole."""

from __future__ import annotations

import dataclasses
import math
import re

_GTE_INDEX = re.compile(r"get-tuple-element\(%[^\s,)]+\), index=(\d+)")


@dataclasses.dataclass(frozen=True)
class Program:
  """What the reading needs of a parsed HLO module."""

  comps: dict[str, list[tuple[str, str, str]]]  # {computation: instrs}
  users: dict[str, list[str]]
  ops: dict[str, str]
  types: dict[str, str]
  carried: dict[str, str]  # see loop_carried


def sliced_elements(name: str, n: int, group_size: int,
                    prog: Program) -> list[bool]:
  """Per result element of an all-reduce over groups of ``group_size``,
  whether every user keeps only the device's slice of it -- a
  ``1/group_size`` part, indexed by the partition id (a tuple's elements are
  read through their get-tuple-elements; any other user of the tuple reads
  it whole)."""
  if n == 1:
    return [_only_sliced(name, group_size, prog)]
  readers: dict[int, list[str]] = {}
  for u in prog.users.get(name, []):
    m = _GTE_INDEX.match(prog.ops.get(u, ""))
    if m is None:
      return [False] * n
    readers.setdefault(int(m.group(1)), []).append(u)
  return [bool(readers.get(i)) and
          all(_only_sliced(u, group_size, prog) for u in readers[i])
          for i in range(n)]


_PASS_THROUGH = ("get-tuple-element", "bitcast", "copy", "reshape")


def _only_sliced(name: str, group_size: int, prog: Program) -> bool:
  """Whether every user of ``name`` keeps only the device's
  ``1/group_size`` slice of it, indexed by the partition id."""
  us = prog.users.get(name, [])
  if not us:
    return False
  whole = _elements(prog.types.get(name, ""))
  for u in us:
    op = prog.ops.get(u, "")
    if op.startswith("dynamic-slice("):
      if _is_part(u, name, whole, group_size, prog):
        continue
      return False
    if op.split("(", 1)[0] in _PASS_THROUGH:  # look through to their users
      if _only_sliced(u, group_size, prog):
        continue
      return False
    # A fusion that slices it: the partition id (or an index computed from
    # it) among the fusion's operands, and inside, every path from the
    # value's parameter ending in a dynamic-slice of it. (A fusion that
    # slices *another* operand by the device's index -- a parameter split
    # over another mesh axis -- while it reads this value whole does not.)
    if op.startswith("fusion(") and any(
        _device_index(o, prog) for o in operands(op)) and \
        _sliced_inside(name, op, whole, group_size, prog):
      continue
    return False
  return True


_CALLS = re.compile(r"calls=%([^\s,}]+)")
_PARAMETER = re.compile(r"parameter\((\d+)\)")


def _sliced_inside(name: str, fusion: str, whole: int, group_size: int,
                   prog: Program) -> bool:
  """Whether the fused computation ``fusion`` calls keeps only slices of
  its operand ``name``."""
  m = _CALLS.search(fusion)
  at = {i for i, o in enumerate(operands(fusion)) if o == name}
  if m is None or not at:
    return False
  params = [n for n, _, op in prog.comps.get(m.group(1), [])
            if (pm := _PARAMETER.match(op)) and int(pm.group(1)) in at]
  return bool(params) and all(
      _slices_only(p, whole, group_size, prog) for p in params)


def _slices_only(name: str, whole: int, group_size: int,
                 prog: Program) -> bool:
  """Inside a fused computation: whether every path from ``name`` ends in
  a dynamic-slice of a ``1/group_size`` part, through ops that keep every
  element (elementwise, layout). One that reaches the root whole, or
  reduces, contracts or updates it, reads it whole."""
  us = prog.users.get(name, [])
  if not us:
    return False  # the fusion's root: the value leaves whole
  for u in us:
    op = prog.ops.get(u, "")
    if op.startswith("dynamic-slice("):
      if _is_part(u, name, whole, group_size, prog):
        continue
      return False
    if op.split("(", 1)[0] in _WHOLE or \
        _elements(prog.types.get(u, "")) != whole:
      return False
    if not _slices_only(u, whole, group_size, prog):
      return False
  return True


# Ops that keep every element of an operand of the same size in their result
# (or write into it): what reaches one of them is not sliced.
_WHOLE = ("dynamic-update-slice", "fusion", "tuple", "call", "custom-call",
          "all-reduce", "all-gather", "while", "conditional")


def _is_part(slice_name: str, of: str, whole: int, group_size: int,
             prog: Program) -> bool:
  """Whether a dynamic-slice keeps a ``1/group_size`` part of ``of``, a
  value of ``whole`` elements: each device of the reduction's group its own
  part (a slice over another mesh axis keeps another fraction)."""
  return operands(prog.ops.get(slice_name, ""))[:1] == [of] and \
      _elements(prog.types.get(slice_name, "")) * group_size == whole


def _elements(type_str: str) -> int:
  """Elements of an array type (``f32[6,64,768]{2,1,0}`` -> 294912)."""
  m = re.match(r"\s*[a-z][a-z0-9]*\[([0-9,]*)\]", type_str)
  if m is None:
    return -1
  return math.prod(int(d) for d in m.group(1).split(",") if d)


def _device_index(name: str, prog: Program, depth: int = 4) -> bool:
  """Whether ``name`` is the partition id or a scalar index computed from it
  by a few ops (``shard_map``'s ``axis_index`` times the block size is a
  fusion of the partition id, read by the fusion that slices; in a loop
  body, XLA hoists it out of the loop and carries it in: ``carried``)."""
  op = prog.ops.get(name, "")
  if op.startswith("partition-id("):
    return True
  if (depth == 0 or
      not re.fullmatch(r"[su]\d+\[\]", prog.types.get(name, ""))):
    return False
  if name in prog.carried:
    return _device_index(prog.carried[name], prog, depth - 1)
  if op.split("(", 1)[0] not in _INDEX_MATH:
    return False
  return any(_device_index(o, prog, depth - 1) for o in operands(op))


def loop_carried(comps, ops: dict[str, str]) -> dict[str, str]:
  """{a loop body's read of its carry (a get-tuple-element of its
  parameter): the value the loop was entered with}, where the loop's
  initial carry is a tuple written out."""
  out: dict[str, str] = {}
  for instrs in comps.values():
    for _, _, op in instrs:
      if not op.startswith("while("):
        continue
      body = re.search(r"body=%([^\s,}]+)", op)
      init = operands(op)
      if body is None or not init or \
          not ops.get(init[0], "").startswith("tuple("):
        continue
      elems = operands(ops[init[0]])
      params = {n for n, _, o in comps.get(body.group(1), [])
                if o.startswith("parameter(")}
      for n, _, o in comps.get(body.group(1), []):
        m = _GTE_INDEX.match(o)
        if m and operands(o)[:1] and operands(o)[0] in params and \
            int(m.group(1)) < len(elems):
          out[n] = elems[int(m.group(1))]
  return out


# Ops an index is computed with (on scalars): what lies between the
# partition id and a dynamic-slice's start index.
_INDEX_MATH = ("fusion", "convert", "multiply", "add", "subtract", "divide",
               "remainder", "select", "compare", "bitcast", "copy", "clamp")


def operands(op: str) -> list[str]:
  """Names of an instruction's operands (inside its first parentheses)."""
  i = op.find("(")
  if i < 0:
    return []
  depth = 0
  for j in range(i, len(op)):
    depth += op[j] == "("
    depth -= op[j] == ")"
    if depth == 0:
      return re.findall(r"%([^\s,)]+)", op[i + 1:j])
  return []
