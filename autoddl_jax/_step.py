"""What :meth:`Plan.jit` returns when a bare ``jax.jit`` function is not
enough (an Explicit-axes mesh, static arguments, flax.nnx objects updated
in place)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding

from autoddl_jax._trace import Static


class PlannedStep:
  """What :meth:`Plan.jit` returns when a bare ``jax.jit`` function is not
  enough; ``__call__`` and ``lower`` take the step's own arguments.

  * Explicit-axes mesh: the plan is lowered on the same devices viewed as
    Auto axes (sharding constraints need them). Arrays placed on the
    Explicit mesh carry that mesh in their types, so they are re-viewed on
    the Auto mesh first -- same devices, same layout, no data moves. So
    are arrays placed on the user's mesh where pipeline stages split one
    of its axes (the data moves where the layouts differ).
  * Static arguments (``jax.jit(f, static_argnums=...)``): they must equal the
    values planned with, and travel as tree structure, not as arrays.
  * In-place flax.nnx objects: the new state the program returns is written
    back into them (as ``nnx.jit`` and ``ad.auto_shard`` do), and the step's
    own result is returned.
  """

  def __init__(self, jitted, in_shardings, *, retype: bool,
               static: Mapping[int, Any], nnx_args: tuple[int, ...]):
    self._jitted = jitted
    self._in = in_shardings
    self._retype = retype
    self._static = static
    self._nnx = nnx_args

  def _args(self, args) -> tuple:
    args = tuple(args)
    if self._static:
      # Static values as given, or as Static nodes (a tree built from the
      # plan's own in_tree, as verify does).
      args = tuple(a.value if isinstance(a, Static) else a for a in args)
      for i, want in self._static.items():
        got = args[i] if i < len(args) else "(missing)"
        if not Static.same(got, want):
          raise TypeError(
              f"static argument {i} is {got!r}; the plan was made with "
              f"{want!r}. Plan again for that value (each static value is "
              "its own program)")
      args = tuple(Static(a) if i in self._static else a
                   for i, a in enumerate(args))
    if self._retype:
      def one(x, s):
        if isinstance(x, jax.ShapeDtypeStruct):
          return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        if isinstance(x, jax.Array) and isinstance(
            x.sharding, NamedSharding) and x.sharding.mesh != s.mesh:
          return jax.device_put(x, s)
        return x
      args = jax.tree_util.tree_map(one, args, self._in)
    return args

  def __call__(self, *args):
    out = self._jitted(*self._args(args))
    if not self._nnx:
      return out
    from flax import nnx
    *new, out = out
    for i in self._nnx:
      nnx.update(args[i], nnx.state(new[i]))
    return out

  def lower(self, *args):
    return self._jitted.lower(*self._args(args))
