"""Fitting a memory budget by the model, and XLA's way of completing a seed.

:func:`fit_budget` finds the cheapest plan whose predicted peak fits a
budget: memory enters the search as a Lagrangian penalty, bisected, with
every seed's completion a candidate too. :func:`propagated` keeps a seed
completed as XLA's sharding propagation completes it where that costs less
than the search's plan. :class:`NoFit` carries why nothing fits.
"""

from __future__ import annotations

import dataclasses
import math

from autoddl_jax import _propagate, _search
from autoddl_jax._cluster import format_bytes, parse_bytes
from autoddl_jax._problem import Problem


class NoFit(Exception):
  """No plan the search found fits the budget by the model (the message is
  :class:`MemoryBudgetError`'s; ``result`` is the smallest plan found)."""

  def __init__(self, message: str, result: _search.SearchResult):
    super().__init__(message)
    self.result = result


def parse_budget(memory_budget) -> float | None:
  """``memory_budget`` in bytes; None for ``float("inf")`` (no constraint)
  and for None (the cluster's default, resolved once the cluster is)."""
  if memory_budget is None:
    return None
  if isinstance(memory_budget, float) and memory_budget == math.inf:
    return None
  return parse_bytes(memory_budget, "memory_budget")


def propagated(prob: Problem, seeds, res: _search.SearchResult
                ) -> _search.SearchResult:
  """The search's result, or a seed completed the way XLA propagates it
  (:func:`_propagate.propagate`, as it is or polished by plan cost) where
  that costs less by the plan's cost (:func:`_search.score`). The pairwise
  objective the search's moves minimise charges every small all-reduce its
  own latency, where the plan's cost combines them: on a ResNet with
  BatchNorm under data parallelism (dozens of tiny scale/bias gradients)
  the search's own plan and even the exact optimum of the pairwise
  objective cost more than the propagated DP plan (compare.py
  --exact-only measures it)."""
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


def fit_budget(prob: Problem, seeds, res, budget: float, progress):
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
  r = _search.search(prob, seeds, mem_weight=scale,
                                 progress=progress, polish=polish)
  if consider(r):
    hi = scale
  else:
    # Before bisecting for the lightest penalty that fits, whether the
    # heaviest fits at all: where none does (a model whose activations
    # cannot fit without remat), one more search says so.
    lo, top = scale, scale * 4.0 ** 11
    r = _search.search(prob, seeds, mem_weight=top,
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
      r = _search.search(prob, seeds, mem_weight=mid,
                                     progress=progress, polish=polish)
      if consider(r):
        hi = mid
      else:
        lo = mid
  if not fits:
    peak, r = smallest
    big = ", ".join(f"{name} {shape} {format_bytes(b)}"
                    for b, name, shape in prob.largest_tensors(r.choice))
    raise NoFit(
        f"no plan fits memory_budget={format_bytes(budget)} per device: the "
        f"smallest plan found needs {format_bytes(peak)}. Largest tensors per "
        f"device in it: {big}. Use more devices, a smaller batch, remat, or a "
        "larger budget.", r)
  time_s, _, best_fit = min(fits, key=lambda f: f[:2])
  best_fit.objective = time_s
  return best_fit.choice, best_fit
