"""Message passing in the search: TRW-S against over-relaxed weights.

    python benchmarks/search_quality.py [--quick]

For each model, mesh and cluster below (the models compare.py used before it
moved to the zoo, plus the 12-layer GPT of ``plan_time.py``) it plans twice
on the same problem: with the search's message passing as TRW-S (tree
weights 1/n, 100 iterations for the unseeded start, the settings before
over-relaxation) and as it is now (weights x1.5, at most 40 iterations,
stopping after 10 without a better labelling). Printed per case: the
iteration at which the unseeded start's labelling stopped improving, the
whole search's objective (predicted step time) and its seconds. Planning is
abstract (shapes only); the exact optimum is in ``compare.py`` and
``scaling.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import plan_time  # noqa: E402 (its 12-layer GPT)
from jax.sharding import AbstractMesh  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _program, _search, _seeds  # noqa: E402
from autoddl_jax.testing import models  # noqa: E402

TRWS = _search.SearchOptions(seeded=_search.Passing(1.0, 100, 3),
                             unseeded=_search.Passing(1.0, 100, 100))
NOW = _search.DEFAULT


CLUSTERS = {
    "2x4": dataclasses.replace(ad.H100_NODE, devices_per_node=4),
    "1x8": ad.H100_NODE,
}
MESHES = [(8,), (2, 4), (4, 2)]


def examples(quick: bool):
  if quick:
    return {"mlp": models.mlp(abstract=True), "gpt": models.gpt(abstract=True)}
  return {
      "mlp": models.mlp(batch=1024, sizes=(4096, 16384, 16384, 4096, 1024),
                        abstract=True),
      "gpt": models.gpt(models.GptConfig(
          vocab=32768, d_model=1024, n_heads=16, n_layers=8, seq=1024,
          batch=16), abstract=True),
      "vgg": models.vgg(batch=64, image=64, channels=(64, 128, 256, 512),
                        hidden=4096, classes=1000, abstract=True),
      "moe": models.moe(tokens=8192, d_model=1024, d_ff=4096, experts=8,
                        abstract=True),
  }


def cases(quick: bool):
  """The models, meshes and clusters above (and plan_time.py's 12-layer
  GPT): (name, example, mesh shape, cluster)."""
  for name, ex in examples(quick).items():
    for shape in MESHES:
      for cname, cluster in CLUSTERS.items():
        yield f"{name} {'x'.join(map(str, shape))} {cname}", ex, shape, cluster
  if not quick:
    title, cfg, shape, _ = plan_time.CASES[0]
    yield f"{title} 2x4 1x8", models.gpt(cfg, abstract=True), shape, \
        ad.H100_NODE


def _search_with(options, prob, seeds):
  t0 = time.perf_counter()
  res = _search.search(prob, seeds, polish=getattr(prob, "untied", None),
                       options=options)
  return res, time.perf_counter() - t0


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny models")
  args = ap.parse_args(argv)
  rows = [("case", "TRW-S best@", "TRW-S ms", "TRW-S s", "x1.5 best@",
           "x1.5 ms", "x1.5 s", "x1.5/TRW-S")]
  ratios = []
  for name, ex, shape, cluster in cases(args.quick):
    mesh = AbstractMesh(shape, ("data",) if len(shape) == 1 else
                        ("data", "model"))
    program = _program.build(ex.step, ex.args, mesh, cluster)
    prob, seeds = program.problem, _seeds.seeds(program)
    out = []
    for settings in (TRWS, NOW):
      res, secs = _search_with(settings, prob, seeds)
      out.append((res.best_iteration[_search.FREE], res, secs))
    ratio = out[1][1].objective / out[0][1].objective
    ratios.append(ratio)
    rows.append((name, *(c for at, res, secs in out for c in (
        str(at), f"{res.objective * 1e3:.5g}", f"{secs:.2f}")),
        f"{ratio:.4f}"))
    print("  ".join(rows[-1]), flush=True)
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  print()
  for r in rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
  t_old = sum(float(r[3]) for r in rows[1:])
  t_new = sum(float(r[6]) for r in rows[1:])
  print(f"\nx1.5 better on {sum(r < 1 - 1e-9 for r in ratios)}, worse on "
        f"{sum(r > 1 + 1e-9 for r in ratios)} of {len(ratios)} cases "
        f"(worst {max(ratios):.4f}, best {min(ratios):.4f}); search seconds "
        f"{t_new:.1f} vs {t_old:.1f}.")
  print(f"jax {jax.__version__}, autoddl_jax {ad.__version__}")


if __name__ == "__main__":
  main()
