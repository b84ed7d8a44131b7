"""The public entry points: :func:`plan` and :func:`cost_of`, and :class:`Plan`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec

from autoddl_jax._errors import MemoryBudgetError
from autoddl_jax import _lower, _propagate, _remat, _search, _select
from autoddl_jax._cluster import H100_NODE, Cluster, MeshInfo, mesh_info
from autoddl_jax._cluster import default_budget
from autoddl_jax._cluster import format_bytes as _fmt_bytes, parse_bytes
from autoddl_jax._cost import transition_states, transition_steps
from autoddl_jax._graph import OpGraph, build_graph, repeat_groups
from autoddl_jax._problem import Evaluation, Problem
from autoddl_jax._sbp import B_CODE as B, P_CODE as P, NdSbp, codes_to_spec
from autoddl_jax._sbp import nd_repr
from autoddl_jax._sbp import spec_to_codes

if TYPE_CHECKING:
  from autoddl_jax._verify import Verification

__all__ = ["MemoryBudgetError", "Plan", "PlanCost", "cost_of", "load_plan",
           "plan"]


@dataclasses.dataclass(frozen=True)
class PlanCost:
  """Predicted cost of one training step, per device."""

  time_s: float  # compute_s + comm_s (no overlap assumed)
  comm_bytes: float  # ring-model bytes each device sends
  compute_s: float
  memory_bytes: float  # peak of live tensors under the plan
  comm_s: float = 0.0

  @classmethod
  def of(cls, ev: Evaluation) -> PlanCost:
    return cls(ev.time_s, ev.comm_bytes, ev.compute_s, ev.memory_bytes,
               ev.comm_s)


# ------------------------------------------------------------------ tracing
@dataclasses.dataclass
class _Traced:
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


@jax.tree_util.register_pytree_node_class
class _Static:
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
    return isinstance(other, _Static) and self.same(self.value, other.value)

  def __hash__(self):
    return hash((type(self.value), self.value))

  def __repr__(self):
    return f"static({self.value!r})"

  def tree_flatten(self):
    return (), self.value

  @classmethod
  def tree_unflatten(cls, value, _):
    return cls(value)


def _jit_argnums(fn: Callable, nargs: int, field: str) -> tuple[int, ...]:
  """Positions a ``jax.jit`` function's ``field`` names (none for other
  functions), negative ones counted from the end."""
  info = getattr(fn, "_jit_info", None)
  nums = getattr(info, field, ()) or ()
  return tuple(sorted({i % nargs for i in nums if -nargs <= i < nargs}))


def static_argnums(fn: Callable, nargs: int) -> tuple[int, ...]:
  """Positions of ``fn``'s static arguments if it is a ``jax.jit`` function
  (``static_argnums``, and ``static_argnames`` given positionally)."""
  return _jit_argnums(fn, nargs, "static_argnums")


def donate_argnums(fn: Callable, nargs: int) -> tuple[int, ...]:
  """Positions of the arguments a ``jax.jit(f, donate_argnums=...)``
  function donates."""
  return _jit_argnums(fn, nargs, "donate_argnums")


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


def _key_tokens(path) -> tuple[str, ...]:
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


def _trace(fn: Callable, args: tuple,
           remat: str | tuple[str, ...] = _remat.NONE) -> _Traced:
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
    args = tuple(_Static(a) if i in static else a for i, a in enumerate(args))
    fn = functools.wraps(jitted)(lambda *a: jitted(*(
        x.value if isinstance(x, _Static) else x for x in a)))
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
    with _auto_context_mesh(), _remat.scan_policy(remat):
      closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abs_args)
  except TypeError as e:
    name = getattr(fn, "__name__", repr(fn))
    raise TypeError(f"tracing {name} with the given example arguments failed: "
                    f"{e}. The arguments must be what {name} is called with.") \
        from e
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
  in_avals = [v.aval for v in closed.jaxpr.invars]
  splittable = []
  for a in in_avals:
    try:
      np.dtype(a.dtype)
      splittable.append(True)
    except TypeError:
      splittable.append(False)  # PRNG keys and other extended dtypes
  return _Traced(
      closed, jax.tree_util.tree_structure(args), out_tree,
      [jax.tree_util.keystr(p) for p, _ in leaves],
      [jax.tree_util.keystr(p) for p, _ in out_leaves], in_avals,
      [v.aval for v in closed.jaxpr.outvars],
      [_key_tokens(p) for p, _ in leaves],
      [_key_tokens(p) for p, _ in out_leaves], splittable, shardings, nodes,
      static, donated, frozenset(
          i for i, (p, _) in enumerate(leaves)
          if p and getattr(p[0], "idx", None) in donated))


def _same_type(a, b) -> bool:
  return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _state_ties(tr: _Traced) -> tuple[dict[int, int], list[list[int]]]:
  """Output leaf -> input leaf it updates; and groups of tied input leaves.

  An output ties to the input with the same tree path (``step(params, opt,
  batch) -> (params, opt, loss)``) and the same type. Among those state
  leaves, optimizer moments tie to their parameter: same type, different depth,
  and the longest common key suffix (``[1][0].mu['w']`` <-> ``[0]['w']``).
  """
  by_key = {k: i for i, k in enumerate(tr.in_keys)}
  out_to_in = {}
  for j, k in enumerate(tr.out_keys):
    i = by_key.get(k)
    if i is not None and _same_type(tr.in_avals[i], tr.out_avals[j]):
      out_to_in[j] = i
  state = sorted(set(out_to_in.values()))
  parent = {i: i for i in state}

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for b in state:
    kb = tr.in_keys[b]
    best, best_c = [], 0
    for a in state:
      ka = tr.in_keys[a]
      if a == b or len(ka) == len(kb) or not _same_type(tr.in_avals[a],
                                                        tr.in_avals[b]):
        continue
      c = 0
      while c < min(len(ka), len(kb)) and ka[-1 - c] == kb[-1 - c]:
        c += 1
      if c > best_c:
        best, best_c = [a], c
      elif c == best_c and c:
        best.append(a)
    for a in best:
      parent[find(a)] = find(b)
  groups: dict[int, list[int]] = {}
  for i in state:
    groups.setdefault(find(i), []).append(i)
  return out_to_in, [sorted(g) for g in groups.values() if len(g) > 1]


# ------------------------------------------------------------------- seeds
def _split_codes(shape, sizes, axes_dims: Sequence[tuple[int, int]]):
  """Codes splitting dim d over axis a for each (a, d) that still divides."""
  codes = [B] * len(sizes)
  div = [1] * len(shape)
  for a, d in axes_dims:
    if sizes[a] > 1 and -len(shape) <= d < len(shape):
      d %= len(shape)
      if shape[d] % (div[d] * sizes[a]) == 0:
        codes[a] = d
        div[d] *= sizes[a]
  return tuple(codes)


def _seed_codes(kind: str, shape, sizes, is_state: bool) -> tuple[int, ...]:
  n = len(sizes)
  rank = len(shape)
  if rank == 0:
    return (B,) * n
  if not is_state:  # data
    axes = range(n) if kind in ("dp", "fsdp") else range(n - 1)
    return _split_codes(shape, sizes, [(a, 0) for a in axes])
  if kind == "fsdp":
    order = sorted(range(rank), key=lambda d: (-shape[d], d))
    out = [B] * n
    div = [1] * rank
    for a in range(n):
      for d in order:
        if sizes[a] > 1 and shape[d] % (div[d] * sizes[a]) == 0:
          out[a] = d
          div[d] *= sizes[a]
          break
    return tuple(out)
  if kind.endswith(("tp_col", "tp_row")) and rank >= 2:
    d = (-1 if kind.endswith("tp_col") else -2) % rank
    axes_dims = [(n - 1, d)]
    if kind.startswith("fsdp_"):
      # FSDP+TP (MaxText's fsdp x tensor): the other axes split the largest
      # dim the tensor-parallel axis leaves whole.
      other = min((x for x in range(rank) if x != d),
                  key=lambda x: (-shape[x], x))
      axes_dims += [(a, other) for a in range(n - 1)]
    return _split_codes(shape, sizes, axes_dims)
  return (B,) * n


SEEDS = ("dp", "fsdp")  # + "megatron" (its own builder) + the user's
BASELINES = (*SEEDS, "megatron", "fsdp_tp")  # what baseline_cost scores
TEXTBOOK = BASELINES  # the plans selection compiles as a user writes them


# -------------------------------------------------------------------- plan
class Plan:
  """A sharding plan for one traced program on one mesh.

  Attributes:
    in_shardings / out_shardings: pytrees of ``NamedSharding`` shaped like the
      arguments / results (``PartitionSpec`` leaves for an abstract mesh).
      For a step that updates flax.nnx objects in place, the results are
      ``(*args with only those objects, the step's result)``: their new state
      is part of the planned program.
    cost: the predicted :class:`PlanCost` per device per step.
    lowering: how :meth:`jit` writes the plan for XLA: ``"pinned"`` (every
      layout the plan chose is pinned, partial sums are reduced where the
      plan reduces them) or ``"boundary"`` (only the in/out shardings, as a
      user writes a textbook plan: XLA's propagation does the rest).
    source: where the plan came from: ``"search"``, ``"search:<start>"``
      (another start's best) or a textbook kind (``"dp"``, ``"fsdp"``,
      ``"megatron"``, ``"fsdp_tp"``).
    selection: how the plan was chosen (:class:`Selection`): by the compiled
      program among candidates, or by the cost model alone.
    search_seconds: wall time of the search; ``selection.seconds`` is the
      time spent compiling candidates, apart from it.
    remat: the ``jax.checkpoint`` policy the step's scanned layer stacks
      (and, for one policy name, its repeated unrolled blocks) were traced
      with (``"none"``, ``"dots_saveable"``, ``"nothing_saveable"``;
      a tuple: one per scan, in call order) -- part of the program this plan
      lowers (:mod:`autoddl_jax._remat`).
    memory_budget: bytes per device the plan was made to fit (None: no
      constraint).
  """

  def __init__(self, *, fn, mesh, mi: MeshInfo, cluster: Cluster,
               traced: _Traced, graph: OpGraph, problem: Problem,
               choice: Sequence[int], search: _search.SearchResult | None,
               search_seconds: float,
               seeds: Mapping[str, Mapping[int, int]] | None = None,
               lowering: str = "pinned", source: str = "search",
               selection: _select.Selection | None = None,
               remat: str | tuple[str, ...] = _remat.NONE,
               budget: float | None = None):
    if lowering not in _select.LOWERINGS:
      raise ValueError(f"lowering must be one of {_select.LOWERINGS}, got "
                       f"{lowering!r}")
    self.fn, self.mesh, self.mesh_info, self.cluster = fn, mesh, mi, cluster
    self._traced, self.graph, self.problem = traced, graph, problem
    self.choice = list(choice)
    self.search = search
    self.search_seconds = search_seconds
    self.lowering, self.source, self.selection = lowering, source, selection
    self.remat, self.memory_budget = remat, budget
    # DP as a user writes it is what XLA's propagation makes of it.
    self.cost = PlanCost.of(
        _propagate.evaluate(problem, self.choice) if source == "dp"
        else problem.evaluate(self.choice))
    names = mi.axis_names
    self.in_sbps = [NdSbp.from_codes(self._op_codes(o))
                    for o in graph.input_ops]
    self.out_sbps = [NdSbp.from_codes(self._op_codes(o))
                     for o in graph.output_ops]
    in_specs = [codes_to_spec(s.codes, len(a.shape), names)
                for s, a in zip(self.in_sbps, traced.in_avals)]
    out_specs = [codes_to_spec(s.codes, len(a.shape), names)
                 for s, a in zip(self.out_sbps, traced.out_avals)]
    self.in_specs = jax.tree_util.tree_unflatten(traced.in_tree, in_specs)
    self.out_specs = jax.tree_util.tree_unflatten(traced.out_tree, out_specs)
    self.in_shardings = self._shard_tree(self.in_specs, mesh)
    self.out_shardings = self._shard_tree(self.out_specs, mesh)
    self._seeds = seeds  # the textbook placements (made on first use if None)
    self._baselines: dict[str, PlanCost] = {}
    self._baseline_choices: dict[str, list[int]] = {}

  def _op_codes(self, op: int) -> tuple[int, ...]:
    return self.problem.cands[op][self.choice[op]][0]

  @staticmethod
  def _shard_tree(specs, mesh):
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec))

  # ---------------------------------------------------------------- lower
  def _auto_mesh(self) -> Mesh:
    if not isinstance(self.mesh, Mesh):
      raise ValueError(
          "this plan was made for an abstract mesh; Plan.jit() needs devices. "
          "Re-plan with a concrete jax.sharding.Mesh (jax.make_mesh) of the "
          f"same shape {dict(zip(self.mesh_info.axis_names, self.mesh_info.axis_sizes))}.")
    # with_sharding_constraint needs Auto axes; the layout is the same.
    return Mesh(self.mesh.devices, self.mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(self.mesh.axis_names))

  def _pins(self, mesh: Mesh, inputs_too: bool = True) -> _lower.Pins:
    g, prob = self.graph, self.problem
    produced: dict[int, tuple[int, ...]] = {}
    for op in g.ops:
      k = self.choice[op.id]
      for s, t in enumerate(op.outs):
        produced[t] = prob.cands[op.id][k][len(op.ins) + s]
    splits = lambda c: c is not None and all(x >= B for x in c)  # noqa: E731
    outputs, bodies = {}, {}
    for (ctx, var), t in g.var_tensor.items():
      codes = produced.get(t)
      if not splits(codes):
        continue
      prod = g.ops[g.tensors[t].producer[0]]
      if prod.kind == "eqn":
        outputs[(ctx, var)] = codes
      elif prod.kind == "link":
        # A link's tensor is a body's argument (pinned as the body starts)
        # or a loop's or branch's result (pinned as the loop returns: the
        # reshard the plan puts at a loop's exit has no other pin, and XLA
        # left alone moves it elsewhere, e.g. a scatter of the backward
        # loop's sharded carry and an all-reduce of the whole table).
        bodies[(ctx, var)] = codes
        outputs[(ctx, var)] = codes
    inputs = {}

    def staged(t, want):
      """The layouts to pin, in turn, to take tensor ``t`` to ``want``:
      every layout of the cost model's path, so that XLA takes the path the
      plan was costed by (a multi-axis reshard left to XLA is often
      replicate-then-slice; benchmarks/transitions.py); None if nothing."""
      have = produced.get(t)
      if want == have or not splits(want):
        return None
      if have is None:
        return (want,)
      aval = g.tensors[t].aval
      path = transition_states(have, want, g.tensors[t].nbytes,
                               tuple(aval.shape), self.mesh_info)
      return tuple(c for c in path if splits(c)) or (want,)

    # Operands entering a scan body: the reshard into the body's layout is
    # staged before the loop (else XLA makes it at the loop's boundary in
    # one go, often replicating the carry).
    for ctx, links in (g.entry_links.items() if inputs_too else ()):
      carry = 0
      for j, lid in enumerate(links):
        link = g.ops[lid]
        path = staged(link.ins[0], prob.cands[lid][self.choice[lid]][0])
        if path:
          inputs[(ctx, j)] = path
        if link.prim == "~merge":  # and the carry's way back, per iteration
          path = staged(link.ins[1], prob.cands[lid][self.choice[lid]][1])
          if path:
            inputs[(ctx, ("carry", carry))] = path
          carry += 1
    # A scan's stacked results: the reshard into the layout they are
    # stacked in is staged inside the body, per iteration, as costed (left
    # to XLA, it stacks them as made and reshards the whole stack after the
    # loop, on top of the per-iteration reshard another consumer needs).
    for ctx, links in (g.exit_links.items() if inputs_too else ()):
      for j, lid in enumerate(links):
        path = staged(g.ops[lid].ins[0], prob.cands[lid][self.choice[lid]][0])
        if path:
          inputs[(ctx, ("ys", j))] = path
    # A loop's carried results: the reshard from the layout the loop carries
    # them in to the layout the plan gives the result is staged at the
    # loop's exit (one constraint there is often replicate-then-slice:
    # "Involuntary full rematerialization" for a scanned GPT's activations).
    for ctx, pairs in (g.result_links.items() if inputs_too else ()):
      for j, (carried, lid) in enumerate(pairs):
        path = staged(carried, prob.cands[lid][self.choice[lid]][0])
        if path:
          inputs[(ctx, ("out", j))] = path
    # The step's results: the reshard into the layout they leave the jit in
    # is staged inside it (left to the out_shardings it is one step, and
    # XLA may replicate the whole result to make it).
    for j, oid in enumerate(g.output_ops if inputs_too else ()):
      t = g.ops[oid].ins[0]
      path = staged(t, prob.cands[oid][self.choice[oid]][0]) \
          if t is not None else None
      if path:
        inputs[((), ("result", j))] = path
    for ctx, oid in (g.eqn_op.items() if inputs_too else ()):
      op = g.ops[oid]
      k = self.choice[oid]
      for s, t in enumerate(op.ins):
        if t is None:
          continue
        path = staged(t, prob.cands[oid][k][s])
        if path:
          inputs[(ctx, s)] = path
    return _lower.Pins(mesh, outputs, inputs, bodies,
                       self._regions() if inputs_too else {})

  def _regions(self) -> dict[tuple, _lower.Region]:
    """The partial-sum regions the lowering runs on local blocks
    (:class:`_lower.Region`): the ops joined by tensors a consumer takes as
    a partial sum, from the dots that make them to where the plan reduces
    them. Each result used outside goes to the layout most of its outside
    consumers want, by the cost model's path. A region the lowering cannot
    write (an op it cannot run on blocks, a partial sum entering from
    outside or crossing a loop boundary, a result used before the region's
    last op) is left to XLA, which then reduces at the op that made it."""
    g, prob, ch = self.graph, self.problem, self.choice
    key_of = {oid: key for key, oid in g.eqn_op.items()}

    def codes(oid, slot):
      return prob.cands[oid][ch[oid]][slot]

    parent: dict[int, int] = {}

    def find(x):
      while parent.setdefault(x, x) != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
      return x

    for op in g.ops:
      if op.kind != "eqn":
        continue
      n_in = len(op.ins)
      if any(P in codes(op.id, n_in + s) for s in range(len(op.outs))):
        find(op.id)
      for j, t in enumerate(op.ins):
        if t is not None and P in codes(op.id, j):
          parent[find(op.id)] = find(g.tensors[t].producer[0])
    comps: dict[int, list[int]] = collections.defaultdict(list)
    for x in list(parent):
      comps[find(x)].append(x)
    regions: dict[tuple, _lower.Region] = {}
    for ids in comps.values():
      for region in self._chain(sorted(ids), key_of, codes) or ():
        regions.update({k: region for k in region.members})
    return regions

  def _inner_steps(self, have, want) -> tuple[_lower.Reduction, ...] | None:
    """The local steps that take a partial sum made inside a chain from
    ``have`` to the layout ``want`` of a consumer inside it: free slices
    (and shares: B -> P) of replicated axes first, then reductions of the
    partial axes it no longer keeps (``psum``, ``psum_scatter``), as the
    cost model's path takes them; None if it takes more (or a split of a
    dim that is split already: out of tile order)."""
    names = self.mesh_info.axis_names
    cut, red = [], []
    for a, (h, w) in enumerate(zip(have, want)):
      if h == w:
        continue
      if w >= 0 and w in have:
        return None
      if h == B and w >= 0:
        cut.append(("slice", (names[a],), w))
      elif h == B and w == P:
        cut.append(("own", (names[a],), None))
      elif h == P and w == B:
        red.append(("psum", (names[a],), None))
      elif h == P and w >= 0:
        red.append(("psum_scatter", (names[a],), w))
      else:
        return None
    return (*cut, *red)

  def _chain(self, ids, key_of, codes) -> list[_lower.Region] | None:
    """A chain of partial-sum ops as regions in program order: a region
    ends before the op that would make one of its results wanted before the
    region's last op runs; partial sums a later region takes are handed to
    it stacked. None if the lowering cannot write the chain."""
    g, prob, ch = self.graph, self.problem, self.choice
    members = set(ids)
    ops = [g.ops[i] for i in ids]
    if any(o.kind != "eqn" or o.id not in key_of or not _lower.runs_local(
        o.prim, prob.cands[o.id][ch[o.id]]) for o in ops):
      return None
    if len({key_of[o.id][:-1] for o in ops}) != 1:
      return None  # members in different jaxprs
    for o in ops:  # partial sums come in only as a replicated value's share
      for j, t in enumerate(o.ins):
        if t is None:
          continue
        prod, ps = g.tensors[t].producer
        have = codes(prod, len(g.ops[prod].ins) + ps)
        if prod in members:
          if self._inner_steps(have, codes(o.id, j)) is None:
            return None
        elif any(w == P and h != B for h, w in zip(have, codes(o.id, j))):
          return None
      for t in o.outs:
        if any(P in codes(c, cs) for c, cs in g.tensors[t].consumers
               if c not in members):
          return None
    # Segments: extend while every result used outside the segment is used
    # after the segment's last op (a segment of one op always is).
    segments, cur = [], []
    for o in ids:
      seg = set(cur + [o])
      first = min((c for m in seg for t in g.ops[m].outs
                   for c, _ in g.tensors[t].consumers if c not in seg),
                  default=float("inf"))
      if cur and first < o:
        segments.append(cur)
        cur = [o]
      else:
        cur = cur + [o]
    segments.append(cur)
    regions = []
    for seg_ids in segments:
      r = self._segment(seg_ids, members, key_of, codes)
      if r is None:
        return None
      regions.append(r)
    return regions

  def _segment(self, ids, members, key_of, codes) -> _lower.Region | None:
    """One region of a chain (``members``): ``ids`` in program order, each
    result used outside them used after the last (:meth:`_chain` cuts the
    segments so)."""
    g = self.graph
    seg = set(ids)
    in_codes, stacked_in, slices = {}, {}, {}
    out_codes, reduce, stacked_out = {}, {}, {}
    for oid in ids:
      o = g.ops[oid]
      key, n_in = key_of[oid], len(o.ins)
      for j, t in enumerate(o.ins):
        if t is None:
          continue
        prod, ps = g.tensors[t].producer
        want = codes(oid, j)
        have = codes(prod, len(g.ops[prod].ins) + ps)
        if prod not in seg and (prod not in members or P not in have):
          # A whole value (from outside, or handed on by an earlier region)
          # comes in; a partial want takes one device's share of it.
          whole = tuple(B if w == P else w for w in want)
          in_codes[(key, j)] = whole
          steps = self._inner_steps(whole, want)
          if steps:
            slices[(key, j)] = steps
          continue
        if prod not in seg:
          stacked_in[(key, j)] = have
        steps = self._inner_steps(have, want)
        if steps:
          slices[(key, j)] = steps
      for s, t in enumerate(o.outs):
        have = codes(oid, n_in + s)
        out_codes[(key, s)] = have
        consumers = g.tensors[t].consumers
        later = any(c in members and c not in seg for c, _ in consumers)
        outside = [(c, cs) for c, cs in consumers if c not in members]
        if P not in have:  # whole already: handed on as it is
          if later or outside:
            reduce[(key, s)] = ([], have)
          continue
        if later:
          stacked_out[(key, s)] = have
        if not outside:
          continue
        wants = [codes(c, cs) for c, cs in outside]
        target = collections.Counter(wants).most_common(1)[0][0]
        aval = g.tensors[t].aval
        r = _lower.reductions(have, target, g.tensors[t].nbytes,
                              tuple(aval.shape), self.mesh_info)
        if r is None:
          return None
        reduce[(key, s)] = r
    if not reduce and not stacked_out:
      return None
    return _lower.Region(tuple(key_of[i] for i in ids), in_codes, out_codes,
                         reduce, stacked_in, slices, stacked_out)

  def jit(self, *, pin_inputs: bool = True, **jit_kwargs) -> Any:
    """The planned step as a ``jax.jit`` function (call it, or ``.lower``).

    ``pin_inputs`` also pins each op's operands where the plan reshards them
    (else only op results are pinned and XLA picks where to reshard). A plan
    with ``lowering="boundary"`` pins nothing inside.
    """
    mesh = self._auto_mesh()
    tr = self._traced
    pins = (self._pins(mesh, pin_inputs) if self.lowering == "pinned"
            else _lower.Pins(mesh, {}, {}, {}))
    fn = _lower.planned_function(tr.closed, tr.in_tree, tr.out_tree, pins,
                                 tr.in_names)
    in_sh = self._shard_tree(self.in_specs, mesh)
    if tr.donate_argnums:
      jit_kwargs.setdefault("donate_argnums", tr.donate_argnums)
    if _remat.cpu_keeps_recompute(tr.closed.jaxpr, mesh):
      jit_kwargs.setdefault("compiler_options", _remat.KEEP_BARRIERS)
    jitted = jax.jit(fn, in_shardings=in_sh,
                     out_shardings=self._shard_tree(self.out_specs, mesh),
                     **jit_kwargs)
    retype = not all(t == AxisType.Auto
                     for t in getattr(self.mesh, "axis_types", ()))
    if not (retype or tr.static or tr.nnx_args):
      return jitted
    return _PlannedStep(jitted, in_sh, retype=retype, static=tr.static,
                        nnx_args=tr.nnx_args)

  def param_specs(self, argnum: int = 0) -> Any:
    """The ``PartitionSpec`` pytree of one argument (default: the first, the
    parameters or the train state), with that argument's own structure."""
    if not isinstance(self.in_specs, tuple) or not \
        -len(self.in_specs) <= argnum < len(self.in_specs):
      raise IndexError(f"the step takes {len(self.in_specs)} arguments; "
                       f"argnum {argnum} is not one of them")
    return self.in_specs[argnum]

  def logical_rules(self, logical_specs: Any, argnum: int = 0
                    ) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """The plan as flax logical-axis rules, where that is exact.

    ``logical_specs`` names each dim of argument ``argnum``'s leaves (a pytree
    of ``PartitionSpec``s of logical names, as ``nn.get_partition_spec`` /
    ``nnx.get_partition_spec`` give for annotated parameters). Returns
    ``((logical name, mesh axes or None), ...)`` for
    ``nn.logical_to_mesh_sharding`` and friends. Raises ``ValueError`` naming
    the conflicts when the plan splits one logical name differently in
    different places (then no rule set is exact: use :meth:`param_specs`).
    """
    planned = self.param_specs(argnum)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    names = jax.tree_util.tree_leaves_with_path(logical_specs, is_leaf=is_spec)
    plans = jax.tree_util.tree_leaves(planned, is_leaf=is_spec)
    if len(names) != len(plans):
      raise ValueError(f"logical_specs has {len(names)} leaves; argument "
                       f"{argnum} has {len(plans)}")
    rules: dict[str, Any] = {}
    conflicts = []
    for (path, lspec), pspec in zip(names, plans):
      if not is_spec(lspec):
        continue
      for d, name in enumerate(lspec):
        if name is None:
          continue
        axes = pspec[d] if d < len(pspec) else None
        if name in rules and rules[name] != axes:
          conflicts.append(f"{name!r}: {rules[name]!r} and {axes!r} (at "
                           f"{jax.tree_util.keystr(path)})")
        rules.setdefault(name, axes)
    if conflicts:
      raise ValueError("no exact logical-axis rules for this plan; the plan "
                       "splits these names differently: " +
                       "; ".join(conflicts))
    return tuple(rules.items())

  def save(self, path) -> None:
    """Writes the plan as versioned JSON (atomically: temp file + rename),
    with fingerprints of the program, mesh and cluster it was made for. Read
    it back with :func:`autoddl_jax.load_plan`."""
    from autoddl_jax import _io
    _io.save(self, path)

  def verify(self, *, pin_inputs: bool = True) -> Verification:
    """Compiles the planned step (abstractly: nothing is allocated) and sets
    what the plan predicted beside what XLA emitted: collective bytes by
    kind, their time on the cluster's links, FLOPs and peak memory per
    device. ``print()`` the result for a table; needs a concrete mesh."""
    from autoddl_jax._verify import verify
    return verify(self, pin_inputs)

  # -------------------------------------------------------------- explain
  def transitions(self) -> list[dict[str, Any]]:
    """Every resharding the plan implies: tensor, from, to, bytes, time."""
    prob, g = self.problem, self.graph
    out = []
    for i in prob.distinct_reshards(self.choice):
      e = prob.edges[i]
      kp, kc = self.choice[e.prod], self.choice[e.cons]
      t = float(prob.edge_pair(e, kp, kc))
      if t <= 0:
        continue
      src = prob.cands[e.prod][kp][e.prod_slot]
      dst = prob.cands[e.cons][kc][e.cons_slot]
      out.append(dict(tensor=g.tensors[e.tensor].name,
                      shape=g.tensors[e.tensor].aval.shape,
                      src=nd_repr(src), dst=nd_repr(dst),
                      collective=_collective_names(
                          src, dst, e.space, self.mesh_info),
                      weight=e.weight, time_s=t,
                      bytes=float(prob.edge_pair(e, kp, kc, "bytes"))))
    return out

  def user_paths(self) -> list[str]:
    """Each argument leaf's path as the user named it (``0/layers/wq``)."""
    return ["/".join(k for k in keys if k != "value")
            for keys in self._traced.in_keys]

  def baseline_cost(self, kind: str = "dp") -> PlanCost:
    """What a textbook plan costs on the same mesh and cluster, for scale:
    ``"dp"`` (parameters replicated, the batch split over every device)
    completed as XLA's sharding propagation completes that boundary when a
    user writes it (:mod:`autoddl_jax._propagate`: the devices as one
    group, partial sums reduced where they are made); ``"fsdp"``
    (parameters too split over every axis, ZeRO-3), ``"megatron"``
    (matmul weights alternately column- and row-split over the last axis,
    data parallel over the others) or ``"fsdp_tp"`` (Megatron's layout with
    each weight's largest other dim split over the other axes, as
    MaxText's fsdp x tensor rules), each completed by the search with those
    placements held."""
    if kind not in self._baselines:
      choice = self.baseline_choice(kind)
      ev = (_propagate.evaluate(self.problem, choice) if kind == "dp"
            else self.problem.evaluate(choice))
      self._baselines[kind] = PlanCost.of(ev)
    return self._baselines[kind]

  def baseline_choice(self, kind: str = "dp") -> list[int]:
    """The candidate per op of :meth:`baseline_cost`'s plan."""
    if kind not in BASELINES:
      raise ValueError(f"unknown baseline {kind!r}; use one of "
                       f"{', '.join(map(repr, BASELINES))}")
    if kind in self._baseline_choices:
      return list(self._baseline_choices[kind])
    choice = (_propagate.propagate(self.problem, self.textbook_pins(kind))
              if kind == "dp" else _search.complete(
                  self.problem, self.textbook_pins(kind), kind).choice)
    self._baseline_choices[kind] = choice
    return list(choice)

  def textbook_pins(self, kind: str) -> dict[int, int]:
    """{input op: candidate} of a textbook plan's boundary (the search's
    seeds, and FSDP+TP)."""
    if self._seeds is None or kind not in self._seeds:
      out_to_in, _ = _state_ties(self._traced)
      state = set(out_to_in.values())
      if self._seeds is None:
        self._seeds = _seeds(self.problem, self.graph, self._traced,
                             self.mesh_info, state)
      if kind == "fsdp_tp" and kind not in self._seeds:
        self._seeds = {**self._seeds, kind: _megatron_seed(
            self.problem, self.graph, self._traced, self.mesh_info, state,
            fsdp=True)}
    return dict(self._seeds[kind])

  def textbook(self, kind: str) -> Plan:
    """A textbook plan (:meth:`baseline_cost`'s kinds) on the same program,
    mesh and cluster, lowered as a user writes it: its in/out shardings
    only, XLA propagating the rest (``lowering="boundary"``)."""
    return self._variant(self.baseline_choice(kind), "boundary", kind)

  def _variant(self, choice, lowering: str, source: str) -> Plan:
    p = Plan(fn=self.fn, mesh=self.mesh, mi=self.mesh_info,
             cluster=self.cluster, traced=self._traced, graph=self.graph,
             problem=self.problem, choice=choice, search=self.search,
             search_seconds=self.search_seconds, seeds=self._seeds,
             lowering=lowering, source=source, remat=self.remat,
             budget=self.memory_budget)
    p._baselines, p._baseline_choices = self._baselines, \
        self._baseline_choices
    return p

  def _program_key(self, lowering: str):
    """What a candidate compiles to: equal keys, equal programs."""
    if lowering == "pinned":
      return ("pinned", self.remat, tuple(self.choice))
    leaves = lambda t: tuple(str(x) for x in jax.tree_util.tree_leaves(  # noqa
        t, is_leaf=lambda y: isinstance(y, PartitionSpec)))
    return ("boundary", self.remat, leaves(self.in_specs),
            leaves(self.out_specs))

  def explain(self, max_rows: int = 40) -> str:
    """The plan as text: per argument its nd-SBP, ``PartitionSpec`` and bytes
    per device; the costliest reshardings (collective, bytes, time); totals
    beside data parallelism's. ``max_rows`` (>= 0) bounds each table."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or \
        max_rows < 0:
      raise ValueError(f"max_rows must be an int >= 0 (rows per table), got "
                       f"{max_rows!r}")
    mi = self.mesh_info
    lines = [f"autoddl_jax plan on mesh "
             f"{dict(zip(mi.axis_names, mi.axis_sizes))} "
             f"(links: {dict(zip(mi.axis_names, mi.link))})"]
    c, dp = self.cost, self.baseline_cost("dp")
    rows = [("per device per step", "this plan", "data parallel")]
    for name, a, b in (
        ("time", f"{c.time_s * 1e3:.4g} ms", f"{dp.time_s * 1e3:.4g} ms"),
        ("  compute", f"{c.compute_s * 1e3:.4g} ms",
         f"{dp.compute_s * 1e3:.4g} ms"),
        ("  communication", f"{c.comm_s * 1e3:.4g} ms",
         f"{dp.comm_s * 1e3:.4g} ms"),
        ("bytes sent", _fmt_bytes(c.comm_bytes), _fmt_bytes(dp.comm_bytes)),
        ("peak memory", _fmt_bytes(c.memory_bytes),
         _fmt_bytes(dp.memory_bytes))):
      rows.append((name, a, b))
    for cat, v in self.memory_by_category().items():
      rows.append((f"  {cat}", _fmt_bytes(v), ""))
    lines.append(_table(rows))
    lines.append(self._budget_line())
    if self.remat != _remat.NONE:
      lines.append(f"remat: the scanned layer stacks and repeated blocks "
                   f"run under "
                   f"jax.checkpoint with policy {self.remat!r} (their "
                   "forward is recomputed in the backward pass)")
    if self.search is not None:
      lines.append(f"search: best start {self.search.seed!r}, "
                   f"{self.search_seconds:.2f} s")
    sel = self.selection
    if sel is not None and sel.mode == "compiled":
      won = sel.candidates[sel.winner]
      lines.append(f"selected by the compiled program: {won.name} "
                   f"({won.lowering} lowering), {sel.reason}; "
                   f"{sel.seconds:.1f} s compiling candidates")
      lines.append(_table(sel.table()))
    elif sel is not None:
      lines.append(f"selected by the cost model: {sel.reason}")
    rows = [("argument", "shape", "nd-SBP", "PartitionSpec", "bytes/device")]
    for name, a, s in zip(self.user_paths(), self._traced.in_avals,
                          self.in_sbps):
      spec = codes_to_spec(s.codes, len(a.shape), mi.axis_names)
      local = math.prod(a.shape) * _itemsize(a) / math.prod(
          sz for cd, sz in zip(s.codes, mi.axis_sizes) if cd >= 0)
      rows.append((name, str(tuple(a.shape)), repr(s), str(spec),
                   _fmt_bytes(local)))
    lines.append(_table(rows[:max_rows + 1]))
    if len(rows) > max_rows + 1:
      lines.append(f"... {len(rows) - max_rows - 1} more arguments")
    tr = sorted(self.transitions(), key=lambda r: -r["time_s"])
    if tr:
      rows = [("tensor", "shape", "from", "to", "collective", "x", "bytes",
               "time")]
      for r in tr[:max_rows]:
        rows.append((r["tensor"], str(r["shape"]), r["src"], r["dst"],
                     r["collective"], f"{r['weight']:g}",
                     _fmt_bytes(r["bytes"]), f"{r['time_s'] * 1e6:.3g} us"))
      lines.append(_table(rows))
      if len(tr) > max_rows:
        lines.append(f"... {len(tr) - max_rows} more transitions")
    if self.graph.unsupported:
      lines.append("replicated (no rule): " + ", ".join(
          f"{k} x{v}" for k, v in sorted(self.graph.unsupported.items())))
    return "\n".join(lines)

  def memory_by_category(self) -> dict[str, float]:
    """Predicted bytes per device at the peak by what they hold:
    ``parameters`` (and other state updated in place, e.g. BatchNorm
    statistics), ``optimizer state`` (an optimizer's moments: state tied
    to a parameter), ``batch and other inputs``, ``results`` (the step's
    new state, counted apart from its inputs: donation is not modelled) and
    ``activations, gradients, temporaries`` (the pool of buffers live at
    once at the peak, as :meth:`Problem.peak_memory` packs them). Their sum
    is ``cost.memory_bytes``."""
    mem = self.problem.memory_breakdown(self.choice)
    tr, mi = self._traced, self.mesh_info
    state = set(_state_ties(tr)[0].values())
    moments = _moments(tr)
    cats = dict.fromkeys(("parameters", "optimizer state",
                          "batch and other inputs"), 0.0)
    for i, (a, sb) in enumerate(zip(tr.in_avals, self.in_sbps)):
      local = math.prod(a.shape) * _itemsize(a) / math.prod(
          sz for cd, sz in zip(sb.codes, mi.axis_sizes) if cd >= 0)
      cat = ("optimizer state" if i in moments else "parameters"
             if i in state else "batch and other inputs")
      cats[cat] += local
    # memory_breakdown counts arguments as allocated (a dead one is not):
    # scale the split to its total.
    total = sum(cats.values())
    if total > 0:
      for k in cats:
        cats[k] *= mem["arguments"] / total
    cats["results"] = mem["results"]
    cats["activations, gradients, temporaries"] = mem["intermediates"]
    return cats

  def _budget_line(self) -> str:
    peak = self.cost.memory_bytes
    dev = self.cluster.memory_per_device
    if self.memory_budget is None:
      return (f"memory: {_fmt_bytes(peak)} of {_fmt_bytes(dev)} per device "
              "(no budget)")
    b = self.memory_budget
    state = "fits" if peak <= b else f"OVER by {_fmt_bytes(peak - b)}"
    return (f"memory budget {_fmt_bytes(b)} per device "
            f"({b / dev:.0%} of {_fmt_bytes(dev)}; the rest is left to "
            f"workspace): {_fmt_bytes(peak)} predicted, {state}")

  def __repr__(self) -> str:
    c = self.cost
    return (f"Plan(time_s={c.time_s:.4g}, comm_bytes={c.comm_bytes:.4g}, "
            f"memory_bytes={c.memory_bytes:.4g})")


class _PlannedStep:
  """What :meth:`Plan.jit` returns when a bare ``jax.jit`` function is not
  enough; ``__call__`` and ``lower`` take the step's own arguments.

  * Explicit-axes mesh: the plan is lowered on the same devices viewed as
    Auto axes (sharding constraints need them). Arrays placed on the
    Explicit mesh carry that mesh in their types, so they are re-viewed on
    the Auto mesh first -- same devices, same layout, no data moves.
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
      # Static values as given, or as _Static nodes (a tree built from the
      # plan's own in_tree, as verify does).
      args = tuple(a.value if isinstance(a, _Static) else a for a in args)
      for i, want in self._static.items():
        got = args[i] if i < len(args) else "(missing)"
        if not _Static.same(got, want):
          raise TypeError(
              f"static argument {i} is {got!r}; the plan was made with "
              f"{want!r}. Plan again for that value (each static value is "
              "its own program)")
      args = tuple(_Static(a) if i in self._static else a
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


def _itemsize(a) -> int:
  try:
    return np.dtype(a.dtype).itemsize
  except TypeError:
    return 4


def _collective_names(src, dst, space, mi) -> str:
  """The collectives of the path the model costs, one name per step (a
  joint all-reduce over two axes is one all-reduce, as XLA emits and
  ``verify`` counts it)."""
  steps = transition_steps(src, dst, space.nbytes, tuple(space.shape), mi)
  return "+".join(kind for kind, _, _ in steps) or "local"


def _table(rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa
  return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths])] +
                   [fmt(r) for r in rows[1:]])


