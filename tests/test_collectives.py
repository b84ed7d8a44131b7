"""One home for the ring formulas: the model's and the HLO reader's agree."""

import pytest

from autoddl_jax import _collectives as col
from autoddl_jax._cost import one_axis
from autoddl_jax._sbp import B_CODE as B, P_CODE as P

N = 3 * 2**20  # bytes of the whole tensor within the group


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("src,dst,kind,result,operand", [
    # (transition, the collective XLA emits, its result / operand bytes on
    # one device, as functions of the group size p)
    (P, B, "all-reduce", lambda p: N, lambda p: N),
    (P, 0, "reduce-scatter", lambda p: N / p, lambda p: N),
    (0, B, "all-gather", lambda p: N, lambda p: N / p),
    (0, 1, "all-to-all", lambda p: N / p, lambda p: N / p),
])
def test_model_and_hlo_reader_count_the_same_bytes(p, src, dst, kind,
                                                   result, operand):
  t, sent, got = one_axis(src, dst, N, p, 1e-6, 1e11)
  assert got == kind
  assert sent == pytest.approx(col.ring_bytes(kind, p, result(p),
                                              operand(p)), rel=1e-12)
  assert t == pytest.approx(col.latency_steps(kind, p) * 1e-6 + sent / 1e11,
                            rel=1e-12)


def test_latency_steps_and_trivial_groups():
  assert col.latency_steps("all-reduce", 8) == 14
  assert col.latency_steps("all-gather", 8) == 7
  assert col.latency_steps("collective-permute", 8) == 1
  assert col.ring_bytes("all-gather", 1, 100.0, 100.0) == 0.0
  assert col.ring_bytes("collective-permute", 1, 100.0, 100.0) == 100.0
  assert one_axis(B, 0, N, 8, 1e-6, 1e11)[:2] == (0.0, 0.0)  # a free slice
