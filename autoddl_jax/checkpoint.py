"""Save and restore a sharded train state under a plan's shardings (orbax).

    ad.checkpoint.save(path, state)                       # every process
    state = ad.checkpoint.restore(path, plan.in_shardings[0], like=state)

``restore`` places each array on the sharding given -- a plan for another
mesh reshards on load.
"""

from __future__ import annotations

import os
from typing import Any

import jax


def _checkpointer():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:  # comes with flax; say so if it is missing
    raise ImportError("autoddl_jax.checkpoint needs orbax-checkpoint (pip "
                      "install orbax-checkpoint; flax installs it)") from e
  return ocp.StandardCheckpointer()


def save(path: str | os.PathLike, tree: Any) -> None:
  """Writes ``tree`` (arrays, possibly sharded over many processes) to the
  folder ``path`` (absolute; created; must not exist). Every process
  calls it."""
  ckpt = _checkpointer()
  ckpt.save(os.path.abspath(os.fspath(path)), tree)
  ckpt.wait_until_finished()


def restore(path: str | os.PathLike, shardings: Any, like: Any) -> Any:
  """Reads a tree saved by :func:`save`, each array placed on the matching
  leaf of ``shardings`` (a pytree of ``jax.sharding.Sharding`` shaped like
  ``like``, e.g. ``plan.in_shardings[0]``). ``like`` gives the structure,
  shapes and dtypes (arrays or ``ShapeDtypeStruct``s)."""
  target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like,
      shardings)
  return _checkpointer().restore(os.path.abspath(os.fspath(path)), target)