# --------------------------------------------------------------- building
def _layerless(keys: tuple[str, ...]) -> tuple[str, ...]:
  return tuple("#" if k.isdigit() else k for k in keys)


def _merge_repeated_params(groups, graph: OpGraph, tokens, min_repeats=4):
  """Joins the state groups of the same parameter in unrolled layers: paths
  equal up to integer keys (``layers/3/wq`` ~ ``layers/7/wq``), same type,
  when it repeats at least ``min_repeats`` times."""
  leaf_of = {o: graph.ops[o].leaf for o in graph.input_ops}
  merged: dict[Any, list[int]] = {}
  out = []
  for g in groups:
    leaves = sorted(leaf_of[o] for o in g if o in leaf_of)
    if not leaves:
      out.append(g)
      continue
    key = tuple(tokens[i] for i in leaves)
    merged.setdefault(key, []).append(g)
  for gs in merged.values():
    if len(gs) >= min_repeats:
      out.append([o for g in gs for o in g])
    else:
      out.extend(gs)
  return out


def _setup(fn, args, mesh, cluster, tie_repeated: bool = True,
           remat: str | tuple[str, ...] = _remat.NONE):
  cluster = H100_NODE if cluster is None else cluster
  if not isinstance(cluster, Cluster):
    raise TypeError(f"cluster must be an autoddl_jax.Cluster, got "
                    f"{type(cluster).__name__}")
  mi = mesh_info(mesh, cluster)  # validates the mesh before tracing
  if isinstance(mesh, Mapping):
    mesh = AbstractMesh(mi.axis_sizes, mi.axis_names)
  tr = _trace(fn, args, remat)
  graph = build_graph(tr.closed, tr.in_names, tr.out_names, tr.splittable)
  out_to_in, tie_groups = _state_ties(tr)
  prob = _state_problem(tr, graph, mi, cluster, out_to_in, tie_groups,
                        tie_repeated, zero=False)
  # Weight-update sharding (ZeRO-1/2): the same program with each
  # optimizer moment's layout free of its parameter's (searched where a
  # budget binds: :func:`plan`).
  prob.zero = _state_problem(tr, graph, mi, cluster, out_to_in, tie_groups,
                             tie_repeated, zero=True, like=prob)
  state = set(out_to_in.values())
  return cluster, mesh, mi, tr, graph, prob, state


