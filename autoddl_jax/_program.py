"""The program a plan is made for: one frozen value, built by one function.

A :class:`Program` is a traced step (:mod:`autoddl_jax._trace`), its
operator graph (:mod:`autoddl_jax._graph`), the search problem over it
(:mod:`autoddl_jax._problem`: candidates, costs, the coordinates tied by
state and repeated layers, :mod:`autoddl_jax._coords`), the mesh it is
planned for and the cluster it is costed on. :func:`build` makes one;
everything downstream -- seeds, search, plans, lowering, reports -- reads
it and never changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec

from autoddl_jax import _remat, pipeline
from autoddl_jax._cluster import H100_NODE, Cluster, MeshInfo, mesh_info
from autoddl_jax._coords import layerless, merge_repeated_params
from autoddl_jax._coords import param_and_moments, state_ties
from autoddl_jax._coords import repeat_groups
from autoddl_jax._graph import build_graph
from autoddl_jax._opgraph import OpGraph
from autoddl_jax._problem import Problem
from autoddl_jax._trace import Traced, trace


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A traced step, its graph and search problem, on one mesh and cluster.

  ``problem`` is the problem plans of this program index their choices
  into: the step's state tied to its results and parameters to their
  optimizer moments (and, where the program was built with
  ``tie_repeated``, repeated layers tied too, ``problem.untied`` the same
  problem untied). :meth:`weight_update_sharded` is the same program with
  each parameter's moments free of its layout (ZeRO-1/2).
  """

  fn: Callable
  mesh: Mesh | AbstractMesh
  mesh_info: MeshInfo
  cluster: Cluster
  traced: Traced
  graph: OpGraph
  problem: Problem
  state: frozenset[int]  # argument leaves the step updates (and returns)
  remat: str | tuple[str, ...] = _remat.NONE
  zero: Problem | None = None  # the weight-update-sharded problem
  # How the step's ``ad.pipeline.scan`` calls run (None: as lax.scan).
  schedule: pipeline.Schedule | None = None
  # Memo of what is derived from this value alone (textbook seeds and
  # their completions): filled on first use, never changed after.
  memo: dict = dataclasses.field(default_factory=dict, repr=False)

  def weight_update_sharded(self) -> Program:
    """The same program, searched with optimizer moments' layouts free of
    their parameters'."""
    return dataclasses.replace(self, problem=self.zero, zero=None, memo={})

  def with_problem(self, problem: Problem) -> Program:
    return dataclasses.replace(self, problem=problem, zero=None, memo={})

  @property
  def donated_ops(self) -> frozenset[int]:
    """Input ops whose buffers a ``donate_argnums`` step gives its
    results."""
    return frozenset(self.graph.input_ops[i]
                     for i in self.traced.donated_leaves)

  def auto_mesh(self) -> Mesh:
    """The plan's devices as Auto axes (sharding constraints need them);
    raises for an abstract mesh."""
    if not isinstance(self.mesh, Mesh):
      raise ValueError(
          "this plan was made for an abstract mesh; Plan.jit() needs "
          "devices. Re-plan with a concrete jax.sharding.Mesh (jax.make_mesh)"
          " of the same shape "
          f"{dict(zip(self.mesh_info.axis_names, self.mesh_info.axis_sizes))}.")
    return Mesh(self.mesh.devices, self.mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(self.mesh.axis_names))


def shard_tree(specs: Any, mesh) -> Any:
  """A pytree of ``PartitionSpec`` as ``NamedSharding`` on ``mesh``."""
  return jax.tree_util.tree_map(
      lambda s: NamedSharding(mesh, s), specs,
      is_leaf=lambda x: isinstance(x, PartitionSpec))


def build(fn: Callable, args: tuple, mesh, cluster: Cluster | None,
          tie_repeated: bool = True,
          remat: str | tuple[str, ...] = _remat.NONE,
          schedule: pipeline.Schedule | None = None) -> Program:
  """Traces ``fn(*args)`` (with ``remat``: :mod:`autoddl_jax._remat`; its
  ``ad.pipeline.scan`` calls run by ``schedule``, whose stage axis is one
  of ``mesh``'s) and builds its graph and problems on ``mesh`` (a Mesh, an
  AbstractMesh or ``{axis: size}``) for ``cluster`` (default: an H100
  node)."""
  cluster = H100_NODE if cluster is None else cluster
  if not isinstance(cluster, Cluster):
    raise TypeError(f"cluster must be an autoddl_jax.Cluster, got "
                    f"{type(cluster).__name__}")
  mi = mesh_info(mesh, cluster)  # validates the mesh before tracing
  if isinstance(mesh, Mapping):
    mesh = AbstractMesh(mi.axis_sizes, mi.axis_names)
  if schedule is not None and schedule.stages > 1 and (
      schedule.axis not in mi.axis_names or
      mi.axis_sizes[mi.axis_names.index(schedule.axis)] != schedule.stages):
    raise ValueError(f"pipeline schedule {schedule}: the mesh "
                     f"{dict(zip(mi.axis_names, mi.axis_sizes))} has no axis "
                     f"{schedule.axis!r} of size {schedule.stages}")
  tr = trace(fn, args, remat, schedule)
  graph = build_graph(tr.closed, tr.in_names, tr.out_names, tr.splittable)
  out_to_in, tie_groups = state_ties(tr)
  donated = frozenset(graph.input_ops[i] for i in tr.donated_leaves)
  # The repeated blocks are the graph's: both problems tie the same ones.
  repeats = repeat_groups(graph, _input_tokens(tr)) if tie_repeated else []
  prob = _state_problem(tr, graph, mi, cluster, donated, out_to_in,
                        tie_groups, tie_repeated, repeats, zero=False)
  # Weight-update sharding (ZeRO-1/2): the same program with each
  # optimizer moment's layout free of its parameter's (searched where a
  # budget binds: :func:`autoddl_jax.plan`).
  zero = _state_problem(tr, graph, mi, cluster, donated, out_to_in,
                        tie_groups, tie_repeated, repeats, zero=True,
                        like=prob)
  return Program(fn, mesh, mi, cluster, tr, graph, prob,
                 frozenset(out_to_in.values()), remat, zero, schedule)


def _input_tokens(tr: Traced) -> list:
  """What ties an input across repeated blocks: its path without layer
  numbers, shape and dtype."""
  return [(layerless(tr.in_keys[i]), tuple(a.shape), str(a.dtype))
          for i, a in enumerate(tr.in_avals)]


def _state_problem(tr, graph, mi, cluster, donated, out_to_in, tie_groups,
                   tie_repeated: bool, repeats: list, zero: bool,
                   like: Problem | None = None) -> Problem:
  """The problem with each updated argument tied to its result, and each
  parameter to its moments (``zero``: the moments of a parameter tied to
  each other only). ``like``: a problem of the same program to share the
  candidates with."""
  groups = []
  in_grouped = set()
  for g in tie_groups:
    parts = [list(g)]
    if zero:
      param, moments = param_and_moments(tr, g)
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
    prob = Problem(graph, mi, cluster, groups, donated)
  else:
    prob = getattr(like, "untied", like).regroup(groups)
  if tie_repeated:
    merged = merge_repeated_params(groups, graph, _input_tokens(tr))
    if repeats or len(merged) != len(groups):
      # Search with repeated blocks tied (decided once); ``prob.untied``
      # refines the best plans per block at the end. ``repeats``: the
      # repeated blocks' ops (_coords.repeat_groups).
      tied = prob.regroup(merged + repeats)
      tied.untied = prob
      prob = tied
  return prob
