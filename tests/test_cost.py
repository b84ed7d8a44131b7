import dataclasses
import math

import numpy as np
import pytest
from jax.sharding import AbstractMesh

import autoddl_jax as ad
from autoddl_jax._cluster import mesh_info
from autoddl_jax._cost import joint_all_reduce, one_axis, transition
from autoddl_jax._cost import transition_steps
from autoddl_jax._cost import valid_states
from autoddl_jax import _states
from autoddl_jax._states import StateSpace, state_space
from autoddl_jax._sbp import B_CODE as B, P_CODE as P

A, BW, N, PP = 2e-6, 1e9, 4096.0, 4


@pytest.mark.parametrize("src,dst,time,sent,kind", [
    (0, 0, 0, 0, None),
    (B, 0, 0, 0, None),
    (B, P, 0, 0, None),
    (0, B, A * 3 + 0.75 * N / BW, 0.75 * N, "all-gather"),
    (P, 1, A * 3 + 0.75 * N / BW, 0.75 * N, "reduce-scatter"),
    (P, B, 2 * A * 3 + 1.5 * N / BW, 1.5 * N, "all-reduce"),
    (0, 1, A * 3 + 0.75 / 4 * N / BW, 0.75 / 4 * N, "all-to-all"),
])
def test_collective_cost_table(src, dst, time, sent, kind):
  t, b, k = one_axis(src, dst, N, PP, A, BW)
  assert t == pytest.approx(time) and b == pytest.approx(sent) and k == kind


def test_size_one_axis_is_free():
  assert one_axis(0, B, N, 1, A, BW)[:2] == (0.0, 0.0)


def _mi(shape=(2, 4)):
  c = ad.Cluster(devices_per_node=4, intra_node_bandwidth=4e9,
                 inter_node_bandwidth=1e9, intra_node_latency=1e-6,
                 inter_node_latency=1e-5)
  return mesh_info(AbstractMesh(shape, ("x", "y")[:len(shape)]), c), c


def test_multi_axis_transition_is_the_cheapest_order():
  mi, c = _mi()
  n = 8 * 16 * 4.0
  # (S0, S0) -> (B, B): gather y first (group size n/2) then x, or x first.
  # Dim 0 is tiled x-major, so gathering x first reorders the blocks: XLA
  # adds a collective-permute of each device's block (n/8).
  y_then_x = (3 * 1e-6 + 0.75 * (n / 2) / 4e9) + (1e-5 + 0.5 * n / 1e9)
  x_then_y = (1e-5 + 0.5 * (n / 4) / 1e9) + (3 * 1e-6 + 0.75 * n / 4e9)
  permute = 1e-5 + (n / 8) / 1e9
  t, _ = transition((0, 0), (B, B), n, (8, 16), mi)
  assert t == pytest.approx(min(y_then_x, x_then_y + permute))
  # S(0) on y -> S(0) on (x, y) is no local slice in that tile order.
  assert transition_steps((B, 0), (0, 0), n, (8, 16), mi) == [
      ("collective-permute", 0, pytest.approx(n / 8))]
  # One axis differing: the other's split shrinks the group's bytes.
  t, b = transition((0, 1), (0, B), n, (8, 16), mi)
  assert b == pytest.approx(0.75 * n / 2)


def test_state_space_respects_divisibility_and_local_bytes():
  mi, _ = _mi()
  sp = state_space((6, 8), 4, mi)
  assert (0, -1) in sp.index and (0, 0) not in sp.index  # 6 % 8 != 0
  assert (-1, 0) not in sp.index  # 6 % 4 != 0
  assert (1, 1) in sp.index
  assert sp.local_bytes[sp.index[(1, 1)]] == 6 * 8 * 4 / 8
  assert sp.local_bytes[sp.index[(P, B)]] == 6 * 8 * 4
  for s in valid_states((6, 8), mi.axis_sizes):
    for d in range(2):
      k = math.prod(sz for c, sz in zip(s, mi.axis_sizes) if c == d)
      assert (6, 8)[d] % k == 0