def _param_and_moments(tr: _Traced, group: Sequence[int]
                       ) -> tuple[int, list[int]]:
  """Of a group of tied state leaves (:func:`_state_ties`): the parameter
  (the shortest path: ``[0]['w']`` beside ``[1][0].mu['w']``) and the
  optimizer moments."""
  order = sorted(group, key=lambda i: (len(tr.in_keys[i]), i))
  return order[0], order[1:]


def _moments(tr: _Traced) -> set[int]:
  """The input leaves that are optimizer moments (:func:`_param_and_moments`
  of every group of tied state)."""
  return {i for g in _state_ties(tr)[1] for i in _param_and_moments(tr, g)[1]}


def _donated_ops(tr: _Traced, graph: OpGraph) -> frozenset[int]:
  return frozenset(graph.input_ops[i] for i in tr.donated_leaves)


def _state_problem(tr, graph, mi, cluster, out_to_in, tie_groups,
                   tie_repeated: bool, zero: bool, like: Problem | None = None
                   ) -> Problem:
  """The problem with each updated argument tied to its result, and each
  parameter to its moments (``zero``: the moments of a parameter tied to
  each other only). ``like``: a problem of the same program to share the
  candidates with."""
  groups = []
  in_grouped = set()
  for g in tie_groups:
    parts = [list(g)]
    if zero:
      param, moments = _param_and_moments(tr, g)
      parts = [[param], moments]
    for part in parts:
      ops = [graph.input_ops[i] for i in part]
      ops += [graph.output_ops[j] for j, i in out_to_in.items() if i in part]
      groups.append(ops)
    in_grouped.update(g)
  for j, i in out_to_in.items():
    if i not in in_grouped:
      groups.append([graph.input_ops[i], graph.output_ops[j]])
  if like is None:
    prob = Problem(graph, mi, cluster, groups, _donated_ops(tr, graph))
  else:
    prob = getattr(like, "untied", like).regroup(groups)
  if tie_repeated:
    tokens = [(_layerless(tr.in_keys[i]), tuple(a.shape), str(a.dtype))
              for i, a in enumerate(tr.in_avals)]
    rep = repeat_groups(graph, tokens)
    merged = _merge_repeated_params(groups, graph, tokens)
    if rep or len(merged) != len(groups):
      # Search with repeated blocks tied (decided once); ``prob.untied``
      # refines the best plans per block at the end.
      tied = prob.regroup(merged + rep)
      tied.untied = prob
      prob = tied
  return prob


