"""Reading jaxprs: one address scheme for every walker.

The graph builder (:mod:`autoddl_jax._graph`) walks a traced program into
ops, the lowering (:mod:`autoddl_jax._lower`) re-runs it with pins, and the
plan's pins name equations by *address*: the tuple of equation indices from
the top jaxpr down, where a call or loop's body is entered at its
equation's address, a ``cond`` branch at ``address + (b,)`` and a
``while``'s cond and body at ``address + ("cond",)`` / ``("body",)``.
:func:`bodies` is the one place that says so, :func:`equations` yields
every equation with its address, and both walkers use them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.extend import core as jcore

from autoddl_jax._factors import Aval

# Calls whose body joins the program (their equations are planned as its).
INLINE = frozenset({"jit", "pjit", "closed_call", "core_call",
                    "custom_jvp_call", "custom_vjp_call",
                    "custom_vjp_call_jaxpr", "remat2", "checkpoint",
                    "custom_lin"})
INLINE_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
LOOPS = frozenset({"scan", "cond", "while"})


def to_aval(a) -> Aval:
  """A jax aval as the rules see it (extended dtypes as uint32)."""
  dtype = a.dtype
  try:
    dtype = np.dtype(dtype)
  except TypeError:  # extended dtypes (PRNG keys) have no numpy dtype
    dtype = np.dtype(np.uint32)
  return Aval(tuple(int(d) for d in a.shape), dtype)


def sub_jaxpr(params: dict) -> tuple[Any, list]:
  """(jaxpr, consts) of an :data:`INLINE` call's body."""
  for key in INLINE_JAXPR_PARAMS:
    if key in params:
      j = params[key]
      if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
      return j, []
  raise KeyError(f"no sub-jaxpr among {sorted(params)}")


def closed(j) -> tuple[Any, list]:
  """(jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
  if isinstance(j, jcore.ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


def bodies(eqn, address: tuple) -> list[tuple[tuple, Any, list]]:
  """(address, jaxpr, consts) of each body an equation at ``address`` runs:
  an inline call's or a scan's (at its own address), a cond's branches,
  a while's cond and body; none for any other equation."""
  name, p = eqn.primitive.name, eqn.params
  if name in INLINE:
    return [(address, *sub_jaxpr(p))]
  if name == "scan":
    return [(address, *closed(p["jaxpr"]))]
  if name == "cond":
    return [(address + (b,), *closed(br))
            for b, br in enumerate(p["branches"])]
  if name == "while":
    return [(address + ("cond",), *closed(p["cond_jaxpr"])),
            (address + ("body",), *closed(p["body_jaxpr"]))]
  return []


def equations(jaxpr, ctx: tuple = ()) -> Iterator[tuple[tuple, Any]]:
  """Every equation that is neither a call nor a loop, with its address,
  in program order (bodies in place of the equations that run them)."""
  for i, eqn in enumerate(jaxpr.eqns):
    address = ctx + (i,)
    subs = bodies(eqn, address)
    if not subs:
      yield address, eqn
    for sub_address, sub, _ in subs:
      yield from equations(sub, sub_address)
