"""What the examples share: 8 simulated CPU devices, a 2-node cluster, and a
report of a plan beside the textbook plans."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import autoddl_jax as ad  # noqa: E402

# 8 devices as 2 nodes x 4: slow links between the nodes, fast inside. The
# chips are slowish (10 TFLOP/s) so that the small example models meet the
# compute-vs-communication trade-offs big models meet on real hardware.
CLUSTER = ad.Cluster(devices_per_node=4, intra_node_bandwidth=100e9,
                     inter_node_bandwidth=12.5e9, intra_node_latency=5e-6,
                     inter_node_latency=20e-6, peak_flops=10e12)


def mesh(shape=(2, 4), names=("data", "model")):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,)
                       * len(shape))


def report(plan: ad.Plan, rows: int = 12) -> None:
  """The plan, then its predicted cost beside DP, FSDP and Megatron."""
  print(plan.explain(max_rows=rows))
  print(f"\n{'plan':<14} {'step (pred.)':>13} {'comm/device':>12} "
        f"{'memory/device':>14}")
  for name, c in [("data parallel", plan.baseline_cost("dp")),
                  ("FSDP", plan.baseline_cost("fsdp")),
                  ("Megatron", plan.baseline_cost("megatron")),
                  ("autoddl_jax", plan.cost)]:
    print(f"{name:<14} {c.time_s * 1e3:10.3f} ms {c.comm_bytes / 2**20:8.2f} "
          f"MiB {c.memory_bytes / 2**20:10.2f} MiB")


def check_losses(losses, ref_losses, tol: float = 1e-5,
                 later_tol: float = 1e-4) -> None:
  """The first step sees the same inputs: its loss must match to ``tol``.
  Later steps start from updated parameters, where Adam's near-sign first
  updates amplify float summation-order noise: ``later_tol``."""
  for i, (a, b) in enumerate(zip(losses, ref_losses)):
    err = abs(float(a) - float(b)) / max(abs(float(b)), 1e-30)
    limit = tol if i == 0 else later_tol
    print(f"step {i}: loss {float(a):.6f} (unsharded {float(b):.6f}, rel. "
          f"error {err:.1e}, limit {limit:.0e})")
    if err > limit:
      raise SystemExit(f"step {i}: the planned step's loss differs from the "
                       f"unsharded step's by {err:.2e} (> {limit})")
  print("OK: the planned steps compute the unsharded steps' losses.")
