"""A Llama-style decoder for the tests: RMSNorm, RoPE written with
split/concatenate, grouped-query attention, SwiGLU, untied embeddings, its
layers stacked in one ``ad.pipeline.scan`` (or ``jax.lax.scan``). The step
and arguments come as :mod:`autoddl_jax.testing.models`' builders give them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from autoddl_jax import pipeline
from autoddl_jax.testing.models import _finish, _init, _keys, _maybe_abstract
from autoddl_jax.testing.models import cross_entropy


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab: int = 128
  d_model: int = 32
  n_heads: int = 4
  n_kv_heads: int = 2  # grouped-query attention
  ffn: int = 64
  n_layers: int = 4
  seq: int = 8
  batch: int = 8
  # The layer stack through ad.pipeline.scan (else jax.lax.scan).
  pipeline: bool = True


def rms_norm(x, scale, eps=1e-6):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def rope(x, base=10000.0):
  """Rotary embedding written with split/concatenate, as public code does."""
  s, hd = x.shape[-3], x.shape[-1]
  freq = base ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None]
  cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def llama(cfg: LlamaConfig = LlamaConfig(), seed=0, optimizer=None,
          abstract=False, return_grads=False):
  """A Llama-style decoder (RMSNorm, RoPE, grouped-query attention,
  SwiGLU, untied embeddings), its layers in one stacked scan."""
  d, h, kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
  hd = d // h

  def init():
    k = _keys(seed)
    n = cfg.n_layers
    layers = {
        "attn_norm": jnp.ones((n, d)),
        "wq": _init(next(k), (n, d, h * hd)),
        "wk": _init(next(k), (n, d, kv * hd)),
        "wv": _init(next(k), (n, d, kv * hd)),
        "wo": _init(next(k), (n, h * hd, d)),
        "mlp_norm": jnp.ones((n, d)),
        "w_gate": _init(next(k), (n, d, cfg.ffn)),
        "w_up": _init(next(k), (n, d, cfg.ffn)),
        "w_down": _init(next(k), (n, cfg.ffn, d)),
    }
    p = {"embed": _init(next(k), (cfg.vocab, d), 0.02), "layers": layers,
         "norm": jnp.ones((d,)), "lm_head": _init(next(k), (d, cfg.vocab))}
    tokens = jax.random.randint(next(k), (cfg.batch, cfg.seq + 1), 0,
                                cfg.vocab)
    return p, {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}

  def block(x, lp):
    b, s, _ = x.shape
    y = rms_norm(x, lp["attn_norm"])
    q = rope((y @ lp["wq"]).reshape(b, s, h, hd))
    k_ = rope((y @ lp["wk"]).reshape(b, s, kv, hd))
    v = (y @ lp["wv"]).reshape(b, s, kv, hd)
    k_ = jnp.repeat(k_, h // kv, axis=2)
    v = jnp.repeat(v, h // kv, axis=2)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k_) / math.sqrt(hd)
    mask = jnp.tril(jnp.ones((s, s), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, h * hd)
    x = x + o @ lp["wo"]
    y = rms_norm(x, lp["mlp_norm"])
    return x + (jax.nn.silu(y @ lp["w_gate"]) * (y @ lp["w_up"])) @ \
        lp["w_down"]

  def loss_fn(p, batch):
    x = p["embed"][batch["inputs"]]
    run = pipeline.scan if cfg.pipeline else jax.lax.scan
    x, _ = run(lambda c, lp: (block(c, lp), None), x, p["layers"])
    logits = rms_norm(x, p["norm"]) @ p["lm_head"]
    return cross_entropy(logits, batch["labels"])

  params, data = _maybe_abstract(init, abstract)
  return _finish(loss_fn, params, data, optimizer, abstract, return_grads)
