"""``@ad.auto_shard`` on flax.nnx (functional and in-place) and flax.linen
steps, and plans saved and loaded."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import autoddl_jax as ad
from conftest import TEST_CLUSTER
from helpers import NnxMlp as Mlp, make_mesh, rel_err

OPTIMIZERS = {"adam": lambda: optax.adam(1e-2), "adamw": lambda: optax.adamw(
    1e-2, weight_decay=0.1)}


def _batch(n=16, seed=1):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(k1, (n, 32)),
          "y": jax.random.normal(k2, (n, 8))}


def _mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _close(a, b, tol=1e-5):
  assert rel_err(a, b) <= tol, (float(a), float(b))


# ---------------------------------------------------------------- nnx
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_nnx_functional_step(opt):
  def make():
    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPTIMIZERS[opt](), wrt=nnx.Param)
    return nnx.split((model, optimizer))

  graphdef, state = make()

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(_mse)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  planned = ad.auto_shard(step, mesh=make_mesh((2, 4), explicit=False),
                          cluster=TEST_CLUSTER)
  ref_state = make()[1]
  ref = jax.jit(step)
  for i in range(2):
    state, loss = planned(state, _batch(seed=i))
    ref_state, ref_loss = ref(ref_state, _batch(seed=i))
    _close(loss, ref_loss)
  assert len(planned.plans) == 1  # the second call did not re-plan
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    _close(a, b, 1e-4)  # after two adam steps (sign-like updates)
  specs = planned.plan.param_specs()
  assert isinstance(specs, nnx.State)
  planned(state, _batch(n=32))  # a new batch shape plans again
  assert len(planned.plans) == 2


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_nnx_in_place_step(opt):
  def make():
    model = Mlp(nnx.Rngs(0))
    return model, nnx.Optimizer(model, OPTIMIZERS[opt](), wrt=nnx.Param)

  def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_mse)(model, batch)
    optimizer.update(model, grads)
    return loss

  model, optimizer = make()
  ref_model, ref_opt = make()
  planned = ad.auto_shard(mesh=make_mesh((4, 2)), cluster=TEST_CLUSTER)(step)
  ref = nnx.jit(step)
  for i in range(3):
    loss = planned(model, optimizer, _batch(seed=i))
    ref_loss = ref(ref_model, ref_opt, _batch(seed=i))
    _close(loss, ref_loss)
  assert len(planned.plans) == 1
  _close(model.l1.kernel[...], ref_model.l1.kernel[...], 1e-4)
  assert int(optimizer.step[...]) == 3  # updated in place


# -------------------------------------------------------------- linen
class LinenMlp(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(8)(jax.nn.relu(linen.Dense(64)(x)))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_linen_train_state_step(opt):
  model = LinenMlp()

  def make():
    params = model.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=OPTIMIZERS[opt]())

  def step(state, batch):
    def loss_fn(p):
      out = state.apply_fn({"params": p}, batch["x"])
      return jnp.mean((out - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  planned = ad.auto_shard(step, mesh=make_mesh((8,), explicit=False),
                          cluster=TEST_CLUSTER, donate_argnums=0)
  state, ref_state = make(), make()
  ref = jax.jit(step)
  for i in range(2):
    state, loss = planned(state, _batch(seed=i))
    ref_state, ref_loss = ref(ref_state, _batch(seed=i))
    _close(loss, ref_loss)
  assert len(planned.plans) == 1
  # Planned as the donating jax.jit it runs as: the new state takes no
  # memory of its own in the model.
  assert planned.plan.problem.donated
  # The optimizer moments follow their parameters' layouts.
  p_specs = planned.plan.param_specs().params
  mu_specs = planned.plan.param_specs().opt_state[0].mu
  assert jax.tree.leaves(p_specs) == jax.tree.leaves(mu_specs)


def test_bare_decorator_plans_over_all_devices():
  @ad.auto_shard
  def step(w, x):
    return jnp.tanh(x @ w).sum()

  w, x = jnp.ones((32, 16)), jnp.ones((64, 32))
  _close(step(w, x), jnp.tanh(x @ w).sum())
  assert dict(step.mesh.shape) == {"data": jax.device_count()}


def test_placed_arguments_are_not_copied():
  mesh = make_mesh((8,), explicit=False)

  @ad.auto_shard(mesh=mesh, cluster=TEST_CLUSTER)
  def step(w, x):
    return w * 2.0, (x @ w).sum()

  w, x = jnp.ones((32, 16)), jnp.ones((64, 32))
  step(w, x)
  placed = jax.device_put(w, step.plan.in_shardings[0])
  assert ad._auto._place(placed, step.plan.in_shardings[0]) is placed


def test_auto_shard_rejects_an_abstract_mesh():
  with pytest.raises(TypeError, match="concrete jax.sharding.Mesh"):
    ad.auto_shard(lambda x: x, mesh=jax.sharding.AbstractMesh((8,), ("d",)))


def test_logical_rules_where_exact_and_conflicts_named():
  from jax.sharding import PartitionSpec as P
  mesh = make_mesh((2, 4), explicit=False)
  w = {"a": jnp.ones((512, 2048)), "b": jnp.ones((2048, 512))}
  x = jnp.ones((8, 512))

  def step(w, x):
    loss = lambda w: jnp.sum(jax.nn.relu(x @ w["a"]) @ w["b"])  # noqa: E731
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, jax.grad(loss)(w))

  # 8 MiB of weights in a 4 MiB budget: the plan must split them (without
  # one, replicated arguments sliced on the device cost the same as split
  # ones, and which the search returns is a tie).
  plan = ad.plan(step, w, x, mesh=mesh, cluster=TEST_CLUSTER,
                 memory_budget="4MiB")
  specs = plan.param_specs()
  # Name each dim after its own placement: always consistent.
  logical = {k: P(*[f"{k}{d}" for d in range(2)]) for k in w}
  rules = dict(plan.logical_rules(logical))
  for k in w:
    for d in range(2):
      want = specs[k][d] if d < len(specs[k]) else None
      assert rules[f"{k}{d}"] == want
  # One name for every dim: consistent only if the plan splits none.
  flat = {k: P("x", "x") for k in w}
  assert any(e is not None for s in specs.values() for e in s), specs
  with pytest.raises(ValueError, match="splits these names differently"):
    plan.logical_rules(flat)
