"""The faults a user meets first: no silent wrong result, a clear typed error
instead of a raw one, bounded caches. One test (or one parametrized test) per
item of the reliability issue; the launcher's items (hangs, signals, which
process failed) are in test_multihost.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax.testing import models
from conftest import TEST_CLUSTER
from helpers import NnxMlp, assert_tree_close, make_mesh, rel_err


def _auto_mesh(shape=(2, 4)):
  return make_mesh(shape, explicit=False)


# ------------------------------------------- 1: other shapes than planned
def test_planned_step_called_with_other_shapes_raises_not_replays():
  def evaluate(w, x, y):
    err = x @ w - y
    return {"mse": jnp.mean(err ** 2)}

  w = jnp.eye(16) * 0.5
  x = jnp.ones((64, 16))
  plan = ad.plan(evaluate, w, x, jnp.zeros((64, 16)), mesh=_auto_mesh(),
                 cluster=TEST_CLUSTER)
  step = plan.jit()
  assert rel_err(step(w, x, jnp.zeros((64, 16)))["mse"], 0.25) < 1e-6
  big = jnp.ones((128, 16))
  with pytest.raises(TypeError, match=r"other argument shapes or dtypes than "
                     r"it was planned for.*\[1\] planned float32\[64, 16\], "
                     r"given float32\[128, 16\].*ad.auto_shard"):
    step(w, big, jnp.zeros((128, 16)))
  # A train step fails the same way (it used to be jax's broadcasting error).
  ex = models.mlp(batch=32)
  train = ad.plan(ex.step, *ex.args, mesh=_auto_mesh(), cluster=TEST_CLUSTER)
  other = models.mlp(batch=64)
  with pytest.raises(TypeError, match=r"planned float32\[32, 64\], given "
                     r"float32\[64, 64\]"):
    train.jit()(*other.args)


# -------------------------------------------- 2: nnx in place through plan
def test_nnx_in_place_step_through_plan_updates_the_objects():
  def make():
    model = NnxMlp(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  def step(model, optimizer, batch):
    def mse(m):
      return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
    loss, grads = nnx.value_and_grad(mse)(model)
    optimizer.update(model, grads)
    return loss

  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(k1, (16, 32)),
           "y": jax.random.normal(k2, (16, 8))}
  model, opt = make()
  plan = ad.plan(step, model, opt, batch, mesh=_auto_mesh(),
                 cluster=TEST_CLUSTER)
  planned = plan.jit()
  ref_model, ref_opt = make()
  ref = nnx.jit(step)
  for _ in range(2):
    loss = planned(model, opt, batch)
    want = ref(ref_model, ref_opt, batch)
    assert rel_err(loss, want) <= 1e-5
  # The objects themselves moved (the old plan.jit() left them as they were).
  assert rel_err(model.l1.kernel[...], make()[0].l1.kernel[...]) > 1e-3
  assert_tree_close(nnx.state(model, nnx.Param),
                    nnx.state(ref_model, nnx.Param), 1e-5, "model")
  assert int(opt.step[...]) == 2
  # What XLA compiled for the plan (the update included) is the plan's.
  v = plan.verify()
  assert v.emitted_bytes == pytest.approx(sum(
      c.total_bytes_per_device for c in v.collectives))
  assert plan.cost.comm_bytes > 0 and v.emitted_bytes > 0


# ------------------------------------------- 3: custom derivative rules
def test_derivatives_of_the_planned_function_keep_custom_rules():
  @jax.custom_vjp
  def scale_grad(x):
    return x

  scale_grad.defvjp(lambda x: (x, None), lambda _, g: (g * 100.0,))

  @jax.custom_jvp
  def sin7(x):
    return jnp.sin(x)

  sin7.defjvp(lambda p, t: (jnp.sin(p[0]), t[0] * 7.0))

  def loss(w, x):
    return jnp.sum(scale_grad(x @ w) ** 2) + jnp.sum(sin7(w))

  w = jnp.full((16, 16), 0.1)
  x = jnp.ones((64, 16))
  plan = ad.plan(loss, w, x, mesh=_auto_mesh(), cluster=TEST_CLUSTER)
  planned = plan.jit()
  # rel 1e-5, as for every plan: a float32 sum of 1024 squares is ~5e-6 off
  # in either order (eager: 2647.0088, planned: 2646.9956, exact: 2646.997).
  assert rel_err(planned(w, x), loss(w, x)) <= 1e-5
  want = jax.grad(loss, argnums=(0, 1))(w, x)
  got = jax.grad(planned, argnums=(0, 1))(w, x)
  for g, r in zip(got, want):
    assert rel_err(g, r) <= 1e-5
  # The rules are really the user's: without them the gradient is 100x off.
  plain = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2) + jnp.sum(jnp.sin(w)))
  assert rel_err(plain(w, x), want[0]) > 0.5


# ------------------------------------------------------- 7: plan files
def _json_edit(fn):
  def edit(raw: bytes) -> bytes:
    data = json.loads(raw)
    fn(data)
    return json.dumps(data).encode()
  return edit


def _set(key, value):
  return _json_edit(lambda d: d.__setitem__(key, value))


@pytest.mark.parametrize("edit,match", [
    (lambda raw: bytes(range(256)) * 4, "not UTF-8"),
    (lambda raw: raw.replace(b'"format"', '"f\u00f6rmat"'.encode(
        "latin-1")), "not UTF-8"),
    (_set("fingerprint", None), "'fingerprint' is a NoneType"),
    (_json_edit(lambda d: d["fingerprint"].__setitem__("mesh", [2, 4])),
     "'fingerprint.mesh' is not"),
    (_set("choice", None), "'choice' is not a list of integers"),
    (_set("choice", [[0, 1]]), "'choice' is not a list of integers"),
    (_set("choice", ["0"]), "'choice' is not a list of integers"),
    (_set("arguments", {"a": 1}), "'arguments' is not a list"),
    (_json_edit(lambda d: d["arguments"].__setitem__(0, "x")),
     "argument entry 0 is not"),
    (_json_edit(lambda d: d["arguments"][1].__setitem__("shape", "64")),
     "argument entry 1 is not"),
    (_set("cost", "fast"), "'cost' is not an object of numbers"),
], ids=["binary", "latin-1", "fingerprint-null", "mesh-list", "choice-null",
        "choice-nested", "choice-str", "arguments-dict", "argument-str",
        "argument-shape", "cost-str"])
def test_corrupted_plan_files_raise_plan_file_error(saved, edit, match,
                                                    capsys):
  from autoddl_jax.__main__ import main
  ex, path = saved
  path.write_bytes(edit(path.read_bytes()))
  with pytest.raises(ad.PlanFileError, match=match):
    ad.load_plan(path, ex.step, *ex.args, mesh=make_mesh((2, 4)),
                 cluster=TEST_CLUSTER)
  # The CLI prints the message, not a traceback.
  assert main(["show", str(path)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "Traceback" not in err
  assert "corrupted" in err


# ------------------------------------------------ 8: inside jax.set_mesh
@pytest.mark.parametrize("where", ["plan-and-run-inside",
                                   "plan-inside-run-outside",
                                   "plan-outside-run-inside",
                                   "auto-shard-inside"])
@pytest.mark.parametrize("placed", [False, True], ids=["host", "placed"])
def test_planning_and_running_inside_set_mesh(where, placed):
  mesh = make_mesh((2, 4))  # Explicit axes, as jax.make_mesh makes them
  ex = models.mlp()
  want = jax.jit(ex.step)(*ex.args)
  args = jax.device_put(ex.args, NamedSharding(mesh, P())) if placed \
      else ex.args
  if where == "auto-shard-inside":
    with jax.set_mesh(mesh):
      got = ad.auto_shard(ex.step, mesh=mesh, cluster=TEST_CLUSTER)(*args)
  else:
    if where.startswith("plan-inside"):
      with jax.set_mesh(mesh):
        plan = ad.plan(ex.step, *args, mesh=mesh, cluster=TEST_CLUSTER)
    else:
      plan = ad.plan(ex.step, *args, mesh=mesh, cluster=TEST_CLUSTER)
    if where.endswith("inside") or where == "plan-and-run-inside":
      with jax.set_mesh(mesh):
        got = plan.jit()(*args)
    else:
      got = plan.jit()(*args)
  assert rel_err(got[2], want[2]) <= 1e-5
  assert_tree_close(got[0], want[0], 1e-5, "params")


def test_a_plan_saved_outside_set_mesh_loads_inside(tmp_path):
  mesh = make_mesh((2, 4))
  ex = models.mlp()
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
  plan.save(tmp_path / "plan.json")
  with jax.set_mesh(mesh):  # the same program, so the same fingerprint
    loaded = ad.load_plan(tmp_path / "plan.json", ex.step, *ex.args,
                          mesh=mesh, cluster=TEST_CLUSTER)
    got = loaded.jit()(*ex.args)
  assert loaded.choice == plan.choice
  assert rel_err(got[2], jax.jit(ex.step)(*ex.args)[2]) <= 1e-5


def test_a_plan_file_gets_the_umasks_permissions(tmp_path):
  import os
  import stat
  ex = models.mlp()
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((8,)),
                 cluster=TEST_CLUSTER)
  old = os.umask(0o022)
  try:
    plan.save(tmp_path / "plan.json")
  finally:
    os.umask(old)
  mode = stat.S_IMODE(os.stat(tmp_path / "plan.json").st_mode)
  assert mode == 0o644  # not mkstemp's private 0o600


# -------------------------------------------------- 9: memory_budget forms
def test_memory_budget_takes_the_cli_strings_and_refuses_bools():
  ex = models.mlp()
  mesh = _auto_mesh()
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                 memory_budget="16GiB")
  same = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER,
                 memory_budget=16 * 2**30)
  assert plan.choice == same.choice

  def never_traced(*args):
    raise AssertionError("the budget must be checked before tracing")

  with pytest.raises(TypeError, match="memory_budget must be a number of "
                     "bytes.*got bool True"):
    ad.plan(never_traced, *ex.args, mesh=mesh, memory_budget=True)
  with pytest.raises(ValueError, match=r"memory_budget='lots' is not a size"):
    ad.plan(never_traced, *ex.args, mesh=mesh, memory_budget="lots")
  with pytest.raises(ValueError, match="positive, finite"):
    ad.plan(never_traced, *ex.args, mesh=mesh, memory_budget=-1)
  with pytest.raises(TypeError, match="memory_budget must be a number"):
    ad.auto_shard(never_traced, mesh=mesh, memory_budget=False)


# ------------------------------------------------------------ 10: meshes
def test_meshes_with_non_integer_sizes_or_repeated_devices_are_refused():
  ex = models.mlp()
  for bad in (2.5, True, "2"):
    with pytest.raises(TypeError, match=r"mesh axis 'data' has size .*sizes "
                       "must be integers"):
      ad.plan(ex.step, *ex.args, mesh={"data": bad})
  assert ad.plan(ex.step, *ex.args, mesh={"data": np.int64(2)}).mesh_info \
      .axis_sizes == (2,)
  devices = np.array(jax.devices()[:4] + jax.devices()[:4]).reshape(2, 4)
  twice = jax.sharding.Mesh(devices, ("data", "model"))
  with pytest.raises(ValueError, match=r"mesh holds device\(s\) \[0, 1, 2, "
                     r"3\] more than once"):
    ad.plan(ex.step, *ex.args, mesh=twice)


# ------------------------------------------ 11: shardings as jax.jit takes
def test_cost_of_takes_jax_style_prefixes_and_flax_trees():
  mesh = _auto_mesh()
  x = jnp.ones((16, 8))

  def one(x):
    return jnp.sum(jnp.tanh(x))

  by_spec = ad.cost_of(one, x, mesh=mesh, in_shardings=P("data"))
  for s in (NamedSharding(mesh, P("data")), (P("data"),)):
    assert ad.cost_of(one, x, mesh=mesh, in_shardings=s) == by_spec
  w = {"a": jnp.ones((8, 8))}
  b = jnp.ones((8,))

  def three(w, b, x):
    return jnp.sum(jnp.tanh(x @ w["a"] + b))

  plan = ad.hand_plan(three, w, b, x, mesh=mesh,
                      in_shardings=(None, None, P("data")))
  assert plan.in_specs == ({"a": P()}, P(), P("data"))
  with pytest.raises(ValueError, match="pytree prefix of the arguments"):
    ad.cost_of(three, w, b, x, mesh=mesh, in_shardings=(None, P("data")))
  with pytest.raises(ValueError, match="pytree prefix of the results"):
    ad.cost_of(one, x, mesh=mesh, in_shardings=P("data"),
               out_shardings=(P(), P()))
  with pytest.raises(ValueError, match="unreduced .*cannot sit at a jit "
                     "boundary"):
    ad.cost_of(one, x, mesh=mesh, in_shardings=P("data"),
               out_shardings=P(unreduced={"data"}))


def test_hand_plan_takes_the_sharding_trees_flax_hands_out():
  mesh = _auto_mesh()
  x = jnp.ones((16, 4))
  init = linen.with_partitioning(linen.initializers.lecun_normal(),
                                 (None, "model"))
  module = linen.Dense(8, kernel_init=init)
  state = train_state.TrainState.create(
      apply_fn=module.apply, params=module.init(jax.random.key(0), x)[
          "params"], tx=optax.sgd(0.1))

  def linen_step(state, x):
    grads = jax.grad(lambda p: jnp.mean(
        state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  # nn.get_sharding of a boxed TrainState: Partitioned nodes in the arguments.
  plan = ad.hand_plan(linen_step, state, x, mesh=mesh,
                      in_shardings=(linen.get_sharding(state, mesh), None))
  assert plan.in_specs[0].params["kernel"].value == P(None, "model")

  class Lin(nnx.Module):
    def __init__(self, rngs):
      self.l = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), (None, "model")), rngs=rngs)

  with jax.set_mesh(mesh):
    graphdef, params = nnx.split(Lin(nnx.Rngs(0)))

  def nnx_step(params, x):
    return jnp.mean(nnx.merge(graphdef, params).l(x))

  plan = ad.hand_plan(nnx_step, params, x, mesh=mesh, in_shardings=(
      nnx.get_named_sharding(params, mesh), None))
  assert plan.in_specs[0]["l"]["kernel"].get_value() == P(None, "model")


# ------------------------------------- 12: str and static arguments
def test_a_str_argument_to_auto_shard_says_what_to_do():
  step = ad.auto_shard(lambda x, kind: jnp.sum(x), mesh=_auto_mesh())
  with pytest.raises(TypeError, match=r"argument leaf \[1\] is a str; "
                     "autoddl_jax plans over arrays.*functools.partial"):
    step(jnp.ones((8, 4)), "mse")


def test_jitted_functions_with_static_arguments_plan_with_them_static():
  def f(x, n):
    for _ in range(n):
      x = jnp.tanh(x @ x.T @ x)
    return jnp.sum(x)

  x = jnp.full((64, 16), 0.01)
  for jitted in (jax.jit(f, static_argnums=1),
                 jax.jit(f, static_argnames="n")):
    plan = ad.plan(jitted, x, 3, mesh=_auto_mesh(), cluster=TEST_CLUSTER)
    assert rel_err(plan.jit()(x, 3), f(x, 3)) <= 1e-5
    with pytest.raises(TypeError, match="static argument 1 is 4; the plan "
                       "was made with 3"):
      plan.jit()(x, 4)
    v = plan.verify()  # compiles from the plan's own tree (static nodes)
    assert v.xla_flops and v.xla_flops > 0
  step = ad.auto_shard(jax.jit(f, static_argnums=1), mesh=_auto_mesh(),
                       cluster=TEST_CLUSTER)
  assert rel_err(step(x, 2), f(x, 2)) <= 1e-5
  assert rel_err(step(x, 1), f(x, 1)) <= 1e-5
  assert len(step.plans) == 2  # one plan per static value


# ------------------------------------------ 13: inspection misuse
def test_inspection_misuse_is_a_clear_error():
  ex = models.mlp()
  plan = ad.plan(ex.step, *ex.args, mesh=_auto_mesh(), cluster=TEST_CLUSTER)
  with pytest.raises(ValueError, match="max_rows must be an int >= 0"):
    plan.explain(max_rows=-1)
  assert "more arguments" in plan.explain(max_rows=0)
  with pytest.raises(TypeError, match="takes a compiled program.*got "
                     "NoneType"):
    ad.collectives(None)
  lowered = plan.jit().lower(*ex.args)
  with pytest.raises(TypeError, match=r"needs a compiled program: pass "
                     r"lowered.compile\(\)"):
    ad.collectives(lowered)
  assert ad.collectives(lowered.compile()), "the plan shards: collectives"


# --------------------------------------------- 14: a bounded plan cache
def test_auto_shard_cache_is_bounded_and_clearable():
  def step(w, x):
    return jnp.sum(jnp.tanh(x @ w))

  w = jnp.ones((16, 16))
  fn = ad.auto_shard(step, mesh=_auto_mesh(), cluster=TEST_CLUSTER,
                     cache_size=2)

  def call(n):
    out = fn(w, jnp.ones((n, 16)))
    assert rel_err(out, step(w, jnp.ones((n, 16)))) < 1e-6
    return fn.plan

  first = {n: call(n) for n in (8, 16, 32)}
  assert len(fn.plans) == 2 and first[8] not in fn.plans.values()
  assert call(16) is first[16]  # a hit, now the most recently used
  assert call(8) is not first[8]  # dropped first, so planned again ...
  assert first[32] not in fn.plans.values()  # ... and 32 made room
  assert call(16) is first[16]
  fn.cache_clear()
  assert not fn.plans and fn.plan is None
  assert call(16) is not first[16]
  with pytest.raises(ValueError, match="cache_size must be a positive int"):
    ad.auto_shard(step, mesh=_auto_mesh(), cache_size=0)
