"""Signatures XLA can do for free, the rules must have: for one equation of
each structural primitive the zoo produces (and one elementwise op of each
rule family), every S/B placement of its operands on a 1-axis mesh of 4 is
compiled alone; where XLA emits no collective, the rules must have that
signature. ``benchmarks/completeness.py`` runs every primitive, several
equations each."""

import functools
import os
import sys

import pytest

from autoddl_jax import _rules

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import completeness  # noqa: E402

MODELS = ("llama", "vit", "resnet", "moe")
# Elementwise ops share a rule per family: one of each is enough here.
SAME_RULE = (set(_rules.UNARY) | set(_rules.BINARY)) - {"max", "integer_pow"}


@functools.lru_cache(maxsize=None)
def _equations():
  eqns = completeness.zoo_equations(MODELS, per_prim=1)
  return {p: es[0] for p, es in eqns.items() if p not in SAME_RULE}


PRIMS = ["add", "mul", "select_n", "dot_general", "conv_general_dilated",
         "gather", "scatter-add", "reduce_sum", "reduce_max", "reshape",
         "transpose", "broadcast_in_dim", "concatenate", "split", "slice",
         "pad", "squeeze", "top_k", "convert_element_type", "max",
         "integer_pow", "cumsum", "iota", "rev"]


def test_the_sample_covers_the_zoo():
  have = set(_equations())
  assert {p for p in PRIMS if p not in ("cumsum", "rev")} <= have, (
      sorted(set(PRIMS) - have))


@pytest.mark.parametrize("prim", PRIMS)
def test_what_xla_runs_locally_the_rules_have(prim):
  eqn = _equations().get(prim)
  if eqn is None:
    pytest.skip(f"{prim} not in the tiny zoo programs of {MODELS}")
  rows = completeness.check_equation(eqn)
  assert rows and not any("error" in r for r in rows), rows
  assert any(r["local"] for r in rows)
  assert not completeness.missing(rows), completeness.missing(rows)


def test_an_operand_that_broadcasts_a_size_1_dim_stays_whole():
  # RoPE's x * cos[None, :, None, :]: lax's mul takes the (1, s, 1, d)
  # operand as it is, and XLA runs x split on the batch with cos whole. A
  # rule that asked for cos split on its size-1 dim has no valid layout for
  # it, so the planner used to move x off the batch split (an all-to-all
  # before and after every RoPE, in data parallelism).
  import jax
  import jax.numpy as jnp
  jx = jax.make_jaxpr(lambda x, c: x * c)(jnp.zeros((8, 16, 4, 8)),
                                          jnp.zeros((1, 16, 1, 8)))
  rows = completeness.check_equation(jx.jaxpr.eqns[0])
  assert any(r["local"] and r["combo"] == (0, -1) for r in rows), rows
  assert not completeness.missing(rows), completeness.missing(rows)
