
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoddl_jax as ad
from autoddl_jax._factors import Aval
from autoddl_jax._graph import build_graph
from autoddl_jax._jaxpr import INLINE
from autoddl_jax._rules import eqn_flops
from conftest import TEST_CLUSTER
from helpers import build, make_mesh, rel_err


def _graph(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  n_in = len(closed.jaxpr.invars)
  return build_graph(closed, [f"in{i}" for i in range(n_in)],
                     [f"out{i}" for i in range(len(closed.jaxpr.outvars))])


@jax.custom_vjp
def _sin(x):
  return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def test_calls_are_opened():
  @jax.jit
  def inner(x):
    return jax.nn.relu(x) + _sin(x)

  def f(x):
    return jax.checkpoint(lambda y: inner(y) * 2)(x).sum()

  g = _graph(jax.value_and_grad(f), jnp.ones((4, 4)))
  prims = {op.prim for op in g.ops}
  assert not prims & INLINE
  assert {"max", "sin", "mul", "reduce_sum"} <= prims
  assert not g.unsupported


def test_scan_body_is_walked_once_with_its_trip_count():
  def f(w, x):
    y, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
    return y.sum()

  small = _graph(f, jnp.ones((3, 8, 8)), jnp.ones((4, 8)))
  big = _graph(f, jnp.ones((48, 8, 8)), jnp.ones((4, 8)))
  assert len(small.ops) == len(big.ops)
  dots = [op for op in big.ops if op.prim == "dot_general"]
  assert [op.weight for op in dots] == [48.0]
  assert dots[0].flops == 2 * 4 * 8 * 8


def test_cond_and_while_become_subgraphs():
  def f(x):
    y = jax.lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: a + 1, x)
    _, z = jax.lax.while_loop(lambda c: c[0] < 3,
                              lambda c: (c[0] + 1, c[1] * 2), (0, y))
    return z

  g = _graph(f, jnp.ones((4,)))
  halves = [op.prim for op in g.ops if op.kind == "eqn" and op.weight == 0.5]
  assert sorted(halves) == ["add", "mul"]  # one op in each of two branches
  assert [op.weight for op in g.ops if op.prim == "lt"] == [1.0]
  assert sum(op.prim == "~merge" for op in g.ops) >= 3


def test_flops():
  a = Aval((4, 6), np.dtype(np.float32))
  b = Aval((6, 8), np.dtype(np.float32))
  o = Aval((4, 8), np.dtype(np.float32))
  p = {"dimension_numbers": (((1,), (0,)), ((), ()))}
  assert eqn_flops("dot_general", [a, b], [o], p) == 2 * 4 * 6 * 8
  assert eqn_flops("exp", [a], [a], {}) == 24


@pytest.mark.parametrize("stride,kernel", [(1, 3), (2, 3), (2, 7), (1, 1)])
def test_conv_flops_are_counted_as_xla_counts_them(stride, kernel):
  # XLA counts only the (output, kernel) positions that land on the input,
  # not on padding or between a dilated input's points (the backward's
  # convs): the zoo ResNet's FLOPs were 13% over cost_analysis's before.
  from jax import lax

  def conv(x, w):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                    dimension_numbers=("NHWC", "HWIO",
                                                       "NHWC"))

  def step(x, w):  # forward and both backward convs
    return jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), (0, 1))(x, w)

  x = jnp.zeros((2, 14, 14, 32))
  w = jnp.zeros((kernel, kernel, 32, 64))
  closed = jax.make_jaxpr(step)(x, w)
  ours = sum(eqn_flops(e.primitive.name,
                       [Aval(v.aval.shape, v.aval.dtype) for v in e.invars],
                       [Aval(v.aval.shape, v.aval.dtype) for v in e.outvars],
                       e.params)
             for e in closed.jaxpr.eqns
             if e.primitive.name == "conv_general_dilated")
  cost = jax.jit(step).lower(x, w).compile().cost_analysis()
  xla = cost[0]["flops"] if isinstance(cost, list) else cost["flops"]
  # XLA's total also holds the elementwise ops (a few per element).
  assert ours == pytest.approx(xla, rel=0.03)
  assert ours <= xla


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("model", ["mlp", "gpt_scan", "vgg", "moe"])
def test_real_train_steps_need_no_fallback(model, opt):
  tx = {"sgd": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(1e-3),
        "adamw": optax.adamw(1e-3)}[opt]
  ex = build(model, optimizer=tx, abstract=True)
  g = _graph(ex.step, *ex.args)
  assert not g.unsupported


