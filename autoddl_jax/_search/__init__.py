"""The AutoDDL search: coordinate descent over SBP signatures, made to find
the optimum of its pairwise model on the graphs training steps make.

Phases, per call of :func:`search`:

1. **Model and eliminations** (:mod:`.model`): the problem as a pairwise
   model over coordinates; nodes with one or two neighbours are folded
   away exactly, leaving a small core (chains like each parameter's
   optimizer update disappear entirely). Folding shared by every start is
   done once.
2. **Message passing** (:mod:`.trws`): from each seed (DP, FSDP, Megatron,
   the user's placements, ... pinned on the parameters) and from no seed,
   the core is labelled by over-relaxed TRW-S.
3. **Local moves** (:mod:`.local`): each labelling is improved by
   coordinate descent and exact DP over spanning trees; a seeded labelling
   is then freed of its seed and improved again; the best
   ``finalists`` get block moves.
4. **Choosing**: the folded nodes are unfolded; candidates are compared by
   the plan's cost (:func:`score`, which shares a reshard among consumers
   and combines latencies, unlike the pairwise objective); the winner is
   refined on the untied problem and polished on the plan's cost
   (:func:`polish_by_score`). Other starts' different plans are kept as
   ``alternatives`` (selection compiles some).

Everything is deterministic: ties keep the current value, then the lowest
index. :func:`exact` (:mod:`.exact`) solves the same pairwise objective as a
MILP, to measure the search against.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from autoddl_jax._problem import Problem
from autoddl_jax._search.exact import exact
from autoddl_jax._search.local import Core, polish_by_score
from autoddl_jax._search.model import EPS, Mrf, Reduced, eliminate
from autoddl_jax._search.model import expand, groups_of, objective, score
from autoddl_jax._search.model import unfold
from autoddl_jax._search.result import SearchResult
from autoddl_jax._search.trws import Passing, trws

__all__ = ["DEFAULT", "FREE", "Mrf", "Passing", "SearchOptions",
           "SearchResult", "complete", "eliminate", "exact", "objective",
           "polish_by_score", "score", "search", "seeds_first", "trws",
           "unfold"]

FREE = "unseeded"  # the name of the search from no seed at all
RELAX = 1.5  # TRW-S's tree weights over-relaxed towards belief propagation


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """How hard :func:`search` works. ``seeded``/``unseeded``: message
  passing from a seed (the parameters pinned: a few iterations suffice) and
  from none; ``seed_effort``/``final_effort``: the local moves' effort
  after each start and on the ``finalists`` best (:meth:`Core.improve`)."""

  seeded: Passing = Passing(RELAX, 100, 3)
  unseeded: Passing = Passing(RELAX, 40, 10)
  seed_effort: int = 0
  final_effort: int = 1
  finalists: int = 2


DEFAULT = SearchOptions()


def _solve(red: Reduced, start: np.ndarray | Passing,
           effort: int, progress=None, stats: dict | None = None):
  """One search on a reduced problem: label the core by message passing
  (when ``start`` is a :class:`Passing`; ``stats`` as for :func:`trws`) or
  start from the labelling ``start``, improve it with local moves of the
  given ``effort`` (see :meth:`Core.improve`), unfold. Returns group
  choices and sweeps."""
  search = Core(red.mrf, red.core)
  if isinstance(start, Passing):
    choice = trws(red.mrf, red.core, start.max_iters, start.patience,
                  start.relax, stats)
  else:
    choice = start.copy()
  sweeps = search.improve(choice, progress=progress, effort=effort)
  return red.unfold(choice), sweeps


def search(prob: Problem, seeds: Mapping[str, Mapping[int, int]], *,
           mem_weight: float = 0.0,
           progress: Callable[[str, int, float], None] | None = None,
           polish: Problem | None = None,
           options: SearchOptions = DEFAULT,
           fixed_ops: Sequence[int] = ()) -> SearchResult:
  """Searches from each seed and from none; returns the best plan.

  ``seeds`` maps a seed name to {op id: candidate} for the ops it pins (the
  program's inputs, usually). Each seed's completion with its pins held is
  searched, then freed and searched again; the best ``options.finalists``
  get block moves; every result is compared by :func:`score` (plus
  ``mem_weight`` times the bytes of every tensor: the memory penalty of
  budget fitting). ``polish`` is the same problem with finer coordinates
  (repeated blocks untied): the winner is refined on it. Ops in
  ``fixed_ops`` keep their seed value throughout: that is
  :func:`complete`, how a hand plan or a seed is scored.
  """
  t0 = time.perf_counter()
  base = Mrf(prob, mem_weight)
  results: list[tuple[float, int, str, np.ndarray, int]] = []
  hard = {int(prob.group_of[o]): seeds_first(seeds)[o] for o in fixed_ops}
  scoring = bool(seeds) and all(set(p) <= set(fixed_ops)
                                for p in seeds.values())
  gseeds = {name: {**hard, **{int(prob.group_of[o]): k
                              for o, k in pins.items()}}
            for name, pins in seeds.items()}
  # Fold once what every search folds; seeded nodes stay so seeds can pin.
  shared = Reduced.of(base, hard,
                       keep={g for p in gseeds.values() for g in p})
  free = shared.pin({})
  starts = [(name, gpins, options.seeded) for name, gpins in gseeds.items()]
  best_iteration: dict[str, int] = {}
  if not scoring:
    # Message passing needs no seed: the unpinned problem is one more start,
    # the one that most often wins, so it gets more patience.
    starts.append((FREE, {}, options.unseeded))
  pinned = []  # each seed's completion with its boundary held
  for n, (name, gpins, passing) in enumerate(starts):
    cb = None if progress is None else (
        lambda s, c, nm=name: progress(nm, s, c))
    # Each seed's boundary gets the search a hand plan gets (so a plan is
    # never worse than scoring its own seeds), then is freed.
    stats: dict[str, int] = {}
    gchoice, sweeps = _solve(shared.pin(gpins) if gpins else free, passing,
                             options.seed_effort, cb, stats)
    best_iteration[name] = stats["best_iteration"]
    pinned.append((name, gchoice, sweeps))
    if not scoring and gpins:
      more, s2 = _solve(free, gchoice, 0, cb)
      sweeps += s2
      if objective(prob, expand(prob, more), mem_weight) <= objective(
          prob, expand(prob, gchoice), mem_weight):
        gchoice = more
    results.append((objective(prob, expand(prob, gchoice), mem_weight), n,
                    name, gchoice, sweeps))
  # The best ``finalists`` get the expensive moves; then every start's plan
  # and the finalists' are compared by what the plan costs (:func:`score`).
  cands = pinned + [(name, gchoice, sweeps)
                    for _, _, name, gchoice, sweeps in results]
  for obj, _, name, gchoice, sweeps in sorted(results,
                                              key=lambda r: r[:2])[:options.finalists]:
    cb = None if progress is None else (
        lambda s, c, nm=name: progress(nm, s, c))
    if scoring:
      continue  # a hand plan: its one search is done
    final, s2 = _solve(free, gchoice, options.final_effort, cb)
    if objective(prob, expand(prob, final), mem_weight) <= obj:
      cands.append((name, final, sweeps + s2))
  best_obj, best = np.inf, None
  for name, gchoice, sweeps in cands:
    sc = score(prob, expand(prob, gchoice), mem_weight)
    if best is None or sc < best_obj - EPS * max(1.0, abs(best_obj)):
      best_obj, best = sc, (name, gchoice, sweeps)
  name, gchoice, sweeps = best
  choice = expand(prob, gchoice)
  if polish is not None:
    phard = {int(polish.group_of[o]): k for o, k in
             ((o, seeds_first(seeds)[o]) for o in fixed_ops)}
    pch, s3 = _solve(Reduced.of(Mrf(polish, mem_weight), phard),
                     groups_of(polish, choice), 0)
    sweeps += s3
    alt = expand(polish, pch)
    alt_score = score(prob, alt, mem_weight)
    if alt_score <= best_obj:
      choice, best_obj = alt, alt_score
  if not scoring:
    alt = polish_by_score(prob, choice, mem_weight)
    if score(prob, alt, mem_weight) < best_obj:
      choice = alt
  alternatives: dict[str, list[int]] = {}
  seen = {tuple(int(c) for c in choice)}
  for _, _, start, gchoice, _ in sorted(results, key=lambda r: r[:2]):
    alt = tuple(int(c) for c in expand(prob, gchoice))
    if alt not in seen:
      seen.add(alt)
      alternatives[start] = list(alt)
  return SearchResult([int(c) for c in choice],
                      objective(prob, choice, mem_weight), name, sweeps,
                      time.perf_counter() - t0, best_iteration, alternatives)


def complete(prob: Problem, pins: Mapping[int, int],
             name: str = "hand") -> SearchResult:
  """The cheapest completion of ``pins`` {op id: candidate} held fixed: how a
  hand plan or a seed is scored."""
  return search(prob, {name: pins}, fixed_ops=list(pins))


def seeds_first(seeds: Mapping[str, Mapping[int, int]]) -> Mapping[int, int]:
  """The pins of the first seed (where fixed ops take their values)."""
  return next(iter(seeds.values()), {})