def _pins_for(prob: Problem, graph: OpGraph, tr: _Traced, mi: MeshInfo,
              codes_of: Callable[[int], tuple[int, ...] | None]
              ) -> dict[int, int]:
  pins = {}
  for i, o in enumerate(graph.input_ops):
    codes = codes_of(i)
    if codes is None:
      continue
    k = prob.find_candidate(o, codes)
    if k is not None:
      pins[o] = k
  return pins


def _megatron_seed(prob: Problem, graph: OpGraph, tr: _Traced, mi: MeshInfo,
                   state: set[int], fsdp: bool = False) -> dict[int, int]:
  """Matmul weights alternate column- and row-parallel on the last mesh axis
  in the order the program first uses them; data splits over the others
  (and with ``fsdp``, so does each weight's largest other dim: FSDP+TP)."""
  first_use = {}
  for i, o in enumerate(graph.input_ops):
    t = graph.tensors[graph.ops[o].outs[0]]
    g = int(prob.group_of[o])
    if i in state and len(tr.in_avals[i].shape) >= 2 and t.consumers:
      first_use[g] = min(first_use.get(g, 1 << 60),
                         min(c for c, _ in t.consumers))
  kind = {g: ("tp_col", "tp_row")[j % 2] for j, g in enumerate(
      sorted(first_use, key=lambda g: (first_use[g], g)))}

  def codes(i):
    if not tr.splittable[i]:
      return None
    k = kind.get(int(prob.group_of[graph.input_ops[i]]), "tp_col")
    return _seed_codes("fsdp_" + k if fsdp else k, tr.in_avals[i].shape,
                       mi.axis_sizes, i in state)

  return _pins_for(prob, graph, tr, mi, codes)


