"""ad.pipeline.scan and pipeline stages chosen by the planner (issue 15)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax import _planner, _program, _remat, _stages, pipeline
from autoddl_jax.testing import llama as models
from conftest import TEST_CLUSTER
from helpers import make_mesh

OPTIMIZERS = {"sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
              "adamw": lambda: optax.adamw(1e-3)}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _layer(h, w):
  return jnp.tanh(h @ w), None


def test_without_a_schedule_it_is_lax_scan():
  ws = jax.random.normal(jax.random.key(0), (4, 8, 8)) / 3
  x = jax.random.normal(jax.random.key(1), (6, 8))
  got = pipeline.scan(_layer, x, ws)[0]
  want = jax.lax.scan(_layer, x, ws)[0]
  np.testing.assert_array_equal(got, want)
  jaxpr = jax.make_jaxpr(lambda w, x: pipeline.scan(_layer, x, w))(ws, x)
  assert [e.primitive.name for e in jaxpr.jaxpr.eqns] == ["scan"]
  assert pipeline.calls(jaxpr.jaxpr) == [pipeline.Call(4, 6, False)]


@pytest.mark.parametrize("stages,micro,replicas", [
    (2, 3, 1), (4, 6, 1), (4, 1, 1), (1, 2, 1), (2, 3, 2), (4, 1, 3)])
def test_the_schedule_computes_the_same_function(stages, micro, replicas):
  ws = jax.random.normal(jax.random.key(0), (4, 8, 8)) / 3
  x = jax.random.normal(jax.random.key(1), (3, 6, 8))  # batch on axis 1

  def loss(w, x):
    return jnp.sum(pipeline.scan(_layer, x, w, batch_axis=1)[0] ** 2)

  want = jax.value_and_grad(loss, argnums=(0, 1))(ws, x)
  sched = pipeline.Schedule(stages, micro, "pp", None,
                            ("dp",) if replicas > 1 else (), replicas)
  with pipeline.scheduled(sched):
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(ws, x)
  names = {e.primitive.name for e in closed.jaxpr.eqns}
  got = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, ws, x)
  for g, w in zip(got, jax.tree.leaves(want)):
    assert _rel(g, w) < 1e-5
  assert ("scan" in names) and (stages == 1 or len(closed.jaxpr.eqns) > 5)


@pytest.mark.parametrize("stages,micro,repeats,replicas", [
    (2, 2, 2, 1), (2, 3, 2, 1), (2, 6, 4, 1), (4, 4, 2, 1), (4, 6, 2, 1),
    (2, 4, 2, 3)])
def test_circular_stages_compute_the_same_function(stages, micro, repeats,
                                                   replicas):
  # Each stage holds chunks s, s + S, ..; a microbatch goes round the ring
  # `repeats` times, waiting M - S ticks on stage 0 between rounds.
  ws = jax.random.normal(jax.random.key(0), (8, 8, 8)) / 3
  x = jax.random.normal(jax.random.key(1), (3, 12, 8))

  def loss(w, x):
    return jnp.sum(pipeline.scan(_layer, x, w, batch_axis=1)[0] ** 2)

  want = jax.value_and_grad(loss, argnums=(0, 1))(ws, x)
  sched = pipeline.Schedule(stages, micro, "pp", None,
                            ("dp",) if replicas > 1 else (), replicas,
                            repeats=repeats)
  assert sched.ticks == repeats * micro + stages - 1
  with pipeline.scheduled(sched):
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(ws, x)
  got = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, ws, x)
  for g, w in zip(got, jax.tree.leaves(want)):
    assert _rel(g, w) < 1e-5


def test_bad_input_says_what_to_change():
  ws = jnp.zeros((3, 8, 8))
  x = jnp.zeros((6, 8))
  with pipeline.scheduled(pipeline.Schedule(2, 2, "pp")):
    with pytest.raises(ValueError, match="3 layers do not split into 2"):
      jax.make_jaxpr(lambda w, x: pipeline.scan(_layer, x, w))(ws, x)
  with pipeline.scheduled(pipeline.Schedule(3, 4, "pp")):
    with pytest.raises(ValueError, match="cannot be dealt into 4"):
      jax.make_jaxpr(lambda w, x: pipeline.scan(_layer, x, w))(
          jnp.zeros((3, 8, 8)), x)
    with pytest.raises(ValueError, match=r"per-layer outputs \(ys\)"):
      jax.make_jaxpr(lambda w, x: pipeline.scan(
          lambda h, w: (h @ w, h), x, w))(jnp.zeros((3, 8, 8)), x)
  with pytest.raises(ValueError, match="same leading"):
    pipeline.scan(_layer, x, (jnp.zeros((3, 8, 8)), jnp.zeros((2, 8))))
  with pytest.raises(ValueError, match="Schedule.stages"):
    pipeline.Schedule(0, 1, "pp")
  with pipeline.scheduled(pipeline.Schedule(2, 2, "pp", repeats=2)):
    with pytest.raises(ValueError, match="6 layers do not split into 2 "
                       "stages of 2 circular chunks"):
      jax.make_jaxpr(lambda w, x: pipeline.scan(_layer, x, w))(
          jnp.zeros((6, 8, 8)), x)
  with pipeline.scheduled(pipeline.Schedule(4, 2, "pp", repeats=2)):
    with pytest.raises(ValueError, match="at least as many microbatches"):
      jax.make_jaxpr(lambda w, x: pipeline.scan(_layer, x, w))(
          jnp.zeros((8, 8, 8)), x)
  ex = models.llama(models.LlamaConfig(pipeline=False))
  with pytest.raises(ValueError, match="calls no ad.pipeline.scan"):
    ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)), cluster=TEST_CLUSTER,
            pipeline=2)
  with pytest.raises(ValueError, match="pipeline must be"):
    ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)), pipeline=0)
  with pytest.raises(ValueError, match="pipeline must be"):
    ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)), pipeline=(1, 2))
  ex = models.llama()  # 4 layers
  with pytest.raises(ValueError, match=r"pipeline=\(2, 3\): .* do not split "
                     "into 2 stages of 3 circular chunks"):
    ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)), cluster=TEST_CLUSTER,
            pipeline=(2, 3))


def test_stage_meshes_split_a_slow_axis():
  mesh = make_mesh((4, 2))
  mi = _program.mesh_info(mesh, TEST_CLUSTER)  # 4 devices per node
  smesh, name = _stages.stage_mesh(mesh, mi, 0, 2)
  assert (name, smesh.axis_names, smesh.devices.shape) == (
      "data_pp", ("data_pp", "data", "model"), (2, 2, 2))
  assert [d.id for d in smesh.devices.flat] == [d.id for d in
                                                 mesh.devices.flat]
  calls = [pipeline.Call(4, 8, False)]
  # data (size 4) spans the nodes: 2 stages over its major half, or 4 over
  # all of it; model (2, inside a node) only whole.
  assert _stages.options(calls, mi, None) == [(0, 2), (0, 4), (1, 2)]
  assert _stages.options(calls, mi, 2) == [(1, 2)]  # a whole axis first
  assert _stages.options([pipeline.Call(4, 8, True)], mi, None) == []
  assert _stages.microbatch_counts(2, [8]) == [8, 4]
  # Circular stages are tried on the best schedule with the fewest chunks
  # the stage's layers split into, and M >= S -- also where GPipe at twice
  # the microbatches was planned: it may have lost by its smaller
  # microbatches, which circular stages do not have.
  assert _stages.circular_repeats(8, 2, 8) == 2
  assert _stages.circular_repeats(12, 2, 8) == 2
  assert _stages.circular_repeats(18, 2, 8) == 3
  assert _stages.circular_repeats(8, 8, 8) is None  # one layer each
  assert _stages.circular_repeats(8, 4, 2) is None  # M < S
  assert _stages.options(calls, mi, None, repeats=2) == [(0, 2), (1, 2)]
  # On three axes the planner splits none by itself (four axes make every
  # tensor's layouts too many to plan in time); a forced count still may.
  mi3 = _program.mesh_info(AbstractMesh((8, 2, 2), ("data", "a", "b")),
                           TEST_CLUSTER)
  assert mi3.link[0] != "intra"
  assert _stages.options(calls, mi3, None) == [(1, 2), (2, 2)]
  assert _stages.options(calls, mi3, 4) == [(0, 4)]


def test_the_stage_axis_keeps_the_stage_dim(monkeypatch):
  # Every value the stages compute keeps its stage dim on the stage axis
  # (autoddl_jax._pinned): on a 3-axis stage mesh that cuts the largest
  # op's candidates by half and the search's time five-fold, and the plan
  # is no slower by the model (here faster: the smaller space is searched
  # better).
  from autoddl_jax import _problem, _search, _seeds
  cfg = models.LlamaConfig(n_layers=2, batch=8)
  ex = models.llama(cfg)
  mesh = make_mesh((4, 2))
  mi = _program.mesh_info(mesh, TEST_CLUSTER)
  smesh, name = _stages.stage_mesh(mesh, mi, 0, 2)
  sched = pipeline.Schedule(2, 8, name, "data")
  out = {}
  for pinned in (True, False):
    if not pinned:
      monkeypatch.setattr(_problem, "pinned_dims", lambda g, m: {})
    prog = _program.build(ex.step, ex.args, smesh, TEST_CLUSTER,
                          schedule=sched)
    prob = prog.problem
    res = _search.search(prob, _seeds.seeds(prog))
    out[pinned] = (prob.evaluate(res.choice).time_s,
                   max(len(c) for c in prob.cands), prob)
  (t_pin, k_pin, prob), (t_free, k_free, _) = out[True], out[False]
  assert t_pin <= t_free * (1 + 1e-9)
  assert k_pin < 0.75 * k_free
  stage = prob.mi.axis_names.index(name)
  shifts = [op for op in prob.graph.ops if op.prim == "stage_shift"]
  assert shifts and all(prob.pins[t][stage] == op.fixed[2]
                        for op in shifts for t in (*op.ins, *op.outs))
  # the stacked layer weights, their gradients and moments: layer dim
  stacked = [o for o, a in zip(prob.graph.input_ops, prog.traced.in_avals)
             if a.shape[:1] == (cfg.n_layers,) and len(a.shape) >= 2]
  assert stacked and all(
      prob.pins[prob.graph.ops[o].outs[0]] == {stage: 0} for o in stacked)


def _permute_axes(plan, compiled):
  return {c.axes for c in ad.collectives(compiled, plan.mesh)
          if c.kind == "collective-permute"}


# Each mesh, stage count and optimizer once in the default run (about a
# minute each on 2 cores); the rest of the product with `pytest -m slow`.
# (S, V): S circular stages of V chunks each.
_CASES = [((2, 4), 2, "sgd_momentum"), ((4, 2), 4, "adamw"),
          ((2, 4), (2, 2), "adamw")]
_SLOW = [(m, s, o) for m in ((2, 4), (4, 2)) for s in (2, 4, (2, 2))
         for o in sorted(OPTIMIZERS) if (m, s, o) not in _CASES]


@pytest.mark.parametrize("shape,stages,opt", _CASES + [
    pytest.param(*c, marks=pytest.mark.slow) for c in _SLOW])
def test_pipelined_llama_equals_the_unsharded_step(shape, stages, opt):
  # batch 32: microbatches of 2 or 4 rows, which split over the replicas
  ex = models.llama(models.LlamaConfig(batch=32), optimizer=OPTIMIZERS[opt](),
                    return_grads=True)
  want = jax.jit(ex.step)(*ex.args)
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh(shape),
                 cluster=TEST_CLUSTER, pipeline=stages, select="model")
  sched = plan.schedule
  stages, repeats = stages if isinstance(stages, tuple) else (stages, None)
  assert sched is not None and sched.stages == stages
  assert repeats is None or sched.repeats == repeats
  if repeats:
    assert f"circular, {repeats} chunks per stage" in plan.explain()
  assert plan.mesh.shape[sched.axis] == stages
  # data parallelism across the nodes inside a stage: a replica dim
  assert sched.replicas == (("data",) if sched.axis == "model" else ())
  step = plan.jit()
  compiled = step.lower(*ex.args).compile()
  got = step(*ex.args)
  # loss, then every gradient, then the updated parameters and state
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _rel(g, w) < 1e-5
  # XLA moves activations between stages point to point, on the stage axis.
  assert (sched.axis,) in _permute_axes(plan, compiled)
  v = plan.verify()
  pred, emitted = v.by_kind["collective-permute"]
  assert pred > 0 and math.isclose(pred, emitted, rel_tol=0.1)


def test_one_stage_where_stages_do_not_pay():
  # Inside one node, with compute the bottleneck, the bubble costs more
  # than the stages save: the planner keeps one stage.
  ex = models.llama()
  cluster = ad.Cluster(devices_per_node=8, intra_node_bandwidth=10e9,
                       inter_node_bandwidth=10e9, peak_flops=1e9,
                       memory_per_device=2**30, flops_efficiency=1.0)
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)),
                 cluster=cluster, select="model")
  assert plan.schedule is None
  forced = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)),
                   cluster=cluster, select="model", pipeline=2)
  assert forced.cost.time_s > plan.cost.time_s
  assert "pipeline" not in plan.explain()
  assert "bubble" in forced.explain()


def test_a_pipelined_plan_saves_and_loads(tmp_path):
  ex = models.llama()
  mesh = make_mesh((2, 4))
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                 pipeline=2, select="model")
  path = tmp_path / "plan.json"
  plan.save(path)
  back = ad.load_plan(path, ex.step, *ex.args, mesh=mesh,
                      cluster=TEST_CLUSTER)
  assert back.schedule == plan.schedule and back.choice == plan.choice
  assert back.cost == plan.cost


def test_stages_across_a_slow_link_beat_every_plan_without_them():
  # Two nodes of four over a slow link (0.25 GB/s), a stack of wide layers
  # and a small batch: every plan without stages replicates the work over
  # the nodes or moves gradients, weights or activations across them each
  # layer; two stages, one a node, move each microbatch's activations once
  # per tick (and reduce the stage's gradients inside the node).
  cfg = models.LlamaConfig(d_model=256, n_heads=4, n_kv_heads=2, ffn=512,
                           n_layers=8, seq=16, batch=16)
  ex = models.llama(cfg)
  cluster = ad.Cluster(devices_per_node=4, intra_node_bandwidth=100e9,
                       inter_node_bandwidth=0.25e9, peak_flops=1e11,
                       memory_per_device=2**30, flops_efficiency=1.0)
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)),
                 cluster=cluster, select="compiled", alternatives=0)
  sel = plan.selection
  assert plan.schedule is not None and plan.schedule.axis == "data"
  won = sel.candidates[sel.winner]
  others = [c for i, c in enumerate(sel.candidates)
            if i != sel.winner and c.compiled is not None]
  names = {c.name for c in others}
  # the textbook plans, and the search's best plan without stages
  assert {"dp", "fsdp", "megatron", "fsdp_tp", "search:no-stages"} <= names
  for c in others:
    assert won.compiled.time_s < c.compiled.time_s, c.name


@pytest.mark.slow  # a third mesh axis: ~1 minute to plan on 2 cores
def test_a_plan_on_a_split_axis_runs_on_the_users_arrays():
  # Two stages over the major half of a (4, 2) mesh's cross-node data
  # axis: the plan's mesh is (data_pp=2, data=2, model=2); arrays placed on
  # the user's mesh are put on it.
  ex = models.llama(models.LlamaConfig(n_layers=2, batch=8),
                    optimizer=OPTIMIZERS["sgd_momentum"](), return_grads=True)
  mesh = make_mesh((4, 2))
  [(plan, over, _)] = _planner.plan_stages(
      ex.step, ex.args, mesh, TEST_CLUSTER, False, [(0, 2)], [8], None,
      False, "none")[:1]
  assert over is None and plan.schedule.split_from == "data"
  assert plan.mesh.axis_names == ("data_pp", "data", "model")
  placed = jax.device_put(ex.args, NamedSharding(mesh, P()))
  want = jax.jit(ex.step)(*ex.args)
  got = plan.jit()(*placed)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _rel(g, w) < 1e-5


def _tiny_gpt_over_a_slow_link(n_layers):
  """A tiny pipelined GPT on (2, 4) whose data axis crosses a slow link,
  and its plan without stages or budget (whose memory budgets scale)."""
  from autoddl_jax.testing import models as zoo
  cfg = zoo.GptConfig(d_model=64, n_heads=4, n_layers=n_layers, seq=16,
                      batch=16, pipeline=True)
  ex = zoo.gpt(cfg, abstract=True)
  cluster = ad.Cluster(devices_per_node=4, intra_node_bandwidth=100e9,
                       inter_node_bandwidth=0.25e9, peak_flops=1e11,
                       memory_per_device=2**30, flops_efficiency=1.0)
  mesh = AbstractMesh((2, 4), ("data", "model"))
  free = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=cluster,
                 memory_budget=float("inf"), pipeline=1)
  return ex, cluster, mesh, free


@pytest.mark.slow  # plans every schedule twice: ~100 s on 2 cores
def test_skipping_schedules_that_cannot_win_changes_no_plan(monkeypatch):
  # Under a budget that binds, plan_stages does not fit a schedule (or a
  # remat variant of one) whose best plan without the budget is already
  # no faster than one that fits. The plan is the one fitting every
  # schedule finds, with fewer searches.
  ex, cluster, mesh, free = _tiny_gpt_over_a_slow_link(4)
  budget = 0.5 * free.cost.memory_bytes
  searches = []
  search_plan = _planner.search_plan
  monkeypatch.setattr(_planner, "search_plan", lambda *a, **k: (
      searches.append(1), search_plan(*a, **k))[1])
  plans, counts = {}, {}
  for prune in (True, False):
    monkeypatch.setattr(_planner, "PRUNE_SCHEDULES", prune)
    searches.clear()
    plans[prune] = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=cluster,
                           memory_budget=budget)
    counts[prune] = len(searches)
  a, b = plans[True], plans[False]
  assert a.schedule is not None and a.schedule == b.schedule
  assert a.remat == b.remat and list(a.choice) == list(b.choice)
  assert a.cost.time_s == b.cost.time_s
  assert a.cost.memory_bytes <= budget
  assert counts[True] < counts[False]  # 18 against 24 when written


def _gpt_175b():
  """The 175B GPT of benchmarks/pipeline_175b.py, abstract (shapes only)."""
  from autoddl_jax.testing import models as zoo
  cfg = zoo.GptConfig(vocab=51200, d_model=12288, n_heads=96, n_layers=96,
                      seq=2048, batch=1024, dtype=jnp.bfloat16,
                      pipeline=True)
  return zoo.gpt(cfg, abstract=True)


@pytest.mark.slow  # the 175B GPT planned twice, abstractly: ~40 s on 2 cores
def test_circular_stages_are_tried_where_gpipe_at_twice_the_microbatches_loses(
    monkeypatch):
  # On (16, 16, 4) GPipe's best is 16 stages at M=64 (a sequence per data
  # replica); M=128 is planned too and loses badly, its microbatches of 8
  # sequences not splitting over data=16. Circular stages have M=128's
  # bubble with M=64's microbatches: they must still be tried, and win.
  ex = _gpt_175b()
  mesh = AbstractMesh((16, 16, 4), ("pp", "data", "model"))
  plan = ad.plan(ex.step, *ex.args, mesh=mesh)
  sched = plan.schedule
  assert (sched.stages, sched.repeats, sched.microbatches) == (16, 2, 64)
  monkeypatch.setattr(_stages, "circular_repeats", lambda *a: None)
  gpipe = ad.plan(ex.step, *ex.args, mesh=mesh)
  assert gpipe.schedule.repeats == 1 and gpipe.schedule.stages == 16
  assert plan.cost.time_s < 0.95 * gpipe.cost.time_s  # 6.98 s vs 7.50 s
  for p in (plan, gpipe):
    assert p.cost.memory_bytes <= p.memory_budget


@pytest.mark.slow  # the 175B GPT planned twice, abstractly: ~3 min on 2 cores
def test_circular_stages_on_the_fitted_winner_get_its_other_microbatches():
  # On (64, 16) the fitted GPipe winner is 8 stages at M=32 (16.8 s);
  # circular stages of 2 chunks take 15.4 s at its M=32, and 14.6 s at
  # M=16, where the per-tick collectives over the mixed 'model' axis are
  # paid half as often: the planner finds what forcing (8, 2) finds.
  ex = _gpt_175b()
  mesh = AbstractMesh((64, 16), ("data", "model"))
  plan = ad.plan(ex.step, *ex.args, mesh=mesh)
  forced = ad.plan(ex.step, *ex.args, mesh=mesh, pipeline=(8, 2))
  assert plan.schedule.repeats == 2
  assert plan.cost.time_s <= forced.cost.time_s * (1 + 1e-9)
  for p in (plan, forced):
    assert p.cost.memory_bytes <= p.memory_budget


def test_circular_stages_are_tried_on_the_fitted_winner_too(monkeypatch):
  # Under a tight budget the fastest GPipe schedule that fits (M=16) is
  # not the fastest without the budget (M=4), on which circular stages
  # were tried first: they are tried on the fitted winner's stage count
  # too, at each of its microbatch counts.
  ex, cluster, mesh, free = _tiny_gpt_over_a_slow_link(8)
  results = []
  plan_stages = _planner.plan_stages
  monkeypatch.setattr(_planner, "plan_stages", lambda *a, **k: (
      results.append(plan_stages(*a, **k)), results[-1])[1])
  ad.plan(ex.step, *ex.args, mesh=mesh, cluster=cluster,
          memory_budget=0.12 * free.cost.memory_bytes)
  [found] = results
  # plan() appends the plan without stages to the list
  found = [f for f in found if f[0].schedule is not None]

  def key(s):
    return s.axis, s.stages, s.microbatches
  fits = [p for p, over, _ in found
          if over is None and p.schedule.repeats == 1]
  winner = min(fits, key=lambda p: p.cost.time_s).schedule
  circular = [key(p.schedule) for p, _, _ in found if p.schedule.repeats > 1]
  assert key(winner) in circular
  counts = {(winner.axis, winner.stages, m)  # the helper's batch is 16
            for m in _stages.microbatch_counts(winner.stages, [16])
            if m >= winner.stages}
  assert len(counts) > 1 and counts <= set(circular)
  assert circular[0] != key(winner)  # the first, on the fastest unfitted


def test_forced_stages_fit_no_plan_without_them(monkeypatch):
  # The plan without stages, over the budget, is fitted among the
  # schedules, best first (_planner.plan_stages); with stages forced it is
  # no candidate, and is not fitted at all.
  from autoddl_jax.testing import models as zoo
  cfg = zoo.GptConfig(d_model=64, n_heads=4, n_layers=4, seq=16, batch=16,
                      pipeline=True)
  ex = zoo.gpt(cfg, abstract=True)
  mesh = AbstractMesh((2, 4), ("data", "model"))
  free = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                 memory_budget=float("inf"), pipeline=1)
  budget = 0.5 * free.cost.memory_bytes
  fitted = []
  fit = _planner.Variants.fit
  monkeypatch.setattr(_planner.Variants, "fit", lambda self, *a, **k: (
      fitted.append(self.schedule), fit(self, *a, **k))[1])
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                 memory_budget=budget, pipeline=2)
  assert plan.schedule.stages == 2 and plan.cost.memory_bytes <= budget
  assert fitted and None not in fitted  # only the schedules were fitted
  fitted.clear()
  flat = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                 memory_budget=budget, pipeline=1)
  assert fitted == [None] and flat.cost.memory_bytes <= budget


def _attention_layer(x, w):  # a weight matmul, then a batched one
  q = x @ w
  return jnp.tanh(jnp.einsum("bqd,bkd->bqk", q, q)).sum()


def _residual_shapes(fn, *args):
  """The shapes of what ``fn``'s backward keeps: its vjp closes over
  them."""
  return {tuple(np.shape(a)) for a in jax.tree.leaves(jax.vjp(fn, *args)[1])}


def test_the_selective_policy_keeps_weight_matmuls_inside_stage_vmaps():
  x = jnp.ones((2, 3, 5))
  w = jnp.ones((5, 7))
  q, scores = (2, 3, 7), (2, 3, 3)
  sel = _remat.NoBatchDotsSaveable
  # Outside a pipeline: jax's dots_with_no_batch_dims_saveable.
  kept = _residual_shapes(jax.checkpoint(_attention_layer, policy=sel(0)),
                          x, w)
  assert q in kept and scores not in kept
  # A stage's vmaps batch every dot: jax's policy then saves none of them,
  # this one still saves the weight matmul and recomputes the scores.
  for levels in (1, 2):
    xs, ws = x[(None,) * levels], w[(None,) * levels]
    lead = (1,) * levels
    f = _attention_layer
    g = jax.checkpoint(f, policy=jax.checkpoint_policies.
                       dots_with_no_batch_dims_saveable)
    h = jax.checkpoint(f, policy=sel(levels))
    for _ in range(levels):
      g, h = jax.vmap(g), jax.vmap(h)
    assert lead + q not in _residual_shapes(
        lambda a, b, g=g: g(a, b).sum(), xs, ws)
    kept = _residual_shapes(lambda a, b, h=h: h(a, b).sum(), xs, ws)
    assert lead + q in kept and lead + scores not in kept
  # The planner traces a layer stack under it once it recomputes a dot
  # dots_saveable would keep (else the program is dots_saveable's).
  for layer, declined in ((_attention_layer, True),
                          (lambda x, w: jnp.tanh(x @ w).sum(), False)):
    def loss(ws, x, layer=layer):
      return jax.lax.scan(lambda c, w: (c + layer(x, w), None), 0.0, ws)[0]
    with _remat.scan_policy(_remat.SELECTIVE):
      jax.make_jaxpr(jax.grad(loss))(jnp.ones((2, 5, 7)), x)
    assert _remat.declined_dots() is declined


def test_selective_remat_of_a_pipelined_llama_is_what_xla_compiles(tmp_path):
  # Recomputing only the attention's batched dots (and what is
  # elementwise) sits between the two jax policies in FLOPs and memory,
  # in the compiled program as in the model, and computes the same step.
  ex = models.llama(models.LlamaConfig(batch=32, seq=32),
                    optimizer=OPTIMIZERS["sgd_momentum"](), return_grads=True)
  want = jax.jit(ex.step)(*ex.args)
  v = {}
  for pol in ("dots_saveable", _remat.SELECTIVE, "nothing_saveable"):
    plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)),
                   cluster=TEST_CLUSTER, pipeline=2, select="model",
                   remat=pol)
    assert plan.remat == pol and plan.schedule.stages == 2
    v[pol] = plan.verify()
    if pol == _remat.SELECTIVE:
      for g, w in zip(jax.tree.leaves(plan.jit()(*ex.args)),
                      jax.tree.leaves(want)):
        assert _rel(g, w) < 1e-5
      plan.save(tmp_path / "plan.json")  # traced again with its policy
      back = ad.load_plan(tmp_path / "plan.json", ex.step, *ex.args,
                          mesh=make_mesh((2, 4)), cluster=TEST_CLUSTER)
      assert back.remat == pol and back.cost == plan.cost
  dots, sel, nothing = v.values()
  assert dots.xla_flops < sel.xla_flops < nothing.xla_flops
  assert dots.xla_memory > sel.xla_memory > nothing.xla_memory
  assert (dots.predicted_memory > sel.predicted_memory >
          nothing.predicted_memory)
  assert abs(sel.predicted_flops_loops_once / sel.xla_flops - 1) < 0.05
  assert abs(sel.predicted_memory / sel.xla_memory - 1) < 0.3
