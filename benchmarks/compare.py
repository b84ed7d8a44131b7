"""autoddl_jax's plans against the plans an expert writes, in one run.

    python benchmarks/compare.py [--quick] [--csv benchmarks/results/compare.csv]

For each model (MLP, GPT-style transformer, VGG-style CNN, mixture of experts)
at a realistic size, compiled abstractly (shapes only, nothing allocated) for
8 simulated CPU devices, on meshes (8,), (2,4), (4,2), for two clusters (2
nodes x 4 devices, 1 node x 8) and with and without a memory budget that rules
out pure data parallelism:

  * hand plans -- DP, FSDP (ZeRO-3), Megatron TP+DP, FSDP+TP (MaxText-style):
    ``jax.jit`` with their in/out shardings, XLA propagating the rest;
  * autoddl_jax's plan (``ad.plan(...).jit()``), with its search time;
  * the exact optimum of the same cost model (MILP, <= 60 s) and the search's
    gap to it (runs without a budget: the MILP has no memory constraint).

Each plan is scored twice, per device per step: by the cost model (what
``ad.cost_of`` / ``plan.cost`` predict) and by what XLA emitted -- its FLOPs
(``cost_analysis``) at the cluster's sustained rate plus its collectives on the
cluster's alpha-beta links -- with XLA's peak memory. ``pred/emit`` is
predicted over emitted collective bytes. One table is printed, and a CSV
written.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # XLA's partitioner warnings

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _hlo, _search, models  # noqa: E402
from autoddl_jax._cluster import mesh_info  # noqa: E402
from autoddl_jax._verify import (  # noqa: E402
    _first, compare_compiled, compile_plan, peak_bytes)

CLUSTERS = {
    "2x4": dataclasses.replace(ad.H100_NODE, devices_per_node=4),
    "1x8": ad.H100_NODE,
}
MESHES = [(8,), (2, 4), (4, 2)]
BUDGET_FRACTION = 0.6  # of data parallel's predicted peak memory


def examples(quick: bool):
  if quick:
    return {
        "mlp": (models.mlp(abstract=True), "mlp"),
        "gpt": (models.gpt(abstract=True), "gpt"),
    }
  return {
      "mlp": (models.mlp(batch=1024, sizes=(4096, 16384, 16384, 4096, 1024),
                         abstract=True), "mlp"),
      "gpt": (models.gpt(models.GptConfig(
          vocab=32768, d_model=1024, n_heads=16, n_layers=8, seq=1024,
          batch=16), abstract=True), "gpt"),
      "vgg": (models.vgg(batch=64, image=64, channels=(64, 128, 256, 512),
                         hidden=4096, classes=1000, abstract=True), "vgg"),
      "moe": (models.moe(tokens=8192, d_model=1024, d_ff=4096, experts=8,
                         abstract=True), "moe"),
  }


def _mesh(shape):
  names = ("data",) if len(shape) == 1 else ("data", "model")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _xla_seconds(flops, comm_s, cluster):
  """XLA's FLOPs at the cluster's sustained rate plus its collectives' time."""
  return flops / (cluster.peak_flops * cluster.flops_efficiency) + comm_s


def _xla_score(compiled, mesh, cluster):
  """(seconds, emitted bytes, peak memory bytes) of a compiled hand plan
  (autoddl's plans are scored from their Verification)."""
  cols = _hlo.collectives(compiled, mesh)
  cost = _first(compiled.cost_analysis())
  flops = float(cost.get("flops", 0.0)) if cost else 0.0
  peak = peak_bytes(compiled.memory_analysis())
  seconds = _xla_seconds(flops, _hlo.emitted_seconds(
      cols, mesh_info(mesh, cluster)), cluster)
  return seconds, sum(c.total_bytes_per_device for c in cols), float(peak)


