"""autoddl_jax's plans against the plans an expert writes, by the compiled program.

    python benchmarks/compare.py [--models llama,vit] [--meshes 8,2x4,4x2]
        [--clusters 2x4,1x8] [--budgets none,0.6] [--budget-clusters 2x4]
        [--size realistic] [--exact-limit 10]
        [--csv benchmarks/results/compare.csv] [--peaks CSV]
        [--resume LOG ...]

(``--budgets 0.6`` runs only the budgeted cases: DP's peak is compiled for
each, or read from an earlier run's CSV with ``--peaks``. ``--resume`` takes
the cases an interrupted run finished from its stderr log -- every finished
case is logged as one JSON ``row`` line -- and runs the rest.)

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
optimum of its cost model (MILP, no budget: ``exact_gap`` by what the two
plans cost, ``pairwise_gap`` by the objective the MILP minimises).
``--exact-only`` prints just those gaps (no compiling). Summary lines follow;
a CSV has every candidate.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's warnings stay on: selection reads "Involuntary full
# rematerialization" from the compile log (INFO lines are dropped).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _search  # noqa: E402
from autoddl_jax._seeds import TEXTBOOK  # noqa: E402
from autoddl_jax._select import compiler_options  # noqa: E402
from autoddl_jax._verify import CompiledScore, compile_plan  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402
from fidelity import CLUSTERS, MESHES, case_grid  # noqa: E402 (same cases)
from fidelity import logged  # noqa: E402 (the same resume log format)


COLUMNS = ["model", "mesh", "cluster", "budget", "best_textbook",
           "textbook_ms", "search_ms", "search_vs", "search_fits", "chosen",
           "chosen_ms", "chosen_vs", "pred_emit", "remat", "search_s",
           "select_s", "exact_gap", "pairwise_gap"]
FLOATS = ("textbook_ms", "search_ms", "search_vs", "chosen_ms", "chosen_vs",
          "pred_emit", "search_s", "select_s")
# Ratios within this of 1 count as ties, in the "better on" count and the
# per-case "no plan better" lines alike: the printed tables keep 4 digits,
# and the search re-finding DP scores 0.99999 of it on the ResNet.
TIE = 1e-3


def _read_table(path: str) -> list[dict]:
  """The case rows of a table this script printed (fixed-width columns)."""
  with open(path) as f:
    lines = f.read().splitlines()
  at = next(i for i, ln in enumerate(lines) if ln.startswith("model "))
  head = lines[at]
  starts = [head.index(c if i == 0 else "  " + c) + (0 if i == 0 else 2)
            for i, c in enumerate(COLUMNS)]
  rows = []
  for ln in lines[at + 1:]:
    if not ln.strip():
      break
    cells = [ln[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
    r = dict(zip(COLUMNS, cells))
    if r["chosen"] != "(none fits)":
      for k in FLOATS:
        if r[k]:
          r[k] = float(r[k])
      r["remat"] = int(r["remat"])
      r["search_fits"] = {"True": True, "False": False}.get(r["search_fits"])
    rows.append({k: v for k, v in r.items() if v != ""})
  return rows


def _budget_label(frac):
  return "-" if frac is None else f"{frac:g}x DP"


def _chosen_label(won, plan) -> str:
  """The winning candidate, with the remat policy of its program where the
  planner chose one (``plan`` is the plan returned: the winner's)."""
  remat = getattr(plan, "remat", "none")
  if remat != "none":
    return f"{won.name} ({won.lowering}, remat {remat})"
  return f"{won.name} ({won.lowering})"


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
  ap.add_argument("--exact-only", action="store_true",
                  help="only the search's gaps to the exact optimum")
  ap.add_argument("--summarize", nargs="+", metavar="TXT",
                  help="print one table and summary from the outputs of "
                       "several runs (a split run: --models in parts)")
  ap.add_argument("--resume", nargs="+", metavar="LOG", default=(),
                  help="stderr logs of interrupted runs: the cases they "
                       "finished are taken from them, not run again")
  args = ap.parse_args(argv)
  if args.exact_only:
    return _gaps_only(args)
  if args.summarize:
    cases = [c for path in args.summarize for c in _read_table(path)]
    _table(COLUMNS, cases)
    return _summary(cases)
  fracs = [None if b == "none" else float(b)
           for b in args.budgets.split(",")]
  fracs.sort(key=lambda f: f is not None)  # unbudgeted first: DP's peak
  known = {}
  if args.peaks:
    with open(args.peaks) as f:
      known = {(r["model"], r["mesh"], r["cluster"]):
               float(r["xla_mem_gib"]) * 2**30 for r in csv.DictReader(f)
               if r["candidate"] == "dp" and r["budget"] == "-"
               and r["xla_mem_gib"]}
  done = _logged_rows(args.resume)
  t0 = time.perf_counter()
  cases, cand_rows = [], []
  for name, case, mkey, mesh, ckey, cluster in case_grid(args):
    dp_peak = known.get((name, mkey, ckey))
    for frac in fracs:
      if frac is not None and ckey not in args.budget_clusters.split(","):
        continue
      head = dict(model=name, mesh=mkey, cluster=ckey,
                  budget=_budget_label(frac))
      key = tuple(head.values())
      if key in done:
        cases.append(done[key])
        print(f"[compare] {head}: finished in a resumed log",
              file=sys.stderr)
        _log_row(cases[-1])  # this log, too, holds every finished case
        continue
      if frac is not None and dp_peak is None:
        dp_peak = _dp_peak(case, mesh, cluster)
      budget = None if frac is None else frac * dp_peak
      print(f"[compare] {head}", file=sys.stderr, flush=True)
      try:
        plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                       memory_budget=budget, select="compiled",
                       select_s=math.inf, verbose=False)
      except ad.MemoryBudgetError as e:
        print(f"[compare]   no plan fits: {e}", file=sys.stderr)
        cases.append(dict(head, chosen="(none fits)"))
        _log_row(cases[-1])
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
            remat=c.compiled.remat_warnings if c.compiled else "",
            note=c.skipped or c.error or ""))
      if frac is None:
        dp_peak = next(c.compiled.memory_bytes for c in cs
                       if c.name == "dp" and c.compiled)
      books = [c for c in cs if c.name in TEXTBOOK and c.compiled
               and c.fits is not False]
      own = cs[0]  # the search's plan, all pins: the model's choice
      won = cs[sel.winner]
      emitted = won.compiled.comm_bytes
      pred_emit = plan.cost.comm_bytes / emitted if emitted else (
          1.0 if plan.cost.comm_bytes == 0 else math.inf)
      if not books:  # the planner's plan fits where no hand plan does
        cases.append(dict(
            head, best_textbook="(none fits)",
            chosen=_chosen_label(won, plan),
            chosen_ms=won.compiled.time_s * 1e3, search_fits=own.fits,
            pred_emit=pred_emit, search_s=plan.search_s,
            select_s=sel.compile_s, remat=won.compiled.remat_warnings))
        _log_row(cases[-1])
        print(f"[compare]   chosen {cases[-1]['chosen']}: no textbook plan "
              "fits", file=sys.stderr, flush=True)
        continue
      book = min(books, key=lambda c: c.compiled.time_s)
      gap = pairwise = ""
      if frac is None and plan.search is not None:
        gap, pairwise = _exact_gaps(plan, args.exact_limit)
      cases.append(dict(
          head, best_textbook=book.name,
          textbook_ms=book.compiled.time_s * 1e3,
          search_ms=own.compiled.time_s * 1e3,
          search_vs=own.compiled.time_s / book.compiled.time_s,
          search_fits=own.fits,
          chosen=_chosen_label(won, plan),
          chosen_ms=won.compiled.time_s * 1e3,
          chosen_vs=won.compiled.time_s / book.compiled.time_s,
          pred_emit=pred_emit,
          remat=won.compiled.remat_warnings,
          search_s=plan.search_s, select_s=sel.compile_s,
          exact_gap=gap, pairwise_gap=pairwise))
      _log_row(cases[-1])
      print(f"[compare]   chosen {cases[-1]['chosen']} "
            f"{cases[-1]['chosen_vs']:.3f} x best textbook "
            f"({book.name}); search's plan {cases[-1]['search_vs']:.3f}",
            file=sys.stderr, flush=True)
  _table(COLUMNS, cases)
  _summary(cases)
  if not cand_rows:  # every case came from --resume: no candidate to write
    return
  os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
  with open(args.csv, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(cand_rows[0]))
    w.writeheader()
    w.writerows(cand_rows)
  print(f"\nwrote {args.csv} (every candidate); "
        f"{time.perf_counter() - t0:.0f} s in all; jax {jax.__version__}, "
        f"autoddl_jax {ad.__version__}")


