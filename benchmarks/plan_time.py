"""How long planning takes: a 12-layer GPT (d_model 768) on a (2, 4) mesh and a
96-layer GPT (d_model 12288, layers in lax.scan) on 1024 devices (128 nodes x 8),
planned abstractly (shapes only, nothing allocated).

    python benchmarks/plan_time.py [--repeats 5] [--no-select]

Prints one table: model, mesh, ops in the graph, coordinates searched, seconds
to plan (trace + graph + search: the median of ``--repeats`` runs, and the
slowest), predicted step time and memory, the remat policy the planner
chose (the 96-layer GPT's activations do not fit an H100's default budget
without it) and the predicted model-FLOPs utilisation (6 N D / peak over
the predicted step time; a line per model gives the bound). Then, once, the scanned 12-layer
GPT planned on a concrete (2, 4) mesh of the 8 simulated CPU devices with
selection by the compiled program (``select="compiled"``): the search's
seconds and selection's, apart. The median because this machine's
speed varies by up to 2x from one run to the next (CPU time, not only wall
time), which one timing would report as the planner's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import AbstractMesh  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax.testing import models  # noqa: E402

CASES = [
    # name, config, mesh shape, mesh axes, concrete mesh?
    ("GPT-12 d768 scan", models.GptConfig(
        vocab=32768, d_model=768, n_heads=12, n_layers=12, seq=1024, batch=32,
        scan=True), (2, 4), ("data", "model")),
    ("GPT-12 d768 unrolled", models.GptConfig(
        vocab=32768, d_model=768, n_heads=12, n_layers=12, seq=1024, batch=32,
        scan=False), (2, 4), ("data", "model")),
    ("GPT-96 d12288 scan", models.GptConfig(
        vocab=51200, d_model=12288, n_heads=96, n_layers=96, seq=2048,
        batch=1024, scan=True, dtype=jax.numpy.bfloat16), (128, 8),
     ("data", "model")),
]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--no-select", action="store_true",
                  help="skip the selection run (it compiles ~8 programs)")
  args = ap.parse_args(argv)
  # Warm JAX's tracing machinery up once, so the first row is not charged
  # with it (a cold first call costs about a second more).
  warm = models.mlp(abstract=True)
  ad.plan(warm.step, *warm.args, mesh=AbstractMesh((2, 4), ("data", "model")))
  rows = [("model", "mesh", "ops", "coords", "plan s (median)", "slowest",
           "step ms (pred)", "memory/device", "remat", "MFU (pred)")]
  notes = []
  for name, cfg, shape, axes in CASES:
    mesh = AbstractMesh(shape, axes)
    times = []
    for _ in range(args.repeats):
      ex = models.gpt(cfg, abstract=True)
      t0 = time.perf_counter()
      plan = ad.plan(ex.step, *ex.args, mesh=mesh)
      times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    # Model-FLOPs utilisation: 6 N D (N parameters, D tokens per step) at
    # the cluster's peak on every device, over the predicted step time.
    n_params = sum(x.size for x in jax.tree.leaves(ex.args[0]))
    tokens = cfg.batch * cfg.seq
    devices = math.prod(shape)
    bound = 6 * n_params * tokens / (devices * plan.cluster.peak_flops)
    rows.append((name, "x".join(map(str, shape)), str(len(plan.graph.ops)),
                 str(len(plan.problem.groups)), f"{med:.2f}",
                 f"{max(times):.2f}", f"{plan.cost.time_s * 1e3:.1f}",
                 f"{plan.cost.memory_bytes / 2**30:.1f} GiB", str(plan.remat),
                 f"{bound / plan.cost.time_s:.1%}"))
    budget = plan.memory_budget
    notes.append(
        f"{name}: {n_params / 1e9:.3g}B parameters, {tokens} tokens/step: "
        f"6ND/peak bound {bound * 1e3:.1f} ms on {devices} devices; "
        f"predicted {plan.cost.time_s * 1e3:.1f} ms; memory "
        f"{plan.cost.memory_bytes / 2**30:.1f} GiB of the budget "
        + ("(none)" if budget is None else f"{budget / 2**30:.1f} GiB"))
    print(f"{name}: " + ", ".join(f"{t:.2f}" for t in times) + " s",
          flush=True)
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  for r in rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
  for n in notes:
    print(n)
  if not args.no_select:
    name, cfg, shape, axes = CASES[0]
    ex = models.gpt(cfg, abstract=True)
    mesh = jax.make_mesh(shape, axes,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    t0 = time.perf_counter()
    plan = ad.plan(ex.step, *ex.args, mesh=mesh, select="compiled",
                   select_s=float("inf"))
    total = time.perf_counter() - t0
    sel = plan.selection
    won = sel.candidates[sel.winner]
    print(f"\n{name} on a concrete {'x'.join(map(str, shape))} mesh, "
          f"select='compiled': {total:.1f} s in all, search "
          f"{plan.search_s:.2f} s, compiling "
          f"{sum(c.compiled is not None for c in sel.candidates)} of "
          f"{len(sel.candidates)} candidates {sel.compile_s:.1f} s; chosen "
          f"{won.name} ({won.lowering}), compiled "
          f"{won.compiled.time_s * 1e3:.2f} ms")
  print(f"jax {jax.__version__}, autoddl_jax {ad.__version__}")


if __name__ == "__main__":
  main()
