"""The memory model against XLA's buffers: what fusion leaves unkept, what
shares the results' allocations, what a reshard adds (``Problem._liveness``,
``_allocations``, ``_reshard_buffers``)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax._verify import compile_plan, peak_bytes
from helpers import make_mesh

B, D, H = 256, 256, 1024  # per-device activations of 32-256 KiB


def _gelu_mlp_step(w1, w2, x):
  def loss(w1, w2):
    h = jax.nn.gelu(x @ w1, approximate=True)  # x**3, tanh, ...
    return ((h @ w2) ** 2).mean()
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  return w1 - 0.1 * g1, w2 - 0.1 * g2


def _args():
  k = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k[0], (D, H)) * 0.05,
          jax.random.normal(k[1], (H, D)) * 0.05,
          jax.random.normal(k[2], (B, D)))


def _entries_by_prim(plan):
  prob = plan.problem
  return {prob.graph.ops[p].prim for _, p, _, _, _ in prob._live}


def _xla_peak(plan):
  compiled, _ = compile_plan(plan)
  return peak_bytes(compiled.memory_analysis())


def test_fused_elementwise_results_are_recomputed_not_kept():
  # GELU's backward needs x @ w1 (a dot's result: kept), its cube and its
  # tanh. The cube is a cheap elementwise op XLA fuses into every consumer,
  # so it holds no buffer; tanh is expensive and has several consumers, so
  # XLA computes it once and keeps it (its IsExpensive rule).
  plan = ad.hand_plan(_gelu_mlp_step, *_args(), mesh=make_mesh((8,)),
                      in_shardings=(P(), P(), P("data")))
  kept = _entries_by_prim(plan)
  assert "dot_general" in kept and "tanh" in kept
  assert "integer_pow" not in kept
  xla = _xla_peak(plan)
  assert plan.cost.memory_bytes == pytest.approx(xla, rel=0.3), (
      plan.cost.memory_bytes, xla)


def test_temporaries_live_in_the_results_allocations_before_the_results():
  # The new weights are the step's results: XLA allocates them apart from
  # its pool of temporaries, and puts temporaries that die before the new
  # weights are made (activations, gradients) inside those allocations.
  plan = ad.hand_plan(_gelu_mlp_step, *_args(), mesh=make_mesh((8,)),
                      in_shardings=(P(), P(), P("data")))
  prob = plan.problem
  mem = prob.memory_breakdown(plan.choice)
  w_bytes = 2 * D * H * 4
  assert mem["arguments"] == pytest.approx(w_bytes + B * D * 4 / 8)
  assert mem["results"] == pytest.approx(w_bytes)
  # the gradients (each the size of its weight) die where the results are
  # made: without the sharing they would sit in the pool at its peak
  assert mem["intermediates"] < w_bytes
  assert sum(mem.values()) == pytest.approx(plan.cost.memory_bytes)


def test_a_gathered_weight_is_a_buffer_from_its_first_use_to_its_last():
  # FSDP: each weight split over the devices, gathered for the forward
  # contraction and again (the same layout: one all-gather, reused) for
  # the backward one; the gathered copy is a full-size buffer in between.
  plan = ad.hand_plan(_gelu_mlp_step, *_args(), mesh=make_mesh((8,)),
                      in_shardings=(P("data"), P("data"), P("data")))
  prob = plan.problem
  bufs = prob._reshard_buffers(plan.choice)
  full = [(s, e) for nb, s, e in bufs if nb == D * H * 4]
  assert full, bufs
  assert any(e > s for s, e in full)  # kept for the backward pass
  xla = _xla_peak(plan)
  assert plan.cost.memory_bytes == pytest.approx(xla, rel=0.3), (
      plan.cost.memory_bytes, xla)


def test_a_scanned_stack_is_predicted_within_a_third_of_xla():
  # Layers in lax.scan: the forward loop stacks its residuals, the
  # backward loop reads them; DP and FSDP.
  L = 4

  def step(ws, x):
    def loss(ws):
      def layer(h, w):
        return jnp.tanh(h @ w), None
      h, _ = jax.lax.scan(layer, x, ws)
      return (h ** 2).mean()
    return ws - 0.1 * jax.grad(loss)(ws)

  ws = jax.random.normal(jax.random.key(1), (L, D, D)) * 0.05
  x = jax.random.normal(jax.random.key(2), (B, D))
  for specs in ((P(), P("data")), (P(None, "data"), P("data"))):
    plan = ad.hand_plan(step, ws, x, mesh=make_mesh((8,)),
                        in_shardings=specs)
    xla = _xla_peak(plan)
    assert plan.cost.memory_bytes == pytest.approx(xla, rel=0.3), (
        specs, plan.cost.memory_bytes, xla)
