"""The held-out model zoo (benchmarks/zoo.py), tiny: every primitive it
produces has a rule, and every plan computes the unsharded step (float32,
rel 1e-5) while XLA emits the collectives the plan needs."""

import functools
import os
import sys

import jax
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import autoddl_jax as ad
from autoddl_jax import _hlo, _rules
from autoddl_jax._jaxpr import INLINE
from conftest import TEST_CLUSTER
from helpers import make_mesh, rel_err

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import zoo  # noqa: E402

CONTROL_FLOW = {"scan", "cond", "while"}  # walked by the graph, not ruled
NAMES = ["llama_scan", "llama", "t5", "vit", "resnet", "mixer", "moe"]


def _build(name: str, **kw) -> zoo.Case:
  if name.startswith("llama"):
    return zoo.llama(scan=name.endswith("_scan"), **kw)
  return zoo.build(name, **kw)


@functools.lru_cache(maxsize=None)
def _case(name: str) -> zoo.Case:
  # SGD keeps the updated state linear in the gradients (Adam's first step
  # is sign-like and amplifies float noise: JAX-NOTES).
  return _build(name, tx=optax.sgd(0.1, momentum=0.9))


def _primitives(jaxpr, out):
  for eqn in jaxpr.eqns:
    out.add(eqn.primitive.name)
    for sub in jcore.jaxprs_in_params(eqn.params):
      _primitives(sub, out)
  return out


def test_every_zoo_primitive_has_a_rule():
  cases = [*(_build(n, abstract=True) for n in NAMES),
           zoo.llama(tied=True, abstract=True),
           zoo.llama(dtype="bf16_compute", abstract=True),
           zoo.mixer(dtype="bfloat16", abstract=True),
           zoo.t5(dtype="bf16_compute", abstract=True)]
  for case in cases:
    prims = _primitives(jax.make_jaxpr(case.step)(*case.args).jaxpr, set())
    missing = prims - set(_rules.RULES) - INLINE - CONTROL_FLOW
    assert not missing, (case.name, case.dtype, sorted(missing))


def _assert_state_close(got, want, rtol=1e-5):
  """Leaf by leaf, relative to the leaf; leaves far below the largest (a
  gradient that is zero in exact arithmetic, like an attention key bias's,
  is float noise) are held to the tree's scale instead."""
  got = [g for g in jax.tree.leaves(got) if jax.numpy.issubdtype(
      g.dtype, jax.numpy.floating)]
  want = [w for w in jax.tree.leaves(want) if jax.numpy.issubdtype(
      w.dtype, jax.numpy.floating)]
  assert len(got) == len(want)
  scale = max(float(np.linalg.norm(np.asarray(w, np.float64))) for w in want)
  for i, (g, w) in enumerate(zip(got, want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    floor = max(float(np.linalg.norm(w)), 1e-3 * scale)
    err = float(np.linalg.norm(g - w)) / floor
    assert err <= rtol, f"leaf {i} {w.shape}: rel err {err:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_zoo_plans_compute_the_unsharded_step(name):
  case = _case(name)
  mesh = make_mesh((2, 4), explicit=False)
  want = jax.jit(case.step)(*case.args)
  plan = ad.plan(case.step, *case.args, mesh=mesh, cluster=TEST_CLUSTER)
  assert not plan.graph.unsupported, plan.graph.unsupported
  compiled = plan.jit().lower(*case.args).compile()
  got = compiled(*case.args)
  assert rel_err(got[-1], want[-1]) <= 1e-5  # the loss
  _assert_state_close(got[:-1], want[:-1])
  # The plan shards these models on the slow test cluster, and what XLA
  # emitted for it is collectives, as the plan said.
  assert plan.cost.comm_bytes > 0
  assert _hlo.emitted_bytes(compiled) > 0


def test_a_partial_sum_gathered_inside_its_chain_runs_on_blocks(monkeypatch):
  # The MoE's FSDP completion on (4,2) keeps the expert activations a
  # partial sum over `data` while gathering them over `model` ((P, S(0)) ->
  # (P, B)) inside one chain of partial-sum ops. With no local form for
  # that gather the whole chain was left to XLA, which all-reduced the
  # (batch, seq, experts, d_model) tensor at the dot that made it (384 MiB
  # over `data` at realistic size where the plan reduces later); now the
  # chain runs in regions (a block gathered with `all_gather` where the
  # value is a partial sum already, by the shard_map's in_specs where it is
  # whole).
  from autoddl_jax import _pins
  from autoddl_jax._sbp import P_CODE
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "benchmarks"))
  import fidelity
  monkeypatch.setitem(zoo.MOE_SIZES, "small", zoo.MoeConfig(
      vocab=2048, d_model=256, heads=4, ffn=704, experts=8, layers=2,
      seq=256, batch=8))
  case = zoo.build("moe", size="small")
  mesh = make_mesh((4, 2), explicit=False)
  cluster = fidelity.CLUSTERS["2x4"]
  ours = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                 select="model")
  plan = ad.hand_plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                      in_shardings=ours.textbook("fsdp").in_specs)
  # Every partial sum the plan makes runs in a region: none is left to XLA.
  regions = _pins.regions(plan.program, plan.choice)
  g, prob = plan.graph, plan.problem
  key_of = {oid: key for key, oid in g.eqn_op.items()}
  partial = [o.id for o in g.ops if o.kind == "eqn" and any(
      P_CODE in prob.cands[o.id][plan.choice[o.id]][len(o.ins) + s]
      for s in range(len(o.outs))) and any(
          g.tensors[t].consumers for t in o.outs)]
  assert partial and all(key_of[i] in regions for i in partial)
  got = plan.jit()(*case.args)
  want = jax.jit(case.step)(*case.args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a, b) <= 1e-5


def test_a_loop_returns_its_carry_in_the_carried_layout_first():
  # The Llama's Megatron completion on (2,4) carries the backward loop's
  # cotangent in one layout and returns it in another. With only the
  # result's layouts pinned after the loop, XLA carried the cotangent in
  # the result's layout (split over the sequence) and gathered it back in
  # every iteration: 8 x 384 MiB of all-gather the plan did not have
  # (benchmarks/fidelity.py: 1552 MiB emitted against 1168 predicted; now
  # 1168). The pinned path now starts at the carried layout.
  from autoddl_jax import _pins
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "benchmarks"))
  import fidelity
  case = zoo.build("llama", size="realistic", abstract=True)
  mesh = fidelity._mesh((2, 4))
  cluster = fidelity.CLUSTERS["2x4"]
  ours = ad.plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                 select="model")
  plan = ad.hand_plan(case.step, *case.args, mesh=mesh, cluster=cluster,
                      in_shardings=ours.textbook("megatron").in_specs)
  g, prob = plan.graph, plan.problem
  pins = _pins.pins(plan.program, plan.choice, plan.program.auto_mesh())
  checked = 0
  for ctx, pairs in g.result_links.items():
    for j, (carried, _) in enumerate(pairs):
      path = pins.inputs.get((ctx, ("out", j)))
      if path is None:
        continue
      op, slot = g.tensors[carried].producer
      have = prob.cands[op][plan.choice[op]][len(g.ops[op].ins) + slot]
      assert path[0] == have, (path, have)
      checked += 1
  assert checked
