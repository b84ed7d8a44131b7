"""How well the cost model predicts what XLA compiles, on the held-out zoo.

    python benchmarks/fidelity.py [--models llama,vit] [--meshes 8,2x4]
                                  [--clusters 2x4,1x8] [--size realistic]
                                  [--resume LOG ...]

(``--resume`` takes the cases an interrupted run finished from its stderr
log -- every finished case is logged as one JSON ``case`` line -- and runs
the rest; ``--summarize TXT ... --resume LOG ...`` prints the tables with
the logs' cases in place of the same cases, compiling nothing.)

For each zoo model (benchmarks/zoo.py, compiled abstractly: nothing
allocated) x mesh x cluster, and each plan -- the textbook plans DP, FSDP and
Megatron (the planner's own seeds: the layouts ``plan.baseline_cost`` names)
completed by ``ad.hand_plan``, and the planner's plan -- every plan is lowered
with all its pins and compiled for 8 simulated CPU devices, then predicted
against the compiled program:

  * time: the plan's predicted time (its collectives, and its FLOPs with loop
    bodies once, as XLA counts them) against XLA's FLOPs at the cluster's
    sustained rate plus its emitted collectives on the same alpha-beta links
    (a CPU all-reduce whose result is only sliced counted as the GPU's
    reduce-scatter, bf16 read as bf16: ``plan.verify``'s reading);
  * bytes by collective kind, FLOPs (loop bodies once, as XLA counts them)
    and peak memory against ``memory_analysis``;
  * per case, Kendall's tau between the predicted and the compiled ranking
    of its plans.

One table, one summary line. The clusters are the fidelity issue's: 2 nodes
x 4 and 1 node x 8, 450 GB/s inside a node, 50 GB/s across, 400 TFLOP/s
sustained (``flops_efficiency=1.0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # partitioner warnings

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _hlo  # noqa: E402
from autoddl_jax._cluster import mesh_info  # noqa: E402
from autoddl_jax._verify import _first, compare_compiled, compile_plan  # noqa: E402
from autoddl_jax._verify import peak_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402

_BASE = dataclasses.replace(ad.H100_NODE, peak_flops=400e12,
                            flops_efficiency=1.0)
CLUSTERS = {"2x4": dataclasses.replace(_BASE, devices_per_node=4),
            "1x8": _BASE}
MESHES = {"8": (8,), "2x4": (2, 4), "4x2": (4, 2)}
TEXTBOOK = ("dp", "fsdp", "megatron")


def _mesh(shape):
  names = ("data",) if len(shape) == 1 else ("data", "model")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _xla_seconds(flops, comm_s, cluster):
  """XLA's FLOPs at the cluster's sustained rate plus its collectives' time."""
  return flops / (cluster.peak_flops * cluster.flops_efficiency) + comm_s


def _xla_score(compiled, mesh, cluster):
  """(seconds, emitted bytes, peak memory bytes) of a compiled program, its
  FLOPs as ``cost_analysis`` counts them (loop bodies once: fidelity.py
  predicts on that footing)."""
  cols = _hlo.collectives(compiled, mesh)
  cost = _first(compiled.cost_analysis())
  flops = float(cost.get("flops", 0.0)) if cost else 0.0
  peak = peak_bytes(compiled.memory_analysis())
  seconds = _xla_seconds(flops, _hlo.emitted_seconds(
      cols, mesh_info(mesh, cluster)), cluster)
  return seconds, sum(c.total_bytes_per_device for c in cols), float(peak)


def textbook_shardings(plan: ad.Plan, kind: str):
  """The in_shardings pytree of a textbook plan, as a user writes it."""
  return plan.textbook(kind).in_specs


def score(plan: ad.Plan, cluster: ad.Cluster) -> dict:
  """Predicted and XLA time, on the same footing: XLA's cost_analysis counts
  a ``while`` body's FLOPs once, so the prediction's compute is taken with
  loop bodies once too (collectives count every trip on both sides)."""
  v = compare_compiled(plan, *compile_plan(plan))
  xla_s = _xla_seconds(v.xla_flops or 0.0, v.emitted_comm_s, cluster)
  rate = cluster.peak_flops * cluster.flops_efficiency
  pred_s = plan.cost.comm_s + v.predicted_flops_loops_once / rate
  return dict(pred_ms=pred_s * 1e3, xla_ms=xla_s * 1e3,
              by_kind=v.by_kind, flops=(v.predicted_flops_loops_once,
                                        v.xla_flops or float("nan")),
              mem=(v.predicted_memory, v.xla_memory or float("nan")))


