"""The 175B GPT written with ad.pipeline.scan, planned abstractly (issue 15).

96 layers (d_model 12288, bf16, AdamW, batch 1024 x 2048) on an
AbstractMesh (128, 8) with the default H100 cluster (128 nodes x 8): the
planner's plan without stages (``pipeline=1``) and with them
(``pipeline=None``: the planner decides, or ``--stages S`` forced), each
under the default memory budget, with predicted step time, memory and the
model-FLOPs utilisation 6ND / (devices x peak) / time.

  python benchmarks/pipeline_175b.py [--stages 16]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import jax  # noqa: E402
from jax.sharding import AbstractMesh  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax.testing import models  # noqa: E402

CFG = models.GptConfig(vocab=51200, d_model=12288, n_heads=96, n_layers=96,
                       seq=2048, batch=1024, scan=True,
                       dtype=jax.numpy.bfloat16, pipeline=True)
PARAMS = 175e9


def row(name, plan, seconds):
  c, cl = plan.cost, plan.cluster
  devices = plan.mesh_info.size
  bound = 6 * PARAMS * CFG.batch * CFG.seq / (devices * cl.peak_flops)
  s = plan.schedule
  sched = "-" if s is None else (  # V: circular chunks per stage
      f"{s.stages}x over {s.axis}, "
      + ("" if s.repeats == 1 else f"V={s.repeats}, ")
      + f"M={s.microbatches}")
  print(f"{name:<12} {sched:<29} remat {str(plan.remat):<17} "
        f"{c.time_s:8.3f} s  compute {c.compute_s:7.3f} s  comm "
        f"{c.comm_s:7.3f} s  mem {c.memory_bytes / 2**30:6.1f} GiB  "
        f"MFU {bound / c.time_s:5.1%}  planned in {seconds:6.1f} s",
        flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--stages", type=int, default=None,
                  help="force this many stages (default: the planner "
                  "decides)")
  ap.add_argument("--skip-flat", action="store_true",
                  help="skip the plan without stages")
  args = ap.parse_args(argv)
  ex = models.gpt(CFG, abstract=True)
  mesh = AbstractMesh((128, 8), ("data", "model"))
  if not args.skip_flat:
    t0 = time.perf_counter()
    flat = ad.plan(ex.step, *ex.args, mesh=mesh, pipeline=1)
    row("no stages", flat, time.perf_counter() - t0)
  t0 = time.perf_counter()
  staged = ad.plan(ex.step, *ex.args, mesh=mesh, pipeline=args.stages,
                   verbose=True)
  row("pipeline" if args.stages is None else f"pipeline={args.stages}",
      staged, time.perf_counter() - t0)


if __name__ == "__main__":
  main()
