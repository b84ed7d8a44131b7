import dataclasses
import itertools

import pytest
from jax.sharding import PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax._sbp import codes_to_spec, spec_to_codes


def test_values_are_frozen_hashable_and_print_like_the_paper():
  assert repr(ad.sbp.S(1)) == "S(1)" and repr(ad.sbp.B) == "B" and repr(ad.sbp.P) == "P"
  assert len({ad.sbp.S(0), ad.sbp.S(0), ad.sbp.B}) == 2
  nd = ad.sbp.NdSbp((ad.sbp.S(0), ad.sbp.B))
  assert repr(nd) == "(S(0), B)"
  assert nd == ad.NdSbp.from_codes((0, -1)) and hash(nd) == hash(
      ad.NdSbp.from_codes((0, -1)))
  with pytest.raises(dataclasses.FrozenInstanceError):
    nd.sbps = ()


@pytest.mark.parametrize("bad", [-1, 1.5, "0"])
def test_split_needs_a_nonnegative_int_dim(bad):
  with pytest.raises(ValueError, match="non-negative int"):
    ad.sbp.S(bad)


def test_ndsbp_rejects_non_sbp_entries():
  with pytest.raises(TypeError, match="S\\(d\\), B or P"):
    ad.sbp.NdSbp(("S0",))


@pytest.mark.parametrize("codes,rank,spec", [
    ((0, 0), 2, P(("x", "y"))),
    ((1, -1), 2, P(None, "x")),
    ((-1, 1), 3, P(None, "y")),
    ((-2, 0), 2, P("y", unreduced={"x"})),
    ((-1, -1), 2, P()),
    ((2, 0, 2), 3, P("y", None, ("x", "z"))),
])
def test_to_spec(codes, rank, spec):
  names = ("x", "y", "z")[:len(codes)]
  got = codes_to_spec(codes, rank, names)
  assert got == spec
  assert spec_to_codes(got, rank, names) == codes


@pytest.mark.parametrize("n_axes", [1, 2, 3, 4])
def test_round_trip_every_placement(n_axes):
  names = tuple(f"a{i}" for i in range(n_axes))
  for codes in itertools.product([-2, -1, 0, 1, 2], repeat=n_axes):
    nd = ad.NdSbp.from_codes(codes)
    spec = nd.to_spec(3, names)
    assert ad.NdSbp.from_spec(spec, 3, names) == nd


def test_spec_errors_say_what_to_change():
  names = ("x", "y")
  with pytest.raises(ValueError, match="not in mesh order"):
    spec_to_codes(P(("y", "x")), 2, names)
  with pytest.raises(ValueError, match="does not have"):
    spec_to_codes(P("z"), 2, names)
  with pytest.raises(ValueError, match="twice"):
    spec_to_codes(P("x", "x"), 2, names)
  with pytest.raises(ValueError, match="rank-1"):
    spec_to_codes(P("x", "y"), 1, names)
  with pytest.raises(ValueError, match="UNCONSTRAINED"):
    spec_to_codes(P(P.UNCONSTRAINED), 1, names)
  with pytest.raises(ValueError, match="has 1 entries but the mesh has 2"):
    codes_to_spec((0,), 1, names)
  with pytest.raises(ValueError, match="rank 1"):
    codes_to_spec((1, -1), 1, names)