def test_transition_matrix_is_zero_on_the_diagonal_and_free_from_b():
  mi, _ = _mi()
  sp = StateSpace((8, 16), 4, mi)  # not the cached one: whole
  for i, s in enumerate(sp.states):
    assert sp.time[i, i] == 0
    if all(c == B for c in s):
      assert (sp.time[i] == 0).all()  # slicing / zeroing is local
  # Every entry is finite (some path always exists).
  assert all(math.isfinite(x) for x in sp.time.ravel())


def test_transition_falls_back_through_replicated_when_no_order_divides():
  mi, _ = _mi()
  # (S0 over x, S1 over y) -> (S1 over x, S0 over y) on a (4, 4) tensor:
  # either one-axis order splits a dim 8 ways on the way, so go through B.
  shape, n = (4, 4), 64.0
  sp = state_space(shape, 4, mi)
  assert (0, 1) in sp.index and (1, 0) in sp.index
  assert (1, 1) not in sp.index and (0, 0) not in sp.index
  t, b = transition((0, 1), (1, 0), n, shape, mi)
  gather = transition((0, 1), (B, B), n, shape, mi)
  assert math.isfinite(t) and (t, b) == gather


@pytest.mark.parametrize("shape,mesh", [((8, 16), (2, 4)), ((4, 4), (2, 4)),
                                        ((6, 8, 4), (2, 2, 2)), ((8,), (8,)),
                                        ((2,), (2, 2, 2, 2))])
