"""Reading the collectives XLA emitted out of compiled HLO text.

Each all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute
becomes a :class:`Collective` with its shapes, device groups (explicit lists,
iota ``[4,2]<=[2,4]T(1,0)`` and mesh ``mesh['a'=2,'b'=4] {'b'}`` forms), how many
times it runs per step (a ``while`` body runs ``known_trip_count`` times) and
the ring-model bytes each device sends per execution.

On CPU, XLA emits bf16 collectives as f32; :func:`collectives` reports what the
HLO says and :attr:`Collective.dtypes` shows it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  name: str
  shapes: tuple[tuple[int, ...], ...]  # result shapes (one per tuple element)
  dtypes: tuple[str, ...]
  operand_shapes: tuple[tuple[int, ...], ...]
  groups: tuple[tuple[int, ...], ...]  # device positions per group
  group_size: int
  count: int  # executions per step
  bytes_per_device: float  # ring-model bytes one device sends per execution
  computation: str

  @property
  def total_bytes_per_device(self) -> float:
    return self.bytes_per_device * self.count


def _split_type(rest: str) -> tuple[str, str]:
  """'(f32[2], s32[]) all-reduce(...)' -> ('(f32[2], s32[])', 'all-reduce(...)')."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].strip()
  i = rest.find(" ")
  return rest[:i], rest[i + 1:].strip()


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
          for m in _ARRAY.finditer(type_str)]


def _nbytes(arrs) -> float:
  return float(sum(_DTYPE_BYTES.get(dt, 4) * math.prod(shape)
                   for dt, shape in arrs))


def parse_groups(attrs: str, num_devices: int) -> list[list[int]]:
  """Device groups of a collective from its attribute text."""
  m = re.search(r"replica_groups=(\{\{[0-9,{}\s]*\}\}|\{\})", attrs)
  if m:
    text = m.group(1)
    groups = [[int(x) for x in g.split(",") if x.strip()]
              for g in re.findall(r"\{([0-9,\s]*)\}", text[1:-1])]
    groups = [g for g in groups if g]
    return groups or [list(range(num_devices))]
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?",
                attrs)
  if m:
    out_shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    arr = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      arr = arr.transpose([int(x) for x in m.group(3).split(",")])
    arr = arr.reshape(out_shape[0], -1)
    return arr.tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
    arr = np.arange(math.prod(sizes)).reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in chosen]
    arr = arr.transpose(rest + chosen).reshape(-1, math.prod(
        sizes[i] for i in chosen) if chosen else 1)
    return arr.tolist()
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if m:
    return [[int(x) for x in p.split(",")]
            for p in re.findall(r"\{([0-9,]+)", m.group(1) + "}")]
  return [list(range(num_devices))]


def ring_bytes(kind: str, p: int, result_bytes: float,
               operand_bytes: float) -> float:
  if kind == "collective-permute":
    return result_bytes
  if p <= 1:
    return 0.0
  frac = (p - 1) / p
  if kind == "all-reduce":
    return 2 * frac * result_bytes
  if kind == "reduce-scatter":
    return frac * operand_bytes
  return frac * result_bytes  # all-gather, all-to-all


def parse_hlo(text: str, num_devices: int) -> list[Collective]:
  comps: dict[str, list[tuple[str, str, str]]] = {}
  types: dict[str, str] = {}
  entry, cur = None, None
  for line in text.splitlines():
    cm = _COMP.match(line)
    if cm and line.rstrip().endswith("{"):
      cur = cm.group(1)
      comps[cur] = []
      if line.startswith("ENTRY"):
        entry = cur
      continue
    im = _INSTR.match(line)
    if im and cur is not None:
      name, rest = im.group(1), im.group(2)
      type_str, op = _split_type(rest)
      types[name] = type_str
      comps[cur].append((name, type_str, op))
  # Executions per step of each computation, from the entry down.
  mult: dict[str, int] = {}
  if entry is not None:
    stack = [(entry, 1)]
    while stack:
      c, m = stack.pop()
      mult[c] = mult.get(c, 0) + m
      for _, _, op in comps.get(c, []):
        opcode = op.split("(", 1)[0]
        trip = 1
        if opcode == "while":
          t = re.search(r'"known_trip_count":\{"n":"(\d+)"', op)
          trip = int(t.group(1)) if t else 1
        for key, callee in re.findall(
            r"(body|condition|calls|true_computation|false_computation)=%"
            r"([^\s,}]+)", op):
          if opcode in KINDS or opcode.endswith("-start"):
            continue
          stack.append((callee, m * (trip if key in ("body", "condition")
                                     else 1)))
        bc = re.search(r"branch_computations=\{([^}]*)\}", op)
        if bc:
          for callee in re.findall(r"%([^\s,]+)", bc.group(1)):
            stack.append((callee, m))
  out = []
  for c, instrs in comps.items():
    for name, type_str, op in instrs:
      opcode = op.split("(", 1)[0]
      kind = opcode[:-6] if opcode.endswith("-start") else opcode
      if kind not in KINDS:
        continue
      res = _arrays(type_str)
      if opcode.endswith("-start") and kind != "all-reduce":
        res = res[len(res) // 2:] if len(res) > 1 else res
      args = op[len(opcode) + 1:]
      depth, end = 1, 0
      for i, ch in enumerate(args):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
          end = i
          break
      operand_names = re.findall(r"%([^\s,)]+)", args[:end])
      opnds = [a for n in operand_names for a in _arrays(types.get(n, ""))]
      attrs = args[end:]
      groups = parse_groups(attrs, num_devices)
      p = len(groups[0]) if groups else num_devices
      rb = _nbytes(res)
      ob = _nbytes(opnds) if opnds else rb
      out.append(Collective(
          kind=kind, name=name, shapes=tuple(s for _, s in res),
          dtypes=tuple(d for d, _ in res),
          operand_shapes=tuple(s for _, s in opnds),
          groups=tuple(tuple(g) for g in groups), group_size=p,
          count=mult.get(c, 0), bytes_per_device=ring_bytes(kind, p, rb, ob),
          computation=c))
  return out


def collectives(compiled: Any) -> list[Collective]:
  """The collectives in a ``jax.stages.Compiled`` (or HLO text)."""
  if isinstance(compiled, str):
    text, n = compiled, 1
  else:
    text = compiled.as_text()
    try:
      n = len(compiled.input_shardings[0][0].device_set) if \
          compiled.input_shardings[0] else 1
    except (AttributeError, IndexError, TypeError):
      n = 1
  return parse_hlo(text, n)


def emitted_bytes(compiled: Any) -> float:
  """Ring-model bytes per device per step over all emitted collectives."""
  return sum(c.total_bytes_per_device for c in collectives(compiled))
