"""Coordinate descent against the exact optimum, determinism, repetition."""


import pytest
import jax

import autoddl_jax as ad
from autoddl_jax import _search, models
from conftest import TEST_CLUSTER
from helpers import assert_tree_close, build, make_mesh, rel_err


@pytest.mark.parametrize("model,shape", [
    ("mlp", (8,)), ("mlp", (2, 4)), ("mlp", (4, 2)), ("moe", (8,)),
    ("moe", (2, 4)), ("vgg", (2, 4)), ("gpt_scan", (8,)),
    ("gpt_unrolled", (2, 4))])
def test_coordinate_descent_is_within_2_percent_of_the_optimum(model, shape):
  ex = build(model, abstract=True)
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh(shape),
                 cluster=TEST_CLUSTER)
  best = _search.exact(plan.problem, time_limit=120)
  assert best is not None, "exact solver did not finish"
  assert best.objective <= plan.cost.time_s * (1 + 1e-9)
  assert plan.cost.time_s <= best.objective * 1.02, (plan.cost.time_s,
                                                     best.objective)


def test_exact_solver_respects_pins():
  ex = build("mlp", abstract=True)
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((8,)),
                 cluster=TEST_CLUSTER)
  prob = plan.problem
  o = plan.graph.input_ops[0]
  k = (plan.choice[o] + 1) % len(prob.cands[o])
  res = _search.exact(prob, pins={o: k})
  assert res.choice[o] == k
  assert res.objective >= _search.exact(prob).objective - 1e-15


def test_same_inputs_same_plan_bit_for_bit():
  ex = build("gpt_scan", abstract=True)
  mesh = make_mesh((2, 4))
  a = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
  b = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
  assert a.choice == b.choice
  assert a.in_specs == b.in_specs and a.cost == b.cost


def test_scanned_layers_are_decided_once():
  def plan_for(n):
    ex = models.gpt(models.GptConfig(n_layers=n), abstract=True)
    return ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)),
                   cluster=TEST_CLUSTER)

  a, b = plan_for(2), plan_for(16)
  assert len(a.problem.groups) == len(b.problem.groups)


def test_unrolled_identical_blocks_are_decided_once_and_stay_exact():
  def ex_for(n):
    return models.gpt(models.GptConfig(n_layers=n, scan=False),
                      return_grads=True)

  mesh = make_mesh((2, 4))
  counts, plans = [], []
  for n in (4, 6):
    ex = ex_for(n)
    plans.append((ex, ad.plan(ex.step, *ex.args, mesh=mesh,
                              cluster=TEST_CLUSTER)))
    counts.append(len(plans[-1][1].problem.groups))
  # Half again as many blocks adds (almost) no decisions.
  assert counts[1] - counts[0] < 0.05 * counts[0], counts
  ex, plan = plans[0]
  ref = jax.jit(ex.step)(*ex.args)
  out = plan.jit()(*ex.args)
  assert rel_err(out[2], ref[2]) <= 1e-5
  assert_tree_close(out[3], ref[3], 1e-5, "grad")


def test_memory_budget_rules_out_replication():
  ex = build("mlp", abstract=True)
  mesh = make_mesh((8,))
  free = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
  dp = ad.hand_plan(ex.step, *ex.args, mesh=mesh, in_shardings=None,
                    cluster=TEST_CLUSTER)
  budget = 0.6 * dp.cost.memory_bytes
  tight = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                  memory_budget=budget)
  assert tight.cost.memory_bytes <= budget
  assert tight.cost.time_s >= free.cost.time_s * (1 - 1e-9)


def test_impossible_memory_budget_names_the_budget_and_the_tensors():
  ex = build("mlp", abstract=True)
  with pytest.raises(ad.MemoryBudgetError,
                     match=r"memory_budget=1 KiB.*smallest plan found needs"
                           r".*Largest tensors"):
    ad.plan(ex.step, *ex.args, mesh=make_mesh((8,)), cluster=TEST_CLUSTER,
            memory_budget=1024)