def test_vectorized_matrix_matches_the_reference_transition(shape, mesh):
  names = ("x", "y", "z", "w")[:len(mesh)]
  c = ad.Cluster(devices_per_node=4)
  mi = mesh_info(AbstractMesh(mesh, names), c)
  sp = StateSpace(shape, 2, mi)  # not the cached one: whole
  for i, s in enumerate(sp.states):
    for j, d in enumerate(sp.states):
      t, b = transition(s, d, sp.nbytes, shape, mi)
      assert sp.time[i, j] == pytest.approx(t, rel=1e-12, abs=1e-18)
      assert sp.bytes[i, j] == pytest.approx(b, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("mesh", [(2, 4), (2, 2, 2), (4, 2, 2)])
def test_a_space_computed_for_some_states_has_the_whole_ones_costs(mesh):
  """Problems compute transitions among the states their candidates use
  (StateSpace.ensure): those entries equal the whole space's, also where
  a cost goes through a state outside them (replicated, or the state
  after a joint all-reduce of several partial axes)."""
  names = ("x", "y", "z")[:len(mesh)]
  for combined in (False, True):
    mi = dataclasses.replace(mesh_info(AbstractMesh(mesh, names),
                                       ad.Cluster(devices_per_node=4)),
                             combined=combined)
    for shape in [(8, 16), (4, 4), (16, 8, 2, 8)]:
      whole = StateSpace(shape, 2, mi)
      part = StateSpace(shape, 2, mi)
      n = len(part.states)
      multi_p = [i for i, s in enumerate(part.states)
                 if sum(c == P for c in s) >= 2]
      rng = np.random.default_rng(n)
      for picked in (multi_p[:3], rng.choice(n, n // 4, replace=False)):
        part.ensure(picked)
        done = np.flatnonzero(part._done)
        assert set(np.asarray(picked).tolist()) <= set(done.tolist())
        for m in ("time", "bytes"):
          np.testing.assert_array_equal(
              getattr(part, m)[np.ix_(done, done)],
              getattr(whole, m)[np.ix_(done, done)])
      assert len(done) < n


@pytest.mark.parametrize("max_pairs", [1, 1 << 20])
def test_spaces_costed_in_one_batch_equal_each_alone(monkeypatch, max_pairs):
  """A problem costs all its spaces on one mesh together (ensure_all):
  spaces of other ranks, shapes and sizes, the combined view among them,
  in one batch or one per space (``MAX_PAIRS``), hold bit for bit the
  costs each space computed alone holds."""
  monkeypatch.setattr(_states, "MAX_PAIRS", max_pairs)
  base = mesh_info(AbstractMesh((2, 2, 4), ("x", "y", "z")),
                   ad.Cluster(devices_per_node=4))
  requests, alone = [], []
  for combined in (False, True):
    mi = dataclasses.replace(base, combined=combined)
    for shape in [(8,), (8, 16), (6, 8, 4), (16, 8, 2, 8), (3, 5)]:
      sp, ref = StateSpace(shape, 2, mi), StateSpace(shape, 2, mi)
      n = len(sp.states)
      used = np.random.default_rng(n).choice(n, max(1, n // 3),
                                             replace=False)
      requests.append((sp, used))
      ref.ensure(used)
      alone.append(ref)
  _states.ensure_all(requests)
  for (sp, _), ref in zip(requests, alone):
    np.testing.assert_array_equal(sp._done, ref._done)
    done = np.flatnonzero(ref._done)
    for m in ("time", "bytes"):
      np.testing.assert_array_equal(getattr(sp, m)[np.ix_(done, done)],
                                    getattr(ref, m)[np.ix_(done, done)])


@pytest.mark.parametrize("shape,mesh", [((8, 16), (2, 4)), ((6, 8, 4), (2, 2, 2))])
def test_transition_steps_add_up_to_the_transition(shape, mesh):
  names = ("x", "y", "z")[:len(mesh)]
  mi = mesh_info(AbstractMesh(mesh, names), ad.Cluster(devices_per_node=4))
  sp = state_space(shape, 4, mi)
  kinds = set()
  for s in sp.states:
    for d in sp.states:
      steps = transition_steps(s, d, sp.nbytes, shape, mi)
      _, b = transition(s, d, sp.nbytes, shape, mi)
      assert sum(x for _, _, x in steps) == pytest.approx(b, rel=1e-12)
      kinds.update(k for k, _, _ in steps)
  assert kinds == {"all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                   "collective-permute"}


def test_partial_on_two_axes_reduces_in_one_joint_all_reduce():
  mi = mesh_info(AbstractMesh((2, 4), ("x", "y")),
                 ad.Cluster(devices_per_node=4))
  n = 4.0 * 64 * 64
  t, b = transition((P, P), (B, B), n, (64, 64), mi)
  assert b == pytest.approx(2 * 7 / 8 * n)  # not 2*(1/2)n + 2*(3/4)n
  assert t == pytest.approx(2 * max(mi.alpha) * 7 + b / min(mi.beta))
  steps = transition_steps((P, P), (B, B), n, (64, 64), mi)
  assert steps == [("all-reduce", (0, 1), pytest.approx(b))]
  # (P, P) -> (S(0), B) is not such a pair: reduce-scatter + all-reduce.
  assert transition((P, P), (0, B), n, (64, 64), mi)[1] < b


def test_a_joint_all_reduce_slices_first_only_where_the_block_divides():
  """On 4 axes a slice the target makes and a split the source keeps can
  cut one dim finer than it divides: (P, S0, P, B) -> (B, B, B, S0) of a
  (2,) vector on (2, 2, 2, 2). The joint all-reduce then runs on the
  unsliced blocks, and every state it goes through is a valid one (this
  raised KeyError while building a 4-axis problem)."""
  mi = mesh_info(AbstractMesh((2, 2, 2, 2), ("a", "b", "c", "d")),
                 ad.Cluster(devices_per_node=4))
  src, dst, n = (P, 0, P, B), (B, B, B, 0), 8.0
  axes, _, sent, mid = joint_all_reduce(src, dst, n, mi, (2,))
  assert axes == (0, 2) and mid == (B, 0, B, B)
  assert sent == pytest.approx(2 * 3 / 4 * n / 2)  # blocks of n/2
  # Where the slice divides, it still comes first: the blocks are n/4.
  assert joint_all_reduce(src, dst, n, mi, (4,))[3] == (B, 0, B, 0)
  for shape in [(2,), (2, 4), (4, 2)]:
    states = set(valid_states(shape, mi.axis_sizes))
    for s in states:
      for d in states:
        j = joint_all_reduce(s, d, n, mi, shape)
        assert j is None or j[3] in states, (s, d)