_ROW = "[compare]   row "


def _log_row(row: dict) -> None:
  """One finished case on stderr, whole: what ``--resume`` reads back."""
  print(_ROW + json.dumps(row), file=sys.stderr, flush=True)


def _logged_rows(paths) -> dict[tuple, dict]:
  """The finished cases in earlier runs' stderr logs, by (model, mesh,
  cluster, budget); the last one logged wins."""
  return {(r["model"], r["mesh"], r["cluster"], r["budget"]): r
          for r in logged(paths, _ROW)}


def _exact_gaps(plan: ad.Plan, limit: float) -> tuple[str, str]:
  """The search's plan against the exact optimum (MILP) of the search's
  pairwise model: by what each plan costs (``plan.cost``: consumers sharing
  a reshard pay it once -- the measure the search's last step picks by) and
  by the pairwise objective the MILP minimises (every consumer pays its own
  reshard). "timeout" if the MILP did not finish in ``limit`` seconds."""
  prob = plan.problem
  ex = _search.exact(prob, time_limit=limit)
  if ex is None:
    return "timeout", "timeout"
  cost = _search.score(prob, plan.choice) / _search.score(prob, ex.choice)
  pair = _search.objective(prob, plan.choice) / ex.objective
  return f"{cost - 1:+.2%}", f"{pair - 1:+.2%}"


