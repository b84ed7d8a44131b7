"""Reading the collectives XLA emitted out of compiled HLO text.

Each all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute
becomes a :class:`Collective` with its shapes, device groups (explicit lists,
iota ``[4,2]<=[2,4]T(1,0)`` and mesh ``mesh['a'=2,'b'=4] {'b'}`` forms), how many
times it runs per step (a ``while`` body runs ``known_trip_count`` times) and
the ring-model bytes each device sends per execution.

On CPU, XLA computes bf16 values in f32, so their collectives are f32 in the
HLO; and it writes a reduce-scatter as an all-reduce whose users keep only
their device's slice (:attr:`Collective.lowered_as` says so, and the kind and
bytes are the reduce-scatter's, as a GPU would run it). Where a collective's
f32 value comes from or goes straight back to bf16,
:attr:`Collective.upcast` says so and ``bytes_per_device`` counts the bf16
bytes the program's own dtype would move (``hlo_bytes_per_device`` keeps
what the HLO says).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax

from autoddl_jax._collectives import KINDS, ring_bytes, seconds
from autoddl_jax._replica_groups import group_axes, parse_groups
from autoddl_jax._sliced import Program, loop_carried, operands
from autoddl_jax._sliced import sliced_elements

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program."""

  kind: str  # "all-reduce" | "all-gather" | "reduce-scatter" | ...
  name: str  # the HLO instruction name
  shapes: tuple[tuple[int, ...], ...]  # result shapes (one per tuple element)
  dtypes: tuple[str, ...]  # result dtypes as the HLO writes them
  operand_shapes: tuple[tuple[int, ...], ...]
  groups: tuple[tuple[int, ...], ...]  # device positions per group
  group_size: int
  count: int  # executions per step
  bytes_per_device: float  # ring-model bytes one device sends per execution
  computation: str
  axes: tuple[str, ...] = ()  # mesh axes a group spans (when the mesh is known)
  upcast: str | None = None  # "bf16" when the HLO's f32 stands for bf16
  hlo_bytes_per_device: float = 0.0  # bytes_per_device at the HLO's dtypes
  lowered_as: str | None = None  # how the HLO spells it, when not by its kind

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


def _read(text: str):
  """(computations {name: [(instr, type, op)]}, types, ops, users, entry)
  of HLO text."""
  comps: dict[str, list[tuple[str, str, str]]] = {}
  types: dict[str, str] = {}
  ops: dict[str, str] = {}
  users: dict[str, list[str]] = {}
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
      types[name], ops[name] = type_str, op
      comps[cur].append((name, type_str, op))
      for operand in operands(op):
        users.setdefault(operand, []).append(name)
  return comps, types, ops, users, entry


def parse_hlo(text: str, num_devices: int,
              mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
              ) -> list[Collective]:
  """Every collective in HLO text. ``mesh`` = (axis names, axis sizes) of the
  program's mesh (device positions = positions in ``mesh.devices.flat``)."""
  comps, types, ops, users, entry = _read(text)
  mult = _multiplicities(comps, entry)
  prog = Program(comps, users, ops, types, loop_carried(comps, ops))
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
      operand_names = operands(op)
      opnds = [a for n in operand_names for a in _arrays(types.get(n, ""))]
      attrs = op[op.index(")"):] if ")" in op else ""
      groups = parse_groups(attrs, num_devices)
      # An f32 collective between converts from/to bf16 moves bf16 values.
      upcast = None
      if all(d == "f32" for d, _ in res) and any(
          _is_bf16_convert(ops.get(n, ""), types.get(n, ""))
          for n in operand_names + users.get(name, [])):
        upcast = "bf16"
      common = dict(
          name=name, groups=tuple(tuple(g) for g in groups),
          group_size=len(groups[0]) if groups else num_devices,
          count=mult.get(c, 0), computation=c,
          axes=group_axes(groups, *mesh) if mesh else (), upcast=upcast)
      if kind != "all-reduce":
        out.append(_collective(kind, res, opnds, **common))
        continue
      # CPU writes a reduce-scatter as an all-reduce whose every user keeps
      # only this device's slice (indexed by partition-id); its combiner
      # may then merge such all-reduces with plain ones into one tuple (a
      # GPU makes the reduce-scatters first and combines each kind apart):
      # each element is read by what its users keep.
      sliced = sliced_elements(name, len(res), common["group_size"], prog)
      for as_rs in (False, True):
        part = [i for i in range(len(res)) if sliced[i] == as_rs]
        if part:
          out.append(_collective(
              "reduce-scatter" if as_rs else "all-reduce",
              [res[i] for i in part],
              [opnds[i] for i in part] if len(opnds) == len(res) else opnds,
              lowered_as="all-reduce + dynamic-slice" if as_rs else None,
              **common))
  return out


