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


# Calls that only name a sub-computation (no derivative rule, no remat):
# their bodies can join the enclosing jaxpr as they are.
PLAIN_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def inline_plain_calls(closed_jaxpr):
  """The program with every plain call (:data:`PLAIN_CALLS`, at any depth
  outside derivative rules and remat) spliced into the jaxpr that calls it.

  The graph opens such calls anyway, and the lowering runs their bodies in
  place; spliced, their equations have addresses in the caller's jaxpr, so
  a partial-sum region may hold ops on both sides of the old call (the
  embedding's gradient: a scatter-add inside ``jnp``'s jitted helper, and
  the unembedding's dot outside, summed and reduced once -- left apart, XLA
  reduces each). Equations are moved, not traced again: their source
  information (what repeated-layer detection keys on) is kept.
  """
  jaxpr, consts = closed(closed_jaxpr)
  new, extra_vars, extra_consts = _splice(jaxpr)
  if new is jaxpr:
    return closed_jaxpr
  new = new.replace(constvars=[*jaxpr.constvars, *extra_vars])
  return jcore.ClosedJaxpr(new, [*consts, *extra_consts])


def _splice(jaxpr):
  """(jaxpr with plain calls spliced, constvars and consts to add)."""
  subst: dict[Any, Any] = {}

  def read(v):
    return v if isinstance(v, jcore.Literal) else subst.get(v, v)

  eqns, extra_vars, extra_consts, changed = [], [], [], False
  for eqn in jaxpr.eqns:
    eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
    name = eqn.primitive.name
    if name in PLAIN_CALLS:
      body, body_consts = sub_jaxpr(eqn.params)
      body, more_vars, more_consts = _splice(body)
      args = eqn.invars[len(eqn.invars) - len(body.invars):]
      inner: dict[Any, Any] = dict(zip(body.invars, args))
      for v, c in zip(body.constvars, body_consts):
        inner[v] = jcore.Var(v.aval)
        extra_vars.append(inner[v])
        extra_consts.append(c)
      extra_vars += more_vars
      extra_consts += more_consts
      for e in body.eqns:
        # Fresh variables per call site: jax reuses one traced body for
        # every call of a function, and two copies must not share names.
        outs = []
        for v in e.outvars:
          if isinstance(v, jcore.DropVar):
            outs.append(v)
          else:
            inner[v] = jcore.Var(v.aval)
            outs.append(inner[v])
        eqns.append(e.replace(
            invars=[v if isinstance(v, jcore.Literal) else inner.get(v, v)
                    for v in e.invars], outvars=outs))
      for v, out in zip(eqn.outvars, body.outvars):
        if not isinstance(v, jcore.DropVar):
          subst[v] = out if isinstance(out, jcore.Literal) else inner.get(
              out, out)
      changed = True
      continue
    if name in LOOPS:
      eqn, did = _splice_loop(eqn)
      changed = changed or did
    eqns.append(eqn)
  if not changed:
    return jaxpr, [], []
  outvars = [read(v) for v in jaxpr.outvars]
  return jaxpr.replace(eqns=eqns, outvars=outvars), extra_vars, extra_consts


def _splice_loop(eqn):
  """A scan's, cond's or while's bodies with their plain calls spliced."""
  p = dict(eqn.params)
  keys = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr")}.get(
      eqn.primitive.name, ())
  did = False
  for k in keys:
    new = inline_plain_calls(p[k])
    did = did or new is not p[k]
    p[k] = new
  if eqn.primitive.name == "cond":
    branches = tuple(inline_plain_calls(b) for b in p["branches"])
    did = any(a is not b for a, b in zip(branches, p["branches"]))
    p["branches"] = branches
  return (eqn.replace(params=p) if did else eqn), did
