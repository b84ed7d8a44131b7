"""Planning with fewer garbage collections.

Planning allocates millions of small container objects that live until the
plan is made (jaxpr equations and tracers, candidate tuples, state
spaces). CPython's cyclic collector runs every 700 net allocations, keeps
promoting them, and its full collections rescan an ever larger heap: on
the 175B GPT's pipelined planning (``benchmarks/pipeline_175b.py``) that
was about 3.5 s of 30 s, in 4,400 collections. While a plan is being made
the collector runs about 70 times less often -- it still runs, so cycles
are reclaimed, and the peak memory of that planning is unchanged -- and the
thresholds the process had are restored afterwards.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# gc.set_threshold while planning: generation 0 collected every 50,000 net
# allocations instead of 700, the older generations a little less often.
THRESHOLD = (50_000, 20, 20)

_lock = threading.Lock()
_depth = 0  # planning calls in progress (they nest: plan -> hand_plan ...)
_saved: tuple[int, ...] | None = None


def fewer_collections(fn: F) -> F:
  """Runs ``fn`` with the collector's thresholds raised to
  :data:`THRESHOLD` (none lowered; a process that turned automatic
  collection off, ``gc.set_threshold(0)``, keeps it off)."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    _enter()
    try:
      return fn(*args, **kwargs)
    finally:
      _exit()

  return wrapped  # type: ignore[return-value]


def _enter() -> None:
  global _depth, _saved
  with _lock:
    if _depth == 0:
      _saved = gc.get_threshold()
      if _saved[0] > 0:
        gc.set_threshold(*(max(a, b) for a, b in zip(_saved, THRESHOLD)))
    _depth += 1


def _exit() -> None:
  global _depth
  with _lock:
    _depth -= 1
    if _depth == 0 and _saved is not None:
      gc.set_threshold(*_saved)
