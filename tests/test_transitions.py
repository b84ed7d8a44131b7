"""Transitions as XLA does them: each reshard compiled alone, its emitted
collectives held to the cost model's by kind (10%). Every pair on a 1-axis
mesh; a fixed sample on 2- and 3-axis meshes (``benchmarks/transitions.py``
runs them all)."""

import os
import sys

import pytest

from autoddl_jax._sbp import P_CODE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import transitions  # noqa: E402


def _sample(mesh, rank, every):
  # Partial sums made by a contraction are left out here: XLA's dot
  # partitioner picks where to reduce them (BENCHMARKS.md, transitions).
  ps = [(s, d) for s, d in transitions.pairs(mesh, rank) if P_CODE not in s]
  return [(mesh, rank, s, d) for s, d in ps[::every]]


CASES = ([((4,), r, s, d) for r in (2, 3)
          for s, d in transitions.pairs((4,), r)]
         + _sample((2, 4), 2, 3) + _sample((4, 2), 3, 17)
         + _sample((2, 2, 2), 2, 23) + _sample((2, 2, 2), 3, 151))


@pytest.mark.parametrize("mesh,rank,src,dst", CASES,
                         ids=[f"{m}-{s}-{d}" for m, _, s, d in CASES])
def test_xla_moves_what_the_model_charges(mesh, rank, src, dst):
  model, xla = transitions.compare(mesh, transitions.SHAPES[rank], src, dst)
  assert transitions.agrees(model, xla), (model, xla)


def test_multi_axis_reshards_are_staged_as_costed():
  # (S0 over x and y) -> (S1 over y): left to XLA as one constraint it
  # gathers the whole tensor (7/8 of it per device) and slices; staged
  # through the model's path it is an all-to-all on y and an all-gather on x.
  shape = transitions.SHAPES[2]
  model, alone = transitions.compare((2, 4), shape, (0, 0), (-1, 1),
                                     staged=False)
  _, staged = transitions.compare((2, 4), shape, (0, 0), (-1, 1))
  assert sorted(model) == ["all-gather", "all-to-all"]
  assert not transitions.agrees(model, alone)
  assert alone["all-gather"] > 3 * sum(model.values())
  assert transitions.agrees(model, staged)
