"""Model proposes, compiler disposes: choosing a plan by its compiled program.

The cost model ranks plans well but not perfectly (benchmarks/fidelity.py),
and XLA may run a plan otherwise than planned. When the mesh is concrete,
:func:`autoddl_jax.plan` therefore compiles a few candidates -- the search's
plan lowered with all its pins and with its boundary only, the search's best
plans from other starts, and the textbook plans (DP, FSDP, Megatron, FSDP+TP)
as a user writes them (``jax.jit`` in/out shardings, XLA propagating the
rest) -- and keeps the one whose compiled program is fastest on the plan's
:class:`~autoddl_jax.Cluster` (:class:`~autoddl_jax._verify.CompiledScore`:
XLA's FLOPs at the sustained rate plus its emitted collectives on the links
of the groups they span), among those whose ``memory_analysis`` peak fits the
memory budget. The compile log is read too: a candidate for which XLA logs
"Involuntary full rematerialization" (it replicated a whole tensor to get
from one sharding to the next) ranks after every candidate without.

Compiling takes ``jax.ShapeDtypeStruct`` arguments: nothing is allocated.
Candidates are compiled in order of promise until ``time_limit`` seconds have
passed (the first is always compiled); in a multi-process run every process
compiles them all, so that each one keeps the same plan whatever its speed.
On the CPU backend, candidates compile at LLVM optimisation level 0, which
halves the time and leaves the partitioned HLO -- its collectives, FLOPs and
buffer assignment -- as it is (measured on the zoo: identical programs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autoddl_jax._cluster import format_bytes
from autoddl_jax._verify import CompiledScore, compile_log, compile_plan

LOWERINGS = ("pinned", "boundary")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan that selection compiled (or meant to).

  ``name`` says where the plan came from: ``"search"`` (the search's best),
  ``"search:<start>"`` (the best plan of another start), or a textbook plan
  (``"dp"``, ``"fsdp"``, ``"megatron"``, ``"fsdp_tp"``). ``lowering`` is
  ``"pinned"`` (every layout of the plan pinned, partial sums run on local
  blocks) or ``"boundary"`` (only the jit boundary: XLA propagates the
  rest). ``compiled`` is None when it was not compiled: ``skipped`` says why
  (out of time) and ``error`` holds a failed compile's message. A candidate
  that is the same program as an earlier one is not compiled again but
  carries that one's score (``skipped`` names it).
  """

  name: str
  lowering: str
  predicted_s: float
  predicted_memory: float
  compiled: CompiledScore | None = None
  compile_s: float = 0.0
  fits: bool | None = None  # memory_analysis peak within the budget
  skipped: str | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Selection:
  """How a plan was chosen: ``mode`` is ``"compiled"`` (by the compiled
  program) or ``"model"`` (by the cost model alone; ``reason`` says why),
  ``winner`` indexes ``candidates`` (None when the model chose)."""

  mode: str
  reason: str
  candidates: tuple[Candidate, ...] = ()
  winner: int | None = None
  compile_s: float = 0.0  # compiling the candidates, in all

  def table(self) -> list[tuple[str, ...]]:
    rows = [("candidate", "lowering", "predicted", "compiled", "comm",
             "XLA peak", "compile", "")]
    for i, c in enumerate(self.candidates):
      s = c.compiled
      note = ("<- chosen" if i == self.winner else
              c.skipped or (f"failed: {c.error[:60]}" if c.error else
                            ("over budget" if c.fits is False else "")))
      if s is not None and s.remat_warnings:
        note = f"{note} (XLA: {s.remat_warnings} full remat)".strip()
      rows.append((
          c.name, c.lowering, f"{c.predicted_s * 1e3:.4g} ms",
          "" if s is None else f"{s.time_s * 1e3:.4g} ms",
          "" if s is None else f"{s.comm_s * 1e3:.4g} ms",
          "" if s is None or s.memory_bytes is None else
          format_bytes(s.memory_bytes),
          f"{c.compile_s:.1f} s" if (s is not None and not c.skipped)
          or c.error else "",
          note))
    return rows


def compiler_options(mesh) -> dict[str, Any] | None:
  """Faster compiles where they change nothing that is scored: on CPU, LLVM
  at level 0 (the HLO passes -- partitioning, collectives, buffer
  assignment -- do not read it)."""
  platforms = {d.platform for d in mesh.devices.flat}
  return {"xla_backend_optimization_level": 0} if platforms == {"cpu"} \
      else None


