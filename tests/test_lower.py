"""The lowering: XLA runs what the plan says. Partial sums kept through
linear ops are reduced where the plan reduces them, not at the dot that made
them; a scatter keeps the layout the plan gave it. Each case is checked for
numerics against the unsharded program and for what XLA emitted."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax import _hlo, _pins
from conftest import TEST_CLUSTER
from helpers import make_mesh, rel_err

CLUSTER = ad.Cluster(devices_per_node=8, intra_node_bandwidth=1e9,
                     intra_node_latency=1e-6)


def _grouped_heads(x, w):
  # Grouped-query attention's backward in miniature: a contraction over a
  # split dim (a partial sum), a transpose, a reshape that groups heads, and
  # a sum over the group that makes the result 4x smaller.
  q = jnp.einsum("btk,kh->bth", x, w)  # (8, 16, 128)
  q = jnp.transpose(q.reshape(8, 16, 4, 4, 8), (0, 2, 1, 3, 4))
  return q.sum(axis=3)  # (8, 4, 16, 8)


def _args():
  k1, k2 = jax.random.split(jax.random.key(0))
  return (jax.random.normal(k1, (8, 16, 64), jnp.float32),
          jax.random.normal(k2, (64, 128), jnp.float32))


def test_a_partial_sum_is_reduced_after_the_linear_ops_that_carry_it():
  mesh = make_mesh((8,), explicit=False)
  x, w = _args()
  plan = ad.hand_plan(_grouped_heads, x, w, mesh=mesh, cluster=CLUSTER,
                      in_shardings=(P(None, None, "data"), P("data", None)))
  regions = set(map(id, _pins.regions(plan.program, plan.choice).values()))  # noqa: SLF001
  assert any(len(r.members) >= 4 for r in _pins.regions(plan.program, plan.choice).values()), regions
  compiled = plan.jit().lower(x, w).compile()
  got = compiled(x, w)
  assert rel_err(got, jax.jit(_grouped_heads)(x, w)) <= 1e-5
  cols = _hlo.collectives(compiled)
  # One reduction, of the summed (8, 4, 16, 8) result: 4x smaller than the
  # dot's (8, 16, 128), which is what XLA reduces when left to itself.
  assert len(cols) == 1, cols
  assert cols[0].operand_shapes[0] in ((8, 4, 16, 8), (1, 4, 16, 8)), cols
  v = plan.verify()
  for kind, (pred, emitted) in v.by_kind.items():
    assert pred == pytest.approx(emitted, rel=0.01), (kind, v.by_kind)


def _scanned(x, ws):
  def layer(c, w):
    return jnp.tanh(c @ w), None
  return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)


def test_a_loop_result_is_pinned_to_the_layout_the_plan_gave_it():
  # The reshard the plan puts at a loop's exit has no op of its own to pin
  # it; left alone XLA moved it (the zoo Llama's backward loop returned the
  # embedding's updates sharded, and XLA scattered them per device and
  # all-reduced the whole table where the plan had gathered the updates).
  mesh = make_mesh((2, 4), explicit=False)
  x = jax.random.normal(jax.random.key(1), (16, 32), jnp.float32)
  ws = jax.random.normal(jax.random.key(2), (3, 32, 32), jnp.float32) / 6
  step = jax.grad(_scanned, argnums=(0, 1))
  plan = ad.plan(step, x, ws, mesh=mesh, cluster=CLUSTER)
  pins = _pins.pins(plan.program, plan.choice, plan.program.auto_mesh())
  closed = plan.traced.closed  # noqa: SLF001
  loops = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  assert loops
  for e in loops:
    for v in e.outvars:
      assert ((), v) in pins.outputs, v
  got = plan.jit()(x, ws)
  want = jax.jit(step)(x, ws)
  for a, b in zip(got, want):
    assert rel_err(a, b) <= 1e-5
  v = plan.verify()
  for kind, (pred, emitted) in v.by_kind.items():
    assert pred == pytest.approx(emitted, rel=0.1), (kind, v.by_kind)


def test_a_partial_sum_is_handed_between_regions_stacked():
  # A chain split in two regions (a result of the first is wanted before
  # the second ends): the partial sum crosses as a stacked value, one addend
  # per device on a leading dim, and is reduced once, at the end.
  from jax.sharding import NamedSharding

  from autoddl_jax import _lower, _regions
  from autoddl_jax._cluster import mesh_info
  mesh = make_mesh((8,), explicit=False)
  x = jax.random.normal(jax.random.key(4), (4, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(5), (64, 16), jnp.float32)
  f = lambda x, w: (x @ w) * 2.0  # noqa: E731
  closed = jax.make_jaxpr(f)(x, w)
  assert [e.primitive.name for e in closed.jaxpr.eqns] == ["dot_general",
                                                           "mul"]
  P_, B_ = -2, -1
  first = _regions.Region(((0,),), {((0,), 0): (1,), ((0,), 1): (0,)},
                        {((0,), 0): (P_,)}, {},
                        stacked_out={((0,), 0): (P_,)})
  steps, spec = _regions.reductions((P_,), (B_,), 4 * 16 * 4, (4, 16),
                                  mesh_info(mesh, ad.Cluster()))
  second = _regions.Region(((1,),), {}, {((1,), 0): (P_,)},
                         {((1,), 0): (steps, spec)},
                         stacked_in={((1,), 0): (P_,)})
  pins = _lower.Pins(mesh, {}, {}, {}, {(0,): first, (1,): second})
  run = jax.jit(lambda x, w: _lower.interpret(
      closed.jaxpr, closed.consts, [x, w], (), pins)[0],
      in_shardings=(NamedSharding(mesh, P(None, "data")),
                    NamedSharding(mesh, P("data", None))))
  compiled = run.lower(x, w).compile()
  assert rel_err(compiled(x, w), f(x, w)) <= 1e-5
  cols = _hlo.collectives(compiled)
  assert [(c.kind, c.operand_shapes[0]) for c in cols] == [
      ("all-reduce", (4, 16))], cols


def _embedding_grad(table, ids, w):
  def loss(table):
    return jnp.sum(jnp.tanh(table[ids] @ w) ** 2)
  return jax.grad(loss)(table)


def test_a_partial_sum_is_scattered_into_the_table_before_it_is_reduced():
  # An embedding's gradient in miniature: the updates reach the scatter-add
  # as a partial sum (a contraction over the column-split weight's dim), and
  # the plan scatters each device's addend into its own zero table (B -> P
  # on the device) and reduces the 16x32 table, not the 64x32x32 updates --
  # what XLA did when the region stopped at the scatter (the zoo MoE's FSDP
  # plan: a 1.8 GiB all-reduce where the plan reduced 0.2 GiB).
  mesh = make_mesh((8,), explicit=False)
  table = jax.random.normal(jax.random.key(6), (16, 32), jnp.float32)
  ids = jax.random.randint(jax.random.key(7), (64, 32), 0, 16)
  w = jax.random.normal(jax.random.key(8), (32, 64), jnp.float32) / 6
  plan = ad.hand_plan(_embedding_grad, table, ids, w, mesh=mesh,
                      cluster=CLUSTER,
                      in_shardings=(P(), P(), P(None, "data")))
  regions = {id(r): r for r in _pins.regions(plan.program, plan.choice).values()}  # noqa: SLF001
  eqns = plan.traced.closed.jaxpr.eqns  # noqa: SLF001
  held = {eqns[k[-1]].primitive.name for r in regions.values()
          for k in r.members if len(k) == 1}
  assert "scatter-add" in held, held
  compiled = plan.jit().lower(table, ids, w).compile()
  assert rel_err(compiled(table, ids, w),
                 jax.jit(_embedding_grad)(table, ids, w)) <= 1e-5
  reduced = [c.operand_shapes[0] for c in _hlo.collectives(compiled)
             if c.kind in ("all-reduce", "reduce-scatter")]
  assert reduced and all(s == (16, 32) for s in reduced), reduced


def test_a_stacked_result_is_resharded_inside_the_loop():
  # A scan's stacked result that the plan stacks in another layout than
  # the body makes it: the reshard is pinned inside the body, per
  # iteration, as costed. Left to XLA with only the loop's result pinned,
  # it stacks the values as made and reshards the whole stack after the
  # loop (the zoo Llama's backward: 128 MiB gathered on top of the
  # per-iteration gathers another consumer needed).
  from jax.sharding import NamedSharding

  from autoddl_jax import _lower
  mesh = make_mesh((8,), explicit=False)
  xs = jax.random.normal(jax.random.key(9), (4, 64, 32), jnp.float32)

  def f(xs):
    return jax.lax.scan(lambda c, x: (c, jnp.sin(x)), 0.0, xs)[1]

  closed = jax.make_jaxpr(f)(xs)
  (scan,) = closed.jaxpr.eqns
  ys = scan.outvars[-1]
  for staged in (False, True):
    inputs = {((0,), ("ys", 0)): ((-1,),)} if staged else {}
    pins = _lower.Pins(mesh, {((), ys): (-1,)}, inputs, {}, {})
    run = jax.jit(lambda xs: _lower.interpret(
        closed.jaxpr, closed.consts, [xs], (), pins)[0],
        in_shardings=NamedSharding(mesh, P(None, "data")))
    compiled = run.lower(xs).compile()
    assert rel_err(compiled(xs), f(xs)) <= 1e-6
    gathers = [(c.operand_shapes[0], c.count)
               for c in _hlo.collectives(compiled) if c.kind == "all-gather"]
    if staged:
      assert gathers == [((8, 32), 4)], gathers
    else:
      assert gathers and all(count == 1 for _, count in gathers), gathers


def test_readers_of_one_value_share_its_reshard():
  # FSDP on (2, 4): each weight is gathered (a staged multi-axis reshard)
  # for the forward's dot and read again, whole, by the backward's. The
  # plan gathers it once and keeps it; with one chain of constraints per
  # reader XLA emitted the last all-gather once per reader.
  import optax  # noqa: PLC0415 (only this test trains)
  mesh = make_mesh((2, 4), explicit=False)
  layers, d, f = 4, 256, 1024

  def loss(params, x):
    h = x
    for w1, w2 in params:
      h = h + jax.nn.gelu(h @ w1) @ w2
    return jnp.mean(h ** 2)

  tx = optax.sgd(0.1)

  def step(params, opt, x):
    value, g = jax.value_and_grad(loss)(params, x)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), opt, value

  ks = jax.random.split(jax.random.key(0), 2 * layers + 1)
  params = [(jax.random.normal(ks[2 * i], (d, f)) / 16,
             jax.random.normal(ks[2 * i + 1], (f, d)) / 32)
            for i in range(layers)]
  x = jax.random.normal(ks[-1], (64, d))
  opt = tx.init(params)
  split = P(("data", "model"))
  specs = ([(P(None, ("data", "model")), split)] * layers,
           jax.tree.map(lambda _: P(), opt), split)
  plan = ad.hand_plan(step, params, opt, x, mesh=mesh, cluster=CLUSTER,
                      in_shardings=specs)
  v = plan.verify()
  pred, emitted = v.by_kind["all-gather"]
  assert emitted == pytest.approx(pred, rel=1e-6)
  got, want = plan.jit()(params, opt, x), jax.jit(step)(params, opt, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, w) <= 1e-5


def _adam_step(params, opt, x):
  # An FSDP step in miniature: layers in a scan, and an Adam-like update that
  # reads each gradient twice (its moment and its square).
  def loss(p):
    h = jnp.tanh(x @ p["w_in"])
    h = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, p["layers"])[0]
    return jnp.mean((h @ p["w_out"]) ** 2)
  g = jax.grad(loss)(params)
  mu = jax.tree.map(lambda m, d: 0.9 * m + 0.1 * d, opt["mu"], g)
  nu = jax.tree.map(lambda v, d: 0.99 * v + 0.01 * d * d, opt["nu"], g)
  new = jax.tree.map(lambda p, m, v: p - 0.01 * m / (jnp.sqrt(v) + 1e-8),
                     params, mu, nu)
  return new, {"mu": mu, "nu": nu}


def test_gradient_reduce_scatters_are_combined_and_costed_so():
  # FSDP: each weight gradient is a partial sum over the batch's axis that
  # the optimizer wants split. Reduced as a psum and the device's slice, XLA
  # merges them into one collective per loop body (and one outside), as it
  # merges DP's all-reduces, and reads as reduce-scatters; the model prices
  # them that way (one latency per group), so the completion reduce-scatters
  # every gradient rather than all-reducing the small ones and slicing.
  mesh = make_mesh((8,), explicit=False)
  ks = jax.random.split(jax.random.key(3), 4)
  params = {"w_in": jax.random.normal(ks[0], (32, 64)) / 6,
            "layers": jax.random.normal(ks[1], (3, 64, 64)) / 8,
            "w_out": jax.random.normal(ks[2], (64, 16)) / 8}
  opt = {"mu": jax.tree.map(jnp.zeros_like, params),
         "nu": jax.tree.map(jnp.ones_like, params)}
  x = jax.random.normal(ks[3], (64, 32))
  fsdp = {"w_in": P("data", None), "layers": P(None, "data", None),
          "w_out": P("data", None)}
  plan = ad.hand_plan(_adam_step, params, opt, x, mesh=mesh,
                      cluster=TEST_CLUSTER, in_shardings=(fsdp, {"mu": fsdp, "nu": fsdp},
                                    P("data", None)))
  compiled = plan.jit().lower(params, opt, x).compile()
  got = compiled(params, opt, x)
  want = jax.jit(_adam_step)(params, opt, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a, b) <= 1e-5
  v = plan.verify()
  for kind, (pred, emitted) in v.by_kind.items():
    assert pred == pytest.approx(emitted, rel=0.01), (kind, v.by_kind)
  rs = [c for c in _hlo.collectives(compiled) if c.kind == "reduce-scatter"]
  # The three weights' gradients: one collective in the backward loop's
  # body, one for the two outside it.
  assert sorted(len(c.shapes) for c in rs) == [1, 2], rs
  assert v.emitted_comm_s == pytest.approx(plan.cost.comm_s, rel=0.01)


@pytest.mark.parametrize("mesh_shape,mode", [((8,), None), ((8,), "clip"),
                                             ((2, 4), "fill")])
def test_a_table_split_over_its_rows_is_looked_up_on_each_devices_rows(
    mesh_shape, mode):
  # An embedding split over its vocabulary (Megatron's): each device looks
  # up the rows it owns and zeros the rest, a partial sum the plan carries
  # on and reduces later. Left to XLA (a gather the regions could not run),
  # every chain of partial sums reaching it was reduced where each op made
  # it: the zoo T5's Megatron plan on (4, 2) gathered and reduce-scattered
  # 2x what the plan costed. Out-of-bounds ids keep their meaning (clamped,
  # or the fill value once).
  from jax.sharding import NamedSharding

  from autoddl_jax import _lower, _regions
  from autoddl_jax._cluster import mesh_info
  mesh = make_mesh(mesh_shape, explicit=False)
  table = jax.random.normal(jax.random.key(9), (16, 32), jnp.float32)
  ids = jax.random.randint(jax.random.key(10), (8, 4), -3 if mode else 0,
                           19 if mode else 16)
  if mode is None:
    f = lambda table, ids: table[ids] * 2.0  # noqa: E731
  else:
    f = lambda table, ids: table.at[ids].get(  # noqa: E731
        mode=mode, fill_value=-7.0) * 2.0
  closed = jax.make_jaxpr(f)(table, ids)
  names = [e.primitive.name for e in closed.jaxpr.eqns]
  gk, mk = (names.index("gather"),), (len(names) - 1,)
  assert names[-1] == "mul", names
  P_, B_ = -2, -1
  split = (0,) * len(mesh_shape)  # the rows over every mesh axis
  part = (P_,) * len(mesh_shape)
  steps, spec = _regions.reductions(part, (B_,) * len(mesh_shape),
                                    8 * 4 * 32 * 4, (8, 4, 32),
                                    mesh_info(mesh, ad.Cluster()))
  region = _regions.Region(
      (gk, mk), {(gk, 0): split, (gk, 1): (B_,) * len(mesh_shape)},
      {(gk, 0): part, (mk, 0): part}, {(mk, 0): (steps, spec)},
      gather_codes={gk: split})
  pins = _lower.Pins(mesh, {}, {}, {}, {gk: region, mk: region})
  run = jax.jit(lambda table, ids: _lower.interpret(
      closed.jaxpr, closed.consts, [table, ids], (), pins)[0],
      in_shardings=(NamedSharding(mesh, P(mesh.axis_names)),
                    NamedSharding(mesh, P())))
  compiled = run.lower(table, ids).compile()
  got, want = compiled(table, ids), f(table, ids)
  assert jnp.array_equal(got, want), (got, want)
  cols = _hlo.collectives(compiled)
  # Only the looked-up rows are reduced; the table is never gathered.
  assert [(c.kind, c.operand_shapes[0]) for c in cols] == [
      ("all-reduce", (8, 4, 32))], cols


def test_a_partial_sum_moves_its_split_dim_inside_a_region():
  # S(1) -> S(0) over one axis while the other keeps the partial sum: one
  # all-to-all inside the region (the zoo MoE's Megatron and the Llama's
  # FSDP on (4, 2) move these). The regions could not write it before, and
  # XLA reduced the whole chain at its dots.
  import types

  from jax.sharding import NamedSharding

  from autoddl_jax import _lower, _regions
  from autoddl_jax._cluster import mesh_info
  P_, B_ = -2, -1
  pinning = types.SimpleNamespace(mesh_info=types.SimpleNamespace(
      axis_names=("data", "model")))
  steps = _pins._Pinning._inner_steps(pinning, (1, P_), (0, P_))  # noqa: SLF001
  assert steps == (("all_to_all", ("data",), (1, 0)),), steps
  mesh = make_mesh((2, 4), explicit=False)
  x = jax.random.normal(jax.random.key(11), (8, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(12), (64, 16), jnp.float32)
  f = lambda x, w: (x @ w) * 2.0  # noqa: E731
  closed = jax.make_jaxpr(f)(x, w)
  red, spec = _regions.reductions((0, P_), (0, B_), 8 * 16 * 4, (8, 16),
                                  mesh_info(mesh, ad.Cluster()))
  region = _regions.Region(
      ((0,), (1,)), {((0,), 0): (B_, 1), ((0,), 1): (1, 0)},
      {((0,), 0): (1, P_), ((1,), 0): (0, P_)}, {((1,), 0): (red, spec)},
      slices={((1,), 0): steps})
  pins = _lower.Pins(mesh, {}, {}, {}, {(0,): region, (1,): region})
  run = jax.jit(lambda x, w: _lower.interpret(
      closed.jaxpr, closed.consts, [x, w], (), pins)[0],
      in_shardings=(NamedSharding(mesh, P(None, "model")),
                    NamedSharding(mesh, P("model", "data"))))
  compiled = run.lower(x, w).compile()
  assert rel_err(compiled(x, w), f(x, w)) <= 1e-5
  kinds = sorted(c.kind for c in _hlo.collectives(compiled))
  assert kinds == ["all-reduce", "all-to-all"], kinds


@pytest.mark.parametrize("op", ["slice", "dynamic_slice"])
def test_a_partial_sum_is_sliced_on_blocks(op):
  # A slice of a partial sum is the partial sum of the slice: the region
  # slices each block, a split dim (taken whole) at the block's size (the
  # ViT's class token under Megatron: one slice the blocks could not run
  # left the whole chain to XLA).
  from jax.sharding import NamedSharding

  from autoddl_jax import _lower, _regions
  from autoddl_jax._cluster import mesh_info
  P_, B_ = -2, -1
  mesh = make_mesh((2, 4), explicit=False)
  x = jax.random.normal(jax.random.key(13), (8, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(14), (64, 16), jnp.float32)
  if op == "slice":
    f = lambda x, w: (x @ w)[:, 2:10]  # noqa: E731
  else:
    f = lambda x, w: jax.lax.dynamic_slice(x @ w, (0, 3), (8, 8))  # noqa: E731
  closed = jax.make_jaxpr(f)(x, w)
  names = [e.primitive.name for e in closed.jaxpr.eqns]
  assert names == ["dot_general", op], names
  red, spec = _regions.reductions((0, P_), (0, B_), 8 * 8 * 4, (8, 8),
                                  mesh_info(mesh, ad.Cluster()))
  region = _regions.Region(
      ((0,), (1,)), {((0,), 0): (0, 1), ((0,), 1): (B_, 0)},
      {((0,), 0): (0, P_), ((1,), 0): (0, P_)}, {((1,), 0): (red, spec)})
  pins = _lower.Pins(mesh, {}, {}, {}, {(0,): region, (1,): region})
  run = jax.jit(lambda x, w: _lower.interpret(
      closed.jaxpr, closed.consts, [x, w], (), pins)[0],
      in_shardings=(NamedSharding(mesh, P("data", "model")),
                    NamedSharding(mesh, P("model", None))))
  compiled = run.lower(x, w).compile()
  assert rel_err(compiled(x, w), f(x, w)) <= 1e-5
  # Only the slice is reduced: 8 of the dot's 16 columns.
  assert [(c.kind, c.operand_shapes[0]) for c in _hlo.collectives(compiled)
          ] == [("all-reduce", (4, 8))]


def test_a_partial_table_looked_up_out_of_bounds_fills_once():
  # A table that is itself a partial sum (a dot's result, its contraction
  # split over the second axis) looked up with mode="fill": every device of
  # that axis holds an addend of each row, but the fill value belongs to
  # the sum once. Each device filled before, and the reduction summed the
  # fill value once per device of the partial axis.
  from jax.sharding import NamedSharding

  from autoddl_jax import _lower, _regions
  from autoddl_jax._cluster import mesh_info
  mesh = make_mesh((2, 2), explicit=False)
  a = jax.random.normal(jax.random.key(11), (16, 8), jnp.float32)
  b = jax.random.normal(jax.random.key(12), (8, 32), jnp.float32)
  ids = jax.random.randint(jax.random.key(13), (8, 4), -3, 19)
  f = lambda a, b, ids: (a @ b).at[ids].get(  # noqa: E731
      mode="fill", fill_value=-7.0) * 2.0
  closed = jax.make_jaxpr(f)(a, b, ids)
  names = [e.primitive.name for e in closed.jaxpr.eqns]
  dk, gk, mk = ((names.index("dot_general"),), (names.index("gather"),),
                (len(names) - 1,))
  assert names[-1] == "mul", names
  P_, B_ = -2, -1
  table = (0, P_)  # rows over the first axis, partial over the second
  steps, spec = _regions.reductions((P_, P_), (B_, B_), 8 * 4 * 32 * 4,
                                    (8, 4, 32), mesh_info(mesh, ad.Cluster()))
  region = _regions.Region(
      (dk, gk, mk),
      {(dk, 0): (0, 1), (dk, 1): (B_, 0), (gk, 1): (B_, B_)},
      {(dk, 0): table, (gk, 0): (P_, P_), (mk, 0): (P_, P_)},
      {(mk, 0): (steps, spec)}, gather_codes={gk: table})
  pins = _lower.Pins(mesh, {}, {}, {}, {dk: region, gk: region, mk: region})
  run = jax.jit(lambda a, b, ids: _lower.interpret(
      closed.jaxpr, closed.consts, [a, b, ids], (), pins)[0],
      in_shardings=(NamedSharding(mesh, P(*mesh.axis_names)),
                    NamedSharding(mesh, P(mesh.axis_names[1])),
                    NamedSharding(mesh, P())))
  got, want = run(a, b, ids), f(a, b, ids)
  assert bool(jnp.any(want == -14.0))  # some ids are out of bounds
  assert float(jnp.max(jnp.abs(got - want))) < 1e-4, (got, want)
