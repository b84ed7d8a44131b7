import dataclasses

import jax
import pytest
from jax.sharding import AbstractMesh

import autoddl_jax as ad
from autoddl_jax._cluster import mesh_info


def test_cluster_has_the_documented_keywords():
  c = ad.Cluster(devices_per_node=4, intra_node_bandwidth=1e11,
                 inter_node_bandwidth=1e10, intra_node_latency=1e-6,
                 inter_node_latency=1e-5, peak_flops=1e15,
                 memory_per_device=2**34)
  assert c.devices_per_node == 4 and c.memory_per_device == 2**34
  assert ad.Cluster() == ad.H100_NODE
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.peak_flops = 1.0


@pytest.mark.parametrize("kw,match", [
    (dict(devices_per_node=0), "devices_per_node"),
    (dict(devices_per_node=2.5), "devices_per_node"),
    (dict(intra_node_bandwidth=-1), "intra_node_bandwidth"),
    (dict(peak_flops=float("inf")), "peak_flops"),
    (dict(inter_node_latency=-1e-6), "inter_node_latency"),
])
def test_cluster_rejects_nonsense(kw, match):
  with pytest.raises(ValueError, match=match):
    ad.Cluster(**kw)


@pytest.mark.parametrize("shape,per_node,links", [
    ((2, 4), 4, ("inter", "intra")),
    ((4, 2), 4, ("mixed", "intra")),
    ((8,), 8, ("intra",)),
    ((8,), 4, ("mixed",)),
    ((128, 8), 8, ("inter", "intra")),
    ((32, 4, 8), 8, ("inter", "inter", "intra")),
    ((2, 2, 2), 2, ("inter", "inter", "intra")),
])
def test_axes_take_the_link_their_groups_cross(shape, per_node, links):
  names = tuple(f"a{i}" for i in range(len(shape)))
  c = ad.Cluster(devices_per_node=per_node)
  mi = mesh_info(AbstractMesh(shape, names), c)
  assert mi.link == links
  for link, a, b in zip(mi.link, mi.alpha, mi.beta):
    assert b == (c.intra_node_bandwidth if link == "intra"
                 else c.inter_node_bandwidth)
    assert a == (c.intra_node_latency if link == "intra"
                 else c.inter_node_latency)


def test_meshes_of_every_kind():
  c = ad.Cluster()
  for m in (jax.make_mesh((2, 4), ("x", "y")), AbstractMesh((2, 4), ("x", "y")),
            {"x": 2, "y": 4}):
    mi = mesh_info(m, c)
    assert mi.axis_names == ("x", "y") and mi.axis_sizes == (2, 4)


def test_mesh_errors():
  c = ad.Cluster()
  with pytest.raises(ValueError, match="1 to 4 axes"):
    mesh_info({f"a{i}": 1 for i in range(5)}, c)
  with pytest.raises(TypeError, match="mesh must be"):
    mesh_info([2, 4], c)
  with pytest.raises(ValueError, match="sizes must be >= 1"):
    mesh_info({"x": 0}, c)
