"""Signatures and factor maps: the vocabulary signature rules are written in.

A signature is ``(input SBPs, output SBPs)`` for one mesh axis such that running
the op on each device's local shards gives the right global result, with no
communication. Signatures on different mesh axes are independent, so the n-D
candidates of an op are the product of its 1-D list over the mesh axes, minus
those that split a dim by more than it divides (see ``_graph``).

Most rules are *factor maps*, as in einsum: every dim of every operand is
labelled with a factor; splitting a factor splits it on every operand that has
it, and the output gets ``S`` where the factor survives or ``P`` where it is
summed away. ``B`` everywhere is always allowed. On top come the *linearity*
signatures that carry partial sums (``P + P -> P``, ``P * B -> P``, ...).

A rule sees shapes only: ``ins``/``outs`` are tuples of :class:`Aval`.
Codes: ``S(d) = d``, ``B = -1``, ``P = -2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autoddl_jax._sbp import B_CODE as B, P_CODE as P

Sig = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Aval:
  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def rank(self) -> int:
    return len(self.shape)

  @property
  def is_float(self) -> bool:
    return np.issubdtype(self.dtype, np.floating) or np.issubdtype(
        self.dtype, np.complexfloating)


SigFn = Callable[[Sequence[Aval], Sequence[Aval], dict[str, Any]],
                 list[Sig]]


def all_b(ins, outs) -> Sig:
  return (tuple(B for _ in ins), tuple(B for _ in outs))


def dedup(sigs: list[Sig]) -> list[Sig]:
  seen, out = set(), []
  for s in sigs:
    if s not in seen:
      seen.add(s)
      out.append(s)
  return out


# ----------------------------------------------------------------- factor maps
def factor_sigs(ins: Sequence[Aval], outs: Sequence[Aval],
                in_factors: Sequence[str], out_factors: Sequence[str],
                summed: str = "", blocked: str = "") -> list[Sig]:
  """Signatures from an einsum-like factor map.

  ``in_factors[i]`` labels each dim of input ``i`` with one character ('' for a
  scalar or an operand the factors do not touch, '.' for a dim that is never
  split). A factor missing from every output is *summed* (split -> P) if listed
  in ``summed``, otherwise not splittable. Factors in ``blocked`` never split.
  """
  sigs = [all_b(ins, outs)]
  factors = sorted({f for fs in (*in_factors, *out_factors) for f in fs} - {"."})
  for f in factors:
    if f in blocked:
      continue
    in_codes = tuple(fs.index(f) if f in fs else B for fs in in_factors)
    if any(f in fs for fs in out_factors):
      out_codes = tuple(fs.index(f) if f in fs else B for fs in out_factors)
    elif f in summed:
      out_codes = tuple(P for _ in out_factors)
    else:
      continue
    sigs.append((in_codes, out_codes))
  return sigs


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def dims(rank: int, start: int = 0) -> str:
  return LETTERS[start:start + rank]


def elementwise(ins, outs, params) -> list[Sig]:
  r = outs[0].rank
  out = outs[0].shape
  # A size-1 dim against a longer result dim broadcasts (lax's elementwise
  # ops take them, e.g. RoPE's ``x * cos[None, :, None, :]``): that operand
  # stays whole along it while the others split it.
  fs = ["".join("." if a.shape[d] == 1 and out[d] != 1 else f
                for d, f in enumerate(dims(r))) if a.rank == r else ""
        for a in ins]
  return factor_sigs(ins, outs, fs, [dims(r)] * len(outs))


def with_partials(sigs: list[Sig], patterns: Sequence[str],
                  ins: Sequence[Aval], outs: Sequence[Aval]) -> list[Sig]:
  """``sigs`` and the partial-sum signatures of an op linear in some inputs.

  Each pattern has one char per input: 'P' (partial), 'B' (replicated), '*'
  (P if the input is a float array, else B); its last char repeats for any
  further inputs ("BP": a predicate, then any number of partial cases). The
  output is P. Integer results carry no partial sums.
  """
  if not all(o.is_float for o in outs):
    return sigs
  for pat in patterns:
    pat = (pat + pat[-1] * len(ins))[:len(ins)]
    codes = []
    for ch, a in zip(pat, ins):
      codes.append(P if ch == "P" or (ch == "*" and a.is_float and a.rank)
                   else B)
    if P in codes:
      sigs = sigs + [(tuple(codes), tuple(P for _ in outs))]
  return dedup(sigs)
