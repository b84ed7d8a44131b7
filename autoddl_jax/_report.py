"""Plans as text for people: explain(), transitions, memory by category.

Nothing here decides anything: it reads a :class:`~autoddl_jax.Plan` (its
program, choice and costs) and formats it. Byte formatting is
:func:`autoddl_jax._cluster.format_bytes`; collective names are the steps
of the cost model's path (:func:`autoddl_jax._cost.transition_steps`), the
names ``verify`` counts XLA's collectives by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from autoddl_jax import _remat
from autoddl_jax._cluster import format_bytes
from autoddl_jax._coords import moments, state_ties
from autoddl_jax._cost import split_factor, transition_steps
from autoddl_jax._sbp import codes_to_spec, nd_repr

if TYPE_CHECKING:  # for annotations only: _plan imports this module
  from autoddl_jax._plan import Plan


def transitions(plan: Plan) -> list[dict[str, Any]]:
  """Every resharding the plan implies: the value (``value``: an argument
  by its path, else the op that makes it; ``tensor``: the graph's name),
  the op that reads it (``consumer``), from, to, collectives, executions
  per step (``weight``), bytes and time."""
  prob, g = plan.problem, plan.graph
  names = op_names(plan)
  out = []
  for i in prob.distinct_reshards(plan.choice):
    e = prob.edges[i]
    kp, kc = plan.choice[e.prod], plan.choice[e.cons]
    t = float(prob.edge_pair(e, kp, kc))
    if t <= 0:
      continue
    src = prob.cands[e.prod][kp][e.prod_slot]
    dst = prob.cands[e.cons][kc][e.cons_slot]
    out.append(dict(tensor=g.tensors[e.tensor].name,
                    value=names[e.prod], consumer=names[e.cons],
                    shape=g.tensors[e.tensor].aval.shape,
                    src=nd_repr(src), dst=nd_repr(dst),
                    collective=collective_names(
                        src, dst, e.space, plan.mesh_info),
                    weight=e.weight, time_s=t,
                    bytes=float(prob.edge_pair(e, kp, kc, "bytes"))))
  return out


def op_names(plan: Plan) -> list[str]:
  """Per op, what a person calls it: an argument or result by its path
  (``0/layers/wq``, ``result 0/layers/wq``), a loop's or branch's boundary
  as such, any other op by its primitive."""
  tr, g = plan.traced, plan.graph
  args, results = tr.user_paths(), tr.result_paths()
  out = []
  for op in g.ops:
    if op.kind == "input":
      out.append(args[op.leaf])
    elif op.kind == "output":
      out.append(f"result {results[op.leaf]}")
    elif op.prim == "~barrier":
      out.append("recomputation (remat)")
    elif op.kind == "link":
      out.append("loop/branch boundary")
    else:
      out.append(op.prim)
  return out


def logical_rules(planned: Any, logical_specs: Any, argnum: int
                  ) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """:meth:`Plan.logical_rules` of the ``PartitionSpec`` tree ``planned``
  of argument ``argnum``."""
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


def explain(plan: Plan, max_rows: int = 40) -> str:
  """The plan as text: per argument its nd-SBP, ``PartitionSpec`` and bytes
  per device; the costliest reshardings (collective, bytes, time); totals
  beside data parallelism's. ``max_rows`` (>= 0) bounds each table."""
  if isinstance(max_rows, bool) or not isinstance(max_rows, int) or \
      max_rows < 0:
    raise ValueError(f"max_rows must be an int >= 0 (rows per table), got "
                     f"{max_rows!r}")
  mi, cl = plan.mesh_info, plan.cluster
  lines = [f"autoddl_jax plan on mesh "
           f"{dict(zip(mi.axis_names, mi.axis_sizes))} "
           f"(links: {dict(zip(mi.axis_names, mi.link))})",
           f"made for: {cl.devices_per_node} devices per node, "
           f"{cl.intra_node_bandwidth / 1e9:g} GB/s inside a node and "
           f"{cl.inter_node_bandwidth / 1e9:g} GB/s across, "
           f"{cl.peak_flops * cl.flops_efficiency / 1e12:g} TFLOP/s "
           f"sustained, {format_bytes(cl.memory_per_device)} per device"]
  sched = plan.schedule
  if sched is not None and sched.stages > 1:
    kind = "GPipe" if sched.repeats == 1 else \
        f"circular, {sched.repeats} chunks per stage"
    lines.append(
        f"pipeline: {sched.stages} stages over mesh axis {sched.axis!r} "
        f"({kind}, ad.pipeline.scan), {sched.microbatches} microbatches, "
        f"{sched.ticks} ticks: bubble {sched.bubble:.1%} of each stage's "
        f"ticks; per-stage memory is the peak below (a device holds one "
        f"stage); the data-parallel column is this pipelined program's")
  c, dp = plan.cost, plan.baseline_cost("dp")
  rows = [("per device per step (predicted)", "this plan",
           "data parallel")]
  for name, a, b in (
      ("time", f"{c.time_s * 1e3:.4g} ms", f"{dp.time_s * 1e3:.4g} ms"),
      ("  compute", f"{c.compute_s * 1e3:.4g} ms",
       f"{dp.compute_s * 1e3:.4g} ms"),
      ("  communication", f"{c.comm_s * 1e3:.4g} ms",
       f"{dp.comm_s * 1e3:.4g} ms"),
      ("bytes sent", format_bytes(c.comm_bytes), format_bytes(dp.comm_bytes)),
      ("peak memory", format_bytes(c.memory_bytes),
       format_bytes(dp.memory_bytes))):
    rows.append((name, a, b))
  for cat, v in memory_by_category(plan).items():
    rows.append((f"  {cat}", format_bytes(v), ""))
  lines.append(table(rows))
  lines.append("(data parallel: parameters replicated, the batch split over "
               "every device, completed as XLA's propagation completes it. "
               "Memory is the model's estimate of XLA's allocation, gradients"
               " among the temporaries; plan.verify() sets it beside "
               "memory_analysis.)")
  lines.append(budget_line(plan))
  if all(cd < 0 for s in plan.in_sbps for cd in s.codes):
    lines.append(
        "every argument is replicated: by the model, splitting anything "
        f"costs more communication than the compute it saves (this step "
        f"computes {c.compute_s * 1e3:.3g} ms per device; data parallelism "
        f"would send {format_bytes(dp.comm_bytes)} in {dp.comm_s * 1e3:.3g} "
        "ms). A larger model or batch, or a cluster with faster links, "
        "shards.")
  if plan.remat != _remat.NONE:
    lines.append(f"remat: the scanned layer stacks and repeated blocks "
                 f"run under "
                 f"jax.checkpoint with policy {plan.remat!r} (their "
                 "forward is recomputed in the backward pass)")
  if plan.search is not None:
    lines.append(f"search: best start {plan.search.seed!r}, "
                 f"{plan.search_s:.2f} s")
  sel = plan.selection
  if sel is not None and sel.mode == "compiled":
    won = sel.candidates[sel.winner]
    lines.append(f"selected by the compiled program: {won.name} "
                 f"({won.lowering} lowering), {sel.reason}; "
                 f"{sel.compile_s:.1f} s compiling candidates")
    lines.append(table(sel.table()))
  elif sel is not None:
    lines.append(f"selected by the cost model: {sel.reason}")
  rows = [("argument", "shape", "nd-SBP", "PartitionSpec", "bytes/device")]
  for name, a, s in zip(plan.traced.user_paths(), plan.traced.in_avals,
                        plan.in_sbps):
    spec = codes_to_spec(s.codes, len(a.shape), mi.axis_names)
    local = local_bytes(a, s.codes, mi.axis_sizes)
    rows.append((name, str(tuple(a.shape)), repr(s), str(spec),
                 format_bytes(local)))
  lines.append(table(rows[:max_rows + 1]))
  if len(rows) > max_rows + 1:
    lines.append(f"... {len(rows) - max_rows - 1} more arguments")
  tr = sorted(transitions(plan), key=lambda r: -r["time_s"])
  if tr:
    rows = [("value", "shape", "from", "to", "read by", "collective",
             "times/step", "bytes", "time")]
    for r in tr[:max_rows]:
      rows.append((r["value"], str(r["shape"]), r["src"], r["dst"],
                   r["consumer"], r["collective"], f"{r['weight']:g}",
                   format_bytes(r["bytes"]), f"{r['time_s'] * 1e6:.3g} us"))
    lines.append("reshards (costliest first; bytes and time per execution "
                 "of each, per device):")
    lines.append(table(rows))
    if len(tr) > max_rows:
      lines.append(f"... {len(tr) - max_rows} more transitions")
  if plan.graph.unsupported:
    lines.append("replicated (no rule): " + ", ".join(
        f"{k} x{v}" for k, v in sorted(plan.graph.unsupported.items())))
  return "\n".join(lines)


def memory_by_category(plan: Plan) -> dict[str, float]:
  """Predicted bytes per device at the peak by what they hold:
  ``parameters`` (and other state updated in place, e.g. BatchNorm
  statistics), ``optimizer state`` (an optimizer's moments: state tied
  to a parameter), ``batch and other inputs``, ``results`` (the step's
  new state, counted apart from its inputs unless written over a donated
  argument) and
  ``activations, gradients, temporaries`` (the pool of buffers live at
  once at the peak, as :meth:`Problem.peak_memory` packs them). Their sum
  is ``cost.memory_bytes``."""
  mem = plan.problem.memory_breakdown(plan.choice)
  tr, mi = plan.traced, plan.mesh_info
  state = set(state_ties(tr)[0].values())
  moms = moments(tr)
  cats = dict.fromkeys(("parameters", "optimizer state",
                        "batch and other inputs"), 0.0)
  for i, (a, sb) in enumerate(zip(tr.in_avals, plan.in_sbps)):
    local = local_bytes(a, sb.codes, mi.axis_sizes)
    cat = ("optimizer state" if i in moms else "parameters"
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


def budget_line(plan: Plan) -> str:
  peak = plan.cost.memory_bytes
  dev = plan.cluster.memory_per_device
  if plan.memory_budget is None:
    return (f"memory: {format_bytes(peak)} of {format_bytes(dev)} per device "
            "(no budget)")
  b = plan.memory_budget
  state = "fits" if peak <= b else f"OVER by {format_bytes(peak - b)}"
  return (f"memory budget {format_bytes(b)} per device "
          f"({b / dev:.0%} of {format_bytes(dev)}; the rest is left to "
          f"workspace): {format_bytes(peak)} predicted, {state}")


def itemsize(a) -> int:
  try:
    return np.dtype(a.dtype).itemsize
  except TypeError:
    return 4


def collective_names(src, dst, space, mi) -> str:
  """The collectives of the path the model costs, one name per step (a
  joint all-reduce over two axes is one all-reduce, as XLA emits and
  ``verify`` counts it)."""
  steps = transition_steps(src, dst, space.nbytes, tuple(space.shape), mi)
  return "+".join(kind for kind, _, _ in steps) or "local"


def table(rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa
  return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths])] +
                   [fmt(r) for r in rows[1:]])


def local_bytes(aval, codes, sizes) -> float:
  """Bytes of one device's block of ``aval`` under ``codes``."""
  return math.prod(aval.shape) * itemsize(aval) / split_factor(codes, sizes)