def _compile_hand(ex, mesh, shardings):
  named = jax.tree.map(lambda s: NamedSharding(mesh, s), shardings,
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
  rep = NamedSharding(mesh, PartitionSpec())
  outs = (named[0], named[1], rep)
  args = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      ex.args, named)
  return jax.jit(ex.step, in_shardings=named, out_shardings=outs).lower(
      *args).compile()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="tiny models (a smoke run of the whole pipeline)")
  ap.add_argument("--csv", default="benchmarks/results/compare.csv")
  ap.add_argument("--exact-limit", type=float, default=60.0)
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  rows, disagreements = [], []
  compiled_cache = {}
  for mname, (ex, family) in examples(args.quick).items():
    for shape in MESHES:
      mesh = _mesh(shape)
      hands = models.hand_plans(ex, mesh, family)
      for cname, cluster in CLUSTERS.items():
        dp_mem = ad.cost_of(ex.step, *ex.args, mesh=mesh,
                            in_shardings=hands["dp"],
                            cluster=cluster).memory_bytes
        for budget in (None, BUDGET_FRACTION * dp_mem):
          case = dict(model=mname, cluster=cname,
                      mesh="x".join(map(str, shape)),
                      budget="-" if budget is None else
                      f"{budget / 2**30:.3g}GiB")
          print(f"[compare] {case}", file=sys.stderr, flush=True)
          scored = []
          for hname, sh in hands.items():
            pred = ad.cost_of(ex.step, *ex.args, mesh=mesh, in_shardings=sh,
                              cluster=cluster)
            key = (mname, shape, hname)
            if key not in compiled_cache:
              compiled_cache[key] = _compile_hand(ex, mesh, sh)
            xla_s, emitted, peak = _xla_score(compiled_cache[key], mesh,
                                              cluster)
            fits = budget is None or peak <= budget
            scored.append(dict(case, plan=hname, model_ms=pred.time_s * 1e3,
                               xla_ms=xla_s * 1e3, pred_emit=(
                                   pred.comm_bytes / emitted if emitted
                                   else float("nan")),
                               xla_mem_gib=peak / 2**30, fits=fits,
                               search_s="", exact_gap=""))
          try:
            plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=cluster,
                           memory_budget=budget)
          except ad.MemoryBudgetError as e:
            print(f"[compare]   no plan fits: {e}", file=sys.stderr)
            rows += scored
            continue
          v = compare_compiled(plan, *compile_plan(plan))
          xla_s = _xla_seconds(v.xla_flops or 0.0, v.emitted_comm_s, cluster)
          emitted, peak = v.emitted_bytes, v.xla_memory
          disagreements.append(dict(
              case, **{f"{k} MiB (pred/XLA)":
                       f"{p / 2**20:.3g}/{e / 2**20:.3g}"
                       for k, (p, e) in v.by_kind.items()},
              flops_ratio=v.predicted_flops_loops_once / v.xla_flops
              if v.xla_flops else float("nan"),
              memory_ratio=v.predicted_memory / v.xla_memory
              if v.xla_memory else float("nan"),
              off=", ".join(v.disagreements()) or "-"))
          gap = ""
          if budget is None:
            best = _search.exact(plan.problem, time_limit=args.exact_limit)
            if best is not None:
              gap = f"{plan.search.objective / best.objective - 1:+.2%}"
            else:
              gap = "timeout"
          scored.append(dict(
              case, plan="autoddl", model_ms=plan.cost.time_s * 1e3,
              xla_ms=xla_s * 1e3,
              pred_emit=plan.cost.comm_bytes / emitted if emitted
              else float("nan"),
              xla_mem_gib=peak / 2**30,
              fits=budget is None or peak <= budget,
              search_s=f"{plan.search_seconds:.2f}", exact_gap=gap))
          best_hand = min((r["xla_ms"] for r in scored[:-1] if r["fits"]),
                          default=float("nan"))
          for r in scored:
            r["vs_best_hand"] = r["xla_ms"] / best_hand
          rows += scored
  _print(rows)
  _summary(rows)
  print("\nWhere autoddl's plans and XLA disagree (bytes per device per step "
        "by collective kind; FLOPs with loop bodies counted once; peak "
        "memory); 'off' lists what differs by more than 10%:")
  _print_disagreements(disagreements)
  os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
  with open(args.csv, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  print(f"\nwrote {args.csv}; {time.perf_counter() - t_start:.0f} s in all; "
        f"jax {jax.__version__}, autoddl_jax {ad.__version__}")


def _fmt(v):
  if isinstance(v, float):
    return "nan" if math.isnan(v) else f"{v:.4g}"
  return str(v)


def _table(cols, rows, missing=""):
  table = [cols] + [[_fmt(r.get(c, missing)) for c in cols] for r in rows]
  widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
  for t in table:
    print("  ".join(c.ljust(w) for c, w in zip(t, widths)))


def _print(rows):
  _table(["model", "cluster", "mesh", "budget", "plan", "model_ms", "xla_ms",
          "vs_best_hand", "pred_emit", "xla_mem_gib", "fits", "search_s",
          "exact_gap"], rows)


def _print_disagreements(rows):
  kinds = [k for k in ("all-reduce", "reduce-scatter", "all-gather",
                       "all-to-all", "collective-permute")
           if any(f"{k} MiB (pred/XLA)" in r for r in rows)]
  _table(["model", "cluster", "mesh", "budget"] + [
      f"{k} MiB (pred/XLA)" for k in kinds] + ["flops_ratio", "memory_ratio",
                                                "off"], rows, missing="-")


def _summary(rows):
  ours = [r for r in rows if r["plan"] == "autoddl"]
  ratios = [r["vs_best_hand"] for r in ours if not math.isnan(
      r["vs_best_hand"])]
  if ratios:
    gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    worse = sum(x > 1.0 for x in ratios)
    print(f"\nautoddl vs best hand plan (XLA-scored): geometric mean {gm:.3f}, "
          f"worse on {worse} of {len(ratios)} cases")
  pe = [r["pred_emit"] for r in rows if not math.isnan(r["pred_emit"])]
  inside = sum(0.9 <= x <= 1.1 for x in pe)
  print(f"predicted/emitted bytes within 0.9-1.1: {inside} of {len(pe)} "
        f"plans (range {min(pe):.2f}-{max(pe):.2f})")
  gaps = [float(r["exact_gap"].rstrip("%")) for r in ours
          if r["exact_gap"] not in ("", "timeout")]
  if gaps:
    print(f"gap to exact optimum: max {max(gaps):+.2f}% over {len(gaps)} "
          f"cases ({sum(r['exact_gap'] == 'timeout' for r in ours)} timed out)")


if __name__ == "__main__":
  main()
