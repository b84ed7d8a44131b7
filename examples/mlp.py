"""A plain-JAX MLP train step (optax adamw) planned with ``ad.plan``: the
library form -- plan, inspect, save, load, jit -- on 8 simulated CPU devices.

    python examples/mlp.py
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -m form too
import _common  # noqa: E402,F401  (8 CPU devices; first)
import jax  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax.testing import models  # noqa: E402


def example():
  """For the CLI: ``python -m autoddl_jax plan examples.mlp:example ...``."""
  ex = models.mlp(batch=256, sizes=(512, 2048, 2048, 512), abstract=True)
  return ex.step, ex.args


def main():
  mesh = _common.mesh()
  ex = models.mlp(batch=256, sizes=(512, 2048, 2048, 512))
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=_common.CLUSTER)
  print(f"MLP {' -> '.join(map(str, (512, 2048, 2048, 512)))}, batch 256; "
        f"mesh {dict(mesh.shape)}; planned in {plan.search_s:.2f} s\n")
  _common.report(plan)

  # Keep the plan; load it back for the same program (no search).
  path = os.path.join(tempfile.mkdtemp(), "mlp_plan.json")
  plan.save(path)
  plan = ad.load_plan(path, ex.step, *ex.args, mesh=mesh,
                      cluster=_common.CLUSTER)
  print(f"\nsaved and reloaded {path}")

  step, ref = plan.jit(), jax.jit(ex.step)
  state = ref_state = ex.args[:2]
  losses, ref_losses = [], []
  for _ in range(3):
    *state, loss = step(*state, ex.batch)
    *ref_state, ref_loss = ref(*ref_state, ex.batch)
    losses.append(loss)
    ref_losses.append(ref_loss)
  _common.check_losses(losses, ref_losses)


if __name__ == "__main__":
  main()
