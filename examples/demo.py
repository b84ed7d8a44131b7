"""The main demo: plan a GPT train step for 8 devices, read the plan, compare
it with hand-written plans, and run it -- on 8 simulated CPU devices.

    python examples/demo.py

Checks that the planned step computes what the unsharded step computes (loss
and gradients to relative 1e-5) and prints the collectives XLA emitted.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax import _hlo, models  # noqa: E402

# 8 devices as 2 nodes x 4: slow links between the nodes, fast inside.
CLUSTER = ad.Cluster(devices_per_node=4, intra_node_bandwidth=100e9,
                     inter_node_bandwidth=12.5e9, intra_node_latency=5e-6,
                     inter_node_latency=20e-6, peak_flops=50e12)


def main():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  cfg = models.GptConfig(vocab=512, d_model=128, n_heads=4, n_layers=4,
                         seq=64, batch=16, scan=True)
  ex = models.gpt(cfg, return_grads=True)
  print(f"GPT: {cfg.n_layers} layers (lax.scan), d_model {cfg.d_model}, "
        f"{sum(x.size for x in jax.tree.leaves(ex.params)):,} parameters; "
        f"mesh {dict(mesh.shape)} on {jax.device_count()} CPU devices")

  t0 = time.perf_counter()
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=CLUSTER)
  print(f"planned in {time.perf_counter() - t0:.2f} s\n")
  print(plan.explain(max_rows=12))

  # The same cost model scores the plans people write by hand.
  def opt_like(spec_tree):
    return optax.tree_utils.tree_map_params(
        ex.optimizer, lambda _, s: s, ex.opt_state, spec_tree,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P))

  batch = jax.tree.map(lambda _: P(("data", "model")), ex.batch)
  rep = jax.tree.map(lambda _: P(), ex.params)

  def fsdp(x):
    d = int(np.argmax(x.shape))
    return P(*[("data", "model") if i == d and x.shape[d] % 8 == 0 else None
               for i in range(x.ndim)])

  fs = jax.tree.map(fsdp, ex.params)
  print("\nplan            predicted step   comm/device   memory/device")
  for name, shard in [("data parallel", (rep, opt_like(rep), batch)),
                      ("FSDP (ZeRO-3)", (fs, opt_like(fs), batch))]:
    c = ad.cost_of(ex.step, *ex.args, mesh=mesh, in_shardings=shard,
                   cluster=CLUSTER)
    print(f"{name:<15} {c.time_s * 1e3:9.3f} ms   {c.comm_bytes / 2**20:8.2f} "
          f"MiB   {c.memory_bytes / 2**20:8.2f} MiB")
  c = plan.cost
  print(f"{'autoddl_jax':<15} {c.time_s * 1e3:9.3f} ms   "
        f"{c.comm_bytes / 2**20:8.2f} MiB   {c.memory_bytes / 2**20:8.2f} MiB")

  # Run it: three steps, planned and unsharded, side by side.
  step = plan.jit()
  ref_step = jax.jit(ex.step)
  state, ref_state = ex.args[:2], ex.args[:2]
  worst = 0.0
  for i in range(3):
    *state, loss, grads = step(*state, ex.batch)
    *ref_state, ref_loss, ref_grads = ref_step(*ref_state, ex.batch)
    g_err = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) /
                      np.linalg.norm(np.asarray(b)))
                for a, b in zip(jax.tree.leaves(grads),
                                jax.tree.leaves(ref_grads)))
    l_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    worst = max(worst, g_err, l_err)
    print(f"step {i}: loss {float(loss):.6f} (unsharded {float(ref_loss):.6f})"
          f", worst gradient rel. error {g_err:.1e}")
  compiled = step.lower(*ex.args).compile()
  kinds: dict[str, int] = {}
  for col in _hlo.collectives(compiled):
    kinds[col.kind] = kinds.get(col.kind, 0) + col.count
  print(f"XLA emitted per step: {kinds}; "
        f"{_hlo.emitted_bytes(compiled) / 2**20:.2f} MiB per device "
        f"(predicted {plan.cost.comm_bytes / 2**20:.2f} MiB)")
  if worst > 1e-5:
    raise SystemExit(f"planned step differs from the unsharded one: {worst}")
  print("OK: the planned step computes the unsharded step's loss and "
        "gradients.")


if __name__ == "__main__":
  main()
