"""Reference models and train steps used by the tests, examples and benchmarks.

Plain JAX + optax, functional style: ``step(params, opt_state, batch) ->
(params, opt_state, loss)``. Four families: an MLP, a GPT-style transformer
(embedding gather, causal attention, layernorm, softmax cross-entropy; layers in
``lax.scan``, ``ad.pipeline.scan`` or unrolled; a Llama-style decoder in
:mod:`autoddl_jax.testing.llama`), a VGG-style CNN (conv, max-pool) -- the AutoDDL
paper's two model families -- and a mixture-of-experts layer (top-1 routing with
capacity, GShard-style dispatch).

Every builder returns an :class:`Example`: the step, its arguments -- real
arrays (``abstract=False``) or ``jax.ShapeDtypeStruct`` (``abstract=True``, for
planning large models without allocating them) -- and the optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from autoddl_jax import pipeline

Params = dict[str, Any]


class Example(NamedTuple):
  step: Callable
  params: Any
  opt_state: Any
  batch: Any
  optimizer: optax.GradientTransformation

  @property
  def args(self) -> tuple:
    return (self.params, self.opt_state, self.batch)


def _init(key, shape, scale=None, dtype=jnp.float32):
  scale = scale if scale is not None else 1.0 / math.sqrt(shape[-2] if len(
      shape) >= 2 else shape[-1])
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _keys(seed: int):
  key = jax.random.key(seed)
  while True:
    key, sub = jax.random.split(key)
    yield sub


def layer_norm(x, scale, bias, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def make_step(loss_fn: Callable, optimizer: optax.GradientTransformation,
              return_grads: bool = False) -> Callable:
  """A train step: forward, backward, optimizer update."""

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if return_grads:
      return params, opt_state, loss, grads
    return params, opt_state, loss

  return step


def _finish(loss_fn, params, batch, optimizer, abstract, return_grads):
  optimizer = optimizer or optax.adamw(1e-3)
  if abstract:
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          params)
    opt_state = jax.eval_shape(optimizer.init, params)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         batch)
  else:
    opt_state = optimizer.init(params)
  return Example(make_step(loss_fn, optimizer, return_grads), params,
                 opt_state, batch, optimizer)


def _maybe_abstract(fn, abstract):
  return jax.eval_shape(fn) if abstract else fn()


# ---------------------------------------------------------------------- MLP
def mlp(batch=32, sizes=(64, 128, 128, 16), seed=0, optimizer=None,
        abstract=False, return_grads=False):
  def init():
    k = _keys(seed)
    p = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
      p[f"w{i}"] = _init(next(k), (a, b))
      p[f"b{i}"] = jnp.zeros((b,))
    x = jax.random.normal(next(k), (batch, sizes[0]))
    y = jax.random.randint(next(k), (batch,), 0, sizes[-1])
    return p, {"x": x, "y": y}

  n = len(sizes) - 1

  def loss_fn(p, b):
    h = b["x"]
    for i in range(n):
      h = h @ p[f"w{i}"] + p[f"b{i}"]
      if i < n - 1:
        h = jax.nn.relu(h)
    return cross_entropy(h, b["y"])

  params, data = _maybe_abstract(init, abstract)
  return _finish(loss_fn, params, data, optimizer, abstract, return_grads)


# ---------------------------------------------------------------------- GPT
@dataclasses.dataclass(frozen=True)
class GptConfig:
  vocab: int = 256
  d_model: int = 64
  n_heads: int = 4
  n_layers: int = 2
  seq: int = 16
  batch: int = 8
  mlp_ratio: int = 4
  scan: bool = True
  dtype: Any = jnp.float32
  # The layer stack through ad.pipeline.scan (pipelined where a plan says).
  pipeline: bool = False


def gpt(cfg: GptConfig = GptConfig(), seed=0, optimizer=None, abstract=False,
        return_grads=False):
  d, h, f = cfg.d_model, cfg.n_heads, cfg.d_model * cfg.mlp_ratio

  def layer_params(k):
    return {
        "ln1_scale": jnp.ones((d,), cfg.dtype),
        "ln1_bias": jnp.zeros((d,), cfg.dtype),
        "wq": _init(next(k), (d, d), dtype=cfg.dtype),
        "wk": _init(next(k), (d, d), dtype=cfg.dtype),
        "wv": _init(next(k), (d, d), dtype=cfg.dtype),
        "wo": _init(next(k), (d, d), dtype=cfg.dtype),
        "ln2_scale": jnp.ones((d,), cfg.dtype),
        "ln2_bias": jnp.zeros((d,), cfg.dtype),
        "w1": _init(next(k), (d, f), dtype=cfg.dtype),
        "w2": _init(next(k), (f, d), dtype=cfg.dtype),
    }

  def init():
    k = _keys(seed)
    layers = [layer_params(k) for _ in range(cfg.n_layers)]
    p = {
        "embed": _init(next(k), (cfg.vocab, d), 0.02, cfg.dtype),
        "pos": _init(next(k), (cfg.seq, d), 0.02, cfg.dtype),
        "ln_f_scale": jnp.ones((d,), cfg.dtype),
        "ln_f_bias": jnp.zeros((d,), cfg.dtype),
        "unembed": _init(next(k), (d, cfg.vocab), dtype=cfg.dtype),
    }
    if cfg.scan:
      p["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    else:
      p["layers"] = {str(i): l for i, l in enumerate(layers)}
    tokens = jax.random.randint(next(k), (cfg.batch, cfg.seq + 1), 0,
                                cfg.vocab)
    return p, {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}

  def block(x, lp):
    b, s, _ = x.shape
    y = layer_norm(x, lp["ln1_scale"], lp["ln1_bias"])
    q = (y @ lp["wq"]).reshape(b, s, h, d // h)
    k = (y @ lp["wk"]).reshape(b, s, h, d // h)
    v = (y @ lp["wv"]).reshape(b, s, h, d // h)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
    mask = jnp.tril(jnp.ones((s, s), bool))
    att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
    att = jax.nn.softmax(att, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
    x = x + o @ lp["wo"]
    y = layer_norm(x, lp["ln2_scale"], lp["ln2_bias"])
    x = x + jax.nn.gelu(y @ lp["w1"]) @ lp["w2"]
    return x

  def loss_fn(p, batch):
    x = p["embed"][batch["inputs"]] + p["pos"]
    if cfg.scan:
      run = pipeline.scan if cfg.pipeline else jax.lax.scan
      x, _ = run(lambda c, lp: (block(c, lp), None), x, p["layers"])
    else:
      for i in range(cfg.n_layers):
        x = block(x, p["layers"][str(i)])
    x = layer_norm(x, p["ln_f_scale"], p["ln_f_bias"])
    logits = (x @ p["unembed"]).astype(jnp.float32)
    return cross_entropy(logits, batch["labels"])

  params, data = _maybe_abstract(init, abstract)
  return _finish(loss_fn, params, data, optimizer, abstract, return_grads)


# ---------------------------------------------------------------------- VGG
def vgg(batch=8, image=16, channels=(8, 16), hidden=64, classes=10, seed=0,
        optimizer=None, abstract=False, return_grads=False):
  """VGG-style: [conv3x3-relu, conv3x3-relu, maxpool2] per stage, then MLP."""

  def init():
    k = _keys(seed)
    p = {}
    cin = 3
    for i, c in enumerate(channels):
      p[f"conv{i}a"] = _init(next(k), (3, 3, cin, c), 1 / math.sqrt(9 * cin))
      p[f"conv{i}b"] = _init(next(k), (3, 3, c, c), 1 / math.sqrt(9 * c))
      cin = c
    side = image // 2 ** len(channels)
    p["fc1"] = _init(next(k), (side * side * cin, hidden))
    p["fc2"] = _init(next(k), (hidden, classes))
    x = jax.random.normal(next(k), (batch, image, image, 3))
    y = jax.random.randint(next(k), (batch,), 0, classes)
    return p, {"x": x, "y": y}

  def conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def loss_fn(p, b):
    x = b["x"]
    for i in range(len(channels)):
      x = jax.nn.relu(conv(x, p[f"conv{i}a"]))
      x = jax.nn.relu(conv(x, p[f"conv{i}b"]))
      x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1),
                                (1, 2, 2, 1), "VALID")
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ p["fc1"])
    return cross_entropy(x @ p["fc2"], b["y"])

  params, data = _maybe_abstract(init, abstract)
  return _finish(loss_fn, params, data, optimizer, abstract, return_grads)


# ---------------------------------------------------------------------- MoE
def moe(tokens=64, d_model=32, d_ff=64, experts=4, capacity_factor=2.0,
        seed=0, optimizer=None, abstract=False, return_grads=False):
  """One top-1 mixture-of-experts FFN layer with capacity, plus a head."""
  cap = int(math.ceil(tokens / experts * capacity_factor))

  def init():
    k = _keys(seed)
    p = {
        "router": _init(next(k), (d_model, experts)),
        "w1": _init(next(k), (experts, d_model, d_ff)),
        "w2": _init(next(k), (experts, d_ff, d_model)),
        "head": _init(next(k), (d_model, d_model)),
    }
    x = jax.random.normal(next(k), (tokens, d_model))
    y = jax.random.normal(next(k), (tokens, d_model))
    return p, {"x": x, "y": y}

  def loss_fn(p, b):
    x = b["x"]
    gates = jax.nn.softmax(x @ p["router"], axis=-1)  # [t, e]
    expert = jnp.argmax(gates, axis=-1)
    onehot = jax.nn.one_hot(expert, experts, dtype=x.dtype)  # [t, e]
    pos = jnp.cumsum(onehot, axis=0) * onehot - 1.0  # slot within expert
    keep = (pos < cap) & (onehot > 0)
    slot = jax.nn.one_hot(jnp.where(keep, pos, -1.0).astype(jnp.int32), cap,
                          dtype=x.dtype)  # [t, e, c]
    dispatch = slot * keep[..., None]
    combine = dispatch * (gates * onehot)[..., None]
    xin = jnp.einsum("tec,td->ecd", dispatch, x)
    hid = jax.nn.relu(jnp.einsum("ecd,edf->ecf", xin, p["w1"]))
    out = jnp.einsum("ecf,efd->ecd", hid, p["w2"])
    y = jnp.einsum("tec,ecd->td", combine, out)
    y = (x + y) @ p["head"]
    return jnp.mean(jnp.square(y - b["y"]))

  params, data = _maybe_abstract(init, abstract)
  return _finish(loss_fn, params, data, optimizer, abstract, return_grads)


# ------------------------------------------------------------- hand plans
def _fit(spec_entries, shape, mesh):
  """Drops axes from a spec where they do not divide the dim."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  out = []
  for d, e in enumerate(spec_entries):
    if e is None:
      out.append(None)
      continue
    axes = (e,) if isinstance(e, str) else tuple(e)
    keep = []
    for a in axes:
      k = np.prod([sizes[x] for x in keep + [a]])
      if shape[d] % k == 0:
        keep.append(a)
    out.append(None if not keep else (keep[0] if len(keep) == 1 else
                                      tuple(keep)))
  return P(*out)


