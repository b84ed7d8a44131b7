"""A VGG-style CNN (the AutoDDL paper's CNN family) in flax.linen with a
``TrainState``, trained with ``@ad.auto_shard`` on 8 simulated CPU devices.

    python examples/vgg.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -m form too
import _common  # noqa: E402,F401  (8 CPU devices; first)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402

import autoddl_jax as ad  # noqa: E402

BATCH, IMAGE, CLASSES = 32, 32, 10


class Vgg(nn.Module):
  """Two [conv3x3-relu x2, maxpool] stages, then a two-layer classifier."""

  @nn.compact
  def __call__(self, x):
    for ch in (32, 64):
      x = nn.relu(nn.Conv(ch, (3, 3))(x))
      x = nn.relu(nn.Conv(ch, (3, 3))(x))
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(256)(x)))


def train_step(state: train_state.TrainState, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["label"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def make():
  model = Vgg()
  params = model.init(jax.random.key(0), jnp.zeros((1, IMAGE, IMAGE, 3)))
  return train_state.TrainState.create(apply_fn=model.apply,
                                       params=params["params"],
                                       tx=optax.adam(1e-3))


def batch_of(i: int):
  k1, k2 = jax.random.split(jax.random.key(i))
  return {"image": jax.random.normal(k1, (BATCH, IMAGE, IMAGE, 3)),
          "label": jax.random.randint(k2, (BATCH,), 0, CLASSES)}


def example():
  """For the CLI: ``python -m autoddl_jax plan examples.vgg:example ...``."""
  abstract = lambda x: jax.ShapeDtypeStruct(jnp.shape(x),  # noqa: E731
                                            jnp.result_type(x))
  return train_step, (jax.tree.map(abstract, make()),
                      jax.tree.map(abstract, batch_of(0)))


def main():
  mesh = _common.mesh()
  step = ad.auto_shard(train_step, mesh=mesh, cluster=_common.CLUSTER)
  state = make()
  losses = []
  for i in range(3):
    state, loss = step(state, batch_of(i))
    losses.append(loss)
  print(f"VGG-style CNN (flax.linen), batch {BATCH} of {IMAGE}x{IMAGE}; mesh "
        f"{dict(mesh.shape)}; planned in {step.plan.search_s:.2f} s\n")
  _common.report(step.plan)
  ref, ref_state, ref_losses = jax.jit(train_step), make(), []
  for i in range(3):
    ref_state, loss = ref(ref_state, batch_of(i))
    ref_losses.append(loss)
  print()
  _common.check_losses(losses, ref_losses)


if __name__ == "__main__":
  main()