def test_unsupported_primitive_falls_back_to_replicated_with_one_warning():
  def f(a, x):
    l = jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(8))
    return (l @ x).sum()

  a = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (8, 16))
  with pytest.warns(ad.UnsupportedPrimitiveWarning, match="cholesky") as w:
    plan = ad.plan(f, a, x, mesh=make_mesh((2, 4)), cluster=TEST_CLUSTER)
  assert len([m for m in w if "cholesky" in str(m.message)]) == 1
  assert rel_err(plan.jit()(a, x), f(a, x)) < 1e-5
  assert "cholesky" in plan.explain()


def test_graph_and_jaxpr_walk_share_equation_addresses():
  # The lowering finds the plan's ops by address (``graph.eqn_op``); the
  # addresses come from one scheme (``_jaxpr.bodies``): every equation the
  # walk yields is an op of the graph under the same address.
  from autoddl_jax._jaxpr import equations

  @jax.custom_jvp
  def soft(x):
    return jnp.tanh(x)

  soft.defjvp(lambda p, t: (soft(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))

  def f(w, x):
    def layer(h, wi):
      return jax.jit(lambda a, b: soft(a @ b))(h, wi), jnp.sum(h)
    h, _ = jax.lax.scan(layer, x, w)
    h = jax.lax.cond(h.sum() > 0, lambda a: a * 2.0, lambda a: -a, h)
    return jnp.sum(h)

  def g(w, x):  # a forward with a while loop (reverse mode cannot take it)
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 1.5,
                                                            c[1] + 1),
                              (f(w, x), 0))[0]

  w = jnp.ones((3, 8, 8))
  x = jnp.ones((4, 8))
  closed = jax.make_jaxpr(lambda w, x: (jax.grad(f)(w, x), g(w, x)))(w, x)
  graph = build_graph(closed, ["w", "x"], ["dw", "y"])
  addresses = [a for a, _ in equations(closed.jaxpr)]
  assert len(addresses) == len(set(addresses))
  assert set(addresses) == set(graph.eqn_op)
  assert any(len(a) >= 3 for a in addresses)  # bodies inside bodies
  assert any("body" in a for a in addresses)


def test_plain_calls_are_spliced_into_their_caller():
  # jnp's helpers and users' nested jax.jit calls join the jaxpr that calls
  # them (at any depth, inside loop bodies too): same values, same source
  # information, no call left -- so a partial-sum region can span them.
  import numpy as np
  from jax.extend import core as jcore

  from autoddl_jax._jaxpr import PLAIN_CALLS, bodies, equations
  from autoddl_jax._jaxpr import inline_plain_calls

  table = np.arange(12.0, dtype=np.float32).reshape(4, 3)

  @jax.jit
  def helper(x):
    return x * jnp.asarray(table)[0], 2.0  # a const and a literal result

  def f(w, xs):
    def body(c, x):
      y, two = helper(x)
      z, _ = helper(x * 3.0)  # one traced body, two call sites
      return c + y.sum() * two + z.sum(), jax.jit(jnp.tanh)(y) + z
    c, ys = jax.lax.scan(body, 0.0, xs)
    e = jnp.zeros((4, 3)).at[jnp.array([0, 2])].add(w)  # jnp's jitted scatter
    return c + ys.sum() + e.sum()

  w = jnp.ones((2, 3))
  xs = jnp.arange(15.0).reshape(5, 3)
  closed = jax.make_jaxpr(jax.value_and_grad(f))(w, xs)
  flat = inline_plain_calls(closed)
  names = lambda c: [e.primitive.name for _, e in equations(c.jaxpr)]  # noqa

  def calls(jaxpr):  # every call's name, at any depth
    out = []
    for e in jaxpr.eqns:
      out += [e.primitive.name] if e.primitive.name in PLAIN_CALLS else []
      for _, sub, _ in bodies(e, ()):
        out += calls(sub)
    return out

  assert len(calls(closed.jaxpr)) >= 2 and not calls(flat.jaxpr)
  assert names(closed) == names(flat)  # the same equations, in order
  jcore.check_jaxpr(flat.jaxpr)  # well-typed, every var bound
  want = jcore.jaxpr_as_fun(closed)(w, xs)
  got = jcore.jaxpr_as_fun(flat)(w, xs)
  for a, b in zip(want, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  infos = {id(e.source_info) for _, e in equations(closed.jaxpr)}
  assert all(id(e.source_info) in infos for _, e in equations(flat.jaxpr))
  assert inline_plain_calls(flat) is flat  # nothing left to splice
