"""``python -m autoddl_jax``: plan a step from the command line, show a plan.

    python -m autoddl_jax plan MODULE:FUNCTION --mesh data=2,model=4 \\
        [--devices-per-node 4] [--memory-budget 16GiB] [--save plan.json]
    python -m autoddl_jax show plan.json

``MODULE:FUNCTION`` (or ``path/to/file.py:FUNCTION``) names a function (no
arguments) that returns ``(step, example_args)``; the args may be arrays or ``jax.ShapeDtypeStruct``s. The mesh
is abstract (nothing runs), so any size can be planned on a laptop.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import re
import sys

def parse_bytes(text: str) -> float:
  """``16GiB`` / ``512MB`` / ``1e9`` -> bytes (as ``memory_budget`` takes)."""
  from autoddl_jax._cluster import parse_bytes as parse
  try:
    return parse(text, "--memory-budget")
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e


def parse_mesh(text: str) -> dict[str, int]:
  """``data=2,model=4`` -> {"data": 2, "model": 4}."""
  out = {}
  for part in text.split(","):
    m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*", part)
    if not m:
      raise argparse.ArgumentTypeError(
          f"bad mesh {text!r}: write axis=size pairs, e.g. data=2,model=4")
    if m.group(1) in out:
      raise argparse.ArgumentTypeError(f"mesh axis {m.group(1)!r} twice")
    out[m.group(1)] = int(m.group(2))
  return out


def _rows(text: str) -> int:
  if not text.isdigit():
    raise argparse.ArgumentTypeError(f"--rows takes a number >= 0, got "
                                     f"{text!r}")
  return int(text)


def _load_target(spec: str):
  """``pkg.module:fn`` or ``path/to/file.py:fn`` -> fn() = (step, args)."""
  if ":" not in spec:
    raise SystemExit(f"error: expected MODULE:FUNCTION, got {spec!r}")
  mod_name, fn_name = spec.rsplit(":", 1)
  try:
    if mod_name.endswith(".py"):
      path = os.path.abspath(mod_name)
      if not os.path.exists(path):
        raise ImportError(f"no file {path}")
      sys.path.insert(0, os.path.dirname(path))  # its sibling imports
      name = os.path.splitext(os.path.basename(path))[0]
      loader = importlib.util.spec_from_file_location(name, path)
      mod = importlib.util.module_from_spec(loader)
      loader.loader.exec_module(mod)
    else:
      mod = importlib.import_module(mod_name)
  except ImportError as e:
    raise SystemExit(f"error: cannot import {mod_name!r}: {e}") from e
  fn = getattr(mod, fn_name, None)
  if not callable(fn):
    raise SystemExit(f"error: {mod_name} has no function {fn_name!r}")
  got = fn()
  if not (isinstance(got, tuple) and len(got) == 2 and callable(got[0])):
    raise SystemExit(f"error: {spec}() must return (step, example_args), got "
                     f"{type(got).__name__}")
  step, args = got
  return step, tuple(args)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m autoddl_jax",
                               description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("plan", help="plan MODULE:FUNCTION's step and explain it")
  p.add_argument("target", help="MODULE:FUNCTION returning (step, args)")
  p.add_argument("--mesh", required=True, type=parse_mesh,
                 help="axis=size pairs, e.g. data=2,model=4")
  p.add_argument("--devices-per-node", type=int, default=None)
  p.add_argument("--memory-budget", type=parse_bytes, default=None,
                 help="per device, e.g. 16GiB")
  p.add_argument("--save", default=None, help="write the plan as JSON here")
  p.add_argument("--rows", type=_rows, default=40, help="rows per table")
  s = sub.add_parser("show", help="print a saved plan")
  s.add_argument("path")
  args = ap.parse_args(argv)

  import autoddl_jax as ad
  from autoddl_jax import _io
  if args.cmd == "show":
    try:
      print(_io.show(args.path))
    except ad.PlanFileError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return 0
  from jax.sharding import AbstractMesh
  step, example = _load_target(args.target)
  mesh = AbstractMesh(tuple(args.mesh.values()), tuple(args.mesh))
  cluster = ad.H100_NODE
  if args.devices_per_node is not None:
    cluster = dataclasses.replace(cluster,
                                  devices_per_node=args.devices_per_node)
  try:
    plan = ad.plan(step, *example, mesh=mesh, cluster=cluster,
                   memory_budget=args.memory_budget)
  except ad.MemoryBudgetError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(plan.explain(max_rows=args.rows))
  if args.save:
    plan.save(args.save)
    print(f"saved {args.save}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
