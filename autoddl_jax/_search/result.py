"""What a search returns."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SearchResult:
  choice: list[int]
  objective: float
  seed: str
  sweeps: int
  search_s: float
  # Per start: the message-passing iteration that found its labelling.
  best_iteration: dict[str, int] = dataclasses.field(default_factory=dict)
  # Per start, best first: its own plan, where it differs from ``choice``
  # (the candidates plan selection compiles beside the winner).
  alternatives: dict[str, list[int]] = dataclasses.field(default_factory=dict)