def _user_codes(tr: _Traced, mi: MeshInfo):
  def codes(i):
    s = tr.shardings[i]
    if isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == \
        mi.axis_names:
      try:
        return spec_to_codes(s.spec, len(tr.in_avals[i].shape), mi.axis_names)
      except ValueError:
        return None
    return None
  return codes


def _seeds(prob: Problem, graph: OpGraph, tr: _Traced, mi: MeshInfo,
           state: set[int], zero: bool = False) -> dict[str, dict[int, int]]:
  seeds = {}
  for kind in SEEDS:
    seeds[kind] = _pins_for(prob, graph, tr, mi, lambda i, kind=kind: (
        _seed_codes(kind, tr.in_avals[i].shape, mi.axis_sizes, i in state)
        if tr.splittable[i] else None))
  seeds["megatron"] = _megatron_seed(prob, graph, tr, mi, state)
  if zero:
    # ZeRO-1/2: DP, with every optimizer moment split as FSDP splits it.
    moments = _moments(tr)
    seeds["zero"] = _pins_for(prob, graph, tr, mi, lambda i: (
        _seed_codes("fsdp" if i in moments else "dp", tr.in_avals[i].shape,
                    mi.axis_sizes, i in state)
        if tr.splittable[i] else None))
  return seeds


SELECT_ENV = "AUTODDL_JAX_SELECT"  # the default of plan(select=...)
SELECT_SECONDS = 120.0


