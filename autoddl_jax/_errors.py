"""autoddl_jax's errors: one base class, a subclass per case.

``except ad.AutoDDLError`` catches every error this package raises on
purpose. Each subclass also derives from the builtin it used to be
(``ValueError`` for bad input, ``RuntimeError`` for a failed run), so code
written against those keeps working.
"""

from __future__ import annotations


class AutoDDLError(Exception):
  """Base class of the errors autoddl_jax raises."""


class MemoryBudgetError(AutoDDLError, ValueError):
  """No plan found fits the per-device memory budget."""


class PlanFileError(AutoDDLError, ValueError):
  """A plan file that cannot be used: unreadable, or made for another
  program, mesh, cluster or format version."""


class DistributedError(AutoDDLError, RuntimeError):
  """The processes of a job could not start together, or disagree."""


class RuleError(AutoDDLError, RuntimeError):
  """A signature rule failed on an equation: a bug in autoddl_jax (a
  primitive with no rule is not one: it runs replicated, with an
  ``UnsupportedPrimitiveWarning``). The message names the primitive and
  its operand types."""
