"""Tracing a step into the program the planner plans.

:func:`trace` turns ``fn(*args)`` -- a plain function, a ``jax.jit`` one
(static and donated arguments read from it), a step over flax.nnx objects
updated in place -- into a :class:`Traced`: the closed jaxpr, the argument
and result trees with each leaf's path and type, and what a lowering must
honour (static values, donation, in-place objects). Nothing here knows about
meshes or costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from autoddl_jax import _remat, pipeline
from autoddl_jax._jaxpr import inline_plain_calls

@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
  """A traced step: its closed jaxpr and what each argument and result leaf
  is (path, type, whether it can be split, the sharding it came with)."""

  closed: Any
  in_tree: Any
  out_tree: Any
  in_names: list[str]
  out_names: list[str]
  in_avals: list[Any]
  out_avals: list[Any]
  in_keys: list[tuple[str, ...]]
  out_keys: list[tuple[str, ...]]
  splittable: list[bool]
  shardings: list[Any]  # argument shardings, when arrays came placed
  # Positions of flax.nnx objects the step updates in place: the traced
  # program returns ``(*args with only those kept, result)`` so that their
  # new state is planned and can be written back (see ``_in_place``).
  nnx_args: tuple[int, ...] = ()
  # Static arguments of a ``jax.jit(f, static_argnums=...)`` step: position
  # -> value. They are traced as Python values (tree structure, no leaves).
  static: Mapping[int, Any] = dataclasses.field(default_factory=dict)
  # Arguments of a ``jax.jit(f, donate_argnums=...)`` step: their buffers
  # become the results' (``Problem.donated``), and ``Plan.jit`` donates them.
  donate_argnums: tuple[int, ...] = ()
  donated_leaves: frozenset[int] = frozenset()

  def user_paths(self) -> list[str]:
    """Each argument leaf's path as the user named it (``0/layers/wq``:
    nnx ``Variable`` boxes left out)."""
    return [_path(keys) for keys in self.in_keys]

  def result_paths(self) -> list[str]:
    """Each result leaf's path, written as :meth:`user_paths`."""
    return [_path(keys) for keys in self.out_keys]


def _path(keys: tuple[str, ...]) -> str:
  return "/".join(k for k in keys if k != "value")


@jax.tree_util.register_pytree_node_class
class Static:
  """A static argument: a pytree node with no leaves whose value is its tree
  structure, so the traced program and ``jax.jit`` both see it as static."""

  def __init__(self, value: Any):
    self.value = value

  @staticmethod
  def same(a: Any, b: Any) -> bool:
    try:
      return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (arrays and odd __eq__s are not equal)
      return False

  def __eq__(self, other):
    return isinstance(other, Static) and self.same(self.value, other.value)

  def __hash__(self):
    return hash((type(self.value), self.value))

  def __repr__(self):
    return f"static({self.value!r})"

  def tree_flatten(self):
    return (), self.value

  @classmethod
  def tree_unflatten(cls, value, _):
    return cls(value)


def jit_argnums(fn: Callable, nargs: int, field: str) -> tuple[int, ...]:
  """Positions a ``jax.jit`` function's ``field`` names (none for other
  functions), negative ones counted from the end."""
  info = getattr(fn, "_jit_info", None)
  nums = getattr(info, field, ()) or ()
  return tuple(sorted({i % nargs for i in nums if -nargs <= i < nargs}))


def static_argnums(fn: Callable, nargs: int) -> tuple[int, ...]:
  """Positions of ``fn``'s static arguments if it is a ``jax.jit`` function
  (``static_argnums``, and ``static_argnames`` given positionally)."""
  return jit_argnums(fn, nargs, "static_argnums")


def donate_argnums(fn: Callable, nargs: int) -> tuple[int, ...]:
  """Positions of the arguments a ``jax.jit(f, donate_argnums=...)``
  function donates."""
  return jit_argnums(fn, nargs, "donate_argnums")


def is_nnx_node(x: Any) -> bool:
  """Flax nnx modules / optimizers (graph nodes), without importing flax
  unless the argument is one of its objects."""
  if not any((c.__module__ or "").startswith("flax.")
             for c in type(x).__mro__):
    return False
  from flax import nnx
  return nnx.graph.is_graph_node(x)


def _in_place(fn: Callable, nodes: tuple[int, ...], nargs: int) -> Callable:
  """``fn`` returning, beside its result, the nnx objects it may update in
  place, at their argument positions (so each new leaf ties to the argument
  leaf it replaces)."""

  @functools.wraps(fn)
  def step(*args):
    out = fn(*args)
    return (*(args[i] if i in nodes else None for i in range(nargs)), out)

  return step