def _dp_baseline_ms(plan: ad.Plan) -> float:
  """``plan.baseline_cost("dp")`` with loop bodies' compute counted once
  (as XLA's cost_analysis counts it; see :func:`score`)."""
  prob = plan.problem
  choice = plan.baseline_choice("dp")
  once = sum(prob.compute[o.id][choice[o.id]] / o.weight
             for o in plan.graph.ops if o.weight > 0)
  return (plan.baseline_cost("dp").comm_s + once) * 1e3


def _user_dp_ms(case, mesh, plan: ad.Plan, cluster: ad.Cluster) -> float:
  """XLA's score of the DP shardings compiled as a user writes them."""
  specs = textbook_shardings(plan, "dp")
  named = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs,
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
  args = jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
      case.args, named)
  compiled = jax.jit(case.step, in_shardings=named).lower(*args).compile()
  return _xla_score(compiled, mesh, cluster)[0] * 1e3


def case_grid(args):
  """(model name, zoo case, mesh key, mesh, cluster key, cluster) for every
  case the command line names (``--models``, ``--meshes``, ``--clusters``,
  ``--size``); compare.py walks the same grid."""
  for name in args.models.split(","):
    case = zoo.build(name, size=args.size, abstract=True)
    for mkey in args.meshes.split(","):
      mesh = _mesh(MESHES[mkey])
      for ckey in args.clusters.split(","):
        yield name, case, mkey, mesh, ckey, CLUSTERS[ckey]


def kendall_tau(a, b) -> float:
  pairs = list(itertools.combinations(range(len(a)), 2))
  s = sum(math.copysign(1, (a[i] - a[j]) * (b[i] - b[j]))
          for i, j in pairs if (a[i] - a[j]) * (b[i] - b[j]) != 0)
  return s / len(pairs) if pairs else float("nan")


def _ratio(p, e):
  return p / e if e else (1.0 if not p else float("inf"))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(zoo.BUILDERS))
  ap.add_argument("--meshes", default=",".join(MESHES))
  ap.add_argument("--clusters", default=",".join(CLUSTERS))
  ap.add_argument("--size", default="realistic", choices=("tiny",
                                                          "realistic"))
  ap.add_argument("--summarize", nargs="+", metavar="TXT",
                  help="merge the tables of runs split by --models (this "
                       "script's printed output) into one table and summary; "
                       "nothing is compiled (with --resume, the logs' cases "
                       "replace the tables' same cases)")
  ap.add_argument("--resume", nargs="+", metavar="LOG", default=(),
                  help="stderr logs of interrupted runs: the cases they "
                       "finished are taken from them, not run again")
  args = ap.parse_args(argv)
  if args.summarize:
    rows, taus, dp_rows = [], [], []
    for path in args.summarize:
      r, t, d = _read_output(path)
      rows, taus, dp_rows = rows + r, taus + t, dp_rows + d
    _report(*_replace_cases(rows, dp_rows, _logged_cases(args.resume)))
    return
  t0 = time.perf_counter()
  rows, taus, dp_rows = [], [], []
  done = _logged_cases(args.resume)
  for name, case, mkey, mesh, ckey, cluster in case_grid(args):
    print(f"[fidelity] {name} mesh {mkey} cluster {ckey}",
          file=sys.stderr, flush=True)
    logged = done.get((name, mkey, ckey))
    if logged is not None:
      print("[fidelity]   finished in a resumed log", file=sys.stderr)
      _log_case(logged)  # this log, too, holds every finished case
      rows += logged["rows"]
      taus.append(logged["tau"])
      dp_rows.append(logged["dp"])
      continue
    ours = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                   verbose=False)
    plans = {k: ad.hand_plan(case.step, *case.args, mesh=mesh,
                             in_shardings=textbook_shardings(ours, k),
                             cluster=cluster) for k in TEXTBOOK}
    plans["autoddl"] = ours
    dp_rows.append(dict(model=name, mesh=mkey, cluster=ckey,
                        pred_ms=_dp_baseline_ms(ours),
                        xla_ms=_user_dp_ms(case, mesh, ours, cluster)))
    case_rows = []
    for pname, p in plans.items():
      s = score(p, cluster)
      case_rows.append(dict(model=name, mesh=mkey, cluster=ckey,
                            plan=pname, **s))
      print(f"[fidelity]   {pname}: predicted {s['pred_ms']:.4g} ms, "
            f"XLA {s['xla_ms']:.4g} ms", file=sys.stderr, flush=True)
    taus.append(kendall_tau([r["pred_ms"] for r in case_rows],
                            [r["xla_ms"] for r in case_rows]))
    for r in case_rows:
      r["tau"] = taus[-1]
    rows += case_rows
    _log_case(dict(rows=case_rows, tau=taus[-1], dp=dp_rows[-1]))
  _report(rows, taus, dp_rows)
  print(f"{time.perf_counter() - t0:.0f} s in all; jax {jax.__version__}")


