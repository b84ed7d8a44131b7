"""Held-out models, written the way public model code is written.

Nothing here is shaped around the planner: the models use Flax's own layers
(linen and nnx: ``Embed``, ``Dense``/``Linear``, ``MultiHeadAttention``,
``RMSNorm``, ``LayerNorm``, ``BatchNorm`` with batch stats, ``Conv``,
``Dropout``) in the forms public code uses them -- RoPE with split and
concatenate, grouped-query attention by repeating K/V heads, SwiGLU, top-2
routing, ``nn.scan`` over layers, bf16 compute over f32 master weights.

    case = zoo.build("llama", size="tiny", dtype="float32", scan=True)
    plan = ad.plan(case.step, *case.args, mesh=mesh)

``size="tiny"`` runs in the tests on CPU; ``size="realistic"`` is for
compiling abstractly (``abstract=True`` gives ``jax.ShapeDtypeStruct``
arguments, nothing allocated). ``dtype`` is ``"float32"``, ``"bf16_compute"``
(f32 parameters, bf16 activations) or ``"bfloat16"`` (bf16 parameters too).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

DTYPES = ("float32", "bf16_compute", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Case:
  """A train step and its example arguments."""

  name: str
  step: Callable
  args: tuple
  scan: bool
  dtype: str


def _dtypes(dtype: str):
  """(compute dtype, parameter dtype)."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  return {"float32": (jnp.float32, jnp.float32),
          "bf16_compute": (jnp.bfloat16, jnp.float32),
          "bfloat16": (jnp.bfloat16, jnp.bfloat16)}[dtype]


def _xent(logits, labels):
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         labels).mean()


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# ----------------------------------------------------------- Llama (linen)
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab: int = 64
  d_model: int = 32
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  ffn: int = 64
  seq: int = 16
  batch: int = 8
  tied: bool = False


LLAMA_SIZES = {"tiny": LlamaConfig(),
               "realistic": LlamaConfig(vocab=32000, d_model=2048, layers=8,
                                        heads=16, kv_heads=4, ffn=5632,
                                        seq=1024, batch=16)}


