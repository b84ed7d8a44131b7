"""The GPT example's model trained on several processes, as on a pod.

On one machine, 2 processes x 4 CPU devices over loopback:

    python -m autoddl_jax.launch --nproc 2 --devices-per-proc 4 examples/multihost.py

Every process runs this script: it joins the job, plans the same step (the
plans are checked equal before compiling), builds the global batch from the
data it holds, trains three steps and prints the loss from process 0.
``--local-data`` makes each process hold only its own rows of the batch, as a
per-process data loader would (``ad.distributed.process_slice`` says which,
``ad.distributed.from_local`` joins them). ``--out FILE`` also writes the losses and final parameters (from
process 0); ``--checkpoint DIR`` saves the final train state with orbax.
"""

from __future__ import annotations

import argparse

import autoddl_jax as ad

ad.distributed.initialize()  # first: fixes the devices of this process

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from autoddl_jax.testing import models  # noqa: E402

CONFIG = models.GptConfig(vocab=256, d_model=64, n_heads=4, n_layers=2,
                          seq=32, batch=16, scan=True)


def local_batch(ex, mesh):
  """The global batch from the part of it this process reads: its rows of
  the batch split over the "data" axis, the layout a per-process loader
  produces. (The part is cut from the whole batch here, which every process
  has; a loader would read only those rows.) The step reshards it if its plan
  lays the batch out otherwise."""
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, PartitionSpec("data")), ex.batch)
  shapes = jax.tree.map(np.shape, ex.batch)
  mine = jax.tree.map(
      lambda x, s: np.asarray(x)[ad.distributed.process_slice(s, x.shape)],
      ex.batch, shardings)
  if jax.process_index() == 0:
    print("process 0 holds batch rows " + ", ".join(
        str(np.shape(x)) for x in jax.tree.leaves(mine)) + " of " +
        ", ".join(str(x) for x in jax.tree.leaves(
            shapes, is_leaf=lambda t: isinstance(t, tuple))), flush=True)
  return ad.distributed.from_local(mine, shardings, shapes)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--out", default=None)
  ap.add_argument("--checkpoint", default=None)
  ap.add_argument("--local-data", action="store_true",
                  help="each process loads only its part of the batch")
  args = ap.parse_args(argv)
  pid = jax.process_index()
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  # The same seed on every process: the same initial values everywhere.
  ex = models.gpt(CONFIG, optimizer=optax.adamw(1e-3))
  step = ad.auto_shard(ex.step, mesh=mesh, verbose=False)
  params, opt_state, losses = ex.params, ex.opt_state, []
  batch = local_batch(ex, mesh) if args.local_data else ex.batch
  for i in range(args.steps):
    params, opt_state, loss = step(params, opt_state, batch)
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