def _collective(kind, res, opnds, *, upcast, lowered_as=None, **common
                ) -> Collective:
  hlo_bytes = ring_bytes(kind, common["group_size"], _nbytes(res),
                         _nbytes(opnds) if opnds else _nbytes(res))
  return Collective(
      kind=kind, shapes=tuple(s for _, s in res),
      dtypes=tuple(d for d, _ in res),
      operand_shapes=tuple(s for _, s in opnds),
      bytes_per_device=hlo_bytes / 2 if upcast else hlo_bytes,
      upcast=upcast, hlo_bytes_per_device=hlo_bytes, lowered_as=lowered_as,
      **common)


def _is_bf16_convert(op: str, type_str: str) -> bool:
  """A convert (or a fusion that is one) with a bf16 side."""
  opcode = op.split("(", 1)[0]
  if opcode == "convert" or (opcode == "fusion" and "convert" in op):
    return "bf16" in type_str or "bf16" in op
  return False


def _multiplicities(comps, entry, trips: bool = True) -> dict[str, int]:
  """Executions per step of each computation, from the entry down (with
  ``trips=False``, a loop body counts once, as XLA's cost analysis counts
  it)."""
  mult: dict[str, int] = {}
  if entry is None:
    return mult
  stack = [(entry, 1)]
  while stack:
    c, m = stack.pop()
    mult[c] = mult.get(c, 0) + m
    for _, _, op in comps.get(c, []):
      opcode = op.split("(", 1)[0]
      trip = 1
      if opcode == "while":
        t = re.search(r'"known_trip_count":\{"n":"(\d+)"', op)
        trip = int(t.group(1)) if t and trips else 1
      if opcode in KINDS or opcode.endswith("-start"):
        continue  # to_apply reducers are not executions of their own
      for key, callee in re.findall(
          r"(body|condition|calls|true_computation|false_computation)=%"
          r"([^\s,}]+)", op):
        stack.append((callee, m * (trip if key in ("body", "condition")
                                   else 1)))
      bc = re.search(r"branch_computations=\{([^}]*)\}", op)
      if bc:
        for callee in re.findall(r"%([^\s,]+)", bc.group(1)):
          stack.append((callee, m))
  return mult


def _dims(type_str: str) -> tuple[int, ...]:
  arrs = _arrays(type_str)
  return arrs[0][1] if arrs else ()


def _dot_flops(type_str: str, op: str, types: dict[str, str]) -> float:
  """FLOPs of one dot or convolution instruction (multiply-adds x 2)."""
  opcode = op.split("(", 1)[0]
  out = math.prod(_dims(type_str))
  opnds = operands(op)
  if opcode == "dot" and opnds:
    lhs = _dims(types.get(opnds[0], ""))
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", op)
    k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m \
        and lhs else 1
    return 2.0 * out * k
  if opcode == "convolution" and len(opnds) > 1:
    kernel = _dims(types.get(opnds[1], ""))
    m = re.search(r"dim_labels=[^_]*_([^-]*)->", op)
    if not kernel or not m or "o" not in m.group(1):
      return 0.0
    # Each output element takes the kernel's window over its input features
    # (already divided by the feature groups).
    return 2.0 * out * math.prod(kernel) / kernel[m.group(1).index("o")]
  return 0.0


