"""The textbook plans' placements: the search's starts and the baselines.

A seed pins every argument of the step (its input ops) to the layout a
textbook plan gives it; the search completes the rest. :class:`Kind` names
them: data parallelism (``dp``: parameters replicated, the batch split over
every device), ``fsdp`` (ZeRO-3: parameters split too), ``megatron``
(matmul weights alternately column- and row-split over the last mesh
axis, data parallel over the others), ``fsdp_tp`` (Megatron's layout with
each weight's largest other dim split over the other axes, as MaxText's
fsdp x tensor rules) and ``zero`` (ZeRO-1/2: DP with each optimizer moment
split as FSDP splits it), plus ``user``: the shardings the arguments came
with.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from jax.sharding import NamedSharding

from autoddl_jax._coords import moments
from autoddl_jax._program import Program
from autoddl_jax._sbp import B_CODE as B, spec_to_codes


class Kind(enum.StrEnum):
  """A textbook plan (a seed of the search, a baseline of a report)."""

  DP = "dp"
  FSDP = "fsdp"
  MEGATRON = "megatron"
  FSDP_TP = "fsdp_tp"
  ZERO = "zero"  # searched where a budget binds, with moments free
  USER = "user"  # the arguments' own shardings


SEEDS = (Kind.DP.value, Kind.FSDP.value)  # + megatron (own builder), user's
BASELINES = (*SEEDS, Kind.MEGATRON.value, Kind.FSDP_TP.value)
TEXTBOOK = BASELINES  # the plans selection compiles as a user writes them

def split_codes(shape, sizes, axes_dims: Sequence[tuple[int, int]]):
  """Codes splitting dim d over axis a for each (a, d) that still divides."""
  codes = [B] * len(sizes)
  div = [1] * len(shape)
  for a, d in axes_dims:
    if sizes[a] > 1 and -len(shape) <= d < len(shape):
      d %= len(shape)
      if shape[d] % (div[d] * sizes[a]) == 0:
        codes[a] = d
        div[d] *= sizes[a]
  return tuple(codes)


def seed_codes(kind: str, shape, sizes, is_state: bool) -> tuple[int, ...]:
  n = len(sizes)
  rank = len(shape)
  if rank == 0:
    return (B,) * n
  if not is_state:  # data
    axes = range(n) if kind in ("dp", "fsdp") else range(n - 1)
    return split_codes(shape, sizes, [(a, 0) for a in axes])
  if kind == "fsdp":
    order = sorted(range(rank), key=lambda d: (-shape[d], d))
    out = [B] * n
    div = [1] * rank
    for a in range(n):
      for d in order:
        if sizes[a] > 1 and shape[d] % (div[d] * sizes[a]) == 0:
          out[a] = d
          div[d] *= sizes[a]
          break
    return tuple(out)
  if kind.endswith(("tp_col", "tp_row")) and rank >= 2:
    d = (-1 if kind.endswith("tp_col") else -2) % rank
    axes_dims = [(n - 1, d)]
    if kind.startswith("fsdp_"):
      # FSDP+TP (MaxText's fsdp x tensor): the other axes split the largest
      # dim the tensor-parallel axis leaves whole.
      other = min((x for x in range(rank) if x != d),
                  key=lambda x: (-shape[x], x))
      axes_dims += [(a, other) for a in range(n - 1)]
    return split_codes(shape, sizes, axes_dims)
  return (B,) * n


def _pins_for(program: Program,
              codes_of: Callable[[int], tuple[int, ...] | None]
              ) -> dict[int, int]:
  """{input op: candidate} for each argument ``codes_of`` places."""
  prob, graph = program.problem, program.graph
  pins = {}
  for i, o in enumerate(graph.input_ops):
    codes = codes_of(i)
    if codes is None:
      continue
    k = prob.find_candidate(o, codes)
    if k is not None:
      pins[o] = k
  return pins


def megatron(program: Program, fsdp: bool = False) -> dict[int, int]:
  """Matmul weights alternate column- and row-parallel on the last mesh axis
  in the order the program first uses them; data splits over the others
  (and with ``fsdp``, so does each weight's largest other dim: FSDP+TP)."""
  prob, graph, tr = program.problem, program.graph, program.traced
  mi, state = program.mesh_info, program.state
  first_use = {}
  for i, o in enumerate(graph.input_ops):
    t = graph.tensors[graph.ops[o].outs[0]]
    g = int(prob.group_of[o])
    if i in state and len(tr.in_avals[i].shape) >= 2 and t.consumers:
      first_use[g] = min(first_use.get(g, 1 << 60),
                         min(c for c, _ in t.consumers))
  kind = {g: ("tp_col", "tp_row")[j % 2] for j, g in enumerate(
      sorted(first_use, key=lambda g: (first_use[g], g)))}

  def codes(i):
    if not tr.splittable[i]:
      return None
    k = kind.get(int(prob.group_of[graph.input_ops[i]]), "tp_col")
    return seed_codes("fsdp_" + k if fsdp else k, tr.in_avals[i].shape,
                      mi.axis_sizes, i in state)

  return _pins_for(program, codes)


def user(program: Program) -> dict[int, int]:
  """The shardings the arguments came with (placed arrays), where they are
  on this mesh's axes."""
  tr, mi = program.traced, program.mesh_info

  def codes(i):
    s = tr.shardings[i]
    if isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == \
        mi.axis_names:
      try:
        return spec_to_codes(s.spec, len(tr.in_avals[i].shape), mi.axis_names)
      except ValueError:
        return None
    return None

  if not any(s is not None for s in tr.shardings):
    return {}
  return _pins_for(program, codes)


def seeds(program: Program, zero: bool = False) -> dict[str, dict[int, int]]:
  """The search's textbook starts on ``program`` (``zero``: ZeRO's too)."""
  tr, mi, state = program.traced, program.mesh_info, program.state
  out = {}
  for kind in SEEDS:
    out[kind] = _pins_for(program, lambda i, kind=kind: (
        seed_codes(kind, tr.in_avals[i].shape, mi.axis_sizes, i in state)
        if tr.splittable[i] else None))
  out[Kind.MEGATRON.value] = megatron(program)
  if zero:
    # ZeRO-1/2: DP, with every optimizer moment split as FSDP splits it.
    moms = moments(tr)
    out[Kind.ZERO.value] = _pins_for(program, lambda i: (
        seed_codes("fsdp" if i in moms else "dp", tr.in_avals[i].shape,
                   mi.axis_sizes, i in state)
        if tr.splittable[i] else None))
  return out


def textbook_pins(program: Program, kind: str) -> dict[int, int]:
  """{input op: candidate} of a textbook plan's boundary (a seed, or
  FSDP+TP), made once per program."""
  memo = program.memo.setdefault("seeds", {})
  if kind not in memo:
    if kind == Kind.FSDP_TP:
      memo[kind] = megatron(program, fsdp=True)
    else:
      memo.update({k: v for k, v in seeds(program).items()
                   if k not in memo})
  return dict(memo[kind])
