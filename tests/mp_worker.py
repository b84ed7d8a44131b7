"""A process of the multi-process tests (run by autoddl_jax.launch or by
hand): ``mp_worker.py MODE``.

  fingerprint  plan a small step and print this process's plan fingerprint
  mismatch     process 1 plans for another cluster: check_same_plan must fail
  die          process 1 kills itself (SIGKILL) at the start of step 2
  raise        process 1 raises at the start of step 2 (its peer is then
               blocked in the step's collectives)
  raise_early  process 1 raises right after joining, before any step
  sleep        join, print the pid, then sleep (for signals to the launcher)
  join         only join (for coordinator and device-count errors)
"""

import os
import signal
import sys
import time

import autoddl_jax as ad

mode = sys.argv[1]
try:
  ad.distributed.initialize(timeout_s=int(os.environ.get("JOIN_TIMEOUT", 30)))
except ad.distributed.DistributedError as e:
  print(f"DistributedError: {e}", flush=True)
  sys.exit(3)
if mode == "join":
  print("joined", flush=True)
  sys.exit(0)
if mode == "sleep":
  print(f"pid {os.getpid()}", flush=True)
  time.sleep(300)
  sys.exit(0)
if mode == "raise_early" and os.environ["AUTODDL_PROCESS_ID"] == "1":
  print(f"raising at {time.time():.3f}", flush=True)
  raise RuntimeError("process 1 fails before the first step")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from autoddl_jax.testing import models  # noqa: E402

pid = jax.process_index()
mesh = jax.make_mesh((2, 4), ("data", "model"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 2)
ex = models.mlp(optimizer=optax.sgd(0.1))
cluster = ad.H100_NODE
if mode == "raise":  # slow compute: the plan splits the batch over processes
  cluster = ad.Cluster(devices_per_node=4, peak_flops=1e9)
if mode == "mismatch" and pid == 1:
  cluster = dataclasses.replace(cluster, inter_node_bandwidth=1e9,
                                devices_per_node=2)
plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=cluster, verbose=False)
print(f"fingerprint {ad.distributed.plan_fingerprint(plan)}", flush=True)
print(f"plan sends {plan.cost.comm_bytes:.0f} bytes per device", flush=True)
try:
  ad.distributed.check_same_plan(plan)
except ad.distributed.DistributedError as e:
  print(f"DistributedError: {e}", flush=True)
  sys.exit(4)
step = ad.auto_shard(ex.step, mesh=mesh, cluster=cluster, verbose=False)
params, opt_state = ex.params, ex.opt_state
for i in range(4):
  if mode == "die" and pid == 1 and i == 2:
    print("dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
  if mode == "raise" and pid == 1 and i == 2:
    print(f"raising at {time.time():.3f}", flush=True)
    raise RuntimeError("process 1 fails in step 2")
  params, opt_state, loss = step(params, opt_state, ex.batch)
  print(f"step {i} loss {float(ad.distributed.to_host(loss)):.6f}", flush=True)
