"""The public API: shapes of results, non-array leaves, and every error."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import autoddl_jax as ad
from conftest import TEST_CLUSTER
from helpers import build, make_mesh, rel_err


def _mlp_step(w, x):
  return jnp.tanh(x @ w).sum()


W = jnp.ones((16, 32)) / 16
X = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100


def test_public_face_is_small():
  assert set(ad.__all__) == {
      "AutoDDLError", "AutoShard", "Candidate", "Cluster", "Collective",
      "CompiledScore", "DistributedError", "H100_NODE", "MemoryBudgetError",
      "NdSbp", "Plan", "PlanCost", "PlanFileError", "RuleError", "Selection",
      "UnsupportedPrimitiveWarning", "Verification", "auto_shard",
      "checkpoint", "collectives", "cost_of", "distributed", "hand_plan",
      "load_plan", "pipeline", "plan", "sbp"}
  # The partial-sum placement does not shadow ``P = PartitionSpec``.
  assert not hasattr(ad, "P") and repr(ad.sbp.P) == "P"
  assert set(ad.sbp.__all__) == {"B", "NdSbp", "P", "S", "Sbp"}


def test_a_plan_is_a_frozen_value():
  plan = ad.plan(lambda w, x: jnp.sum(jnp.tanh(x @ w)), W, X,
                 mesh=AbstractMesh((8,), ("data",)))
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.memory_budget = 1.0
  again = plan.replace(memory_budget=1e9)
  assert again.memory_budget == 1e9 and plan.memory_budget != 1e9
  assert again.choice == plan.choice and again.program is plan.program
  assert again.cost == plan.cost


def test_a_rule_naming_a_dim_its_operand_lacks_is_an_internal_error(
    monkeypatch):
  # Rules are values checked where they are applied: a signature that splits
  # dim 5 of a rank-2 value is a rule bug, not a plan.
  from autoddl_jax import _rules
  bad = _rules.Rule(lambda ins, outs, params: [((-1,), (-1,)), ((5,), (5,))])
  monkeypatch.setitem(_rules.RULES, "tanh", bad)
  with pytest.raises(ad.RuleError, match=r"splits dim 5 of a rank-2 value"):
    ad.plan(lambda x: jnp.tanh(x @ W), X, mesh=AbstractMesh((8,), ("data",)))


def test_errors_share_one_base_and_keep_their_builtins():
  for err, builtin in ((ad.MemoryBudgetError, ValueError),
                       (ad.PlanFileError, ValueError),
                       (ad.DistributedError, RuntimeError),
                       (ad.RuleError, RuntimeError)):
    assert issubclass(err, ad.AutoDDLError) and issubclass(err, builtin)
  assert ad.distributed.DistributedError is ad.DistributedError


def test_a_failing_rule_is_an_internal_error_naming_the_primitive(
    monkeypatch):
  from autoddl_jax import _rules

  def broken(ins, outs, params):
    raise IndexError("tuple index out of range")

  monkeypatch.setitem(_rules.RULES, "tanh", _rules.Rule(broken))
  with pytest.raises(ad.RuleError,
                     match=r"rule of 'tanh' failed on \(float32\[8, 32\]\)"
                           r": IndexError"):
    ad.plan(lambda x: jnp.tanh(x @ W), X, mesh=AbstractMesh((8,), ("data",)))


def test_plan_fields_and_explain():
  mesh = make_mesh((2, 4))
  ex = build("mlp")
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
  leaves = jax.tree.leaves(plan.in_shardings)
  assert len(leaves) == len(jax.tree.leaves(ex.args))
  assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in leaves)
  assert jax.tree.structure(plan.out_shardings[0]) == jax.tree.structure(
      ex.params)
  c = plan.cost
  assert c.time_s == pytest.approx(c.compute_s + c.comm_s)
  assert c.comm_bytes >= 0 and c.memory_bytes > 0
  text = plan.explain()
  assert "0/w0" in text and "PartitionSpec" in text and "nd-SBP" in text
  assert "data parallel" in text
  # Memory at the peak by category adds up to the peak; the arguments are
  # every input's block, alive all step.
  mem = plan.problem.memory_breakdown(plan.choice)
  assert sum(mem.values()) == pytest.approx(c.memory_bytes)
  arg_bytes = sum(
      math.prod(a.shape) * a.dtype.itemsize / math.prod(
          plan.mesh_info.axis_sizes[i] for i, code in enumerate(
              plan.problem.cands[o][plan.choice[o]][0]) if code >= 0)
      for o, a in zip(plan.graph.input_ops, plan.traced.in_avals))
  assert mem["arguments"] == pytest.approx(arg_bytes)
  cats = plan.memory_by_category()
  assert sum(cats.values()) == pytest.approx(c.memory_bytes)
  assert cats["results"] == mem["results"]
  assert "activations, gradients, temporaries" in text
  assert "memory budget" in text
  dp = plan.baseline_cost("dp")
  assert plan.cost.time_s <= dp.time_s * (1 + 1e-9)
  assert plan.user_paths()[0] == "0/b0"
  lowered = plan.jit().lower(*ex.args)  # jit() supports .lower
  compiled = lowered.compile()
  # The compiled program takes the arguments where the plan puts them.
  got = jax.tree_util.tree_leaves(compiled.input_shardings[0])
  want = jax.tree_util.tree_leaves(plan.in_shardings)
  assert [s.spec for s in got] == [s.spec for s in want]


def test_arrays_placed_on_the_plans_shardings_run_as_is():
  for explicit in (True, False):
    mesh = make_mesh((2, 4), explicit=explicit)
    ex = build("mlp")
    plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
    placed = jax.device_put(ex.args, plan.in_shardings)
    out = plan.jit()(*placed)
    assert rel_err(out[2], jax.jit(ex.step)(*ex.args)[2]) < 1e-5
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        placed)
    compiled = plan.jit().lower(*abstract).compile()
    out_abstract = compiled.out_info
    assert jax.tree.map(lambda x: x.shape, out_abstract) == jax.tree.map(
        lambda x: x.shape, jax.eval_shape(ex.step, *ex.args))


def test_auto_axes_mesh_works_too():
  mesh = make_mesh((2, 4), explicit=False)
  plan = ad.plan(_mlp_step, W, X, mesh=mesh, cluster=TEST_CLUSTER)
  assert rel_err(plan.jit()(W, X), _mlp_step(W, X)) < 1e-5


def test_shapes_the_mesh_cannot_split_are_never_split():
  w = jnp.ones((3, 5)) / 3
  x = jnp.ones((7, 3))
  plan = ad.plan(_mlp_step, w, x, mesh=make_mesh((2, 4)),
                 cluster=TEST_CLUSTER)
  assert all(s.spec == P() for s in jax.tree.leaves(plan.in_shardings))
  assert rel_err(plan.jit()(w, x), _mlp_step(w, x)) < 1e-5


def test_non_array_leaves_are_handled():
  def step(params, batch, lr, key, nothing, ids):
    noise = jax.random.normal(key, batch.shape) * 0.0
    emb = params["emb"][ids]
    loss = ((batch + noise) @ params["w"]).sum() + emb.sum()
    g = jax.grad(lambda p: ((batch @ p["w"]).sum() + p["emb"][ids].sum()))(
        params)
    return jax.tree.map(lambda p, g: p - lr * g, params, g), loss

  params = {"w": W, "emb": jnp.ones((64, 4))}
  ids = jnp.arange(8, dtype=jnp.int32)
  args = (params, X, 0.1, jax.random.key(0), None, ids)
  plan = ad.plan(step, *args, mesh=make_mesh((8,)), cluster=TEST_CLUSTER)
  names = plan.traced.in_names
  specs = dict(zip(names, (s.spec for s in jax.tree.leaves(
      plan.in_shardings))))
  assert specs["[2]"] == P() and specs["[3]"] == P()  # scalar, PRNG key
  got = plan.jit()(*args)
  want = jax.jit(step)(*args)
  assert rel_err(got[1], want[1]) < 1e-5
  for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
    assert rel_err(a, b) < 1e-5


def test_abstract_mesh_plans_but_cannot_run():
  am = AbstractMesh((128, 8), ("data", "model"))
  ex = build("mlp", abstract=True)
  plan = ad.plan(ex.step, *ex.args, mesh=am)
  assert plan.mesh_info.link == ("inter", "intra")
  with pytest.raises(ValueError, match="abstract mesh.*concrete"):
    plan.jit()
  plan2 = ad.plan(ex.step, *ex.args, mesh={"data": 2, "model": 4})
  with pytest.raises(ValueError, match="needs devices"):
    plan2.jit()


def test_mesh_larger_than_the_devices_is_refused():
  devices = np.array(jax.devices() * 2).reshape(4, 4)
  with pytest.raises(ValueError, match="[Dd]evice"):
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    ad.plan(_mlp_step, W, X, mesh=mesh)


def test_args_that_do_not_match_fn():
  with pytest.raises(TypeError, match="tracing _mlp_step .* failed"):
    ad.plan(_mlp_step, W, jnp.ones((8, 7)), mesh=make_mesh((8,)))
  with pytest.raises(TypeError, match="tracing _mlp_step .* failed"):
    ad.plan(_mlp_step, W, mesh=make_mesh((8,)))


def test_non_array_leaf_error_names_the_leaf():
  with pytest.raises(TypeError, match=r"leaf \[1\]\['mode'\] is a str"):
    ad.plan(lambda w, cfg: w.sum(), W, {"mode": "fast"},
            mesh=make_mesh((8,)))
  with pytest.raises(TypeError, match="fn must be callable"):
    ad.plan("step", W, mesh=make_mesh((8,)))


def test_bad_options():
  with pytest.raises(ValueError, match="memory_budget must be a positive"):
    ad.plan(_mlp_step, W, X, mesh=make_mesh((8,)), memory_budget=-5)
  with pytest.raises(TypeError, match="cluster must be an autoddl_jax"):
    ad.plan(_mlp_step, W, X, mesh=make_mesh((8,)), cluster={"bw": 1})


def test_cost_of_scores_hand_plans_and_checks_them():
  mesh = make_mesh((2, 4))
  dp = (P(), P(("data", "model")))
  cost = ad.cost_of(_mlp_step, W, X, mesh=mesh, in_shardings=dp,
                    cluster=TEST_CLUSTER)
  assert isinstance(cost, ad.PlanCost) and cost.time_s > 0
  rep = ad.cost_of(_mlp_step, W, X, mesh=mesh, in_shardings=None,
                   cluster=TEST_CLUSTER)
  assert rep.memory_bytes > cost.memory_bytes
  with pytest.raises(ValueError, match="splits dim 0 of size 3 2 ways, which "
                     "does not divide it"):
    ad.cost_of(_mlp_step, jnp.ones((3, 32)), jnp.ones((8, 3)), mesh=mesh,
               in_shardings=(P("data"), P()))
  with pytest.raises(ValueError, match="does not have"):
    ad.cost_of(_mlp_step, W, X, mesh=mesh, in_shardings=(P("x"), P()))
  with pytest.raises(ValueError, match="pytree prefix of the arguments"):
    ad.cost_of(_mlp_step, W, X, mesh=mesh, in_shardings=(P(), P(), P()))
  with pytest.raises(ValueError, match="mesh axes"):
    other = jax.make_mesh((8,), ("z",))
    ad.cost_of(_mlp_step, W, X, mesh=mesh,
               in_shardings=(NamedSharding(other, P()), P()))
  with pytest.raises(TypeError, match="NamedSharding, PartitionSpec or None"):
    ad.cost_of(_mlp_step, W, X, mesh=mesh, in_shardings=("data", P()))


def test_reshard_rows_name_the_collectives_of_the_costed_path():
  """A joint (P, P) -> (B, B) is one all-reduce over both axes -- as XLA
  emits it and verify() counts it -- not "all-reduce+all-reduce"."""
  from autoddl_jax._report import collective_names as _collective_names
  from autoddl_jax._cluster import mesh_info
  from autoddl_jax._states import state_space
  from autoddl_jax._sbp import B_CODE, P_CODE
  mi = mesh_info(AbstractMesh((2, 4), ("a", "b")), TEST_CLUSTER)
  space = state_space((64, 64), 4, mi)
  assert _collective_names((P_CODE, P_CODE), (B_CODE, B_CODE), space,
                           mi) == "all-reduce"
  assert _collective_names((P_CODE, 0), (B_CODE, B_CODE), space,
                           mi) == "all-reduce+all-gather"
  assert _collective_names((0, B_CODE), (0, B_CODE), space, mi) == "local"


def test_explain_says_why_a_plan_is_replicated():
  # Links so slow that no split pays: the plan replicates everything and
  # explain() says why, beside the cluster it was made for.
  slow = ad.Cluster(devices_per_node=8, intra_node_bandwidth=1e3,
                    inter_node_bandwidth=1e3)
  plan = ad.plan(lambda w, x: jnp.sum(jnp.tanh(x @ w)), W, X,
                 mesh=AbstractMesh((8,), ("data",)), cluster=slow)
  assert all(c < 0 for s in plan.in_sbps for c in s.codes)
  text = plan.explain()
  assert "every argument is replicated" in text
  assert "made for: 8 devices per node, 1e-06 GB/s inside a node" in text


def test_planning_collects_garbage_less_often_and_restores_the_thresholds():
  import gc
  from autoddl_jax import _gc
  seen = []

  def step(w, x):
    seen.append(gc.get_threshold())  # traced while planning
    return _mlp_step(w, x)

  before = gc.get_threshold()
  try:
    gc.set_threshold(700, 10, 10)
    ad.plan(step, W, X, mesh=AbstractMesh((2,), ("d",)),
            cluster=TEST_CLUSTER)
    assert seen and all(t == _gc.THRESHOLD for t in seen)
    assert gc.get_threshold() == (700, 10, 10)
    # Restored after an error too; nested planning calls restore once.
    with pytest.raises(ValueError):
      ad.plan(step, W, X, mesh=AbstractMesh((2,), ("d",)), alternatives=-1)
    assert gc.get_threshold() == (700, 10, 10)
    inner = _gc.fewer_collections(gc.get_threshold)
    outer = _gc.fewer_collections(lambda: (inner(), gc.get_threshold()))
    assert outer() == (_gc.THRESHOLD, _gc.THRESHOLD)
    assert gc.get_threshold() == (700, 10, 10)
    # Never lowered; automatic collection turned off stays off.
    gc.set_threshold(100_000, 50, 50)
    assert inner() == (100_000, 50, 50)
    gc.set_threshold(0)
    assert inner()[0] == 0 and gc.get_threshold()[0] == 0
  finally:
    gc.set_threshold(*before)
