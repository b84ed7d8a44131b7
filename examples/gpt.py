"""A GPT-style transformer in flax.nnx (layers in ``lax.scan``), trained with
``@ad.auto_shard`` on 8 simulated CPU devices.

    python examples/gpt.py

Plans the in-place nnx train step (model and optimizer updated inside the
step) for a (2, 4) mesh of 2 nodes x 4 devices, prints the plan beside DP,
FSDP and Megatron, runs three steps and checks each loss against the
unsharded step, then sets what the plan predicted beside what XLA compiled.
``python -m autoddl_jax plan examples.gpt:example --mesh data=16,model=8``
plans it for 128 devices from the command line.
"""

from __future__ import annotations

import time

import _common  # noqa: F401  (8 CPU devices; first)
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import autoddl_jax as ad

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 512, 128, 4, 4, 64, 16


class Gpt(nnx.Module):
  """Token + position embeddings, ``LAYERS`` pre-norm blocks whose weights are
  stacked on a leading layer axis (one ``lax.scan`` runs them), a tied
  unembedding."""

  def __init__(self, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(0.02)
    stack = lambda *shape: nnx.Param(init(rngs.params(), (LAYERS, *shape)))  # noqa: E731
    self.embed = nnx.Param(init(rngs.params(), (VOCAB, D)))
    self.pos = nnx.Param(init(rngs.params(), (SEQ, D)))
    self.wqkv = stack(D, 3 * D)
    self.wo = stack(D, D)
    self.w1 = stack(D, 4 * D)
    self.w2 = stack(4 * D, D)
    self.ln1 = nnx.Param(jnp.ones((LAYERS, D)))
    self.ln2 = nnx.Param(jnp.ones((LAYERS, D)))
    self.ln_f = nnx.Param(jnp.ones((D,)))

  def __call__(self, tokens):
    x = self.embed[...][tokens] + self.pos[...][None]
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))

    def norm(x, scale):
      x = x - x.mean(-1, keepdims=True)
      return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale

    def block(x, w):
      wqkv, wo, w1, w2, ln1, ln2 = w
      q, k, v = jnp.split(norm(x, ln1) @ wqkv, 3, axis=-1)
      heads = lambda t: t.reshape(*t.shape[:2], HEADS, -1)  # noqa: E731
      q, k, v = heads(q), heads(k), heads(v)
      att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
      att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
      y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
      x = x + y @ wo
      return x + jax.nn.gelu(norm(x, ln2) @ w1) @ w2, None

    weights = (self.wqkv[...], self.wo[...], self.w1[...], self.w2[...],
               self.ln1[...], self.ln2[...])
    x, _ = jax.lax.scan(block, x, weights)
    return norm(x, self.ln_f[...]) @ self.embed[...].T


def loss_fn(model: Gpt, batch):
  logits = model(batch["tokens"])
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()


def train_step(model: Gpt, optimizer: nnx.Optimizer, batch):
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


def make(seed: int = 0):
  model = Gpt(nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  return model, optimizer


def batch_of(step: int):
  k = jax.random.key(100 + step)
  tokens = jax.random.randint(k, (BATCH, SEQ + 1), 0, VOCAB)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def example():
  """For the CLI: the functional form of the step and abstract arguments."""
  graphdef, state = nnx.split(make())

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = train_step(model, optimizer, batch)
    return nnx.state((model, optimizer)), loss

  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  return step, (jax.tree.map(abstract, state),
                jax.tree.map(abstract, batch_of(0)))


def main():
  mesh = _common.mesh()
  model, optimizer = make()
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"GPT (flax.nnx): {LAYERS} layers in lax.scan, d_model {D}, {n:,} "
        f"parameters; mesh {dict(mesh.shape)} on {jax.device_count()} CPU "
        "devices (2 nodes x 4)")
  step = ad.auto_shard(train_step, mesh=mesh, cluster=_common.CLUSTER)
  t0 = time.perf_counter()
  losses = [step(model, optimizer, batch_of(0))]
  print(f"planned and ran the first step in {time.perf_counter() - t0:.2f} s "
        f"(the search alone: {step.plan.search_seconds:.2f} s)\n")
  _common.report(step.plan)
  losses += [step(model, optimizer, batch_of(i)) for i in (1, 2)]
  ref_model, ref_opt = make()
  ref = nnx.jit(train_step)
  ref_losses = [ref(ref_model, ref_opt, batch_of(i)) for i in range(3)]
  print()
  _common.check_losses(losses, ref_losses)
  print(f"(one plan for all three steps: {len(step.plans)} made)\n")
  print("what the plan predicted against what XLA compiled, per device:")
  print(step.plan.verify())


if __name__ == "__main__":
  main()
