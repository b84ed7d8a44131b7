"""Plan fingerprints: did a change to the code change any plan?

    python benchmarks/fingerprints.py > after.txt
    python benchmarks/fingerprints.py --compare benchmarks/results/fingerprints.txt

For a fixed set of programs -- the held-out zoo at realistic sizes planned
abstractly on (8,) and (2, 4) meshes of the 2 nodes x 4 cluster, with no
budget and with half the unbudgeted plan's predicted peak; and tiny zoo
models planned and lowered on 8 simulated CPU devices -- prints one line per
plan: a hash of everything the plan decided (its choice per op, the specs of
its arguments and results, where it came from, its remat policy, its
predicted cost to the last bit, the textbook baselines' choices and costs,
and every resharding it implies) and, for the lowered ones, a hash of the
StableHLO text ``Plan.jit`` lowers. Two runs of one commit print the same
lines; ``--compare`` exits 1 naming every case whose line differs, which is
how a refactor shows that it changed no plan.

Selection is by the cost model (``select="model"``): selection by the
compiled program is deterministic too, but costs minutes per case; what it
chooses among is the candidates this hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import AbstractMesh, AxisType  # noqa: E402

import autoddl_jax as ad  # noqa: E402
import zoo  # noqa: E402
from fidelity import CLUSTERS  # noqa: E402

ABSTRACT = [("llama", dict(scan=True)), ("llama", dict(scan=False)),
            ("t5", {}), ("vit", {}), ("resnet", {}), ("mixer", {}),
            ("moe", {})]
TINY = [("llama", dict(scan=True)), ("llama", dict(scan=False)),
        ("t5", {}), ("resnet", {}), ("moe", {})]
MESHES = {"8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model"))}


def _digest(obj) -> str:
  return hashlib.sha256(
      json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def decided(plan: ad.Plan) -> dict:
  """Everything a plan decided, as plain values (floats by their repr)."""
  kinds = ("dp", "fsdp", "megatron", "fsdp_tp")
  return dict(
      choice=list(plan.choice), source=plan.source, remat=plan.remat,
      lowering=plan.lowering,
      cost=[repr(float(x)) for x in (plan.cost.time_s, plan.cost.comm_bytes,
                                     plan.cost.compute_s,
                                     plan.cost.memory_bytes,
                                     plan.cost.comm_s)],
      in_specs=[str(s) for s in jax.tree.leaves(
          plan.in_specs, is_leaf=lambda x: isinstance(x, jax.P))],
      out_specs=[str(s) for s in jax.tree.leaves(
          plan.out_specs, is_leaf=lambda x: isinstance(x, jax.P))],
      baselines={k: (list(plan.baseline_choice(k)),
                     repr(plan.baseline_cost(k).time_s)) for k in kinds},
      transitions=[(t["tensor"], t["src"], t["dst"], t["collective"],
                    repr(t["bytes"])) for t in plan.transitions()])


def abstract_cases():
  cluster = CLUSTERS["2x4"]
  for name, kw in ABSTRACT:
    case = zoo.build(name, size="realistic", abstract=True, **kw)
    tag = name + ("" if kw.get("scan", True) else "-unrolled")
    for mkey, (shape, axes) in MESHES.items():
      mesh = AbstractMesh(shape, axes)
      plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                     select="model")
      yield f"{tag} mesh={mkey} budget=none", _digest(decided(plan))
      budget = 0.5 * plan.cost.memory_bytes
      try:
        fit = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                      select="model", memory_budget=budget)
        line = _digest(decided(fit))
      except ad.MemoryBudgetError as e:
        line = "no-fit " + _digest(str(e))
      yield f"{tag} mesh={mkey} budget=0.5", line


def lowered_cases():
  cluster = CLUSTERS["2x4"]
  for name, kw in TINY:
    case = zoo.build(name, size="tiny", **kw)
    tag = name + ("" if kw.get("scan", True) else "-unrolled")
    for mkey, (shape, axes) in MESHES.items():
      mesh = jax.make_mesh(shape, axes,
                           axis_types=(AxisType.Auto,) * len(shape))
      plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                     select="model")
      text = plan.jit().lower(*case.args).as_text()
      yield (f"tiny {tag} mesh={mkey}",
             f"{_digest(decided(plan))} hlo={_digest(text)}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--compare", help="a file this script printed before")
  ap.add_argument("--only", choices=("abstract", "lowered"))
  args = ap.parse_args(argv)
  gens = {"abstract": abstract_cases, "lowered": lowered_cases}
  lines = {}
  for kind, gen in gens.items():
    if args.only and kind != args.only:
      continue
    for key, value in gen():
      lines[key] = value
      print(f"{key}: {value}", flush=True)
  if not args.compare:
    return 0
  with open(args.compare) as f:
    before = dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)
  diff = [k for k in lines if before.get(k) != lines[k]]
  missing = [k for k in before if k not in lines and not args.only]
  for k in diff:
    print(f"CHANGED {k}: {before.get(k)} -> {lines[k]}", file=sys.stderr)
  for k in missing:
    print(f"MISSING {k}", file=sys.stderr)
  print(f"{len(lines) - len(diff)} of {len(lines)} plans identical",
        file=sys.stderr)
  return 1 if diff or missing else 0


if __name__ == "__main__":
  sys.exit(main())