def select(candidates: Sequence[tuple[str, str, Any]], *,
           budget: float | None, time_limit: float,
           key: Callable[[Any, str], Any],
           progress: Callable[[str], None] | None = None,
           prior: Sequence[tuple[Any, Candidate]] = ()
           ) -> tuple[int | None, Selection]:
  """Compiles ``candidates`` [(name, lowering, Plan)] in order and returns
  (index of the best, the :class:`Selection`).

  ``key(plan, lowering)`` names the program a candidate compiles to: a
  candidate whose key an earlier one had is the same program and is not
  compiled again. The best is the fastest compiled candidate whose peak fits
  ``budget``; if none fits, the one with the smallest peak. None if nothing
  compiled. ``prior`` [(key, Candidate)] are candidates an earlier call
  compiled: they come first and compete as they are.
  """
  t0 = time.perf_counter()
  everyone = jax.process_count() > 1  # same candidates on every process
  seen: dict[Any, int] = {k: i for i, (k, _) in enumerate(prior)}
  out: list[Candidate] = [c for _, c in prior]
  for name, lowering, plan in candidates:
    c = Candidate(name, lowering, plan.cost.time_s, plan.cost.memory_bytes)
    k = key(plan, lowering)
    if k in seen:
      # The same program: not compiled again, but scored as it was (a
      # textbook plan the search's own boundary equals is still there to
      # be compared with).
      first = out[seen[k]]
      out.append(dataclasses.replace(
          c, compiled=first.compiled, fits=first.fits,
          skipped=f"same program as {first.name} ({first.lowering})"))
      continue
    seen[k] = len(out)
    if len(out) > len(prior) and not everyone and \
        time.perf_counter() - t0 > time_limit:
      out.append(dataclasses.replace(
          c, skipped=f"not compiled: select_s={time_limit:g} spent"))
      continue
    t1 = time.perf_counter()
    try:
      with compile_log() as log:
        compiled, mesh = compile_plan(plan, lowering == "pinned",
                                      compiler_options(plan.mesh))
      score = CompiledScore.of(compiled, mesh, plan.mesh_info, plan.cluster,
                               log="".join(log))
    except Exception as e:  # noqa: BLE001 (reported; the others still run)
      out.append(dataclasses.replace(
          c, compile_s=time.perf_counter() - t1,
          error=f"{type(e).__name__}: {e}"))
      continue
    fits = None if budget is None or score.memory_bytes is None else \
        score.memory_bytes <= budget
    out.append(dataclasses.replace(
        c, compiled=score, compile_s=time.perf_counter() - t1,
        fits=fits))
    if progress is not None:
      progress(f"compiled {name} ({lowering}): {score.time_s * 1e3:.4g} ms, "
               f"peak {score.memory_bytes or 0:.4g} B, "
               f"{time.perf_counter() - t1:.1f} s")
  done = [i for i, c in enumerate(out) if c.compiled is not None]
  fit = [i for i in done if out[i].fits is not False]
  if fit:
    # A program XLA had to rematerialise in full is not the plan it was
    # given (a whole tensor replicated somewhere, for a moment): it comes
    # after every program without, whatever its score. Ties go to the
    # earlier candidate (the search's plan comes first).
    win = min(fit, key=lambda i: (bool(out[i].compiled.remat_warnings),
                                  out[i].compiled.time_s, i))
    reason = "fastest compiled program" + (
        " within the memory budget" if budget is not None else "")
    if out[win].compiled.remat_warnings:
      reason += " (every candidate made XLA rematerialise a tensor in full)"
    elif any(out[i].compiled.remat_warnings and
             out[i].compiled.time_s < out[win].compiled.time_s for i in fit):
      reason += " without a full rematerialisation in XLA's log"
  elif done:
    win = min(done, key=lambda i: (out[i].compiled.memory_bytes or math.inf,
                                   i))
    reason = "no candidate fits the memory budget by memory_analysis: " \
             "the smallest"
  else:
    win, reason = None, "no candidate compiled: the cost model's plan"
  return win, Selection("compiled" if win is not None else "model", reason,
                        tuple(out), win, time.perf_counter() - t0)