def loop_flops(text: str) -> float:
  """The dot and convolution FLOPs that XLA's ``cost_analysis`` leaves out
  by counting a ``while`` body once: each such instruction's FLOPs times
  (its executions per step - the executions cost analysis counts). Add it
  to ``cost_analysis()["flops"]`` for the step's FLOPs with every trip
  (elementwise work in loop bodies stays counted once: small beside the
  contractions)."""
  comps, types, _, _, entry = _read(text)
  every = _multiplicities(comps, entry)
  once = _multiplicities(comps, entry, trips=False)
  extra = 0.0
  for c, instrs in comps.items():
    k = every.get(c, 0) - once.get(c, 0)
    if k <= 0:
      continue
    for _, type_str, op in instrs:
      if op.startswith(("dot(", "convolution(")):
        extra += k * _dot_flops(type_str, op, types)
  return extra


def collectives(compiled: Any, mesh: Any = None) -> list[Collective]:
  """The collectives of a compiled program.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
      or its HLO text.
    mesh: the ``Mesh`` the program runs on, to name the axes each collective
      spans; found from the program's input shardings when not given.

  Returns:
    One :class:`Collective` per collective instruction, each with ``kind``,
    ``count`` (executions per step) and ``bytes_per_device`` (ring-model bytes
    one device sends per execution).
  """
  if isinstance(compiled, str):
    text, n = compiled, 1
  elif isinstance(compiled, jax.stages.Lowered):
    # A Lowered program's text is StableHLO before partitioning: it holds
    # no collectives yet, and an empty list would read as "none emitted".
    raise TypeError("ad.collectives needs a compiled program: pass "
                    "lowered.compile() (the collectives are chosen when XLA "
                    "partitions the program), not the jax.stages.Lowered")
  elif isinstance(compiled, jax.stages.Compiled) or (
      hasattr(compiled, "as_text") and hasattr(compiled, "input_shardings")):
    text = compiled.as_text()
    shardings = [s for s in jax.tree_util.tree_leaves(
        getattr(compiled, "input_shardings", ()))]
    n = max((len(s.device_set) for s in shardings), default=1)
    if mesh is None:
      mesh = next((s.mesh for s in shardings if hasattr(s, "mesh")), None)
  else:
    raise TypeError(f"ad.collectives takes a compiled program "
                    f"(jax.jit(f).lower(...).compile()) or its HLO text, got "
                    f"{type(compiled).__name__}")
  if mesh is not None:
    n = max(n, math.prod(mesh.axis_sizes) if hasattr(mesh, "axis_sizes")
            else mesh.devices.size)
  info = None if mesh is None else (tuple(mesh.axis_names),
                                    tuple(int(x) for x in mesh.axis_sizes))
  return parse_hlo(text, n, info)


def emitted_bytes(compiled: Any) -> float:
  """Ring-model bytes per device per step over all emitted collectives."""
  return sum(c.total_bytes_per_device for c in collectives(compiled))


def emitted_seconds(cols: list[Collective], mi: Any) -> float:
  """The alpha-beta time of emitted collectives on a mesh's links (a
  :class:`MeshInfo`): a group spanning several axes runs at the slowest of
  their links."""
  total = 0.0
  for c in cols:
    p = c.group_size
    if c.count == 0 or p <= 1:
      continue
    idx = [mi.axis_names.index(a) for a in c.axes] or range(mi.ndim)
    alpha = max(mi.alpha[i] for i in idx)
    beta = min(mi.beta[i] for i in idx)
    total += c.count * seconds(c.kind, p, c.bytes_per_device, alpha, beta)
  return total