def plan(fn: Callable, *args: Any, mesh: Mesh | AbstractMesh,
         cluster: Cluster | None = None,
         memory_budget: float | str | None = None,
         verbose: bool | None = None, select: str | None = None,
         select_seconds: float = SELECT_SECONDS,
         alternatives: int = 2,
         remat: str | Sequence[str] | None = None) -> Plan:
  """Finds a sharding plan for ``fn(*args)`` on ``mesh``.

  Args:
    fn: the step function (e.g. a train step: forward, backward, update).
    *args: example arguments: arrays or ``jax.ShapeDtypeStruct``s (only shapes
      and dtypes are used; placed arrays also seed the search with their
      shardings).
    mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes) or an
      ``AbstractMesh`` for planning without devices.
    cluster: the hardware to cost for; defaults to an H100 node preset.
    memory_budget: bytes per device the plan's peak memory must fit in: a
      number or a string such as ``"16GiB"`` or ``"512MB"``. ``None`` (the
      default): what XLA's allocator may take of
      ``cluster.memory_per_device`` (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
      0.75 unless set; the rest is the CUDA context's and the libraries'
      workspace). ``float("inf")``: no constraint.
    verbose: print the search's progress to stderr (one line per start and
      round, with the best cost so far, and per compiled candidate); by
      default only when stderr is a terminal, so scripts, logs and tests
      stay quiet.
    select: how the plan is chosen. ``"compiled"`` (the default for a
      concrete mesh): the search's plan (lowered with all its pins, and with
      its boundary only), the best plans of ``alternatives`` other starts
      and the textbook plans (DP, FSDP, Megatron, FSDP+TP as a user writes
      them) are compiled abstractly, and the plan whose compiled program is
      fastest on ``cluster`` within the budget is returned (one for which
      XLA logs "Involuntary full rematerialization" only if all do)
      (:mod:`autoddl_jax._select`; ``plan.explain()`` shows them all).
      With a budget, a search's plan over it by ``memory_analysis`` is
      fitted again -- sharding, weight-update sharding and remat, as the
      first fit -- under the budget scaled by the model's error on it
      (twice at most: ``"search:refit1"``, ``"search:refit2"``).
      ``"model"``: the cost model's plan, nothing compiled (the default for
      an abstract mesh, which has no devices to compile for). The
      environment variable ``AUTODDL_JAX_SELECT`` sets the default.
    select_seconds: compiling stops starting new candidates after this
      many seconds (the first is always compiled; multi-process runs
      compile all, to keep one plan on every process).
    alternatives: how many other starts' plans to compile (>= 0).
    remat: rematerialisation of the step's ``jax.lax.scan`` layer stacks
      (``flax.linen.scan`` and ``nnx.scan`` too) and of the blocks a Python
      loop repeats back to back in the function ``jax.grad`` /
      ``jax.value_and_grad`` (``nnx`` ones too) differentiate. ``None``
      (the default): the planner decides -- where the best plan without
      remat does not fit the budget by the model, the step is planned again
      with every stack and block under ``jax.checkpoint`` with
      ``"dots_saveable"`` and with ``"nothing_saveable"``, and the fastest
      plan that fits wins (the recomputed FLOPs and the smaller residuals
      are in the traced program the model costs). A policy name forces it
      on both; a sequence gives one per scan in the order the step calls
      them (repeated blocks then stay as written); ``"none"`` turns it off.
      A step that already holds a ``jax.checkpoint`` is planned as written.

  Returns:
    A :class:`Plan`.

  Raises:
    MemoryBudgetError: no plan fits the budget (by the model with
      ``select="model"``, else by XLA's ``memory_analysis``); the message
      names the budget, the smallest plan and its largest tensors.
  """
  t0 = time.perf_counter()
  budget = _parse_budget(memory_budget)
  select = _select_mode(select, mesh)
  if not (isinstance(select_seconds, (int, float)) and select_seconds >= 0):
    raise ValueError(f"select_seconds must be a number >= 0, got "
                     f"{select_seconds!r}")
  if isinstance(alternatives, bool) or not isinstance(alternatives, int) \
      or alternatives < 0:
    raise ValueError(f"alternatives must be an int >= 0, got "
                     f"{alternatives!r}")
  if remat is not None:
    remat = _remat.validate(remat)
  if verbose is None:
    verbose = sys.stderr.isatty()
  cluster = H100_NODE if cluster is None else cluster
  if budget is None and memory_budget is None and isinstance(cluster,
                                                             Cluster):
    budget = default_budget(cluster)[0]
  policy = _remat.NONE if remat is None else remat
  # First the best plan without the budget: where it fits, it is the plan.
  base, over, free_peak, setup = _search_plan(
      fn, args, mesh, cluster, None, verbose, t0, policy)
  base.memory_budget = budget
  best = base
  variants = _Variants(fn, args, mesh, cluster, verbose, policy, setup,
                       may_remat=remat is None and not _remat.has_checkpoint(
                           base._traced.closed.jaxpr))
  if budget is not None and free_peak > budget:
    # It does not fit: shard more, shard the optimizer state apart from the
    # parameters (ZeRO-1/2), recompute a layer's activations in the
    # backward pass -- the model prices each, and the fastest plan that
    # fits wins.
    best, over, options = variants.fit(budget)
    best.search_seconds = time.perf_counter() - t0
    if over is not None:
      tried = ("the optimizer state sharded apart from the parameters"
               + (" and the layer stacks and repeated blocks "
                  "rematerialised (" + ", ".join(_remat.AUTO) + ")"
                  if variants.remats else
                  f", with remat={policy!r} as asked" if remat is not None
                  else "; the step has no jax.lax.scan layer stack or "
                  "repeated block without its own jax.checkpoint to "
                  "rematerialise"))
      over = _NoFit(f"{over} Tried: {tried}.", over.result)
  if over is not None and memory_budget is None:
    frac = default_budget(cluster)[1]
    over = _NoFit(f"{over} (The budget is the default: {frac:g} of "
                  f"cluster.memory_per_device, as XLA's allocator takes; "
                  "pass memory_budget= to change it, float('inf') to plan "
                  "without it.)", over.result)
    if best.remat == policy:
      base = best  # the textbook plans: on the step as written
    else:
      base = options[0][0]
  if select == "model":
    if over is not None:
      raise MemoryBudgetError(str(over))
    best.selection = _select.Selection("model", (
        "abstract mesh: no devices to compile for" if not isinstance(
            mesh, Mesh) else "select='model'"))
    return best
  chosen = _select_compiled(best, budget, float(select_seconds),
                            alternatives, verbose, base=base,
                            refit=lambda target: variants.fit(target)[0])
  sel = chosen.selection
  if budget is not None and (sel.winner is None or not
                             sel.candidates[sel.winner].fits):
    peaks = [c.compiled.memory_bytes for c in sel.candidates
             if c.compiled is not None and c.compiled.memory_bytes]
    raise MemoryBudgetError(
        (str(over) if over is not None else
         f"no plan fits memory_budget={_fmt_bytes(budget)} per "
         "device by the compiled programs.") +
        (f" By memory_analysis, the smallest compiled candidate needs "
         f"{_fmt_bytes(min(peaks))}." if peaks else ""))
  return chosen


