"""A plan: a program and one choice of candidate per op, frozen.

:class:`Plan` is a value -- a :class:`~autoddl_jax._program.Program` and the
candidate (an nd-SBP signature) chosen for each of its ops, with where the
choice came from -- plus what follows from it: the predicted
:class:`PlanCost`, the arguments' and results' nd-SBPs and
``PartitionSpec``s. It lowers (:meth:`Plan.jit`, pins from
:mod:`autoddl_jax._pins`), saves (:mod:`autoddl_jax._io`), verifies against
the compiled program (:mod:`autoddl_jax._verify`) and explains itself
(:mod:`autoddl_jax._report`); :meth:`Plan.replace` makes a changed copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

from autoddl_jax import _io, _lower, _pins, _propagate, _remat, _report
from autoddl_jax import _search, _seeds
from autoddl_jax._problem import PlanCost
from autoddl_jax._program import Program, shard_tree
from autoddl_jax._sbp import NdSbp, codes_to_spec
from autoddl_jax._select import LOWERINGS, Selection
from autoddl_jax._step import PlannedStep
from autoddl_jax._verify import Verification, verify


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """A sharding plan for one traced program on one mesh.

  Attributes:
    program: the traced step, its graph and search problem, mesh and
      cluster (:class:`~autoddl_jax._program.Program`); ``fn``, ``mesh``,
      ``mesh_info``, ``cluster``, ``graph``, ``problem`` and ``remat`` are
      its.
    choice: the candidate per op of ``problem`` (its index into
      ``problem.cands[op]``).
    in_shardings / out_shardings: pytrees of ``NamedSharding`` shaped like the
      arguments / results (``PartitionSpec`` leaves for an abstract mesh).
      For a step that updates flax.nnx objects in place, the results are
      ``(*args with only those objects, the step's result)``: their new state
      is part of the planned program.
    in_specs / out_specs, in_sbps / out_sbps: the same as ``PartitionSpec``s
      and as :class:`NdSbp`.
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
    search: the search's result (None for a loaded plan).
    search_s: wall time of the search; ``selection.compile_s`` is the
      time spent compiling candidates, apart from it.
    remat: the ``jax.checkpoint`` policy the step's scanned layer stacks
      (and, for one policy name, its repeated unrolled blocks) were traced
      with (``"none"``, ``"dots_saveable"``,
      ``"dots_with_no_batch_dims_saveable"``, ``"nothing_saveable"``;
      a tuple: one per scan, in call order) -- part of the program this plan
      lowers (:mod:`autoddl_jax._remat`).
    memory_budget: bytes per device the plan was made to fit (None: no
      constraint).
    schedule: how the step's ``ad.pipeline.scan`` stacks run
      (:class:`autoddl_jax.pipeline.Schedule`: stages over a mesh axis,
      microbatches), or None (as ``lax.scan``) -- part of the program this
      plan lowers; ``mesh`` is then the mesh it was planned on (the user's,
      or with an axis split for the stages, :mod:`autoddl_jax._stages`).
  """

  program: Program
  choice: tuple[int, ...]
  search: _search.SearchResult | None = None
  search_s: float = 0.0
  lowering: str = "pinned"
  source: str = "search"
  selection: Selection | None = None
  memory_budget: float | None = None
  cost: PlanCost = dataclasses.field(init=False)
  in_sbps: list[NdSbp] = dataclasses.field(init=False, repr=False)
  out_sbps: list[NdSbp] = dataclasses.field(init=False, repr=False)
  in_specs: Any = dataclasses.field(init=False, repr=False)
  out_specs: Any = dataclasses.field(init=False, repr=False)
  in_shardings: Any = dataclasses.field(init=False, repr=False)
  out_shardings: Any = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    if self.lowering not in LOWERINGS:
      raise ValueError(f"lowering must be one of {LOWERINGS}, got "
                       f"{self.lowering!r}")
    set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
    set_("choice", tuple(self.choice))
    prob, g, tr = self.problem, self.graph, self.traced
    # DP as a user writes it is what XLA's propagation makes of it.
    set_("cost", _propagate.evaluate(prob, list(self.choice))
         if self.source == "dp" else prob.evaluate(list(self.choice)))
    names = self.mesh_info.axis_names
    codes = lambda op: prob.cands[op][self.choice[op]][0]  # noqa: E731
    set_("in_sbps", [NdSbp.from_codes(codes(o)) for o in g.input_ops])
    set_("out_sbps", [NdSbp.from_codes(codes(o)) for o in g.output_ops])
    in_specs = [codes_to_spec(s.codes, len(a.shape), names)
                for s, a in zip(self.in_sbps, tr.in_avals)]
    out_specs = [codes_to_spec(s.codes, len(a.shape), names)
                 for s, a in zip(self.out_sbps, tr.out_avals)]
    set_("in_specs", jax.tree_util.tree_unflatten(tr.in_tree, in_specs))
    set_("out_specs", jax.tree_util.tree_unflatten(tr.out_tree, out_specs))
    set_("in_shardings", shard_tree(self.in_specs, self.mesh))
    set_("out_shardings", shard_tree(self.out_specs, self.mesh))

  # The program's parts, as a plan's attributes.
  fn = property(lambda self: self.program.fn)
  mesh = property(lambda self: self.program.mesh)
  mesh_info = property(lambda self: self.program.mesh_info)
  cluster = property(lambda self: self.program.cluster)
  graph = property(lambda self: self.program.graph)
  problem = property(lambda self: self.program.problem)
  traced = property(lambda self: self.program.traced)
  remat = property(lambda self: self.program.remat)
  schedule = property(lambda self: self.program.schedule)

  def replace(self, **changes: Any) -> Plan:
    """A copy with ``changes`` (dataclass fields) applied."""
    return dataclasses.replace(self, **changes)

  def variant(self, choice: Sequence[int], lowering: str, source: str
              ) -> Plan:
    """Another choice on the same program (sharing its memo)."""
    return self.replace(choice=tuple(choice), lowering=lowering,
                        source=source, selection=None)

  # ---------------------------------------------------------------- lower
  def jit(self, *, pin_inputs: bool = True, **jit_kwargs) -> Any:
    """The planned step as a ``jax.jit`` function (call it, or ``.lower``).

    ``pin_inputs`` also pins each op's operands where the plan reshards them
    (else only op results are pinned and XLA picks where to reshard). A plan
    with ``lowering="boundary"`` pins nothing inside.
    """
    mesh = self.program.auto_mesh()
    tr = self.traced
    pins = (_pins.pins(self.program, self.choice, mesh, pin_inputs)
            if self.lowering == "pinned" else _lower.Pins(mesh, {}, {}, {}))
    fn = _lower.planned_function(tr.closed, tr.in_tree, tr.out_tree, pins,
                                 tr.in_names)
    in_sh = shard_tree(self.in_specs, mesh)
    if tr.donate_argnums:
      jit_kwargs.setdefault("donate_argnums", tr.donate_argnums)
    if _remat.cpu_keeps_recompute(tr.closed.jaxpr, mesh):
      jit_kwargs.setdefault("compiler_options", _remat.KEEP_BARRIERS)
    jitted = jax.jit(fn, in_shardings=in_sh,
                     out_shardings=shard_tree(self.out_specs, mesh),
                     **jit_kwargs)
    # Arrays placed on another mesh of the same devices -- Explicit axes,
    # or the user's mesh where pipeline stages split an axis of it -- are
    # put on the plan's first.
    retype = not all(t == AxisType.Auto
                     for t in getattr(self.mesh, "axis_types", ())) or (
                         self.schedule is not None and
                         self.schedule.split_from is not None)
    if not (retype or tr.static or tr.nnx_args):
      return jitted
    return PlannedStep(jitted, in_sh, retype=retype, static=tr.static,
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
    return _report.logical_rules(self.param_specs(argnum), logical_specs,
                                 argnum)

  def save(self, path) -> None:
    """Writes the plan as versioned JSON (atomically: temp file + rename),
    with fingerprints of the program, mesh and cluster it was made for. Read
    it back with :func:`autoddl_jax.load_plan`."""
    _io.save(self, path)

  def verify(self, *, pin_inputs: bool = True) -> Verification:
    """Compiles the planned step (abstractly: nothing is allocated) and sets
    what the plan predicted beside what XLA emitted: collective bytes by
    kind, their time on the cluster's links, FLOPs and peak memory per
    device. ``print()`` the result for a table; needs a concrete mesh."""
    return verify(self, pin_inputs)

  # ------------------------------------------------------------ baselines
  def baseline_cost(self, kind: str = "dp") -> PlanCost:
    """What a textbook plan costs on the same mesh and cluster, for scale:
    ``"dp"`` (parameters replicated, the batch split over every device)
    completed as XLA's sharding propagation completes that boundary when a
    user writes it (:mod:`autoddl_jax._propagate`: the devices as one
    group, partial sums reduced where they are made); ``"fsdp"``
    (parameters too split over every axis, ZeRO-3), ``"megatron"``
    (each matmul weight column- or row-split over the last axis as the
    dataflow pairs them, :mod:`autoddl_jax._tensor_parallel`; data
    parallel over the others) or ``"fsdp_tp"`` (Megatron's layout with
    each weight's largest other dim split over the other axes, as
    MaxText's fsdp x tensor rules), each completed by the search with those
    placements held."""
    memo = self.program.memo.setdefault("baseline_cost", {})
    if kind not in memo:
      choice = self.baseline_choice(kind)
      memo[kind] = (_propagate.evaluate(self.problem, choice) if kind == "dp"
                    else self.problem.evaluate(choice))
    return memo[kind]

  def baseline_choice(self, kind: str = "dp") -> list[int]:
    """The candidate per op of :meth:`baseline_cost`'s plan."""
    if kind not in _seeds.BASELINES:
      raise ValueError(f"unknown baseline {kind!r}; use one of "
                       f"{', '.join(map(repr, _seeds.BASELINES))}")
    memo = self.program.memo.setdefault("baseline_choice", {})
    if kind not in memo:
      pins = self.textbook_pins(kind)
      memo[kind] = (_propagate.propagate(self.problem, pins) if kind == "dp"
                    else _search.complete(self.problem, pins, kind).choice)
    return list(memo[kind])

  def textbook_pins(self, kind: str) -> dict[int, int]:
    """{input op: candidate} of a textbook plan's boundary (the search's
    seeds, and FSDP+TP)."""
    return _seeds.textbook_pins(self.program, kind)

  def textbook(self, kind: str) -> Plan:
    """A textbook plan (:meth:`baseline_cost`'s kinds) on the same program,
    mesh and cluster, lowered as a user writes it: its in/out shardings
    only, XLA propagating the rest (``lowering="boundary"``)."""
    return self.variant(self.baseline_choice(kind), "boundary", kind)

  def program_key(self, lowering: str):
    """What a candidate compiles to: equal keys, equal programs."""
    if lowering == "pinned":
      return ("pinned", self.remat, self.schedule, tuple(self.choice))
    leaves = lambda t: tuple(str(x) for x in jax.tree_util.tree_leaves(  # noqa
        t, is_leaf=lambda y: isinstance(y, PartitionSpec)))
    return ("boundary", self.remat, self.schedule, leaves(self.in_specs),
            leaves(self.out_specs))

  # -------------------------------------------------------------- explain
  def explain(self, max_rows: int = 40) -> str:
    """The plan as text for people (:func:`autoddl_jax._report.explain`)."""
    return _report.explain(self, max_rows)

  def transitions(self) -> list[dict[str, Any]]:
    """Every resharding the plan implies: tensor, from, to, bytes, time."""
    return _report.transitions(self)

  def user_paths(self) -> list[str]:
    """Each argument leaf's path as the user named it (``0/layers/wq``)."""
    return self.traced.user_paths()

  def memory_by_category(self) -> dict[str, float]:
    """Predicted bytes per device at the peak by what they hold
    (:func:`autoddl_jax._report.memory_by_category`); their sum is
    ``cost.memory_bytes``."""
    return _report.memory_by_category(self)

  def __repr__(self) -> str:
    c = self.cost
    return (f"Plan(time_s={c.time_s:.4g}, comm_bytes={c.comm_bytes:.4g}, "
            f"memory_bytes={c.memory_bytes:.4g})")