def _megatron_param(path: str, shape, model_axis):
  """Megatron TP: column-parallel in, row-parallel out, vocab-parallel embed."""
  r = len(shape)
  col = [None] * (r - 1) + [model_axis]
  row = [None] * r
  if r >= 2:
    row[r - 2] = model_axis
  name = path.split("'")[-2] if "'" in path else path
  if name in ("wq", "wk", "wv", "w1", "fc1", "unembed", "w0", "w2_mlp") or \
      name.endswith("a"):
    return col
  if name in ("wo", "w2", "fc2", "w1_mlp") or name.endswith("b"):
    return row
  if name == "embed":
    return [model_axis, None]
  if name.startswith("w") and r == 2:  # MLP layers alternate
    return col if int(name[1:]) % 2 == 0 else row
  if name.startswith("b") and name[1:].isdigit():
    return [model_axis] if int(name[1:]) % 2 == 0 else [None]
  return [None] * r


def hand_plans(ex: Example, mesh, model: str) -> dict[str, tuple]:
  """What an expert writes by hand: in_shardings (params, optimizer state,
  batch) of a reference example on a mesh, for data parallel ("dp"), ZeRO-3
  ("fsdp"), Megatron tensor parallel on the last axis + data parallel on the
  others ("megatron") and, on meshes of two or more axes, Megatron with the
  parameters also split over the data axes, MaxText-style ("fsdp_tp").
  ``model`` is the example's family: "mlp", "gpt", "vgg" or "moe"."""
  axes = tuple(mesh.axis_names)
  all_axes = axes if len(axes) > 1 else axes[0]
  data_axes = axes[:-1] if len(axes) > 1 else None
  model_axis = axes[-1]

  def data(spec_first):
    return jax.tree.map(lambda x: _fit([spec_first] + [None] * (x.ndim - 1),
                                       x.shape, mesh), ex.batch)

  def with_opt(param_specs):
    opt = optax.tree_utils.tree_map_params(
        ex.optimizer, lambda _, s: s, ex.opt_state, param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P))
    return opt

  plans = {}
  rep = jax.tree.map(lambda _: P(), ex.params)
  plans["dp"] = (rep, with_opt(rep), data(all_axes))

  def fsdp_spec(x):
    d = int(np.argmax(x.shape))
    return _fit([all_axes if i == d else None for i in range(x.ndim)],
                x.shape, mesh)

  fs = jax.tree.map(fsdp_spec, ex.params)
  plans["fsdp"] = (fs, with_opt(fs), data(all_axes))

  def meg(path, x):
    ps = jax.tree_util.keystr(path)
    entries = _megatron_param(ps, x.shape[-2:] if x.ndim >= 2 else x.shape,
                              model_axis)
    entries = [None] * (x.ndim - len(entries)) + list(entries)
    if model == "moe" and x.ndim == 3:  # expert parallel
      entries = [model_axis, None, None]
    return _fit(entries, x.shape, mesh)

  mg = jax.tree_util.tree_map_with_path(meg, ex.params)
  plans["megatron"] = (mg, with_opt(mg), data(data_axes))
  if data_axes:
    def fsdp_tp(spec, x):
      # Split the largest dim the model axis leaves free over the data axes.
      entries = list(spec) + [None] * (x.ndim - len(spec))
      free = [d for d in range(x.ndim) if entries[d] is None]
      if free:
        d = max(free, key=lambda i: (x.shape[i], -i))
        entries[d] = data_axes if len(data_axes) > 1 else data_axes[0]
      return _fit(entries, x.shape, mesh)
    ft = jax.tree.map(fsdp_tp, mg, ex.params,
                      is_leaf=lambda s: isinstance(s, P))
    plans["fsdp_tp"] = (ft, with_opt(ft), data(data_axes))
  return plans