def rope(x, positions, base: float = 10000.0):
  """Rotary embeddings, rotate-half form: x is [batch, seq, heads, dim]."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[:, None].astype(jnp.float32) * freq[None, :]
  sin = jnp.sin(angle)[None, :, None, :].astype(x.dtype)
  cos = jnp.cos(angle)[None, :, None, :].astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaAttention(nn.Module):
  cfg: LlamaConfig
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    b, s, _ = x.shape
    hd = c.d_model // c.heads
    dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    q = dense(c.heads * hd, name="wq")(x).reshape(b, s, c.heads, hd)
    k = dense(c.kv_heads * hd, name="wk")(x).reshape(b, s, c.kv_heads, hd)
    v = dense(c.kv_heads * hd, name="wv")(x).reshape(b, s, c.kv_heads, hd)
    pos = jnp.arange(s)
    q, k = rope(q, pos), rope(k, pos)
    k = jnp.repeat(k, c.heads // c.kv_heads, axis=2)  # grouped-query
    v = jnp.repeat(v, c.heads // c.kv_heads, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(
        self.dtype)
    mask = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, c.heads * hd)
    return dense(c.d_model, name="wo")(out)


class LlamaBlock(nn.Module):
  cfg: LlamaConfig
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, _=None):
    norm = functools.partial(nn.RMSNorm, dtype=self.dtype,
                             param_dtype=self.param_dtype)
    dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    x = x + LlamaAttention(self.cfg, self.dtype, self.param_dtype)(
        norm(name="attn_norm")(x))
    h = norm(name="mlp_norm")(x)
    h = nn.silu(dense(self.cfg.ffn, name="gate")(h)) * dense(
        self.cfg.ffn, name="up")(h)
    return x + dense(self.cfg.d_model, name="down")(h), None


class Llama(nn.Module):
  cfg: LlamaConfig
  scan: bool
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    embed = nn.Embed(c.vocab, c.d_model, dtype=self.dtype,
                     param_dtype=self.param_dtype)
    x = embed(tokens)
    if self.scan:
      stack = nn.scan(LlamaBlock, variable_axes={"params": 0},
                      split_rngs={"params": True}, length=c.layers)
      x, _ = stack(c, self.dtype, self.param_dtype, name="layers")(x, None)
    else:
      for i in range(c.layers):
        x, _ = LlamaBlock(c, self.dtype, self.param_dtype,
                          name=f"layer_{i}")(x)
    x = nn.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
    if c.tied:
      return embed.attend(x)
    return nn.Dense(c.vocab, use_bias=False, dtype=self.dtype,
                    param_dtype=self.param_dtype, name="lm_head")(x)


def _linen_lm_case(name, module, cfg, tx, scan, dtype, abstract):
  tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0,
                              cfg.vocab)

  def init():
    return module.init(jax.random.key(0), tokens[:, :-1])["params"]

  params = jax.eval_shape(init) if abstract else jax.jit(init)()

  def loss_fn(params, tokens):
    logits = module.apply({"params": params}, tokens[:, :-1])
    return _xent(logits, tokens[:, 1:])

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
  batch = _abstract(tokens) if abstract else tokens
  return Case(name, step, (params, opt_state, batch), scan, dtype)


def llama(size="tiny", dtype="float32", scan=True, tied=False, abstract=False,
          tx=None):
  cfg = dataclasses.replace(LLAMA_SIZES[size], tied=tied)
  comp, par = _dtypes(dtype)
  return _linen_lm_case("llama" + ("_tied" if tied else ""),
                        Llama(cfg, scan, comp, par), cfg,
                        tx or optax.adamw(1e-3), scan, dtype, abstract)


# ------------------------------------------------- T5-style (flax.nnx)
@dataclasses.dataclass(frozen=True)
class T5Config:
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  ffn: int = 64
  layers: int = 2
  src: int = 16
  tgt: int = 8
  batch: int = 8
  dropout: float = 0.1


T5_SIZES = {"tiny": T5Config(layers=1),
            "realistic": T5Config(vocab=32128, d_model=768, heads=12,
                                  ffn=3072, layers=6, src=512, tgt=128,
                                  batch=16)}


class T5Layer(nnx.Module):
  def __init__(self, c: T5Config, cross: bool, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm1 = nnx.RMSNorm(c.d_model, **kw)
    self.attn = nnx.MultiHeadAttention(c.heads, c.d_model, decode=False,
                                       use_bias=False, **kw)
    self.has_cross = cross
    if cross:
      self.norm_x = nnx.RMSNorm(c.d_model, **kw)
      self.cross = nnx.MultiHeadAttention(c.heads, c.d_model, decode=False,
                                          use_bias=False, **kw)
    self.norm2 = nnx.RMSNorm(c.d_model, **kw)
    self.wi = nnx.Linear(c.d_model, c.ffn, use_bias=False, **kw)
    self.wo = nnx.Linear(c.ffn, c.d_model, use_bias=False, **kw)
    self.drop = nnx.Dropout(c.dropout, rngs=rngs)

  def __call__(self, x, enc=None, mask=None):
    x = x + self.drop(self.attn(self.norm1(x), mask=mask))
    if self.has_cross:
      h = self.norm_x(x)
      x = x + self.drop(self.cross(h, enc, enc))
    return x + self.drop(self.wo(jax.nn.relu(self.wi(self.norm2(x)))))


class T5(nnx.Module):
  def __init__(self, c: T5Config, dtype, param_dtype, rngs):
    self.embed = nnx.Embed(c.vocab, c.d_model, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
    self.encoder = nnx.List([T5Layer(c, False, dtype, param_dtype, rngs)
                             for _ in range(c.layers)])
    self.decoder = nnx.List([T5Layer(c, True, dtype, param_dtype, rngs)
                             for _ in range(c.layers)])
    self.norm = nnx.RMSNorm(c.d_model, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs)

  def __call__(self, src, tgt):
    enc = self.embed(src)
    for layer in self.encoder:
      enc = layer(enc)
    x = self.embed(tgt)
    causal = nnx.make_causal_mask(tgt)
    for layer in self.decoder:
      x = layer(x, enc, causal)
    return self.embed.attend(self.norm(x))


def _nnx_case(name, make_model, make_batch, loss_fn, tx, scan, dtype,
              abstract):
  """A functional nnx step over ``nnx.split((model, optimizer))``."""
  def make():
    model = make_model()
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, state = nnx.split(nnx.eval_shape(make) if abstract else make())
  if abstract:
    state = _abstract(state)

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  batch = make_batch()
  return Case(name, step, (state, _abstract(batch) if abstract else batch),
              scan, dtype)


def t5(size="tiny", dtype="float32", abstract=False, tx=None):
  c = T5_SIZES[size]
  comp, par = _dtypes(dtype)

  def batch():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"src": jax.random.randint(k1, (c.batch, c.src), 0, c.vocab),
            "tgt": jax.random.randint(k2, (c.batch, c.tgt + 1), 0, c.vocab)}

  def loss_fn(model, b):
    return _xent(model(b["src"], b["tgt"][:, :-1]), b["tgt"][:, 1:])

  return _nnx_case("t5", lambda: T5(c, comp, par, nnx.Rngs(0)), batch,
                   loss_fn, tx or optax.adamw(1e-3), False, dtype, abstract)


# ------------------------------------------------------------ ViT (nnx)
@dataclasses.dataclass(frozen=True)
class VitConfig:
  image: int = 16
  patch: int = 4
  channels: int = 3
  d_model: int = 32
  heads: int = 4
  mlp: int = 64
  layers: int = 2
  classes: int = 10
  batch: int = 8


VIT_SIZES = {"tiny": VitConfig(layers=1),
             "realistic": VitConfig(image=224, patch=16, d_model=768,
                                    heads=12, mlp=3072, layers=12,
                                    classes=1000, batch=64)}


class VitBlock(nnx.Module):
  def __init__(self, c: VitConfig, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ln1 = nnx.LayerNorm(c.d_model, **kw)
    self.attn = nnx.MultiHeadAttention(c.heads, c.d_model, decode=False, **kw)
    self.ln2 = nnx.LayerNorm(c.d_model, **kw)
    self.fc1 = nnx.Linear(c.d_model, c.mlp, **kw)
    self.fc2 = nnx.Linear(c.mlp, c.d_model, **kw)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Vit(nnx.Module):
  def __init__(self, c: VitConfig, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.patch = nnx.Conv(c.channels, c.d_model, (c.patch, c.patch),
                          strides=(c.patch, c.patch), padding="VALID", **kw)
    n = (c.image // c.patch) ** 2
    self.cls = nnx.Param(jnp.zeros((1, 1, c.d_model), param_dtype))
    self.pos = nnx.Param(0.02 * jax.random.normal(
        rngs.params(), (1, n + 1, c.d_model), param_dtype))
    self.blocks = nnx.List([VitBlock(c, dtype, param_dtype, rngs)
                            for _ in range(c.layers)])
    self.ln = nnx.LayerNorm(c.d_model, **kw)
    self.head = nnx.Linear(c.d_model, c.classes, **kw)

  def __call__(self, images):
    x = self.patch(images)
    b, h, w, d = x.shape
    x = x.reshape(b, h * w, d)
    cls = jnp.broadcast_to(self.cls[...], (b, 1, d)).astype(x.dtype)
    x = jnp.concatenate([cls, x], axis=1) + self.pos[...].astype(x.dtype)
    for blk in self.blocks:
      x = blk(x)
    return self.head(self.ln(x[:, 0]))


def _image_batch(batch, image, channels, classes):
  k1, k2 = jax.random.split(jax.random.key(1))
  return {"image": jax.random.normal(k1, (batch, image, image, channels)),
          "label": jax.random.randint(k2, (batch,), 0, classes)}


def vit(size="tiny", dtype="float32", abstract=False, tx=None):
  c = VIT_SIZES[size]
  comp, par = _dtypes(dtype)

  def loss_fn(model, b):
    return _xent(model(b["image"].astype(comp)), b["label"])

  return _nnx_case("vit", lambda: Vit(c, comp, par, nnx.Rngs(0)),
                   lambda: _image_batch(c.batch, c.image, c.channels,
                                        c.classes),
                   loss_fn, tx or optax.adamw(1e-3), False, dtype, abstract)


# ------------------------------------------- ResNet with BatchNorm (linen)
@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  image: int = 16
  widths: tuple[int, ...] = (8, 16)
  blocks: int = 1
  classes: int = 10
  batch: int = 8


RESNET_SIZES = {"tiny": ResNetConfig(),
                "realistic": ResNetConfig(image=224, widths=(64, 128, 256,
                                                             512),
                                          blocks=2, classes=1000, batch=64)}


class ResBlock(nn.Module):
  width: int
  stride: int
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype,
                             param_dtype=self.param_dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                             momentum=0.9, dtype=self.dtype,
                             param_dtype=self.param_dtype)
    h = nn.relu(norm()(conv(self.width, (3, 3), (self.stride,) * 2)(x)))
    h = norm()(conv(self.width, (3, 3))(h))
    if x.shape[-1] != self.width or self.stride != 1:
      x = norm()(conv(self.width, (1, 1), (self.stride,) * 2)(x))
    return nn.relu(x + h)


class ResNet(nn.Module):
  cfg: ResNetConfig
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, train: bool = True):
    c = self.cfg
    x = nn.Conv(c.widths[0], (3, 3), use_bias=False, dtype=self.dtype,
                param_dtype=self.param_dtype)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, dtype=self.dtype,
                             param_dtype=self.param_dtype)(x))
    for i, w in enumerate(c.widths):
      for j in range(c.blocks):
        x = ResBlock(w, 2 if (i and not j) else 1, self.dtype,
                     self.param_dtype)(x, train)
    x = x.mean(axis=(1, 2))
    return nn.Dense(c.classes, dtype=self.dtype,
                    param_dtype=self.param_dtype)(x)


class BnState(train_state.TrainState):
  batch_stats: Any = None


def resnet(size="tiny", dtype="float32", abstract=False, tx=None):
  c = RESNET_SIZES[size]
  comp, par = _dtypes(dtype)
  model = ResNet(c, comp, par)
  tx = tx or optax.sgd(0.1, momentum=0.9)
  batch = _image_batch(c.batch, c.image, 3, c.classes)

  def init():
    v = model.init(jax.random.key(0), batch["image"], train=False)
    return BnState.create(apply_fn=model.apply, params=v["params"], tx=tx,
                          batch_stats=v["batch_stats"])

  state = jax.eval_shape(init) if abstract else jax.jit(init)()

  def step(state, batch):
    def loss_fn(params):
      logits, upd = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats},
          batch["image"].astype(comp), train=True, mutable=["batch_stats"])
      return _xent(logits, batch["label"]), upd["batch_stats"]
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), loss

  return Case("resnet", step, (state, _abstract(batch) if abstract else
                               batch), False, dtype)


# --------------------------------------------------- MLP-Mixer (linen)
@dataclasses.dataclass(frozen=True)
class MixerConfig:
  image: int = 16
  patch: int = 4
  d_model: int = 32
  tokens_mlp: int = 16
  channels_mlp: int = 64
  layers: int = 2
  classes: int = 10
  batch: int = 8


MIXER_SIZES = {"tiny": MixerConfig(layers=1),
               "realistic": MixerConfig(image=224, patch=16, d_model=768,
                                        tokens_mlp=384, channels_mlp=3072,
                                        layers=12, classes=1000, batch=64)}


class MlpBlock(nn.Module):
  hidden: int
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(nn.Dense, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    return dense(x.shape[-1])(nn.gelu(dense(self.hidden)(x)))


class Mixer(nn.Module):
  cfg: MixerConfig
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    x = nn.Conv(c.d_model, (c.patch, c.patch), strides=(c.patch, c.patch),
                dtype=self.dtype, param_dtype=self.param_dtype)(x)
    x = x.reshape(x.shape[0], -1, c.d_model)
    norm = functools.partial(nn.LayerNorm, dtype=self.dtype,
                             param_dtype=self.param_dtype)
    for _ in range(c.layers):
      y = jnp.swapaxes(norm()(x), 1, 2)  # token mixing
      x = x + jnp.swapaxes(MlpBlock(c.tokens_mlp, self.dtype,
                                    self.param_dtype)(y), 1, 2)
      x = x + MlpBlock(c.channels_mlp, self.dtype, self.param_dtype)(
          norm()(x))
    x = norm()(x).mean(axis=1)
    return nn.Dense(c.classes, dtype=self.dtype,
                    param_dtype=self.param_dtype)(x)


def mixer(size="tiny", dtype="float32", abstract=False, tx=None):
  c = MIXER_SIZES[size]
  comp, par = _dtypes(dtype)
  model = Mixer(c, comp, par)
  tx = tx or optax.adamw(1e-3)
  batch = _image_batch(c.batch, c.image, 3, c.classes)

  def init():
    return model.init(jax.random.key(0), batch["image"])["params"]

  params = jax.eval_shape(init) if abstract else jax.jit(init)()

  def step(params, opt_state, batch):
    def loss_fn(p):
      return _xent(model.apply({"params": p}, batch["image"].astype(comp)),
                   batch["label"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
  return Case("mixer", step, (params, opt_state, _abstract(batch) if abstract
                              else batch), False, dtype)


# ------------------------------------------- Mixtral-style MoE (flax.nnx)
@dataclasses.dataclass(frozen=True)
class MoeConfig:
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  ffn: int = 32
  experts: int = 4
  top_k: int = 2
  layers: int = 2
  seq: int = 16
  batch: int = 8


MOE_SIZES = {"tiny": MoeConfig(layers=1),
             "realistic": MoeConfig(vocab=32000, d_model=1024, heads=16,
                                    ffn=2816, experts=8, layers=4, seq=1024,
                                    batch=8)}


class SparseMoe(nnx.Module):
  """Top-k routing with dense expert compute and a one-hot combine, as the
  simple public Mixtral ports do."""

  def __init__(self, c: MoeConfig, dtype, param_dtype, rngs):
    init = nnx.initializers.lecun_normal()
    self.k, self.dtype = c.top_k, dtype
    self.router = nnx.Linear(c.d_model, c.experts, use_bias=False,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    shape = (c.experts, c.d_model, c.ffn)
    self.w_gate = nnx.Param(init(rngs.params(), shape, param_dtype))
    self.w_up = nnx.Param(init(rngs.params(), shape, param_dtype))
    self.w_down = nnx.Param(init(rngs.params(), (c.experts, c.ffn,
                                                 c.d_model), param_dtype))

  def __call__(self, x):
    logits = self.router(x).astype(jnp.float32)
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits, -1), self.k)
    weights = weights / weights.sum(-1, keepdims=True)
    combine = (jax.nn.one_hot(idx, logits.shape[-1]) *
               weights[..., None]).sum(-2).astype(self.dtype)  # [b, s, E]
    wg, wu, wd = (w[...].astype(self.dtype)
                  for w in (self.w_gate, self.w_up, self.w_down))
    h = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, wg)) * jnp.einsum(
        "bsd,edf->bsef", x, wu)
    out = jnp.einsum("bsef,efd->bsed", h, wd)
    return jnp.einsum("bsed,bse->bsd", out, combine)


class MoeLm(nnx.Module):
  def __init__(self, c: MoeConfig, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.embed = nnx.Embed(c.vocab, c.d_model, **kw)
    self.norms = nnx.List([nnx.RMSNorm(c.d_model, **kw)
                           for _ in range(2 * c.layers)])
    self.attn = nnx.List([nnx.MultiHeadAttention(
        c.heads, c.d_model, decode=False, use_bias=False, **kw)
        for _ in range(c.layers)])
    self.moe = nnx.List([SparseMoe(c, dtype, param_dtype, rngs)
                         for _ in range(c.layers)])
    self.head = nnx.Linear(c.d_model, c.vocab, use_bias=False, **kw)

  def __call__(self, tokens):
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    for i, (attn, moe) in enumerate(zip(self.attn, self.moe)):
      x = x + attn(self.norms[2 * i](x), mask=mask)
      x = x + moe(self.norms[2 * i + 1](x))
    return self.head(x)


def moe(size="tiny", dtype="float32", abstract=False, tx=None):
  c = MOE_SIZES[size]
  comp, par = _dtypes(dtype)

  def batch():
    return jax.random.randint(jax.random.key(1), (c.batch, c.seq + 1), 0,
                              c.vocab)

  def loss_fn(model, tokens):
    return _xent(model(tokens[:, :-1]), tokens[:, 1:])

  return _nnx_case("moe", lambda: MoeLm(c, comp, par, nnx.Rngs(0)), batch,
                   loss_fn, tx or optax.adamw(1e-3), False, dtype, abstract)


# ------------------------------------------------------------------- all
BUILDERS: dict[str, Callable[..., Case]] = {
    "llama": llama, "t5": t5, "vit": vit, "resnet": resnet, "mixer": mixer,
    "moe": moe}


def build(name: str, **kw) -> Case:
  """One zoo case: ``build("llama", size="tiny", dtype="float32",
  scan=True)``; ``scan`` applies to the models with a layer stack option."""
  if name not in BUILDERS:
    raise ValueError(f"unknown zoo model {name!r}; one of {sorted(BUILDERS)}")
  return BUILDERS[name](**kw)