class _Variants:
  """The programs a budget may call for -- the step as written, and traced
  again with its layer stacks and repeated blocks rematerialised (each
  policy of ``_remat.AUTO`` where ``may_remat``) -- each traced once, and
  :meth:`fit`, which searches them all under a budget with weight-update
  sharding free: the fastest plan that fits by the model, else the
  smallest. :func:`plan` fits the budget with it, and selection fits it
  again, under the budget scaled by the model's error on a compiled
  plan."""

  def __init__(self, fn, args, mesh, cluster, verbose: bool, policy,
               setup, may_remat: bool):
    self.fn, self.args, self.mesh, self.cluster = fn, args, mesh, cluster
    self.verbose, self.policy = verbose, policy
    self.setups = {policy: setup}
    self.policies = [policy] + (list(_remat.AUTO) if may_remat else [])
    self.remats = False  # a remat variant was searched

  def fit(self, budget: float) -> tuple[Plan, _NoFit | None, list]:
    options, beat = [], math.inf
    for pol in self.policies:
      setup = self.setups.get(pol)
      if setup is None:
        setup = self.setups[pol] = _setup(self.fn, self.args, self.mesh,
                                          self.cluster, remat=pol)
      if pol != self.policy:
        if not _remat.has_checkpoint(setup[3].closed.jaxpr):
          break  # no layer stack nor repeated block: nothing to recompute
        self.remats = True
      p, o = _search_plan(
          self.fn, self.args, self.mesh, self.cluster, budget, self.verbose,
          time.perf_counter(), pol, zero=True, setup=setup, beat=beat)[:2]
      options.append((p, o))
      if o is None:
        beat = min(beat, p.cost.time_s)
    fits = [i for i, (_, o) in enumerate(options) if o is None]
    pick = (min(fits, key=lambda i: options[i][0].cost.time_s) if fits else
            min(range(len(options)),
                key=lambda i: options[i][0].cost.memory_bytes))
    return (*options[pick], options)


def _parse_budget(memory_budget) -> float | None:
  """``memory_budget`` in bytes; None for ``float("inf")`` (no constraint)
  and for None (the cluster's default, resolved once the cluster is)."""
  if memory_budget is None:
    return None
  if isinstance(memory_budget, float) and memory_budget == math.inf:
    return None
  return parse_bytes(memory_budget, "memory_budget")


def _search_plan(fn, args, mesh, cluster, budget: float | None,
                 verbose: bool, t0: float, remat, zero: bool = False,
                 setup=None, beat: float = math.inf
                 ) -> tuple[Plan, _NoFit | None, float, tuple]:
  """Trace (with ``remat``), search and fit the budget by the model: (the
  plan, why nothing fits the budget or None, the peak of the best plan
  without the budget, what :func:`_setup` made, which ``setup`` reuses).
  ``zero``: the optimizer moments' layouts are free of their parameters'
  (weight-update sharding). ``beat``: the time of a plan that fits already;
  where the best plan here without the budget is no faster, fitting it
  cannot win and is skipped."""
  if setup is None:
    setup = _setup(fn, args, mesh, cluster, remat=remat)
  cluster, mesh, mi, tr, graph, prob, state = setup
  if zero:
    prob = prob.zero
  seeds = _seeds(prob, graph, tr, mi, state, zero=zero)
  if any(s is not None for s in tr.shardings):
    user = _pins_for(prob, graph, tr, mi, _user_codes(tr, mi))
    if user:
      seeds = {"user": user, **seeds}
  progress = None
  if verbose:
    what = "" if remat == _remat.NONE else f", layer stacks remat {remat}"
    what += ", moments free of their parameters" if zero else ""
    print(f"[autoddl_jax] planning {len(graph.ops)} ops, "
          f"{len(prob.groups)} coordinates, {len(seeds)} seeds on "
          f"{dict(zip(mi.axis_names, mi.axis_sizes))}{what}",
          file=sys.stderr, flush=True)
    progress = lambda seed, sweep, obj: print(  # noqa: E731
        f"[autoddl_jax] start {seed:>10}  sweep {sweep:>3}  best "
        f"{obj * 1e3:.6g} ms", file=sys.stderr, flush=True)
  res = _propagated(prob, seeds, _search.coordinate_descent(
      prob, seeds, progress=progress, polish=getattr(prob, "untied", None)))
  choice = res.choice
  free_peak = prob.peak_memory(choice)
  over = None  # why no plan fits the budget by the model, if none does
  if budget is not None and free_peak > budget and \
      prob.evaluate(choice).time_s >= beat:
    over = _NoFit("slower than a plan that fits, without the budget", res)
  elif budget is not None:
    try:
      choice, res = _fit_budget(prob, seeds, res, float(budget), progress)
    except _NoFit as e:
      # The model's memory is an estimate: the compiled programs decide.
      over, choice, res = e, e.result.choice, e.result
  best = Plan(fn=fn, mesh=mesh, mi=mi, cluster=cluster, traced=tr, graph=graph,
              problem=prob, choice=choice, search=res,
              search_seconds=time.perf_counter() - t0, seeds=seeds,
              remat=remat, budget=budget)
  return best, over, free_peak, setup


def _select_mode(select: str | None, mesh) -> str:
  concrete = isinstance(mesh, Mesh)
  if select is None:
    env = os.environ.get(SELECT_ENV)
    if env not in (None, "", "compiled", "model"):
      raise ValueError(f"{SELECT_ENV}={env!r}: use 'compiled' or 'model'")
    select = env or ("compiled" if concrete else "model")
    if not concrete:
      select = "model"
  if select not in ("compiled", "model"):
    raise ValueError(f"select must be 'compiled' or 'model', got {select!r}")
  if select == "compiled" and not concrete:
    raise ValueError(
        "select='compiled' needs a concrete jax.sharding.Mesh to compile "
        "for; this mesh is abstract. Plan with select='model' (the default "
        "for an abstract mesh), or pass a Mesh of devices (jax.make_mesh).")
  return select


def _select_compiled(best: Plan, budget: float | None, seconds: float,
                     alternatives: int, verbose: bool,
                     base: Plan | None = None, *,
                     refit: Callable[[float], Plan]) -> Plan:
  """:func:`plan`'s ``select="compiled"``: the candidates, compiled, and
  the winner with its :class:`Selection`. ``base`` is the plan of the step
  as written where ``best`` is of a remat variant: the textbook plans are
  written on it, and it is a candidate too (``"search:no-remat"``).
  ``refit(target)``: the plan for a budget of ``target`` by the model
  (:meth:`_Variants.fit`)."""
  base = best if base is None else base
  cands = [("search", "pinned", best),
           ("search", "boundary",
            best._variant(best.choice, "boundary", "search"))]
  if base is not best:
    cands.append(("search:no-remat", "pinned", base))
  cands += [(k, "boundary", base.textbook(k)) for k in TEXTBOOK]
  alts = list(best.search.alternatives.items())[:alternatives] \
      if best.search is not None else []
  cands += [(f"search:{start}", "pinned",
             best._variant(ch, "pinned", f"search:{start}"))
            for start, ch in alts]
  progress = None
  if verbose:
    progress = lambda msg: print(f"[autoddl_jax] {msg}",  # noqa: E731
                                 file=sys.stderr, flush=True)
  key = lambda p, low: p._program_key(low)  # noqa: E731
  t0 = time.perf_counter()
  win, sel = _select.select(cands, budget=budget, time_limit=seconds,
                            key=key, progress=progress)
  if budget is not None:
    # The model's memory is an estimate. Where the search's plan is over
    # the budget by memory_analysis, search again under the budget scaled
    # by the model's error on that plan (twice at most): a plan the model
    # puts that much lower is one XLA puts under the budget.
    last, target = sel.candidates[0], float(budget)
    for attempt in range(2):
      if last.fits is not False or not last.predicted_memory or \
          time.perf_counter() - t0 > seconds:
        break  # fits; nothing to scale by; select_seconds spent
      target *= last.predicted_memory / last.compiled.memory_bytes
      if progress is not None:
        progress(f"refit under {_fmt_bytes(target)} by the model")
      again = refit(target)
      again = again._variant(again.choice, "pinned", "search:refit")
      again.memory_budget = budget
      if any(key(p, low) == key(again, "pinned") for _, low, p in cands):
        break  # a plan already compiled
      name = f"search:refit{attempt + 1}"
      cands.append((name, "pinned", again))
      prior = [(key(p, low), c) for (_, low, p), c in
               zip(cands, sel.candidates)]
      win, sel = _select.select(
          [cands[-1]], budget=budget, key=key, progress=progress,
          time_limit=max(0.0, seconds - (time.perf_counter() - t0)),
          prior=prior)
      last = sel.candidates[-1]
      if last.compiled is None:
        break
    sel = dataclasses.replace(sel, seconds=time.perf_counter() - t0)
  chosen = best if win is None else cands[win][2]
  chosen.selection = sel
  return chosen


