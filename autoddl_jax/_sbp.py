"""SBP placements and their exact meaning as JAX `PartitionSpec`s.

A tensor's placement on a device mesh is an *nd-SBP*: one 1-D SBP per mesh axis.

=========  =========================================  ==================================
1-D SBP    meaning on mesh axis ``a``                 JAX
=========  =========================================  ==================================
``S(d)``   tensor dim ``d`` is split across ``a``      ``a`` appears in spec entry ``d``
``B``      every device on ``a`` holds the whole       ``a`` absent from the spec
``P``      every device holds an addend (sum)          ``PartitionSpec(..., unreduced={a})``
=========  =========================================  ==================================

Several axes splitting one dim appear in that spec entry in *mesh order*
(major to minor), e.g. ``(S(0), S(0))`` on mesh ``('x', 'y')`` is ``P(('x', 'y'))``.

Internally a 1-D SBP is a small int (``S(d)`` is ``d``, ``B`` is ``-1``, ``P`` is
``-2``) so that the search can hash and compare millions of them cheaply; the
public classes below wrap those codes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import PartitionSpec

B_CODE = -1
P_CODE = -2

__all__ = ["B", "P", "S", "NdSbp", "Sbp"]


@dataclasses.dataclass(frozen=True)
class Sbp:
  """A 1-D SBP: ``S(d)``, ``B`` or ``P``. Frozen and hashable."""

  code: int

  def __post_init__(self):
    if not isinstance(self.code, int) or self.code < P_CODE:
      raise ValueError(f"invalid SBP code {self.code!r}: use S(dim), B or P")

  @property
  def is_split(self) -> bool:
    return self.code >= 0

  @property
  def dim(self) -> int | None:
    return self.code if self.code >= 0 else None

  def __repr__(self) -> str:
    return code_repr(self.code)


def S(dim: int) -> Sbp:  # noqa: N802 - the paper's notation
  """Split along tensor dimension ``dim``."""
  if not isinstance(dim, int) or dim < 0:
    raise ValueError(f"S(dim) needs a non-negative int dim, got {dim!r}")
  return Sbp(dim)


B = Sbp(B_CODE)
P = Sbp(P_CODE)


def code_repr(code: int) -> str:
  if code >= 0:
    return f"S({code})"
  return "B" if code == B_CODE else "P"


def nd_repr(codes: Sequence[int]) -> str:
  return "(" + ", ".join(code_repr(c) for c in codes) + ")"


@dataclasses.dataclass(frozen=True)
class NdSbp:
  """One 1-D SBP per mesh axis, in mesh-axis order. Frozen and hashable."""

  sbps: tuple[Sbp, ...]

  def __post_init__(self):
    object.__setattr__(self, "sbps", tuple(self.sbps))
    for s in self.sbps:
      if not isinstance(s, Sbp):
        raise TypeError(f"NdSbp entries must be S(d), B or P, got {s!r}")

  @classmethod
  def from_codes(cls, codes: Sequence[int]) -> NdSbp:
    return cls(tuple(Sbp(int(c)) for c in codes))

  @property
  def codes(self) -> tuple[int, ...]:
    return tuple(s.code for s in self.sbps)

  def to_spec(self, rank: int, axis_names: Sequence[str]) -> PartitionSpec:
    return codes_to_spec(self.codes, rank, axis_names)

  @classmethod
  def from_spec(cls, spec: PartitionSpec, rank: int,
                axis_names: Sequence[str]) -> NdSbp:
    return cls.from_codes(spec_to_codes(spec, rank, axis_names))

  def __repr__(self) -> str:
    return nd_repr(self.codes)


def codes_to_spec(codes: Sequence[int], rank: int,
                  axis_names: Sequence[str]) -> PartitionSpec:
  """nd-SBP codes (one per mesh axis) -> PartitionSpec of a rank-``rank`` tensor."""
  if len(codes) != len(axis_names):
    raise ValueError(f"nd-SBP {nd_repr(codes)} has {len(codes)} entries but the "
                     f"mesh has {len(axis_names)} axes {tuple(axis_names)}")
  entries: list[list[str]] = [[] for _ in range(rank)]
  unreduced = []
  for code, name in zip(codes, axis_names):
    if code >= 0:
      if code >= rank:
        raise ValueError(f"S({code}) on mesh axis {name!r} but the tensor has "
                         f"rank {rank}")
      entries[code].append(name)  # mesh order is major -> minor
    elif code == P_CODE:
      unreduced.append(name)
  spec_entries = [None if not e else (e[0] if len(e) == 1 else tuple(e))
                  for e in entries]
  while spec_entries and spec_entries[-1] is None:
    spec_entries.pop()
  if unreduced:
    return PartitionSpec(*spec_entries, unreduced=set(unreduced))
  return PartitionSpec(*spec_entries)


def spec_to_codes(spec: PartitionSpec, rank: int,
                  axis_names: Sequence[str]) -> tuple[int, ...]:
  """PartitionSpec -> nd-SBP codes, validating against the mesh axis order."""
  names = tuple(axis_names)
  codes = [B_CODE] * len(names)
  entries = tuple(getattr(spec, "partitions", spec))
  if len(entries) > rank:
    raise ValueError(f"PartitionSpec {spec} has {len(entries)} entries for a "
                     f"rank-{rank} tensor")
  for dim, entry in enumerate(entries):
    if entry is None:
      continue
    if entry is PartitionSpec.UNCONSTRAINED:
      raise ValueError(f"PartitionSpec {spec}: UNCONSTRAINED has no SBP; give "
                       "an explicit axis or None")
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    positions = []
    for a in axes:
      if a not in names:
        raise ValueError(f"PartitionSpec {spec} names axis {a!r}, which the "
                         f"mesh {names} does not have")
      if codes[names.index(a)] != B_CODE:
        raise ValueError(f"PartitionSpec {spec} uses mesh axis {a!r} twice")
      positions.append(names.index(a))
      codes[names.index(a)] = dim
    if positions != sorted(positions):
      raise ValueError(
          f"PartitionSpec {spec}: axes {axes} on dim {dim} are not in mesh "
          f"order {names}; write them major->minor as the mesh lists them")
  for a in getattr(spec, "unreduced", ()) or ():
    if a not in names:
      raise ValueError(f"PartitionSpec {spec}: unreduced axis {a!r} is not in "
                       f"the mesh {names}")
    if codes[names.index(a)] != B_CODE:
      raise ValueError(f"PartitionSpec {spec}: axis {a!r} both splits and is "
                       "unreduced")
    codes[names.index(a)] = P_CODE
  return tuple(codes)
