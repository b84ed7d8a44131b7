"""Signatures XLA can do for free, the rules must have.

    python benchmarks/completeness.py [--per-primitive 4] [--models llama,t5]

For each primitive the zoo's programs produce (benchmarks/zoo.py, tiny
sizes; up to ``--per-primitive`` distinct equations of each) and each
placement of its operands on a 1-axis mesh of 4 devices -- every operand B
or S on one of its dims that 4 divides -- the equation is compiled alone.
Where XLA emits no collective, the op ran locally on those shards, so the
rules must list that signature: the operands' placements and the layout XLA
gave the results. A placement XLA runs locally that the rules lack is a plan
the search can never take; the table lists every one (``EXCEPTIONS`` holds
those left out on purpose, with the reason).

``tests/test_completeness.py`` runs one equation of each primitive.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from jax.extend import core as jcore  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _rules  # noqa: E402
from autoddl_jax._jaxpr import INLINE, to_aval  # noqa: E402
from autoddl_jax._lower import bind_eqn  # noqa: E402
from autoddl_jax._sbp import B_CODE as B, codes_to_spec, spec_to_codes  # noqa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402

CONTROL_FLOW = {"scan", "cond", "while"}
N = 4  # devices on the mesh axis
# Primitives not checked, and why.
SKIP = {
    # PRNG internals (Dropout): key-typed operands have no float layout, and
    # the planner runs them replicated on purpose (every device draws the
    # same bits).
    "random_bits", "random_wrap", "random_unwrap", "random_seed",
    "random_fold_in", "random_split", "threefry2x32",
}
# (primitive, operand codes, result codes) XLA runs locally that the rules
# leave out on purpose.
EXCEPTIONS: dict[tuple[str, tuple[int, ...], tuple[int, ...]], str] = {}


def _walk(jaxpr, out: dict, per_prim: int):
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in INLINE or name in CONTROL_FLOW:
      for sub in jcore.jaxprs_in_params(eqn.params):
        _walk(sub, out, per_prim)
      continue
    if name in SKIP:
      continue
    key = (name, tuple(tuple(getattr(v.aval, "shape", ())) for v in
                       eqn.invars), repr(sorted(
                           (k, str(v)) for k, v in eqn.params.items())))
    seen = out.setdefault(name, {})
    if len(seen) < per_prim and key not in seen:
      seen[key] = eqn


def zoo_equations(models, per_prim: int) -> dict[str, list[Any]]:
  """Distinct equations of each primitive over the tiny zoo programs."""
  out: dict = {}
  for name in models:
    if name == "llama_scan":
      case = zoo.llama(scan=True, tx=optax.adamw(1e-3), abstract=True)
    else:
      case = zoo.build(name, abstract=True)
    _walk(jax.make_jaxpr(case.step)(*case.args).jaxpr, out, per_prim)
  return {k: list(v.values()) for k, v in sorted(out.items())}


def _placements(aval) -> list[int]:
  shape = tuple(getattr(aval, "shape", ()))
  return [B] + [d for d, n in enumerate(shape) if n % N == 0 and n >= N]


def _mesh():
  return jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:N])


def covered(sig, sigs, in_avals=None) -> bool:
  """Whether the planner can run ``sig`` locally: some rule signature has
  its results, and operands it reaches for free (the same placement, or B
  sliced to S / zeroed to P on the device: a free transition). A slice must
  divide the operand (``in_avals``): a size-1 dim that broadcasts cannot be
  split, so the rule must keep that operand whole."""
  ins, outs = sig

  def free(c, r, a):
    if c == r:
      return True
    return c == B and (r < 0 or a is None or a.shape[r] % N == 0)

  avals = in_avals or [None] * len(ins)
  return any(so == outs and all(free(c, r, a)
                                for c, r, a in zip(ins, si, avals))
             for si, so in sigs)


def check_equation(eqn, mesh=None) -> list[dict]:
  """For every placement of the equation's operands: whether XLA ran it
  without collectives, the result layout it chose, and whether the rules
  have that signature."""
  mesh = mesh or _mesh()
  ins = [v for v in eqn.invars]
  in_avals = [to_aval(v.aval) for v in ins]
  out_avals = [to_aval(v.aval) for v in eqn.outvars]
  sigs = set(_rules.signatures(eqn.primitive.name, in_avals, out_avals,
                               eqn.params) or [])
  lit = [isinstance(v, jcore.Literal) for v in ins]
  choices = [[B] if is_lit else _placements(v.aval)
             for v, is_lit in zip(ins, lit)]
  rows = []
  for combo in itertools.product(*choices):
    args, spots = [], []
    for v, c, is_lit in zip(ins, combo, lit):
      if is_lit:
        continue
      spec = codes_to_spec((c,), len(v.aval.shape), ("x",))
      args.append(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                       sharding=NamedSharding(mesh, spec)))
      spots.append(len(spots))

    def fn(*xs, eqn=eqn, lit=lit):
      it = iter(xs)
      vals = [v.val if is_lit else next(it) for v, is_lit in zip(
          eqn.invars, lit)]
      out = bind_eqn(eqn, vals, mesh)
      return out if eqn.primitive.multiple_results else [out]

    try:
      compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
      rows.append(dict(combo=combo, error=f"{type(e).__name__}: {e}"[:120]))
      continue
    local = not ad.collectives(compiled, mesh)
    outs = []
    for s, a in zip(jax.tree.leaves(compiled.output_shardings,
                                    is_leaf=lambda x: hasattr(x, "spec")),
                    out_avals):
      spec = getattr(s, "spec", None)
      outs.append(B if spec is None else spec_to_codes(
          spec, len(a.shape), ("x",))[0])
    sig = (tuple(combo), tuple(outs))
    rows.append(dict(combo=combo, local=local, outs=tuple(outs),
                     in_rules=covered(sig, sigs, in_avals),
                     excepted=EXCEPTIONS.get((eqn.primitive.name, *sig))))
  return rows


def missing(rows) -> list[dict]:
  """Placements XLA runs locally that the rules lack (and no exception
  names)."""
  return [r for r in rows if r.get("local") and not r["in_rules"]
          and not r["excepted"]]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="llama,llama_scan," + ",".join(
      n for n in zoo.BUILDERS if n != "llama"))
  ap.add_argument("--per-primitive", type=int, default=4)
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  eqns = zoo_equations(args.models.split(","), args.per_primitive)
  mesh = _mesh()
  total = collections.Counter()
  for prim, es in eqns.items():
    for eqn in es:
      rows = check_equation(eqn, mesh)
      miss = missing(rows)
      errs = [r for r in rows if "error" in r]
      total["placements"] += len(rows)
      total["local"] += sum(bool(r.get("local")) for r in rows)
      total["missing"] += len(miss)
      total["errors"] += len(errs)
      shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
      print(f"{prim:24} {str(shapes)[:60]:60} placements {len(rows):3d} "
            f"local {sum(bool(r.get('local')) for r in rows):3d} "
            f"missing {len(miss)}", flush=True)
      for r in miss:
        print(f"    MISSING {r['combo']} -> {r['outs']}")
      for r in errs[:2]:
        print(f"    error {r['combo']}: {r['error']}")
  print(f"\ncompleteness: {len(eqns)} primitives, {total['placements']} "
        f"placements, {total['local']} run locally by XLA, "
        f"{total['missing']} of those missing from the rules "
        f"({total['errors']} did not compile); "
        f"{time.perf_counter() - t0:.0f} s")
  return total["missing"]


if __name__ == "__main__":
  sys.exit(1 if main() else 0)
