"""Shared test helpers: meshes, numerics checks and hand-written plans."""

from __future__ import annotations

import numpy as np
import jax
import optax
from jax.sharding import AxisType, PartitionSpec as P

from autoddl_jax import models

MESH_SHAPES = [(8,), (2, 4), (4, 2)]


def make_mesh(shape, explicit=True):
  names = ("data",) if len(shape) == 1 else ("data", "model")
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types)


def build(name: str, **kw) -> models.Example:
  if name == "mlp":
    return models.mlp(**kw)
  if name == "gpt_scan":
    return models.gpt(models.GptConfig(scan=True), **kw)
  if name == "gpt_unrolled":
    return models.gpt(models.GptConfig(scan=False), **kw)
  if name == "vgg":
    return models.vgg(**kw)
  if name == "moe":
    return models.moe(**kw)
  raise ValueError(name)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_tree_close(got, want, rtol, what):
  gl = jax.tree_util.tree_leaves_with_path(got)
  wl = jax.tree_util.tree_leaves(want)
  assert len(gl) == len(wl)
  for (path, g), w in zip(gl, wl):
    err = rel_err(g, w)
    assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: rel err {err:.3g}"


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


def hand_plans(ex: models.Example, mesh, model: str) -> dict[str, object]:
  """DP, FSDP and Megatron TP+DP in_shardings for an example on a mesh."""
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
  return plans
