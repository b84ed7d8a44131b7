"""``@ad.auto_shard``: plan on first call, cache by signature, run jitted."""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from autoddl_jax._api import plan as make_plan
from autoddl_jax._plan import Plan
from autoddl_jax._trace import PY_SCALAR, is_nnx_node, static_argnums
from autoddl_jax._cluster import Cluster, parse_bytes


def _signature(args) -> Any:
  leaves, tree = jax.tree_util.tree_flatten(args)
  # Python scalars sign as the arrays they become (a TrainState's step is 0,
  # then an int32 array). Other leaves are refused when the step is planned.
  def sign(x):
    if not hasattr(x, "shape") and not isinstance(x, PY_SCALAR):
      return type(x).__name__, repr(x)
    return tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x))
  return tree, tuple(sign(x) for x in leaves)


def _abstract(x: Any, mesh: Mesh) -> Any:
  """A ShapeDtypeStruct of an argument leaf, keeping a placement made on the
  same mesh (so it seeds the search)."""
  s = getattr(x, "sharding", None)
  if not isinstance(s, NamedSharding) or s.mesh.shape_tuple != \
      mesh.shape_tuple:
    s = None
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    if not isinstance(x, PY_SCALAR):
      return x  # not an array: the planner's tracing says what to do
    x = jax.numpy.asarray(x)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)


def _place(x: Any, s: NamedSharding) -> Any:
  """``x`` on sharding ``s``; arrays already there are passed as they are.
  With several processes, a value every process holds whole becomes a
  global array of which each process keeps its devices' shards."""
  if isinstance(x, jax.Array) and (x.sharding == s or (
      x.sharding.is_equivalent_to(s, x.ndim))):
    return x
  if jax.process_count() > 1 and not (isinstance(x, jax.Array) and
                                      not x.is_fully_addressable):
    from autoddl_jax.distributed import global_array
    return global_array(x, s)
  return jax.device_put(x, s)


class AutoShard:
  """A step function that plans its own sharding (see :func:`auto_shard`).

  Attributes:
    plan: the plan of the most recent call (``None`` before the first).
    plans: the cached plans by argument signature, least recently used
      first; at most ``cache_size`` (the oldest is dropped, with its jitted
      function, when a new signature needs room). ``cache_clear()`` empties
      it.
  """

  def __init__(self, fn: Callable, mesh: Mesh | None, cluster: Cluster | None,
               memory_budget: float | None, donate_argnums: Sequence[int],
               verbose: bool | None, cache_size: int,
               select: str | None = None):
    functools.update_wrapper(self, fn)
    self._fn = fn
    self._mesh = mesh
    self._cluster = cluster
    self._budget = memory_budget
    self._donate = tuple(donate_argnums)
    self._verbose = verbose
    self._select = select
    self._lock = threading.Lock()
    self.cache_size = cache_size
    self.plans: collections.OrderedDict[Any, Plan] = collections.OrderedDict()
    self._jitted: dict[Any, Any] = {}
    self.plan: Plan | None = None

  def cache_clear(self) -> None:
    """Drops every cached plan and jitted function (as ``jax.jit``'s
    ``clear_cache``); the next call plans again."""
    with self._lock:
      self.plans.clear()
      self._jitted.clear()
      self.plan = None

  @property
  def mesh(self) -> Mesh:
    if self._mesh is None:  # bare @auto_shard: one data axis over all devices
      self._mesh = jax.make_mesh((jax.device_count(),), ("data",),
                                 axis_types=(jax.sharding.AxisType.Auto,))
    return self._mesh

  def __call__(self, *args):
    nodes = [i for i, a in enumerate(args) if is_nnx_node(a)]
    if nodes:
      return self._call_nnx(args, nodes)
    return self._run(self._fn, args, extra_key=None)

  def _run(self, fn: Callable, args: tuple, extra_key: Any):
    # A jax.jit step's static arguments are planned as values: each value is
    # its own signature.
    static = static_argnums(fn, len(args))
    key = (extra_key, _signature([a for i, a in enumerate(args)
                                  if i not in static]),
           tuple((i, type(args[i]), args[i]) for i in static))
    with self._lock:
      if key not in self.plans:
        abstract = [a if i in static else jax.tree.map(
            lambda x: _abstract(x, self.mesh), a) for i, a in enumerate(args)]
        planned = fn
        if self._donate and getattr(fn, "_jit_info", None) is None:
          # Planned as the jax.jit step it becomes: the donated state's
          # results take no memory of their own (Problem.donated).
          planned = jax.jit(fn, donate_argnums=self._donate)
        p = make_plan(planned, *abstract, mesh=self.mesh,
                      cluster=self._cluster,
                      memory_budget=self._budget, verbose=self._verbose,
                      select=self._select)
        if jax.process_count() > 1:  # one plan everywhere, before compiling
          from autoddl_jax.distributed import check_same_plan
          check_same_plan(p)
        self.plans[key] = p
        self._jitted[key] = p.jit(donate_argnums=self._donate)
        while len(self.plans) > self.cache_size:
          old, _ = self.plans.popitem(last=False)
          del self._jitted[old]
      self.plans.move_to_end(key)
      self.plan = self.plans[key]
      jitted = self._jitted[key]
    placed = [a if i in static else jax.tree.map(_place, a, s)
              for i, (a, s) in enumerate(zip(args, self.plan.in_shardings))]
    return jitted(*placed)

  def _call_nnx(self, args: tuple, nodes: list[int]):
    """In-place nnx style: ``step(model, optimizer, batch)`` updates the
    model and optimizer. Their state is split out, the step runs as a pure
    function of it (planned like any other), and the new state is written
    back into the same objects."""
    from flax import nnx
    graphdef, state = nnx.split(tuple(args[i] for i in nodes))
    others = tuple(a for i, a in enumerate(args) if i not in nodes)

    def pure(state, others):
      objs = nnx.merge(graphdef, state)
      it_o, it_n = iter(others), iter(objs)
      call = [next(it_n) if i in nodes else next(it_o)
              for i in range(len(args))]
      out = self._fn(*call)
      return nnx.state(objs), out

    pure.__name__ = getattr(self._fn, "__name__", "step")
    new_state, out = self._run(pure, (state, others),
                               extra_key=(graphdef, tuple(nodes)))
    nnx.update(tuple(args[i] for i in nodes), new_state)
    return out

  def __repr__(self) -> str:
    return (f"auto_shard({getattr(self._fn, '__name__', self._fn)!r}, "
            f"mesh={dict(self.mesh.shape)}, plans={len(self.plans)})")


