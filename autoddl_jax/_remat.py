"""Rematerialisation of scanned layer stacks as a planned choice.

A train step is traced after autodiff: its jaxpr already holds the backward
pass, and what the forward keeps for it (the stacked residuals a scan's
forward emits) cannot be changed on that jaxpr without differentiating
again. So a remat choice is a *trace* of the step: while the step is traced
under :func:`scan_policy`, every ``jax.lax.scan`` the user's code calls
(``lax.scan`` itself, ``flax.linen.scan``, ``nnx.scan``) runs its body under
``jax.checkpoint`` with that policy. The jaxpr then holds the recomputation
and the smaller residuals, so the cost model counts the extra FLOPs and the
memory saved from the program itself, and the lowering (which interprets
that jaxpr) keeps the checkpoint. A step whose jaxpr already holds a
``jax.checkpoint`` is planned as given: the user chose.

Scans are matched to a policy by the order the step calls them in
(``policy`` may be one name for all, or a tuple with one per call).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import jax
import jax.extend
from jax import lax

# Policies by name, cheapest in FLOPs first (and largest in memory).
POLICIES: dict[str, object] = {
    "none": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
NONE = "none"
AUTO = ("dots_saveable", "nothing_saveable")  # what plan(remat=None) tries

_state = threading.local()
_original_scan = lax.scan


def _policy_for(index: int) -> str:
  policy = _state.policy
  if isinstance(policy, str):
    return policy
  return policy[index] if index < len(policy) else NONE


def _scan(f, init, xs=None, length=None, **kwargs):
  index = _state.calls
  _state.calls += 1
  name = _policy_for(index)
  if name != NONE:
    f = jax.checkpoint(f, policy=POLICIES[name], prevent_cse=False)
  return _original_scan(f, init, xs, length, **kwargs)


def validate(policy: str | Sequence[str]) -> str | tuple[str, ...]:
  names = (policy,) if isinstance(policy, str) else tuple(policy)
  for n in names:
    if n not in POLICIES:
      raise ValueError(f"remat policy {n!r} is not one of "
                       f"{', '.join(POLICIES)}")
  return policy if isinstance(policy, str) else names


@contextlib.contextmanager
def scan_policy(policy: str | Sequence[str]) -> Iterator[None]:
  """Trace with every ``jax.lax.scan`` call's body under ``policy``."""
  policy = validate(policy)
  if policy == NONE:
    yield
    return
  if getattr(_state, "policy", None) is not None:
    raise RuntimeError("scan_policy does not nest")
  # jax and flax cache traced bodies by function: a body traced before
  # (without the checkpoint) would be reused, and one traced here would be
  # reused after. Clearing the caches costs a re-trace (and recompiles of
  # jitted functions called later), once per planned variant.
  jax.clear_caches()
  _state.policy, _state.calls = policy, 0
  lax.scan = _scan
  try:
    yield
  finally:
    lax.scan = _original_scan
    _state.policy = None
    jax.clear_caches()


def _holds(jaxpr, names: tuple[str, ...]) -> bool:
  """Whether the jaxpr, at any depth, holds an equation of one of ``names``."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      return True
    if any(_holds(sub, names)
           for sub in jax.extend.core.jaxprs_in_params(eqn.params)):
      return True
  return False


def has_checkpoint(jaxpr) -> bool:
  """Whether the jaxpr, at any depth, holds a ``jax.checkpoint``."""
  return _holds(jaxpr, ("checkpoint", "remat2"))


def has_scan(jaxpr) -> bool:
  return _holds(jaxpr, ("scan",))
