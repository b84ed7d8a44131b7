"""A GPT-style transformer in flax.nnx (layers in ``lax.scan``), trained with
``@ad.auto_shard`` on 8 simulated CPU devices.

    python examples/gpt.py

Plans the in-place nnx train step (model and optimizer updated inside the
step) for a (2, 4) mesh of 2 nodes x 4 devices, prints the plan beside DP,
FSDP and Megatron, runs three steps and checks each loss against the
unsharded step, then sets what the plan predicted beside what XLA compiled.
``python -m autoddl_jax plan examples.gpt:example_large --mesh
data=16,model=8`` plans it at GPT-2 medium's shape for 128 devices from
the command line (``examples/gpt.py:example_large`` works too).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -m form too
import _common  # noqa: E402,F401  (8 CPU devices; first)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import autoddl_jax as ad  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 512
  d: int = 128
  heads: int = 4
  layers: int = 4
  seq: int = 64
  batch: int = 16


SMALL = Config()  # runs on 8 CPU devices
# GPT-2 medium's shape (355M parameters), batch 64 x 1024 tokens: planned
# abstractly (``example_large``), nothing allocated.
LARGE = Config(vocab=50304, d=1024, heads=16, layers=24, seq=1024, batch=64)


class Gpt(nnx.Module):
  """Token + position embeddings, ``LAYERS`` pre-norm blocks whose weights are
  stacked on a leading layer axis (one ``lax.scan`` runs them), a tied
  unembedding."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(0.02)
    d, layers = cfg.d, cfg.layers
    stack = lambda *shape: nnx.Param(init(rngs.params(), (layers, *shape)))  # noqa: E731
    self.heads = cfg.heads
    self.embed = nnx.Param(init(rngs.params(), (cfg.vocab, d)))
    self.pos = nnx.Param(init(rngs.params(), (cfg.seq, d)))
    self.wqkv = stack(d, 3 * d)
    self.wo = stack(d, d)
    self.w1 = stack(d, 4 * d)
    self.w2 = stack(4 * d, d)
    self.ln1 = nnx.Param(jnp.ones((layers, d)))
    self.ln2 = nnx.Param(jnp.ones((layers, d)))
    self.ln_f = nnx.Param(jnp.ones((d,)))

  def __call__(self, tokens):
    x = self.embed[...][tokens] + self.pos[...][None]
    seq = tokens.shape[1]
    mask = jnp.tril(jnp.ones((seq, seq), bool))

    def norm(x, scale):
      x = x - x.mean(-1, keepdims=True)
      return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale

    def block(x, w):
      wqkv, wo, w1, w2, ln1, ln2 = w
      q, k, v = jnp.split(norm(x, ln1) @ wqkv, 3, axis=-1)
      heads = lambda t: t.reshape(*t.shape[:2], self.heads, -1)  # noqa: E731
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


def make(seed: int = 0, cfg: Config = SMALL):
  model = Gpt(cfg, nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  return model, optimizer


def batch_of(step: int, cfg: Config = SMALL):
  k = jax.random.key(100 + step)
  tokens = jax.random.randint(k, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def example(cfg: Config = SMALL):
  """For the CLI: the functional form of the step and abstract arguments
  (shapes only: the model is never built)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: make(cfg=cfg)))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = train_step(model, optimizer, batch)
    return nnx.state((model, optimizer)), loss

  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  return step, (jax.tree.map(abstract, state),
                jax.eval_shape(lambda: batch_of(0, cfg)))


def example_large():
  """:func:`example` at GPT-2 medium's shape (:data:`LARGE`)."""
  return example(LARGE)


def main():
  mesh = _common.mesh()
  model, optimizer = make()
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"GPT (flax.nnx): {SMALL.layers} layers in lax.scan, d_model "
        f"{SMALL.d}, {n:,} "
        f"parameters; mesh {dict(mesh.shape)} on {jax.device_count()} CPU "
        "devices (2 nodes x 4)")
  step = ad.auto_shard(train_step, mesh=mesh, cluster=_common.CLUSTER)
  t0 = time.perf_counter()
  losses = [step(model, optimizer, batch_of(0))]
  print(f"planned and ran the first step in {time.perf_counter() - t0:.2f} s "
        f"(the search alone: {step.plan.search_s:.2f} s)\n")
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