_CASE = "[fidelity]   case "


def _log_case(case: dict) -> None:
  """One finished case on stderr, whole: what ``--resume`` reads back."""
  print(_CASE + json.dumps(case), file=sys.stderr, flush=True)


def logged(paths, prefix: str):
  """The JSON objects logged after ``prefix`` in earlier runs' stderr logs,
  in order (what ``--resume`` reads here and in compare.py)."""
  for path in paths:
    with open(path) as f:
      for ln in f:
        if ln.startswith(prefix):
          yield json.loads(ln[len(prefix):])


def _logged_cases(paths) -> dict[tuple, dict]:
  """The finished cases in earlier runs' stderr logs, by (model, mesh,
  cluster); the last one logged wins."""
  cases = {}
  for c in logged(paths, _CASE):
    for r in c["rows"]:  # JSON has no tuples
      r["by_kind"] = {k: tuple(v) for k, v in r["by_kind"].items()}
      r["flops"], r["mem"] = tuple(r["flops"]), tuple(r["mem"])
    d = c["dp"]
    cases[d["model"], d["mesh"], d["cluster"]] = c
  return cases


def _replace_cases(rows, dp_rows, cases: dict[tuple, dict]):
  """(rows, taus, DP rows) of printed tables with the cases of later runs'
  logs put in place of the same (model, mesh, cluster), or added."""
  key = lambda r: (r["model"], r["mesh"], r["cluster"])  # noqa: E731
  order = list(dict.fromkeys([key(r) for r in rows] + list(cases)))
  by_case: dict[tuple, list] = {}
  for r in rows:
    by_case.setdefault(key(r), []).append(r)
  dp = {key(d): d for d in dp_rows}
  tau = {k: rs[0]["tau"] for k, rs in by_case.items()}
  for k, c in cases.items():
    by_case[k], dp[k], tau[k] = c["rows"], c["dp"], c["tau"]
  out = [r for k in order for r in by_case[k]]
  return out, [tau[k] for k in order], [dp[k] for k in order if k in dp]


def _report(rows, taus, dp_rows):
  _print(rows)
  print("\nThe data-parallel baseline (baseline_cost('dp')) against XLA's "
        "program for DP shardings as a user writes them (jax.jit "
        "in_shardings, XLA propagating the rest):")
  for r in dp_rows:
    print(f"  {r['model']:7} mesh {r['mesh']:4} cluster {r['cluster']}: "
          f"predicted {r['pred_ms']:.4g} ms, XLA {r['xla_ms']:.4g} ms "
          f"({_ratio(r['pred_ms'], r['xla_ms']):.2f})")
  _summary(rows, taus)
  ok = sum(abs(_ratio(r["pred_ms"], r["xla_ms"]) - 1) <= 0.15
           for r in dp_rows)
  print(f"data-parallel baseline within 15% of XLA's DP in {ok}/"
        f"{len(dp_rows)} cases")


