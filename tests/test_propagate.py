"""The data-parallel baseline is what XLA makes of DP shardings: the DP
boundary (parameters replicated, the batch split over every device) given
to ``jax.jit`` as a user writes it, XLA propagating the rest."""

import os
import sys

import jax
import pytest
from jax.sharding import NamedSharding

import autoddl_jax as ad
from autoddl_jax import _hlo
from autoddl_jax._sbp import codes_to_spec
from conftest import TEST_CLUSTER
from helpers import make_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import zoo  # noqa: E402


def _user_dp(case, plan, mesh):
  """(bytes sent per device, seconds) of XLA's program for the baseline's
  boundary given as in_shardings only."""
  choice = plan.baseline_choice("dp")
  names = plan.mesh_info.axis_names
  specs = [codes_to_spec(plan.problem.cands[o][choice[o]][0], len(a.shape),
                         names)
           for o, a in zip(plan.graph.input_ops, plan.traced.in_avals)]
  shardings = jax.tree_util.tree_unflatten(
      plan.traced.in_tree, [NamedSharding(mesh, s) for s in specs])
  args = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      case.args, shardings)
  compiled = jax.jit(case.step, in_shardings=shardings).lower(
      *args).compile()
  cols = _hlo.collectives(compiled, mesh)
  return (sum(c.total_bytes_per_device for c in cols),
          _hlo.emitted_seconds(cols, plan.mesh_info), specs)


@pytest.mark.parametrize("name", ["resnet", "llama", "moe"])
def test_the_dp_baseline_is_what_xla_makes_of_dp_shardings(name):
  case = zoo.build(name, abstract=True)
  seen = {}
  for shape in ((8,), (2, 4)):
    mesh = make_mesh(shape, explicit=False)
    plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER)
    dp = plan.baseline_cost("dp")
    xla_bytes, xla_s, specs = _user_dp(case, plan, mesh)
    # The boundary is DP's: some argument split over every device.
    assert any(s and set(a for p in s if p for a in (
        p if isinstance(p, tuple) else (p,))) == set(mesh.axis_names)
               for s in specs)
    assert dp.comm_bytes == pytest.approx(xla_bytes, rel=0.10), shape
    assert dp.comm_s == pytest.approx(xla_s, rel=0.15), shape
    seen[shape] = dp
  # One layout over the same devices, however the mesh names them.
  assert seen[(8,)].time_s == pytest.approx(seen[(2, 4)].time_s, rel=1e-9)
  assert seen[(8,)].comm_bytes == pytest.approx(seen[(2, 4)].comm_bytes,
                                                rel=1e-9)
