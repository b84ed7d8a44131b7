"""Which results of a CPU all-reduce each device only slices: XLA:CPU writes
a reduce-scatter as an all-reduce whose every reader keeps the device's part
(a dynamic-slice indexed by the partition id), and its combiner merges such
all-reduces with plain ones into one tuple. :func:`sliced_elements` reads
each element of one by what its readers keep (:mod:`autoddl_jax._hlo`
counts it as the reduce-scatter a GPU emits)."""

from __future__ import annotations

import re

_GTE_INDEX = re.compile(r"get-tuple-element\(%[^\s,)]+\), index=(\d+)")


def sliced_elements(name: str, n: int, users: dict[str, list[str]],
                     ops: dict[str, str], types: dict[str, str],
                     carried: dict[str, str]) -> list[bool]:
  """Per result element of an all-reduce, whether every user keeps only the
  device's slice of it (a tuple's elements are read through their
  get-tuple-elements; any other user of the tuple reads it whole)."""
  if n == 1:
    return [_only_sliced(name, users, ops, types, carried)]
  readers: dict[int, list[str]] = {}
  for u in users.get(name, []):
    m = _GTE_INDEX.match(ops.get(u, ""))
    if m is None:
      return [False] * n
    readers.setdefault(int(m.group(1)), []).append(u)
  return [bool(readers.get(i)) and
          all(_only_sliced(u, users, ops, types, carried)
              for u in readers[i])
          for i in range(n)]


_PASS_THROUGH = ("get-tuple-element", "bitcast", "copy", "reshape")


def _only_sliced(name: str, users: dict[str, list[str]],
                 ops: dict[str, str], types: dict[str, str],
                 carried: dict[str, str]) -> bool:
  """Whether every user of ``name`` slices it by the device's partition id."""
  us = users.get(name, [])
  if not us:
    return False
  for u in us:
    op = ops.get(u, "")
    if op.startswith("dynamic-slice("):
      continue
    if op.split("(", 1)[0] in _PASS_THROUGH:  # look through to their users
      if _only_sliced(u, users, ops, types, carried):
        continue
      return False
    if op.startswith("fusion(") and any(
        _device_index(o, ops, types, carried) for o in operands(op)):
      continue
    return False
  return True


def _device_index(name: str, ops: dict[str, str], types: dict[str, str],
                  carried: dict[str, str], depth: int = 4) -> bool:
  """Whether ``name`` is the partition id or a scalar index computed from it
  by a few ops (``shard_map``'s ``axis_index`` times the block size is a
  fusion of the partition id, read by the fusion that slices; in a loop
  body, XLA hoists it out of the loop and carries it in: ``carried``)."""
  op = ops.get(name, "")
  if op.startswith("partition-id("):
    return True
  if (depth == 0 or not re.fullmatch(r"[su]\d+\[\]", types.get(name, ""))):
    return False
  if name in carried:
    return _device_index(carried[name], ops, types, carried, depth - 1)
  if op.split("(", 1)[0] not in _INDEX_MATH:
    return False
  return any(_device_index(o, ops, types, carried, depth - 1)
             for o in operands(op))


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