def _read_output(path: str):
  """(rows, per-case taus, DP rows) from this script's printed output (the
  table's 4 significant digits: a ratio within 0.1% of a tolerance may
  read either way)."""
  with open(path) as f:
    lines = f.read().splitlines()
  at = next(i for i, ln in enumerate(lines) if ln.startswith("model "))
  head = [h for h in lines[at].split("  ") if h.strip()]
  head = [h.strip() for h in head]
  rows, taus, dp_rows = [], [], []

  def pair(cell, unit):
    return tuple(float(x) * unit for x in cell.split("/"))

  for ln in lines[at + 1:]:
    cells = [c for c in ln.split("  ") if c.strip()]
    if len(cells) != len(head):
      break
    d = dict(zip(head, (c.strip() for c in cells)))
    by_kind = {h.split(" MiB")[0]: pair(d[h], 2**20) for h in head
               if h.endswith("MiB pred/xla")}
    by_kind = {k: v for k, v in by_kind.items() if v != (0.0, 0.0)}
    rows.append(dict(model=d["model"], mesh=d["mesh"], cluster=d["cluster"],
                     plan=d["plan"], pred_ms=float(d["pred_ms"]),
                     xla_ms=float(d["xla_ms"]), by_kind=by_kind,
                     flops=(float(d["flops pred/xla"]), 1.0),
                     mem=pair(d["mem GiB pred/xla"], 2**30),
                     tau=float(d["tau"])))
  for i, r in enumerate(rows):
    if i == 0 or any(r[k] != rows[i - 1][k] for k in ("model", "mesh",
                                                        "cluster")):
      taus.append(r["tau"])
  for ln in lines:
    m = re.match(r"\s+(\S+)\s+mesh (\S+)\s+cluster (\S+): predicted (\S+) ms, "
                 r"XLA (\S+) ms", ln)
    if m:
      dp_rows.append(dict(model=m[1], mesh=m[2], cluster=m[3],
                          pred_ms=float(m[4]), xla_ms=float(m[5])))
  return rows, taus, dp_rows


def _print(rows):
  kinds = sorted({k for r in rows for k in r["by_kind"]})
  head = ["model", "mesh", "cluster", "plan", "pred_ms", "xla_ms",
          "pred/xla"] + [f"{k} MiB pred/xla" for k in kinds] + [
              "flops pred/xla", "mem GiB pred/xla", "tau"]
  table = [head]
  for r in rows:
    cells = [r["model"], r["mesh"], r["cluster"], r["plan"],
             f"{r['pred_ms']:.4g}", f"{r['xla_ms']:.4g}",
             f"{_ratio(r['pred_ms'], r['xla_ms']):.2f}"]
    for k in kinds:
      p, e = r["by_kind"].get(k, (0.0, 0.0))
      cells.append(f"{p / 2**20:.4g}/{e / 2**20:.4g}")
    cells += [f"{_ratio(*r['flops']):.2f}",
              f"{r['mem'][0] / 2**30:.3g}/{r['mem'][1] / 2**30:.3g}",
              f"{r['tau']:+.2f}"]
    table.append(cells)
  widths = [max(len(t[i]) for t in table) for i in range(len(head))]
  for t in table:
    print("  ".join(c.ljust(w) for c, w in zip(t, widths)))


def _summary(rows, taus):
  n = len(rows)
  time_ok = sum(abs(_ratio(r["pred_ms"], r["xla_ms"]) - 1) <= 0.15
                for r in rows)
  bytes_ok = sum(all(abs(_ratio(p, e) - 1) <= 0.10
                     for p, e in r["by_kind"].values()) for r in rows)
  mem_ok = sum(abs(_ratio(*r["mem"]) - 1) <= 0.30 for r in rows)
  good_tau = sum(t >= 0.8 for t in taus)
  print(f"\nfidelity: time within 15% on {time_ok}/{n} plans, bytes by kind "
        f"within 10% on {bytes_ok}/{n}, peak memory within 30% on "
        f"{mem_ok}/{n}; Kendall tau >= 0.8 in {good_tau}/{len(taus)} cases "
        f"(mean {sum(taus) / len(taus):+.2f})")


if __name__ == "__main__":
  main()
