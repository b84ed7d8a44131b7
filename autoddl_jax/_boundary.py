"""Shardings as users write them (what ``jax.jit`` takes), read into codes.

``in_shardings`` / ``out_shardings`` arrive as one sharding for every leaf
or as a pytree prefix of the arguments (results), with flax's boxed trees
(``nn.get_sharding``, ``nnx.get_named_sharding``) as they come:
:func:`flat_shardings` gives one per leaf, :func:`to_codes` one leaf's
nd-SBP codes, with errors that say which leaf and what to change.
"""

from __future__ import annotations

import math
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autoddl_jax._cluster import MeshInfo
from autoddl_jax._sbp import B_CODE as B, spec_to_codes


def to_codes(s, aval, mi: MeshInfo, where: str) -> tuple[int, ...]:
  rank = len(aval.shape)
  if s is None:
    return (B,) * mi.ndim
  if isinstance(s, NamedSharding):
    if tuple(s.mesh.axis_names) != mi.axis_names:
      raise ValueError(f"{where}: sharding's mesh axes "
                       f"{tuple(s.mesh.axis_names)} differ from the plan's "
                       f"mesh axes {mi.axis_names}")
    s = s.spec
  if not isinstance(s, PartitionSpec):
    raise TypeError(f"{where}: expected a NamedSharding, PartitionSpec or "
                    f"None, got {type(s).__name__}")
  if getattr(s, "unreduced", None) or getattr(s, "reduced", None):
    raise ValueError(f"{where}: {s} holds an unreduced (partial-sum) or "
                     "reduced axis, which cannot sit at a jit boundary: "
                     "arguments and results are whole values. Drop "
                     "unreduced=/reduced= from it")
  codes = spec_to_codes(s, rank, mi.axis_names)
  for d in range(rank):
    k = math.prod(sz for c, sz in zip(codes, mi.axis_sizes) if c == d)
    if aval.shape[d] % k:
      raise ValueError(f"{where}: {s} splits dim {d} of size {aval.shape[d]} "
                       f"{k} ways, which does not divide it")
  return codes


def _is_sharding_leaf(x) -> bool:
  return x is None or isinstance(x, NamedSharding | PartitionSpec)


def _unbox(tree):
  """Flax's boxed values (``nn.Partitioned`` and other axis metadata, nnx
  ``Variable``s) replaced by what they hold, so a tree of shardings flax
  hands out (``nn.get_sharding``, ``nnx.get_named_sharding``) is a prefix
  of the arguments whatever their boxing."""
  if "flax" not in sys.modules:  # no flax objects without flax imported
    return tree
  from flax import nnx
  from flax.core import meta

  def boxed(x) -> bool:
    return isinstance(x, meta.AxisMetadata | nnx.Variable)

  def open_box(x):
    if isinstance(x, nnx.Variable):
      return x.get_value()
    return x.unbox() if boxed(x) else x

  return jax.tree_util.tree_map(
      open_box, tree, is_leaf=lambda x: boxed(x) or _is_sharding_leaf(x))


def flat_shardings(tree, target_tree, n: int, what: str) -> list:
  """One sharding per leaf of ``target_tree`` from what ``jax.jit`` takes:
  one sharding for every leaf, or a pytree prefix of the arguments (results)
  -- ``(None, None, P('data'))`` for three arguments -- whose each sharding
  covers the subtree under it."""
  if tree is None:
    return [None] * n
  tree = _unbox(tree)
  if _is_sharding_leaf(tree):
    return [tree] * n
  for path, s in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=_is_sharding_leaf)[0]:
    if not _is_sharding_leaf(s):
      raise TypeError(f"{what}{jax.tree_util.keystr(path)}: expected a "
                      f"NamedSharding, PartitionSpec or None, got "
                      f"{type(s).__name__} {s!r}")
  index = jax.tree_util.tree_unflatten(target_tree, range(n))
  flat: list = [None] * n
  def put(s, sub):
    for i in jax.tree_util.tree_leaves(sub):
      flat[i] = s
  try:
    jax.tree_util.tree_map(put, tree, index, is_leaf=_is_sharding_leaf)
  except (ValueError, TypeError) as e:
    whose, entry = (("arguments", ": a tuple with one entry per argument")
                    if what.startswith("in_") else ("results", ""))
    got = jax.tree_util.tree_structure(tree, is_leaf=_is_sharding_leaf)
    raise ValueError(
        f"{what} must be one sharding or a pytree prefix of the {whose} (as "
        f"jax.jit takes{entry}, each entry a NamedSharding, PartitionSpec, "
        f"None or a tree of them); got {got} for {whose} {target_tree}. "
        f"{str(e).splitlines()[0]}") from e
  return flat
