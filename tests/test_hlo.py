"""``ad.collectives``: the collectives XLA emitted, from HLO text snippets of
each replica-group form and from compiled programs known by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax import _hlo
from autoddl_jax._cluster import mesh_info
from conftest import TEST_CLUSTER
from helpers import make_mesh

MESH_24 = (("data", "model"), (2, 4))


def _module(*body: str, extra: str = "") -> str:
  lines = "\n".join("  " + b for b in body)
  return (f"HloModule m\n\n{extra}\n%add (a: f32[], b: f32[]) -> f32[] {{\n"
          "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
          "  ROOT %s = f32[] add(%a, %b)\n}\n\n"
          f"ENTRY %main (p0: f32[16,32]) -> f32[16,32] {{\n"
          f"  %p0 = f32[16,32]{{1,0}} parameter(0)\n{lines}\n}}\n")


def _one(text, mesh=MESH_24):
  (c,) = _hlo.parse_hlo(text, 8, mesh)
  return c


def test_explicit_replica_groups():
  c = _one(_module(
      "ROOT %ar = f32[16,32]{1,0} all-reduce(%p0), channel_id=1, "
      "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, "
      "to_apply=%add"))
  assert c.kind == "all-reduce" and c.count == 1
  assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.axes == ("model",)
  assert c.bytes_per_device == pytest.approx(2 * 3 / 4 * 16 * 32 * 4)


def test_iota_replica_groups_with_transpose_span_the_other_axis():
  c = _one(_module(
      "ROOT %ag = f32[16,32]{1,0} all-gather(%p0), channel_id=1, "
      "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, "
      "use_global_device_ids=true"))
  assert c.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and c.axes == ("data",)
  assert c.bytes_per_device == pytest.approx(1 / 2 * 16 * 32 * 4)


def test_iota_replica_groups_over_all_devices_span_both_axes():
  c = _one(_module(
      "ROOT %ar = f32[16,32]{1,0} all-reduce(%p0), channel_id=1, "
      "replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add"))
  assert c.group_size == 8 and c.axes == ("data", "model")


def test_mesh_form_replica_groups():
  c = _one(_module(
      "ROOT %ar = f32[16,32]{1,0} all-reduce(%p0), channel_id=1, "
      "replica_groups=mesh['data'=2,'model'=4] {'data'}, "
      "use_global_device_ids=true, to_apply=%add"))
  assert c.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and c.axes == ("data",)


def test_mesh_form_with_device_ids():
  # What XLA writes for the 'model' axis of a (2, 4) mesh in jax 0.10.
  c = _one(_module(
      "ROOT %ar = f32[16,32]{1,0} all-reduce(%p0), channel_id=1, "
      "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], "
      "device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, "
      "to_apply=%add"))
  assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.axes == ("model",)


def test_tuple_collective_counts_every_operand():
  c = _one(_module(
      "%p1 = f32[8]{0} multiply(%p0, %p0)",
      "ROOT %ar = (f32[16,32]{1,0}, f32[8]{0}) all-reduce(%p0, %p1), "
      "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, "
      "use_global_device_ids=true, to_apply=%add"))
  assert c.shapes == ((16, 32), (8,))
  assert c.bytes_per_device == pytest.approx(2 * 7 / 8 * (16 * 32 + 8) * 4)


def test_collectives_in_a_while_body_count_the_trip_count():
  extra = (
      "%body (t: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {\n"
      "  %t = (s32[], f32[16,32]{1,0}) parameter(0)\n"
      "  %i = s32[] get-tuple-element(%t), index=0\n"
      "  %x = f32[16,32]{1,0} get-tuple-element(%t), index=1\n"
      "  %ag = f32[16,32]{1,0} all-gather(%x), channel_id=2, "
      "replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true\n"
      "  ROOT %r = (s32[], f32[16,32]{1,0}) tuple(%i, %ag)\n}\n"
      "%cond (t: (s32[], f32[16,32])) -> pred[] {\n"
      "  %t = (s32[], f32[16,32]{1,0}) parameter(0)\n"
      "  ROOT %c = pred[] constant(true)\n}\n")
  text = _module(
      "%z = s32[] constant(0)",
      "%t0 = (s32[], f32[16,32]{1,0}) tuple(%z, %p0)",
      "%w = (s32[], f32[16,32]{1,0}) while(%t0), condition=%cond, body=%body, "
      'backend_config={"known_trip_count":{"n":"12"}}',
      "ROOT %o = f32[16,32]{1,0} get-tuple-element(%w), index=1", extra=extra)
  c = _one(text)
  assert c.kind == "all-gather" and c.count == 12 and c.axes == ("model",)
  assert c.total_bytes_per_device == pytest.approx(12 * c.bytes_per_device)


def test_collective_permute_and_all_to_all():
  text = _module(
      "%cp = f32[16,32]{1,0} collective-permute(%p0), channel_id=1, "
      "source_target_pairs={{0,4},{4,0},{1,5},{5,1}}",
      "ROOT %a2a = f32[16,32]{1,0} all-to-all(%cp), channel_id=2, "
      "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}")
  cp, a2a = _hlo.parse_hlo(text, 8, MESH_24)
  assert cp.kind == "collective-permute" and cp.axes == ("data",)
  assert cp.bytes_per_device == 16 * 32 * 4
  assert a2a.kind == "all-to-all"
  assert a2a.bytes_per_device == pytest.approx(3 / 4 * 16 * 32 * 4)


def test_bf16_upcast_on_cpu_is_reported_not_doubled():
  text = _module(
      "%x = bf16[16,32]{1,0} parameter(1)",
      "%cv = f32[16,32]{1,0} convert(%x)",
      "%ar = f32[16,32]{1,0} all-reduce(%cv), channel_id=1, "
      "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, "
      "to_apply=%add",
      "ROOT %back = bf16[16,32]{1,0} convert(%ar)")
  c = _one(text)
  assert c.upcast == "bf16" and c.dtypes == ("f32",)
  assert c.bytes_per_device == pytest.approx(c.hlo_bytes_per_device / 2)


# ------------------------------------------------------ compiled programs
def _jit(f, *args):
  return jax.jit(f).lower(*args).compile()


def test_data_parallel_gradient_all_reduce():
  mesh = make_mesh((2, 4), explicit=False)
  w = jax.ShapeDtypeStruct((64, 32), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32,
                           sharding=NamedSharding(mesh, P(("data", "model"))))
  grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
  f = jax.jit(grad, out_shardings=NamedSharding(mesh, P()))
  (c,) = ad.collectives(f.lower(w, x).compile())
  assert c.kind == "all-reduce" and c.group_size == 8
  assert c.axes == ("data", "model")
  assert c.bytes_per_device == pytest.approx(2 * 7 / 8 * 64 * 32 * 4)


def test_megatron_mlp_forward_all_reduce():
  mesh = make_mesh((2, 4), explicit=False)
  s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=s("data", None))
  w1 = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=s(None, "model"))
  w2 = jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=s("model", None))
  f = jax.jit(lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2,
              out_shardings=s("data", None))
  (c,) = ad.collectives(f.lower(x, w1, w2).compile())
  assert c.kind == "all-reduce" and c.axes == ("model",)
  assert c.bytes_per_device == pytest.approx(2 * 3 / 4 * 8 * 64 * 4)


def test_all_to_all_reshard():
  mesh = make_mesh((8,), explicit=False)
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32,
                           sharding=NamedSharding(mesh, P("data", None)))
  f = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P(None,
                                                                   "data")))
  cols = ad.collectives(f.lower(x).compile())
  assert [c.kind for c in cols] == ["all-to-all"]
  assert cols[0].bytes_per_device == pytest.approx(7 / 64 * 64 * 64 * 4)


def test_emitted_seconds_uses_the_slowest_link_of_the_group():
  mesh = make_mesh((2, 4), explicit=False)
  mi = mesh_info(mesh, TEST_CLUSTER)
  text = _module(
      "ROOT %ar = f32[16,32]{1,0} all-reduce(%p0), channel_id=1, "
      "replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add")
  (c,) = _hlo.parse_hlo(text, 8, MESH_24)
  want = 14 * max(mi.alpha) + c.bytes_per_device / min(mi.beta)
  assert _hlo.emitted_seconds([c], mi) == pytest.approx(want)
  assert np.isfinite(want)


def test_cpu_all_reduce_then_slice_reads_as_a_reduce_scatter():
  mesh = make_mesh((2, 4), explicit=False)
  s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=s(None, "model"))
  w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=s("model", None))
  f = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=s("model", None))
  (c,) = ad.collectives(f.lower(x, w).compile())
  assert c.kind == "reduce-scatter" and c.axes == ("model",)
  if c.lowered_as is not None:  # CPU; a GPU emits the reduce-scatter itself
    assert c.lowered_as == "all-reduce + dynamic-slice"
  assert c.bytes_per_device == pytest.approx(3 / 4 * 16 * 32 * 4)


def test_all_reduce_read_whole_beside_a_slice_of_another_operand():
  # The gradient is reduced over `data` and read whole; the same fusion
  # slices the replicated `nu` by the device's `model` index. That is an
  # all-reduce (the ViT's AdamW update, realistic zoo on (4,2)); a reader
  # that took "a fusion of it and the partition id" for a slice of it
  # counted a reduce-scatter over `data` -- half the bytes.
  mesh = make_mesh((4, 2), explicit=False)
  s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731

  def step(x, y, nu):
    g = x.T @ y  # a partial sum over `data`
    return 0.999 * nu + 0.001 * (g * g).T

  x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=s("data", None))
  y = jax.ShapeDtypeStruct((32, 128), jnp.float32, sharding=s("data", None))
  nu = jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=s())
  compiled = jax.jit(step, out_shardings=s(None, "model")).lower(
      x, y, nu).compile()
  (c,) = ad.collectives(compiled)
  assert c.axes == ("data",)
  assert c.kind == "all-reduce" and c.lowered_as is None
  # the reduced block: XLA slices the gradient over `model` before reducing
  (size,) = [np.prod(sh) for sh in c.shapes]
  assert c.bytes_per_device == pytest.approx(2 * 3 / 4 * size * 4)


def test_a_slice_over_another_axis_is_not_a_reduce_scatter():
  # An all-reduce over 4 devices whose reader keeps half of it (a slice by
  # another axis' index) is no reduce-scatter over those 4.
  text = _module(
      "%ar = f32[16,32]{1,0} all-reduce(%p0), channel_id=1, "
      "replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add",
      "%pid = u32[] partition-id()",
      "%z = s32[] constant(0)",
      "%i = s32[] convert(%pid)",
      "ROOT %ds = f32[8,32]{1,0} dynamic-slice(%ar, %i, %z), "
      "dynamic_slice_sizes={8,32}")
  c = _one(text)
  assert c.kind == "all-reduce" and c.group_size == 4
  quarter = text.replace("f32[8,32]", "f32[4,32]").replace("{8,32}", "{4,32}")
  assert _one(quarter).kind == "reduce-scatter"


def test_combined_all_reduce_reads_each_element_by_what_its_users_keep():
  # XLA:CPU merges the bias gradient's all-reduce (kept whole: the bias is
  # replicated) with the weights' (each device keeps its slice: they are
  # split) into one tuple; a GPU makes reduce-scatters of the latter before
  # combining, so the tuple reads as one all-reduce and one reduce-scatter.
  mesh = make_mesh((8,), explicit=False)
  rep, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def step(p, x):
    g = jax.grad(lambda p: (jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]).sum())(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

  sh = {"w": NamedSharding(mesh, P("data", None)), "b": rep, "v": row}
  p = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=rep),
       "b": jax.ShapeDtypeStruct((256,), jnp.float32, sharding=rep),
       "v": jax.ShapeDtypeStruct((256,), jnp.float32, sharding=rep)}
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=row)
  f = jax.jit(step, in_shardings=({k: rep for k in p}, row),
              out_shardings=sh)
  cols = ad.collectives(f.lower(p, x).compile())
  by_kind = {}
  for c in cols:
    by_kind.setdefault(c.kind, []).extend(c.shapes)
  assert sorted(by_kind["all-reduce"]) == [(256,)]
  assert sorted(by_kind["reduce-scatter"]) == [(256,), (256, 256)]
  rs = sum(c.bytes_per_device for c in cols if c.kind == "reduce-scatter")
  assert rs == pytest.approx(7 / 8 * (256 * 256 + 256) * 4)
  ar = sum(c.bytes_per_device for c in cols if c.kind == "all-reduce")
  assert ar == pytest.approx(2 * 7 / 8 * 256 * 4)


def test_tuple_all_reduce_elements_parsed_from_text():
  text = _module(
      "%ar = (f32[16,32]{1,0}, f32[16,32]{1,0}) all-reduce(%p0, %p0), "
      "channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, "
      "to_apply=%add",
      "%g0 = f32[16,32]{1,0} get-tuple-element(%ar), index=0",
      "%g1 = f32[16,32]{1,0} get-tuple-element(%ar), index=1",
      "%pid = u32[] partition-id()",
      "%z = s32[] constant(0)",
      "%ds = f32[2,32]{1,0} dynamic-slice(%g1, %z, %z), "
      "dynamic_slice_sizes={2,32}",
      "ROOT %t = (f32[16,32]{1,0}, f32[2,32]{1,0}) tuple(%g0, %ds)")
  cols = _hlo.parse_hlo(text, 8, MESH_24)
  assert [(c.kind, c.shapes) for c in cols] == [
      ("all-reduce", ((16, 32),)), ("reduce-scatter", ((16, 32),))]
  assert cols[1].lowered_as == "all-reduce + dynamic-slice"
  assert all(c.name == "ar" and c.count == 1 for c in cols)
