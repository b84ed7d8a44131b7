"""Shared test helpers: meshes and numerics checks (hand-written plans live in
``autoddl_jax.testing.models.hand_plans``)."""

from __future__ import annotations

import numpy as np
import jax
from flax import nnx
from jax.sharding import AxisType

from autoddl_jax.testing import models
from autoddl_jax.testing.models import hand_plans  # noqa: F401 (re-exported)

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


class NnxMlp(nnx.Module):
  """A two-layer flax.nnx MLP, 32 -> 64 -> 8, for the nnx step tests."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(32, 64, rngs=rngs)
    self.l2 = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


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
