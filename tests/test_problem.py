"""The search problem (``_problem``): a plan's cost is its parts, and each
argument's candidates cover the layouts a user can write."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import autoddl_jax as ad
from autoddl_jax import _program
from autoddl_jax._sbp import B_CODE as B
from conftest import TEST_CLUSTER

W = jnp.ones((64, 32))
X = jnp.ones((16, 64))


def _program_of(shape=(2, 4)):
  names = ("data", "model")[:len(shape)]
  return _program.build(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2), (W, X),
                        AbstractMesh(shape, names), TEST_CLUSTER)


def test_evaluate_is_compute_plus_communication_and_the_plan_cost():
  prog = _program_of()
  plan = ad.plan(prog.fn, W, X, mesh=prog.mesh, cluster=TEST_CLUSTER)
  ev = prog.problem.evaluate(list(plan.choice))
  assert ev.time_s == pytest.approx(ev.compute_s + ev.comm_s, rel=1e-12)
  assert ev == plan.cost  # one class: PlanCost
  # The bytes are the distinct reshards' bytes, each once.
  keep = prog.problem.distinct_reshards(np.asarray(plan.choice))
  assert ev.comm_bytes == pytest.approx(float(prog.problem.edge_costs(
      np.asarray(plan.choice), "bytes")[keep].sum()))


@pytest.mark.parametrize("codes", [(B, B), (0, B), (B, 1), (0, 1), (1, 0)])
def test_every_argument_layout_is_a_candidate(codes):
  prog = _program_of()
  op = prog.graph.input_ops[0]  # w: (64, 32), both dims divide 2 and 4
  k = prog.problem.find_candidate(op, codes)
  assert k is not None and prog.problem.cands[op][k][0] == codes


def test_replicated_plan_costs_no_communication():
  prog = _program_of((8,))
  prob = prog.problem
  all_b = [next(k for k, c in enumerate(prob.cands[o.id])
                if all(x == B for slot in c for x in slot))
           for o in prog.graph.ops]
  ev = prob.evaluate(all_b)
  assert ev.comm_s == 0.0 and ev.comm_bytes == 0.0 and ev.compute_s > 0


def test_memoised_candidates_and_signatures_equal_fresh_ones():
  # Both are kept across programs (the planner builds one per schedule and
  # remat variant); a program built with them cleared must be the same.
  from autoddl_jax import _candidates, _rules
  warm = _program_of()
  _candidates.candidates.cache_clear()
  _rules._memoised.cache_clear()
  cold = _program_of()
  assert [op.sigs for op in warm.graph.ops] == [
      op.sigs for op in cold.graph.ops]
  assert warm.problem.cands == cold.problem.cands
  for a, b in zip(warm.problem.slot_idx, cold.problem.slot_idx):
    assert len(a) == len(b) and all(np.array_equal(x, y)
                                    for x, y in zip(a, b))
  np.testing.assert_array_equal(np.concatenate(warm.problem.out_bytes),
                                np.concatenate(cold.problem.out_bytes))
  assert _rules._memoised.cache_info().currsize  # refilled
  assert _candidates.candidates.cache_info().currsize