def auto_shard(fn: Callable | None = None, *, mesh: Mesh | None = None,
               cluster: Cluster | None = None,
               memory_budget: float | None = None,
               donate_argnums: int | Sequence[int] = (),
               verbose: bool | None = None, cache_size: int = 16,
               select: str | None = None) -> Any:
  """Plans a step's sharding on first call and runs it with ``jax.jit``.

  Use as ``@ad.auto_shard(mesh=mesh)``, bare as ``@ad.auto_shard`` (one
  ``data`` axis over all devices) or as ``ad.auto_shard(step, mesh=mesh)``.
  The first call with a new argument signature (tree structure, shapes,
  dtypes) traces the step abstractly and plans it; later calls with the same
  signature reuse the plan and the jitted function. Arguments are placed on
  the plan's shardings (arrays already placed that way are not copied).

  Steps may take and return pytrees (params / optax states / batches, a
  linen ``TrainState``, an nnx ``State`` from ``nnx.split``) or take nnx
  modules and optimizers and update them in place.

  Args:
    fn: the step function.
    mesh: the ``jax.sharding.Mesh`` to plan for.
    cluster: the hardware to cost for (default: ``ad.H100_NODE``).
    memory_budget: bytes per device the plan must fit in: a number or a
      string such as ``"16GiB"``.
    donate_argnums: passed to ``jax.jit``.
    verbose: print the search's progress (default: when stderr is a tty).
    cache_size: how many argument signatures keep their plan and jitted
      function (least recently used dropped first); ``step.cache_clear()``
      drops them all.
    select: how each plan is chosen, as :func:`autoddl_jax.plan` takes it
      (default: by the compiled program, which compiles a few candidates on
      the first call of each signature; ``"model"`` compiles only the plan).
  """
  if isinstance(donate_argnums, int):
    donate_argnums = (donate_argnums,)
  if memory_budget is not None:
    memory_budget = parse_bytes(memory_budget, "memory_budget")
  if isinstance(cache_size, bool) or not isinstance(cache_size, int) or \
      cache_size < 1:
    raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
  if mesh is not None and not isinstance(mesh, Mesh):
    raise TypeError(f"auto_shard needs a concrete jax.sharding.Mesh (it runs "
                    f"the step), got {type(mesh).__name__}; plan abstract "
                    "meshes with ad.plan")
  if fn is None:
    return functools.partial(auto_shard, mesh=mesh, cluster=cluster,
                             memory_budget=memory_budget,
                             donate_argnums=donate_argnums, verbose=verbose,
                             cache_size=cache_size, select=select)
  if not callable(fn):
    raise TypeError(f"auto_shard decorates a function, got {type(fn).__name__}")
  return AutoShard(fn, mesh, cluster, memory_budget, donate_argnums, verbose,
                   cache_size, select)
