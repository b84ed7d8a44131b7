"""A plot of compare.py's ratios: each case's plan against its best
textbook plan, by the compiled program.

    python benchmarks/plot_compare.py benchmarks/results/compare.csv [more.csv]
        [--out benchmarks/results/compare.png]

Reads the CSVs compare.py writes (every candidate of every case) and draws,
per case, the chosen plan's compiled score and the search's own plan's
(``select="model"``, where it fits), each divided by the best textbook plan that fits
(DP, FSDP, Megatron, FSDP+TP as users write them). Below 1 is better than
the best hand plan. Needs matplotlib (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import math

TEXTBOOK = ("dp", "fsdp", "megatron", "fsdp_tp")


def ratios(paths):
  """[(case label, chosen / best textbook, search / best textbook)]."""
  cases = collections.OrderedDict()
  for path in paths:
    with open(path) as f:
      for r in csv.DictReader(f):
        key = (r["model"], r["mesh"], r["cluster"], r["budget"])
        cases.setdefault(key, []).append(r)
  out = []
  for (model, mesh, cluster, budget), rows in cases.items():
    done = [r for r in rows if r["xla_ms"]]
    books = [float(r["xla_ms"]) for r in done
             if r["candidate"] in TEXTBOOK and r["fits"] != "False"]
    chosen = [float(r["xla_ms"]) for r in done if r["chosen"] == "True"]
    # the search's own plan, where it fits the budget (else it is no plan)
    own = [float(r["xla_ms"]) for r in done
           if r["candidate"] == "search" and r["lowering"] == "pinned"
           and r["fits"] != "False"]
    if not books or not chosen:
      continue  # nothing fits: the case does not count
    best = min(books)
    label = f"{model} {mesh} {cluster}" + ("" if budget == "-" else
                                           f" {budget}")
    out.append((label, chosen[0] / best, own[0] / best if own else math.nan))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv", nargs="+")
  ap.add_argument("--out", default="benchmarks/results/compare.png")
  args = ap.parse_args(argv)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise SystemExit("plot_compare.py needs matplotlib: pip install -e "
                     "'.[plot]'") from e
  rows = ratios(args.csv)
  if not rows:
    raise SystemExit(f"no case with a fitting textbook plan in {args.csv}")
  labels, chosen, own = zip(*rows)
  y = range(len(rows))
  fig, ax = plt.subplots(figsize=(7, 0.22 * len(rows) + 1.2))
  ax.barh([i + 0.2 for i in y], own, height=0.4, color="#bbbbbb",
          label="search's own plan (select='model')")
  ax.barh([i - 0.2 for i in y], chosen, height=0.4, color="#3366aa",
          label="plan returned (select='compiled')")
  ax.axvline(1.0, color="black", linewidth=0.8)
  ax.set_yticks(list(y))
  ax.set_yticklabels(labels, fontsize=7)
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.set_xlabel("compiled score / best textbook plan's (lower is better)")
  gm = math.exp(sum(math.log(c) for c in chosen) / len(chosen))
  ax.set_title(f"autoddl_jax vs hand plans, by the compiled program "
               f"(geometric mean {gm:.3f})", fontsize=9)
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}: {len(rows)} cases, chosen geometric mean "
        f"{gm:.3f}, worst {max(chosen):.3f}")


if __name__ == "__main__":
  main()
