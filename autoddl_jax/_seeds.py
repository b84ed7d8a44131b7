"""The textbook plans' placements: the search's starts and the baselines.

A seed pins every argument of the step (its input ops) to the layout a
textbook plan gives it; the search completes the rest. :class:`Kind` names
them: data parallelism (``dp``: parameters replicated, the batch split over
every device), ``fsdp`` (ZeRO-3: parameters split too), ``megatron``
(matmul weights column- or row-split over the last mesh axis as the
dataflow pairs them, :mod:`autoddl_jax._tensor_parallel`; data parallel
over the others), ``fsdp_tp`` (Megatron's layout with
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
from autoddl_jax._tensor_parallel import weight_dims


class Kind(enum.StrEnum):
  """A textbook plan (a seed of the search, a baseline of a report)."""

  DP = "dp"
  FSDP = "fsdp"
  MEGATRON = "megatron"
  FSDP_TP = "fsdp_tp"
  ZERO = "zero"  # searched where a budget binds, with moments free
  USER = "user"  # the arguments' own shardings


SEEDS = (Kind.DP.value, Kind.FSDP.value)  # + megatron, fsdp_tp, user's
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
  return (B,) * n


def tp_codes(shape, sizes, dims: Sequence[int], fsdp: bool
             ) -> tuple[int, ...]:
  """A weight's Megatron codes: the first of ``dims`` the last mesh axis
  divides is split over it; with ``fsdp`` (FSDP+TP, MaxText's fsdp x
  tensor rules) the other axes split the largest dim it leaves whole."""
  n, rank = len(sizes), len(shape)
  tp = next((d for d in dims if shape[d] % sizes[-1] == 0), None)
  axes_dims = [] if tp is None else [(n - 1, tp)]
  if fsdp and rank >= 2:
    other = min((x for x in range(rank) if x != tp),
                key=lambda x: (-shape[x], x))
    axes_dims += [(a, other) for a in range(n - 1)]
  return split_codes(shape, sizes, axes_dims)


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
  """Matmul weights column- or row-parallel on the last mesh axis as the
  dataflow makes them (:mod:`autoddl_jax._tensor_parallel`), data split
  over the other axes (and with ``fsdp``, so is each weight's largest other
  dim: FSDP+TP). A weight's optimizer moments follow it."""
  prob, graph, tr = program.problem, program.graph, program.traced
  mi, state = program.mesh_info, program.state
  if "tp_dims" not in program.memo:  # a walk of the program, made once
    weights = [i for i in state if len(tr.in_avals[i].shape) >= 2]
    found = weight_dims(tr.closed, weights, [
        i for i in range(len(tr.in_avals)) if i not in state])
    by_group: dict[int, tuple[int, ...]] = {}
    for i, dims in sorted(found.items()):
      by_group.setdefault(int(prob.group_of[graph.input_ops[i]]), dims)
    program.memo["tp_dims"] = by_group
  group_dims = program.memo["tp_dims"]

  def codes(i):
    if not tr.splittable[i]:
      return None
    shape = tr.in_avals[i].shape
    if i not in state:
      return seed_codes(Kind.MEGATRON, shape, mi.axis_sizes, False)
    dims = group_dims.get(int(prob.group_of[graph.input_ops[i]]), ())
    return tp_codes(shape, mi.axis_sizes, dims if len(shape) >= 2 else (),
                    fsdp and len(shape) >= 2)

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
  out[Kind.FSDP_TP.value] = megatron(program, fsdp=True)
  if zero:
    # ZeRO-1/2: DP, with every optimizer moment split as FSDP splits it.
    moms = moments(tr)
    out[Kind.ZERO.value] = _pins_for(program, lambda i: (
        seed_codes("fsdp" if i in moms else "dp", tr.in_avals[i].shape,
                   mi.axis_sizes, i in state)
        if tr.splittable[i] else None))
  return out


def textbook_pins(program: Program, kind: str) -> dict[int, int]:
  """{input op: candidate} of a textbook plan's boundary (one of the
  seeds), made once per program."""
  memo = program.memo.setdefault("seeds", {})
  if kind not in memo:
    memo.update({k: v for k, v in seeds(program).items() if k not in memo})
  return dict(memo[kind])