def _propagated(prob: Problem, seeds, res: _search.SearchResult
                ) -> _search.SearchResult:
  """The search's result, or a seed completed the way XLA propagates it
  (:func:`_propagate.propagate`, as it is or polished by plan cost) where
  that costs less by the plan's cost (:func:`_search.score`). The pairwise
  objective the search's moves minimise charges every small all-reduce its
  own latency, where the plan's cost combines them: on a ResNet with
  BatchNorm under data parallelism (dozens of tiny scale/bias gradients)
  the search's own plan cost 1.6x the propagated DP plan, and the exact
  optimum of the pairwise objective 1.35x (compare.py --exact-only)."""
  best, best_score = None, _search.score(prob, res.choice)
  for name, pins in seeds.items():
    ch = _propagate.propagate(prob, pins)
    sc = _search.score(prob, ch)
    if sc < best_score * (1 - 1e-9):
      best, best_score = (name, ch), sc
    if sc < 1.25 * best_score:  # else polishing it is unlikely to win
      # polish_by_score's moves do not see combined latencies either: its
      # result is one more candidate, not a step that must be taken.
      ch = _search.polish_by_score(prob, ch)
      sc = _search.score(prob, ch)
      if sc < best_score * (1 - 1e-9):
        best, best_score = (name, ch), sc
  if best is None:
    return res
  name, ch = best
  alts = {res.seed: list(res.choice), **res.alternatives}
  return dataclasses.replace(
      res, choice=[int(c) for c in ch], objective=_search.objective(prob, ch),
      seed=f"{name}:propagated", alternatives=alts)


class _NoFit(Exception):
  """No plan the search found fits the budget by the model (the message is
  :class:`MemoryBudgetError`'s; ``result`` is the smallest plan found)."""

  def __init__(self, message: str, result: _search.SearchResult):
    super().__init__(message)
    self.result = result


def _fit_budget(prob: Problem, seeds, res, budget: float, progress):
  """The cheapest plan found whose peak memory fits ``budget``.

  Memory enters the search as a Lagrangian penalty on the bytes of every
  tensor (a proxy for the peak): a weight that puts the peak on the time's
  scale, then (where that does not fit) one 4**11 times heavier; where that
  fits, the weight is bisected between them (four times, geometrically:
  to within 4**(11/16)). Each seed completed with its
  placements held is a candidate too, so a budgeted plan is never worse than
  a seed that fits.
  """
  peak = prob.peak_memory(res.choice)
  if peak <= budget:
    return res.choice, res
  fits: list[tuple[float, int, _search.SearchResult]] = []
  smallest = (peak, res)

  def consider(r):
    nonlocal smallest
    pk = prob.peak_memory(r.choice)
    if pk < smallest[0]:
      smallest = (pk, r)
    if pk <= budget:
      fits.append((prob.evaluate(r.choice).time_s, len(fits), r))
      return True
    return False

  polish = getattr(prob, "untied", None)
  scale = max(res.objective, 1e-30) / max(peak, 1.0)
  lo = hi = None
  r = _search.coordinate_descent(prob, seeds, mem_weight=scale,
                                 progress=progress, polish=polish)
  if consider(r):
    hi = scale
  else:
    # Before bisecting for the lightest penalty that fits, whether the
    # heaviest fits at all: where none does (a model whose activations
    # cannot fit without remat), one more search says so.
    lo, top = scale, scale * 4.0 ** 11
    r = _search.coordinate_descent(prob, seeds, mem_weight=top,
                                   progress=progress, polish=polish)
    if consider(r):
      hi = top
  # The seeds completed with their placements held: the penalty weighs
  # every tensor's bytes, not the peak, so a seed can fit where the
  # penalised searches do not (ZeRO's, whose replicated parameters the
  # penalty counts against it, on a step that donates them).
  for name, pins in seeds.items():
    consider(_search.complete(prob, pins, name))
  if hi is not None and lo is not None:
    for _ in range(4):  # a lighter penalty that still fits is cheaper
      mid = math.sqrt(lo * hi)
      r = _search.coordinate_descent(prob, seeds, mem_weight=mid,
                                     progress=progress, polish=polish)
      if consider(r):
        hi = mid
      else:
        lo = mid
  if not fits:
    peak, r = smallest
    big = ", ".join(f"{name} {shape} {_fmt_bytes(b)}"
                    for b, name, shape in prob.largest_tensors(r.choice))
    raise _NoFit(
        f"no plan fits memory_budget={_fmt_bytes(budget)} per device: the "
        f"smallest plan found needs {_fmt_bytes(peak)}. Largest tensors per "
        f"device in it: {big}. Use more devices, a smaller batch, remat, or a "
        "larger budget.", r)
  time_s, _, best_fit = min(fits, key=lambda f: f[:2])
  best_fit.objective = time_s
  return best_fit.choice, best_fit


def _to_codes(s, aval, mi: MeshInfo, where: str) -> tuple[int, ...]:
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


def _flat_shardings(tree, target_tree, n: int, what: str) -> list:
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


def hand_plan(fn: Callable, *args: Any, mesh, in_shardings,
              out_shardings=None, cluster: Cluster | None = None) -> Plan:
  """A Plan whose arguments (and results) follow the given shardings.

  ``in_shardings`` / ``out_shardings`` are what ``jax.jit`` takes: one
  ``NamedSharding`` / ``PartitionSpec`` / None (replicated) for every leaf,
  or a pytree prefix of the arguments (results), such as ``(None, None,
  P("data"))`` for three arguments; flax's boxed trees (``nn.get_sharding``
  of a ``TrainState``, ``nnx.get_named_sharding``) work as they come.

  The intermediates get the cheapest layout under the cost model given that
  boundary, which is what XLA's sharding propagation aims at too.
  """
  t0 = time.perf_counter()
  cluster, mesh, mi, tr, graph, prob, state = _setup(fn, args, mesh, cluster,
                                               tie_repeated=False)
  ins = _flat_shardings(in_shardings, tr.in_tree, len(tr.in_avals),
                        "in_shardings")
  pins = {}
  for i, (s, a) in enumerate(zip(ins, tr.in_avals)):
    codes = _to_codes(s, a, mi,
                      f"in_shardings for argument {tr.in_names[i] or i}")
    k = prob.find_candidate(graph.input_ops[i], codes)
    if k is None:
      raise ValueError(f"in_shardings for {tr.in_names[i]}: {s} cannot be "
                       "used for this argument")
    pins[graph.input_ops[i]] = k
  if out_shardings is not None:
    outs = _flat_shardings(out_shardings, tr.out_tree, len(tr.out_avals),
                           "out_shardings")
    for j, (s, a) in enumerate(zip(outs, tr.out_avals)):
      codes = _to_codes(s, a, mi, f"out_shardings for result "
                        f"{tr.out_names[j] or j}")
      pins[graph.output_ops[j]] = prob.find_candidate(graph.output_ops[j],
                                                      codes)
  # A hand plan may lay out a result differently from the argument it updates
  # (or a moment differently from its parameter): score those untied.
  groups = [g for g in prob.groups if len(g) > 1]
  keep = [g for g in groups if len({pins[o] for o in g if o in pins}) <= 1]
  if len(keep) != len(groups):
    prob = Problem(graph, mi, cluster, keep, _donated_ops(tr, graph))
  res = _search.complete(prob, pins, "hand")
  return Plan(fn=fn, mesh=mesh, mi=mi, cluster=cluster, traced=tr, graph=graph,
              problem=prob, choice=res.choice, search=res,
              search_seconds=time.perf_counter() - t0)


def cost_of(fn: Callable, *args: Any, mesh, in_shardings, out_shardings=None,
            cluster: Cluster | None = None) -> PlanCost:
  """Scores a hand-written plan on the same cost model as :func:`plan`.

  Args:
    in_shardings: one sharding, or a pytree prefix of ``args`` (as
      ``jax.jit`` takes) of ``NamedSharding``/``PartitionSpec``/None
      (None = replicated); see :func:`hand_plan`.
    out_shardings: likewise for the results; None leaves them to the model.
  """
  return hand_plan(fn, *args, mesh=mesh, in_shardings=in_shardings,
                   out_shardings=out_shardings, cluster=cluster).cost


def load_plan(path, fn: Callable, *args: Any, mesh: Mesh | AbstractMesh,
              cluster: Cluster | None = None) -> Plan:
  """Reads a plan saved with :meth:`Plan.save` for ``fn(*args)`` on ``mesh``.

  The program is traced again (no search) and must be the one the plan was
  made for, on a mesh of the same axes and sizes and the same cluster;
  otherwise :class:`autoddl_jax.PlanFileError` says what differs. A
  truncated or corrupted file raises it too.
  """
  from autoddl_jax import _io
  return _io.load(path, fn, args, mesh, cluster)