# Python scalars: traced as weak-typed scalars and kept replicated.
PY_SCALAR = (bool, int, float, complex)


def key_tokens(path) -> tuple[str, ...]:
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def _abstract_leaf(path, x):
  if isinstance(x, jax.ShapeDtypeStruct):
    # Traced without its sharding (kept as a seed): one on an Explicit-axes
    # mesh would enter the program's types.
    return (jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type),
            getattr(x, "sharding", None))
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype), getattr(x, "sharding", None)
  if isinstance(x, np.ndarray | np.generic):
    return jax.ShapeDtypeStruct(x.shape, x.dtype), None
  if isinstance(x, PY_SCALAR):
    return x, None  # traced as a weak-typed scalar, kept replicated
  raise TypeError(
      f"argument leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}; "
      "autoddl_jax plans over arrays (jax/numpy arrays, jax.ShapeDtypeStruct "
      "or Python scalars). Close over other values with functools.partial.")


def _auto_context_mesh():
  """No Explicit-axes context mesh while tracing.

  Tracing under ``jax.set_mesh`` of an Explicit-axes mesh (the
  ``jax.make_mesh`` default) writes that mesh into the program's types and
  parameters, while the plan is lowered on the Auto view of the same
  devices. The step is traced as outside any mesh instead, so it is the same
  program (and fingerprint) wherever it was planned.
  """
  cur = jax.sharding.get_abstract_mesh()
  if cur.empty or all(t == AxisType.Auto for t in cur.axis_types):
    return contextlib.nullcontext()
  try:
    return jax.set_mesh(None)  # no mesh at all, as outside set_mesh
  except ValueError:  # planning inside a jax trace: set_mesh is refused
    return jax.sharding.use_abstract_mesh(AbstractMesh((), ()))


def trace(fn: Callable, args: tuple,
           remat: str | tuple[str, ...] = _remat.NONE,
           schedule: pipeline.Schedule | None = None) -> Traced:
  """``fn(*args)`` traced (its layer stacks under ``remat``, its
  ``ad.pipeline.scan`` calls run by ``schedule``) into a :class:`Traced`."""
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}")
  static = {i: args[i] for i in static_argnums(fn, len(args))}
  donated = tuple(i for i in donate_argnums(fn, len(args)) if i not in static)
  for i, v in static.items():
    try:
      hash(v)
    except TypeError as e:
      raise TypeError(f"static argument {i} of {getattr(fn, '__name__', fn)}"
                      f" is a {type(v).__name__}, which is not hashable; "
                      "jax.jit needs static arguments hashable") from e
  if static:
    jitted = fn
    args = tuple(Static(a) if i in static else a for i, a in enumerate(args))
    fn = functools.wraps(jitted)(lambda *a: jitted(*(
        x.value if isinstance(x, Static) else x for x in a)))
  nodes = tuple(i for i, a in enumerate(args) if is_nnx_node(a))
  if nodes:
    fn = _in_place(fn, nodes, len(args))
  leaves, in_tree = jax.tree_util.tree_flatten_with_path(args)
  abstract, shardings = [], []
  for path, x in leaves:
    a, s = _abstract_leaf(path, x)
    abstract.append(a)
    shardings.append(s)
  abs_args = jax.tree_util.tree_unflatten(in_tree, abstract)
  try:
    with _auto_context_mesh(), _remat.scan_policy(remat), \
        pipeline.scheduled(schedule):
      closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abs_args)
  except TypeError as e:
    name = getattr(fn, "__name__", repr(fn))
    raise TypeError(f"tracing {name} with the given example arguments failed: "
                    f"{e}. The arguments must be what {name} is called with.") \
        from e
  # Plain nested jits join the jaxpr that calls them (see _jaxpr).
  closed = inline_plain_calls(closed)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
  in_avals = [v.aval for v in closed.jaxpr.invars]
  splittable = []
  for a in in_avals:
    try:
      np.dtype(a.dtype)
      splittable.append(True)
    except TypeError:
      splittable.append(False)  # PRNG keys and other extended dtypes
  return Traced(
      closed, jax.tree_util.tree_structure(args), out_tree,
      [jax.tree_util.keystr(p) for p, _ in leaves],
      [jax.tree_util.keystr(p) for p, _ in out_leaves], in_avals,
      [v.aval for v in closed.jaxpr.outvars],
      [key_tokens(p) for p, _ in leaves],
      [key_tokens(p) for p, _ in out_leaves], splittable, shardings, nodes,
      static, donated, frozenset(
          i for i, (p, _) in enumerate(leaves)
          if p and getattr(p[0], "idx", None) in donated))