def _dp_peak(case, mesh, cluster) -> float:
  """DP's peak by memory_analysis, as a user writes DP (the budgets are
  fractions of it): the same program selection compiles as its "dp"
  candidate."""
  plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                 select="model", verbose=False).textbook("dp")
  compiled, m = compile_plan(plan, False, compiler_options(plan.mesh))
  return CompiledScore.of(compiled, m, plan.mesh_info, cluster).memory_bytes


def _gaps_only(args):
  rows = []
  for name, case, mkey, mesh, ckey, cluster in case_grid(args):
    plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                   select="model", verbose=False)
    gap, pairwise = _exact_gaps(plan, args.exact_limit)
    rows.append(dict(model=name, mesh=mkey, cluster=ckey,
                     search_s=plan.search_s, exact_gap=gap,
                     pairwise_gap=pairwise))
    print(f"[compare] {rows[-1]}", file=sys.stderr, flush=True)
  _table(["model", "mesh", "cluster", "search_s", "exact_gap",
          "pairwise_gap"], rows)
  print()
  _gap_summary(rows)


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
  done = [c for c in cases if c.get("chosen_vs", "") != ""]
  if not done:
    return
  chosen = [c["chosen_vs"] for c in done]
  # The search's own plan counts where it fits the budget by memory_analysis
  # (a plan that does not fit is no plan).
  own = [c["search_vs"] for c in done if c.get("search_fits") is not False]
  worse = [c for c in done if c["chosen_vs"] > 1 + 1e-9]
  books = [c for c in done if c["chosen"].split(" ")[0] in TEXTBOOK]
  print(f"\nchosen plan vs best textbook plan (compiled score): geometric "
        f"mean {_gmean(chosen):.3f}, worse on {len(worse)} of {len(done)} "
        f"cases, better (by more than {TIE:.1%}) on "
        f"{sum(x < 1 - TIE for x in chosen)}")
  print(f"the search's own plan (select='model') vs best textbook: geometric "
        f"mean {_gmean(own):.3f}, worse on "
        f"{sum(x > 1 + 1e-9 for x in own)} of {len(own)} (over the budget by "
        f"memory_analysis, not counted: {len(done) - len(own)})")
  # Per case where nothing better than the best textbook plan was found:
  # a textbook plan chosen, or the search's plan scoring within TIE of it
  # (on one node the search's plan for the ViT and Mixer is DP itself).
  for c in done:
    if c in books or c["chosen_vs"] > 1 - TIE:
      print(f"  no plan better than a textbook plan found: {c['model']} mesh "
            f"{c['mesh']} cluster {c['cluster']} budget {c['budget']} -> "
            f"{c['chosen']} ({c['chosen_vs']:.5f} x {c['best_textbook']})")
  # Every chosen plan, also where only the planner's fits (not counted in
  # the ratios above: no textbook plan to compare with).
  chosen_all = [c for c in cases if c.get("pred_emit", "") != ""]
  pe = [c["pred_emit"] for c in chosen_all]
  ours = [c["pred_emit"] for c in chosen_all
          if c["chosen"].split(" ")[0] not in TEXTBOOK]
  print(f"chosen plans' predicted/emitted bytes within 0.9-1.1: "
        f"{sum(0.9 <= x <= 1.1 for x in pe)} of {len(pe)}; of those the "
        f"search made (not a textbook plan returned as a user writes it): "
        f"{sum(0.9 <= x <= 1.1 for x in ours)} of {len(ours)}")
  print(f"chosen plans XLA logged an \"Involuntary full rematerialization\" "
        f"for: {sum(bool(c['remat']) for c in done)} of {len(done)}")
  _gap_summary(done)
  nofit = [c for c in cases if c.get("chosen") == "(none fits)"]
  if nofit:
    print(f"no plan fits (not counted): {len(nofit)} cases")
  only = [c for c in cases if c.get("best_textbook") == "(none fits)"]
  if only:
    print(f"the planner's plan fits where no textbook plan does (not "
          f"counted above): {len(only)} cases: " + ", ".join(
              f"{c['model']} {c['mesh']} {c['cluster']} {c['budget']}"
              for c in only))


def _gap_summary(done):
  for col, what in (("exact_gap", "by plan cost"),
                    ("pairwise_gap", "by the MILP's pairwise objective")):
    gaps = [float(c[col].rstrip("%")) for c in done
            if c.get(col) not in (None, "", "timeout")]
    if gaps:
      print(f"search's plan against the exact optimum of its model, {what}: "
            f"max {max(gaps):+.2f}% over {len(gaps)} cases "
            f"({sum(c.get(col) == 'timeout' for c in done)} timed out)")


if __name__ == "__main__":
  main()
