"""Which pipeline schedules the planner tries (``ad.plan(pipeline=...)``).

A step whose layer stacks go through :func:`autoddl_jax.pipeline.scan` can
run them as ``S`` stages over a mesh axis with ``M`` microbatches. Stages go
over a whole mesh axis of size ``S``, or over the major part of a larger
axis, which is split in two: ``(a_pp=S, a=n/S)`` -- stage ``s`` is the
``s``-th block of consecutive devices along ``a``, so on a node-major mesh
the stage boundaries cross the slow links and the rest of the axis stays
for data or tensor parallelism. :func:`options` lists the schedules to plan
(the stage count divides the axis and every stack's layer count), with
:func:`microbatch_counts` (dividing every batch: ``4S`` first for every
schedule, the others for the best two without the budget only) and
:func:`circular_repeats` (circular stages, for the best schedule and
the best that fits),
:func:`stage_mesh` makes the mesh a schedule is planned on, and
:func:`fit_best_first` fits the planned schedules to the budget.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from autoddl_jax._cluster import MeshInfo
from autoddl_jax.pipeline import Call

# Microbatches per stage the planner tries: GPipe needs M >> S for a small
# bubble; past ~8S the bubble is under 1/9 and per-tick latencies grow.
MICROBATCHES_PER_STAGE = (4, 2, 8)  # the first for every schedule
MAX_AXES = 4  # mesh_info's limit: an axis split adds one
# The planner splits an axis for stages by itself only on a mesh of at most
# this many axes. A split of a third gives four, and a rank-r tensor has up
# to (r+2)**4 layouts on four axes, every pair of them costed: the 175B GPT's
# first schedule on (2, 64, 2, 4) was still being planned after 7 minutes and
# 10 GiB, against 2.3 s on (2, 64, 8); a tiny GPT plans in 221 s on (2, 2,
# 2, 2) against 3 s on (2, 2, 2). A forced stage count may still split one.
AUTO_SPLIT_AXES = 2


def stage_axis_name(axis: str, names: Sequence[str]) -> str:
  name = f"{axis}_pp"
  while name in names:
    name += "_"
  return name


def stage_mesh(mesh, mi: MeshInfo, axis: int, stages: int
               ) -> tuple[Mesh | AbstractMesh, str]:
  """(the mesh a schedule of ``stages`` over mesh axis ``axis`` is planned
  on, the name of its stage axis): ``mesh`` itself where the axis has that
  size, else ``mesh`` with the axis split into (stages, the rest)."""
  names, sizes = list(mi.axis_names), list(mi.axis_sizes)
  if sizes[axis] == stages:
    return mesh, names[axis]
  if sizes[axis] % stages:
    raise ValueError(f"{stages} stages do not divide mesh axis "
                     f"{names[axis]!r} of size {sizes[axis]}")
  stage = stage_axis_name(names[axis], names)
  names[axis:axis + 1] = [stage, names[axis]]
  sizes[axis:axis + 1] = [stages, sizes[axis] // stages]
  if isinstance(mesh, Mesh):
    types = list(mesh.axis_types)
    types[axis:axis + 1] = [types[axis]] * 2
    return Mesh(np.asarray(mesh.devices).reshape(sizes), tuple(names),
                axis_types=tuple(types)), stage
  return AbstractMesh(tuple(sizes), tuple(names)), stage


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(stages: int, batches: Sequence[int]) -> list[int]:
  """The microbatch counts tried for ``stages``: for each multiple of
  :data:`MICROBATCHES_PER_STAGE`, the largest count up to it that divides
  every batch (the first is :data:`FIRST_MICROBATCHES` per stage)."""
  g = math.gcd(*batches)
  out = []
  for k in MICROBATCHES_PER_STAGE:
    m = max(d for d in _divisors(g) if d <= k * stages)
    if m not in out:
      out.append(m)
  return out


def options(calls: Sequence[Call], mi: MeshInfo, stages: int | None,
            repeats: int | None = None) -> list[tuple[int, int]]:
  """(mesh axis, stage count) of each schedule to plan: ``stages`` forced,
  or every count > 1 (None); with ``repeats`` forced, only counts of
  which the layers split into that many chunks per stage. A whole axis
  of that size is always tried; an axis is split for stages only where
  its link is not inside one node (the slow link is where stages pay, and
  a third mesh axis makes the search slower), and for a forced count only
  where no whole axis has it. Empty where the step has no
  ``ad.pipeline.scan`` that can be pipelined. Unforced, an axis is split
  only on a mesh of :data:`AUTO_SPLIT_AXES` axes at most."""
  if not calls or any(c.has_ys or c.batch is None for c in calls):
    return []
  layers = math.gcd(*(c.layers for c in calls))
  most = MAX_AXES if stages is not None else AUTO_SPLIT_AXES + 1
  out = []
  for a, n in enumerate(mi.axis_sizes):
    for s in _divisors(n):
      if s < 2 or layers % (s * (repeats or 1)) or (
          stages is not None and s != stages):
        continue
      if s == n or (mi.link[a] != "intra" and len(mi.axis_sizes) < most):
        out.append((a, s))
  if stages is not None and any(mi.axis_sizes[a] == s for a, s in out):
    # Forced: a whole axis of that size is the schedule a user means.
    out = [(a, s) for a, s in out if mi.axis_sizes[a] == s]
  return out


def why_none(calls: Sequence[Call], mi: MeshInfo, stages: int,
             repeats: int | None = None) -> str:
  """Why ``stages`` stages cannot be planned (for the error message)."""
  if not calls:
    return ("the step calls no ad.pipeline.scan (write its layer stack as "
            "ad.pipeline.scan(f, init, xs) instead of jax.lax.scan)")
  if any(c.has_ys for c in calls):
    return "an ad.pipeline.scan's f returns per-layer outputs (ys)"
  if any(c.batch is None for c in calls):
    return ("an ad.pipeline.scan's carry has no batch dim common to all its "
            "leaves at batch_axis")
  layers = sorted({c.layers for c in calls})
  if repeats and any(n % (stages * repeats) for n in layers):
    return (f"the layer counts {layers} do not split into {stages} stages "
            f"of {repeats} circular chunks each")
  return (f"no mesh axis of {dict(zip(mi.axis_names, mi.axis_sizes))} is "
          f"divisible by {stages} while the layer counts {layers} are")


def circular_repeats(layers: int, stages: int, microbatches: int
                     ) -> int | None:
  """The chunks per stage the planner tries circular stages with, on the
  best schedule without the budget and on the stage count of the best
  GPipe one that fits, at each of its microbatch counts
  (``_planner.plan_stages``): the fewest > 1 the layers per stage
  split into (each chunk more adds a round of permutes and halves the
  bubble less). None where there is no such count, or where the
  microbatches are fewer than the stages.

  Tried whether or not GPipe with 2M microbatches was planned: circular
  stages have 2M's bubble at M's microbatch size, so where 2M lost to M
  (its microbatches too small, or not splitting over the data axes:
  the 175B GPT on (16, 16, 4), where GPipe at M=128 takes 14.5 s against
  7.5 s at M=64) they can still win -- 16 stages of 2 chunks at M=64
  take 7.0 s there. Where 2M is past the counts tried, GPipe has no
  schedule with that bubble: on the 175B GPT on (128, 8) under selective
  recomputation 16 stages of 2 chunks at M=128 take 6.351 s against
  GPipe's 6.547 s."""
  more = [v for v in _divisors(layers // stages) if v > 1]
  return more[0] if more and microbatches >= stages else None


def fit_best_first(pending, bar: float, budget, flat, verbose: bool,
                   prune: bool = True) -> float:
  """Fits the schedules ``pending`` ((bound, the planner's _Scouted, or
  None for the plan without stages)) to ``budget`` in the order of their
  bounds; with ``prune``, one whose bound is no faster than ``bar``, the
  fastest plan that fits so far, is not fitted. Returns the new bar."""
  for lower, e in sorted(pending, key=lambda t: t[0]):
    what = "no stages" if e is None else e.what
    if prune and lower >= bar:
      if verbose:
        print(f"[autoddl_jax] pipeline: {what}: not fitted to the budget: "
              f"{lower * 1e3:.6g} ms without it, another plan that fits "
              f"takes {bar * 1e3:.6g} ms", file=sys.stderr, flush=True)
      continue
    if verbose:
      print(f"[autoddl_jax] pipeline: {what}: fitting the budget",
            file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    beat_now = bar if prune else math.inf
    if e is None:
      fitted_s = flat[1](beat_now, bar < math.inf)
    else:
      fitted, e.over, _ = e.variants.fit(budget, beat=beat_now,
                                         others_fit=bar < math.inf)
      e.plan = fitted or e.plan  # None: no variant can fit (over says why)
      e.seconds += time.perf_counter() - t0
      fitted_s = e.plan.cost.time_s if e.over is None else None
    if fitted_s is not None:
      bar = min(bar, fitted_s)
  return bar


def replica_axes(mi: MeshInfo, stage_axis: str, micro_rows: Sequence[int]
                 ) -> tuple[tuple[str, ...], int]:
  """(the axes a stage's weights get a replica dim over, their product):
  the axes across nodes other than the stage axis, where every
  microbatch's rows split over them. Data parallelism there keeps each
  replica's gradient apart over the ticks and sums it once after the loop
  (a partial sum a loop carries is reduced on every trip: once per tick
  over the slow link); inside a node the search chooses freely."""
  axes = tuple(a for a, link in zip(mi.axis_names, mi.link)
               if a != stage_axis and link != "intra")
  count = math.prod(mi.axis_sizes[mi.axis_names.index(a)] for a in axes)
  if count == 1 or any(r % count for r in micro_rows):
    return (), 1
  return axes, count
