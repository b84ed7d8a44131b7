"""Test setup: 8 simulated CPU devices, before jax does anything."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite plans by the cost model unless a test asks for selection by the
# compiled program (ad.plan(select="compiled"), tests/test_select.py): that
# compiles ~8 candidates, ~3 s each for a tiny model on this machine, and
# most tests are about the plan the model made.
os.environ.setdefault("AUTODDL_JAX_SELECT", "model")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import autoddl_jax as ad  # noqa: E402

# A small, slow cluster so that tiny test models still have something to gain
# from sharding: slow compute, modest links, 4 devices per node.
TEST_CLUSTER = ad.Cluster(
    devices_per_node=4, intra_node_bandwidth=10e9, inter_node_bandwidth=2e9,
    intra_node_latency=1e-6, inter_node_latency=5e-6, peak_flops=1e9,
    memory_per_device=2**30, flops_efficiency=1.0)


@pytest.fixture
def cluster():
  return TEST_CLUSTER


@pytest.fixture
def saved(tmp_path):
  """(example, path) of an MLP step's plan on a (2, 4) mesh, saved."""
  import optax
  from autoddl_jax.testing import models
  from helpers import make_mesh
  ex = models.mlp(optimizer=optax.adam(1e-2))
  plan = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4)),
                 cluster=TEST_CLUSTER)
  path = tmp_path / "plan.json"
  plan.save(path)
  return ex, path
