"""autoddl_jax's plans against the plans an expert writes, by the compiled program.

    python benchmarks/compare.py [--models llama,vit] [--meshes 8,2x4,4x2]
        [--clusters 2x4,1x8] [--budgets none,0.6] [--budget-clusters 2x4]
        [--size realistic] [--exact-limit 10]
        [--csv benchmarks/results/compare.csv] [--peaks CSV]

(``--budgets 0.6 --peaks benchmarks/results/compare.csv`` runs only the
budgeted cases, with DP's peaks from an earlier run's CSV.)

For each held-out zoo model (benchmarks/zoo.py, compiled abstractly: nothing
allocated) x mesh x cluster x memory budget (none, and fractions of the DP
plan's peak by XLA's ``memory_analysis``), ``ad.plan(select="compiled")``
compiles its candidates for 8 simulated CPU devices -- the search's plan
lowered with all its pins and with its boundary only, other starts' best
plans, and the textbook plans DP, FSDP, Megatron and FSDP+TP as a user writes
them (``jax.jit`` in/out shardings, XLA propagating the rest; tests/
test_select.py holds these to ``jax.jit`` of the step itself) -- and returns
the fastest that fits. Every plan is scored by its compiled program, per
device per step: XLA's FLOPs (every loop trip) at the cluster's sustained
rate plus its emitted collectives on the cluster's alpha-beta links, and its
``memory_analysis`` peak against the budget.

Per case the table gives the best fitting textbook plan, the search's own
plan (what the cost model alone returns, ``select="model"``), the chosen
plan, each against the best textbook plan, and the search's gap to the exact
optimum of its cost model (MILP, no budget). Summary lines follow; a CSV has
every candidate.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # XLA's partitioner warnings

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _search  # noqa: E402
from autoddl_jax._api import TEXTBOOK  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402
from fidelity import CLUSTERS, MESHES, case_grid  # noqa: E402 (same cases)


def _budget_label(frac):
  return "-" if frac is None else f"{frac:g}x DP"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(zoo.BUILDERS))
  ap.add_argument("--meshes", default=",".join(MESHES))
  ap.add_argument("--clusters", default=",".join(CLUSTERS))
  ap.add_argument("--budgets", default="none,0.6",
                  help="'none' and fractions of DP's XLA peak memory")
  ap.add_argument("--budget-clusters", default=",".join(CLUSTERS),
                  help="the clusters the budgets run on (none runs on all)")
  ap.add_argument("--size", default="realistic", choices=("tiny",
                                                          "realistic"))
  ap.add_argument("--exact-limit", type=float, default=10.0)
  ap.add_argument("--peaks", default=None,
                  help="a CSV this script wrote without budgets: its DP "
                       "peaks set the budgets, and the unbudgeted runs are "
                       "not repeated")
  ap.add_argument("--csv", default="benchmarks/results/compare.csv")
  args = ap.parse_args(argv)
  fracs = [None if b == "none" else float(b)
           for b in args.budgets.split(",")]
  known = {}
  if args.peaks:
    with open(args.peaks) as f:
      known = {(r["model"], r["mesh"], r["cluster"]):
               float(r["xla_mem_gib"]) * 2**30 for r in csv.DictReader(f)
               if r["candidate"] == "dp" and r["budget"] == "-"
               and r["xla_mem_gib"]}
  elif fracs[0] is not None:
    fracs = [None] + fracs  # the budgets are fractions of DP's peak there
  t0 = time.perf_counter()
  cases, cand_rows = [], []
  for name, case, mkey, mesh, ckey, cluster in case_grid(args):
    dp_peak = known.get((name, mkey, ckey))
    for frac in fracs:
      if frac is not None and ckey not in args.budget_clusters.split(","):
        continue
      budget = None if frac is None else frac * dp_peak
      head = dict(model=name, mesh=mkey, cluster=ckey,
                  budget=_budget_label(frac))
      print(f"[compare] {head}", file=sys.stderr, flush=True)
      try:
        plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                       memory_budget=budget, select="compiled",
                       select_seconds=math.inf, verbose=False)
      except ad.MemoryBudgetError as e:
        print(f"[compare]   no plan fits: {e}", file=sys.stderr)
        cases.append(dict(head, chosen="(none fits)"))
        continue
      sel = plan.selection
      cs = sel.candidates
      for i, c in enumerate(cs):
        cand_rows.append(dict(
            head, candidate=c.name, lowering=c.lowering,
            predicted_ms=c.predicted_s * 1e3,
            xla_ms=c.compiled.time_s * 1e3 if c.compiled else "",
            xla_mem_gib=c.compiled.memory_bytes / 2**30
            if c.compiled else "",
            fits=c.fits, chosen=i == sel.winner,
            note=c.skipped or c.error or ""))
      if frac is None:
        dp_peak = next(c.compiled.memory_bytes for c in cs
                       if c.name == "dp" and c.compiled)
      books = [c for c in cs if c.name in TEXTBOOK and c.compiled
               and c.fits is not False]
      book = min(books, key=lambda c: c.compiled.time_s)
      own = cs[0]  # the search's plan, all pins: the model's choice
      won = cs[sel.winner]
      gap = ""
      if frac is None and plan.search is not None:
        ex = _search.exact(plan.problem, time_limit=args.exact_limit)
        gap = ("timeout" if ex is None else
               f"{plan.search.objective / ex.objective - 1:+.2%}")
      emitted = won.compiled.comm_bytes
      cases.append(dict(
          head, best_textbook=book.name,
          textbook_ms=book.compiled.time_s * 1e3,
          search_ms=own.compiled.time_s * 1e3,
          search_vs=own.compiled.time_s / book.compiled.time_s,
          search_fits=own.fits,
          chosen=f"{won.name} ({won.lowering})",
          chosen_ms=won.compiled.time_s * 1e3,
          chosen_vs=won.compiled.time_s / book.compiled.time_s,
          pred_emit=plan.cost.comm_bytes / emitted if emitted
          else (1.0 if plan.cost.comm_bytes == 0 else math.inf),
          search_s=plan.search_seconds, select_s=sel.seconds,
          exact_gap=gap))
      print(f"[compare]   chosen {cases[-1]['chosen']} "
            f"{cases[-1]['chosen_vs']:.3f} x best textbook "
            f"({book.name}); search's plan {cases[-1]['search_vs']:.3f}",
            file=sys.stderr, flush=True)
  _table(["model", "mesh", "cluster", "budget", "best_textbook",
          "textbook_ms", "search_ms", "search_vs", "chosen", "chosen_ms",
          "chosen_vs", "pred_emit", "search_s", "select_s", "exact_gap"],
         cases)
  _summary(cases)
  os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
  with open(args.csv, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(cand_rows[0]))
    w.writeheader()
    w.writerows(cand_rows)
  print(f"\nwrote {args.csv} (every candidate); "
        f"{time.perf_counter() - t0:.0f} s in all; jax {jax.__version__}, "
        f"autoddl_jax {ad.__version__}")


def _fmt(v):
  if isinstance(v, float):
    return "nan" if math.isnan(v) else f"{v:.4g}"
  return str(v)


def _table(cols, rows):
  table = [cols] + [[_fmt(r.get(c, "")) for c in cols] for r in rows]
  widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
  for t in table:
    print("  ".join(c.ljust(w) for c, w in zip(t, widths)))


def _gmean(xs):
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _summary(cases):
  done = [c for c in cases if "chosen_vs" in c]
  if not done:
    return
  chosen = [c["chosen_vs"] for c in done]
  own = [c["search_vs"] for c in done]
  worse = [c for c in done if c["chosen_vs"] > 1 + 1e-9]
  books = [c for c in done if c["chosen"].split(" ")[0] in TEXTBOOK]
  print(f"\nchosen plan vs best textbook plan (compiled score): geometric "
        f"mean {_gmean(chosen):.3f}, worse on {len(worse)} of {len(done)} "
        f"cases, better on {sum(x < 1 - 1e-9 for x in chosen)}")
  print(f"the search's own plan (select='model') vs best textbook: geometric "
        f"mean {_gmean(own):.3f}, worse on "
        f"{sum(x > 1 + 1e-9 for x in own)} of {len(own)}")
  for c in books:
    print(f"  no plan better than a textbook plan found: {c['model']} mesh "
          f"{c['mesh']} cluster {c['cluster']} budget {c['budget']} -> "
          f"{c['chosen']}")
  pe = [c["pred_emit"] for c in done]
  print(f"chosen plans' predicted/emitted bytes within 0.9-1.1: "
        f"{sum(0.9 <= x <= 1.1 for x in pe)} of {len(pe)}")
  gaps = [float(c["exact_gap"].rstrip("%")) for c in done
          if c["exact_gap"] not in ("", "timeout")]
  if gaps:
    print(f"search gap to the exact optimum of its model: max "
          f"{max(gaps):+.2f}% over {len(gaps)} cases "
          f"({sum(c['exact_gap'] == 'timeout' for c in done)} timed out)")
  nofit = [c for c in cases if c.get("chosen") == "(none fits)"]
  if nofit:
    print(f"no plan fits: {len(nofit)} cases")


if __name__ == "__main__":
  main()
