"""Signatures XLA can do for free, the rules must have: for one equation of
each structural primitive the zoo produces (and one elementwise op of each
rule family), every S/B placement of its operands on a 1-axis mesh of 4 is
compiled alone; where XLA emits no collective, the rules must have that
signature. ``benchmarks/completeness.py`` runs every primitive, several
equations each."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
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


def _eqn_of(fn, *args, prim):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return next(e for e in jaxpr.eqns if e.primitive.name == prim)


@pytest.mark.parametrize("prim", ["gather", "scatter"])
def test_a_vmapped_slot_read_and_write_split_their_whole_dims(prim):
  # A per-stage ring buffer (a pipeline's residuals) is read and written
  # at a slot that differs per stage: vmapped dynamic_slice and
  # dynamic_update_slice, whose gather/scatter name every dim in the index
  # map. A dim taken whole can only start at 0 (the index is clamped), and
  # XLA splits it with no collective; the rules must have that (they had
  # only the batch dim, so every read of a stage's ring was whole).
  ring = jnp.zeros((4, 3, 8, 4))
  slot = jnp.array([0, 2, 1, 1])
  upd = jnp.zeros((4, 1, 8, 4))
  if prim == "gather":
    fn = jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, 1, 0))
    eqn = _eqn_of(fn, ring, slot, prim=prim)
  else:
    fn = jax.vmap(lambda r, i, u: jax.lax.dynamic_update_slice_in_dim(
        r, u, i, 0))
    eqn = _eqn_of(fn, ring, slot, upd, prim=prim)
  rows = completeness.check_equation(eqn)
  assert rows and not any("error" in r for r in rows), rows
  # XLA ran the whole dims (2 and 3 of the ring) split with no collective,
  assert any(r["local"] and r["combo"][0] in (2, 3) for r in rows), rows
  # and the rules have every signature it ran locally.
  assert not completeness.missing(rows), completeness.missing(rows)


def test_a_fill_or_drop_slice_keeps_its_indexed_dims_whole():
  # Under FILL_OR_DROP a nonzero start fills the slice rather than
  # clamping, so a dim the index names is not split even when whole.
  t = jnp.zeros((6, 8))
  idx = jnp.array([[1, 0]])
  dn = jax.lax.GatherDimensionNumbers(offset_dims=(1, 2),
                                      collapsed_slice_dims=(),
                                      start_index_map=(0, 1))
  fn = lambda t, i: jax.lax.gather(  # noqa: E731
      t, i, dn, (2, 8), mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
  eqn = _eqn_of(fn, t, idx, prim="gather")
  sigs = _rules.signatures("gather", [completeness.to_aval(v.aval)
                                      for v in eqn.invars],
                           [completeness.to_aval(v.aval)
                            for v in eqn.outvars], eqn.params)
  assert not any(s[0][0] == 1 for s in sigs), sigs
