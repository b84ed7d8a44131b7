"""The GPT example's model trained on several processes, as on a pod.

On one machine, 2 processes x 4 CPU devices over loopback:

    python -m autoddl_jax.launch --nproc 2 --devices-per-proc 4 examples/multihost.py

Every process runs this script: it joins the job, plans the same step (the
plans are checked equal before compiling), builds the global batch from the
data it holds, trains three steps and prints the loss from process 0.
``--out FILE`` also writes the losses and final parameters (from process 0);
``--checkpoint DIR`` saves the final train state with orbax.
"""

from __future__ import annotations

import argparse

import autoddl_jax as ad

ad.distributed.initialize()  # first: fixes the devices of this process

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from autoddl_jax import models  # noqa: E402

CONFIG = models.GptConfig(vocab=256, d_model=64, n_heads=4, n_layers=2,
                          seq=32, batch=16, scan=True)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--out", default=None)
  ap.add_argument("--checkpoint", default=None)
  args = ap.parse_args(argv)
  pid = jax.process_index()
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  # The same seed on every process: the same initial values everywhere.
  ex = models.gpt(CONFIG, optimizer=optax.adamw(1e-3))
  step = ad.auto_shard(ex.step, mesh=mesh, verbose=False)
  params, opt_state, losses = ex.params, ex.opt_state, []
  for i in range(args.steps):
    # Every process holds the whole batch here; a per-process loader would
    # use ad.distributed.from_local instead.
    params, opt_state, loss = step(params, opt_state, ex.batch)
    losses.append(float(ad.distributed.to_host(loss)))
    if pid == 0:
      print(f"step {i}: loss {losses[-1]:.6f}", flush=True)
  if pid == 0:
    print(f"{jax.process_count()} processes, {jax.device_count()} devices, "
          f"plan {ad.distributed.plan_fingerprint(step.plan)[:12]}",
          flush=True)
  if args.checkpoint:
    ad.checkpoint.save(args.checkpoint, params)
  final = ad.distributed.to_host(params)
  if args.out and pid == 0:
    flat = {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_leaves_with_path(final)}
    np.savez(args.out, losses=np.array(losses), **flat)


if __name__ == "__main__":
  main()
