"""How planning time grows: with layers (12 -> 96, scanned and unrolled) and
with devices (8 -> 1024, abstract meshes of 1 to 3 axes), with the exact
solver's time beside it where it finishes.

    python benchmarks/scaling.py [--exact-limit 60]

Everything is planned abstractly (shapes only) for the default H100 cluster.
``plan s`` is the whole of ``ad.plan`` (trace, graph, search); ``exact s`` is
the MILP on the same problem (``timeout`` past the limit) and ``gap`` is the
search's objective over the exact one.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.sharding import AbstractMesh  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _search  # noqa: E402
from autoddl_jax.testing import models  # noqa: E402


def gpt(n_layers: int, scan: bool, d_model: int = 768, batch: int = 32):
  return models.gpt(models.GptConfig(
      vocab=32768, d_model=d_model, n_heads=12, n_layers=n_layers, seq=1024,
      batch=batch, scan=scan), abstract=True)


def _mesh(shape):
  return AbstractMesh(shape, ("data", "model", "pipe")[:len(shape)] if
                      len(shape) < 3 else ("data", "fsdp", "model"))


def run(name, ex, shape, exact_limit, exact_max_ops):
  mesh = _mesh(shape)
  t0 = time.perf_counter()
  plan = ad.plan(ex.step, *ex.args, mesh=mesh)
  dt = time.perf_counter() - t0
  if len(plan.graph.ops) > exact_max_ops:
    ex_s, gap = "skipped", ""  # the MILP alone would not fit in memory here
  elif (best := _search.exact(plan.problem, time_limit=exact_limit)) is None:
    ex_s, gap = "timeout", ""
  else:
    ex_s = f"{best.search_s:.1f}"
    gap = f"{plan.search.objective / best.objective - 1:+.2%}"
  row = (name, "x".join(map(str, shape)), str(len(plan.graph.ops)),
         str(len(plan.problem.groups)), f"{dt:.2f}", ex_s, gap)
  print("  ".join(row), flush=True)
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--exact-limit", type=float, default=60.0)
  ap.add_argument("--exact-max-ops", type=int, default=20000,
                  help="skip the exact solver on larger graphs")
  args = ap.parse_args(argv)
  warm = models.mlp(abstract=True)  # JAX's first trace costs ~1 s extra
  ad.plan(warm.step, *warm.args, mesh=AbstractMesh((2, 4), ("data", "model")))
  rows = [("model", "mesh", "ops", "coords", "plan s", "exact s", "gap")]
  for scan in (True, False):
    for n in (12, 24, 48, 96):
      rows.append(run(f"GPT-{n} {'scan' if scan else 'unrolled'}",
                      gpt(n, scan), (2, 4), args.exact_limit,
                      args.exact_max_ops))
  for shape in [(8,), (2, 4), (8, 8), (4, 4, 4), (16, 8), (8, 8, 8),
                (128, 8), (16, 8, 8)]:
    rows.append(run("GPT-12 scan d1536", gpt(12, True, d_model=1536,
                                             batch=1024), shape,
                    args.exact_limit, args.exact_max_ops))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  print()
  for r in rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
  print(f"\njax {jax.__version__}, autoddl_jax {ad.__version__}")


if __name__ == "__main__":
  main()
