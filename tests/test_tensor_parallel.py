"""The Megatron textbook plan as an expert writes it: each weight column- or
row-parallel as the dataflow pairs them (``_tensor_parallel``), on models
written as public code is (benchmarks/zoo.py, tiny), and what XLA compiles
for it."""

import os
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

import autoddl_jax as ad
from autoddl_jax import _tensor_parallel
from autoddl_jax._sbp import B_CODE
from autoddl_jax._seeds import tp_codes
from conftest import TEST_CLUSTER
from helpers import make_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import zoo  # noqa: E402


def _roles(case) -> dict[str, tuple[int, ...] | None]:
  """{parameter path: the dims a Megatron layout splits} (None: no matmul)."""
  closed = jax.make_jaxpr(case.step)(*case.args)
  leaves = jax.tree_util.tree_leaves_with_path(case.args[0])
  n_all = len(jax.tree_util.tree_leaves(case.args))
  params = [i for i, (_, x) in enumerate(leaves) if x.ndim >= 2]
  raw = list(range(n_all - len(jax.tree_util.tree_leaves(case.args[-1])),
                   n_all))
  dims = _tensor_parallel.weight_dims(closed, params, raw)
  name = lambda path: "/".join(str(getattr(k, "key", getattr(k, "idx", k)))
                               for k in path)  # noqa: E731
  return {name(p): dims.get(i) for i, (p, x) in enumerate(leaves)
          if x.ndim >= 2 and not {"mu", "nu", "opt_state"} & set(
              name(p).split("/"))}


def _pick(roles, *parts):
  """The one role whose path holds every part, in order."""
  hits = [v for k, v in roles.items()
          if all(p in k.split("/") for p in parts)]
  assert len(hits) >= 1, (parts, sorted(roles))
  assert all(h == hits[0] for h in hits), (parts, hits)
  return hits[0]


def test_llama_scanned_column_then_row():
  # nn.scan over stacked layers: every weight meets the loop in one
  # equation; the roles come from the body's dataflow. Kernels are stacked
  # (layers, in, out): column-parallel splits dim 2, row-parallel dim 1.
  roles = _roles(zoo.llama(scan=True, abstract=True))
  for w in ("wq", "wk", "wv", "gate", "up"):
    assert _pick(roles, w, "kernel") == (2,), w
  for w in ("wo", "down"):
    assert _pick(roles, w, "kernel") == (1,), w
  assert _pick(roles, "embedding") == (0,)  # the vocabulary
  assert _pick(roles, "lm_head", "kernel") == (1,)
  assert _pick(roles, "attn_norm", "scale") is None


def test_t5_attention_kernels_split_their_heads():
  # nnx.MultiHeadAttention: (d_model, heads, head_dim) in, (heads, head_dim,
  # d_model) out; the MLP's wi column-, wo row-parallel.
  roles = _roles(zoo.t5(abstract=True))
  for proj in ("query", "key"):
    assert _pick(roles, "attn", proj, "kernel") == (1, 2)
    assert _pick(roles, "cross", proj, "kernel") == (1, 2)
  assert _pick(roles, "attn", "out", "kernel") == (0,)
  assert _pick(roles, "wi", "kernel") == (1,)
  assert _pick(roles, "wo", "kernel") == (0,)


def test_projection_of_the_raw_input_stays_whole():
  # A ViT's patch projection reads the image: it stays whole, so the
  # residual stream is whole and every block pairs column with row.
  roles = _roles(zoo.vit(abstract=True))
  assert _pick(roles, "patch", "kernel") == ()
  assert _pick(roles, "fc1", "kernel") == (1,)
  assert _pick(roles, "fc2", "kernel") == (0,)
  assert _pick(roles, "query", "kernel") == (1, 2)


def test_moe_experts_split_their_hidden_units():
  # "bsd,edf->bsef" then "bsef,efd->bsed": f is split (the expert dim is
  # the second choice for gate/up), and down contracts f.
  roles = _roles(zoo.moe(abstract=True))
  assert _pick(roles, "w_gate") == (2, 0)
  assert _pick(roles, "w_up") == (2, 0)
  assert _pick(roles, "w_down") == (1,)


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, use_bias=False, name="stem")(x)
    h = nn.gelu(nn.Dense(64, use_bias=False, name="fc1")(x))
    return x + nn.Dense(32, use_bias=False, name="fc2")(h)


def test_megatron_textbook_plan_runs_one_all_reduce_per_pair():
  # The textbook Megatron plan of a residual MLP block on (2, 4): the stem
  # on the raw input whole, fc1 column-, fc2 row-parallel over "model",
  # the batch over "data". XLA propagating
  # that boundary keeps the weights where they are (no all-gather of a
  # weight) and reduces the forward's partial sum once.
  mesh = make_mesh((2, 4), explicit=False)
  model = _Mlp()
  x = jnp.ones((16, 32))
  params = model.init(jax.random.key(0), x)["params"]
  tx = optax.sgd(0.1)

  def step(params, opt, x):
    loss, g = jax.value_and_grad(
        lambda p: (model.apply({"params": p}, x) ** 2).mean())(params)
    up, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, up), opt, loss

  plan = ad.plan(step, params, tx.init(params), x, mesh=mesh,
                 cluster=TEST_CLUSTER, select="model", verbose=False)
  book = plan.textbook("megatron")
  specs = book.param_specs(0)
  assert specs["stem"]["kernel"] == P()
  assert specs["fc1"]["kernel"] == P(None, "model")
  assert specs["fc2"]["kernel"] == P("model")
  assert book.in_specs[2] == P("data")
  compiled = book.jit().lower(
      *jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
          a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
          (params, tx.init(params), x), book.in_specs,
          is_leaf=lambda s: isinstance(s, P))).compile()
  cols = ad.collectives(compiled, mesh)
  weight_shapes = {(32, 64), (64, 32), (32, 16), (16, 32), (8, 64),
                   (64, 8)}
  assert not [c for c in cols if c.kind == "all-gather"
              and set(c.shapes) & weight_shapes]
  fwd = [c for c in cols if c.kind == "all-reduce" and c.axes == ("model",)]
  assert fwd and all(s == (8, 32) for c in fwd for s in c.shapes)


@pytest.mark.parametrize("fsdp", [False, True])
def test_tp_codes_fall_back_to_the_next_dim_that_divides(fsdp):
  # heads (6) do not divide by 4: head_dim (8) is split instead; with
  # FSDP the data axis splits the largest other dim.
  codes = tp_codes((32, 6, 8), (2, 4), (1, 2), fsdp)
  assert codes == ((0 if fsdp else B_CODE), 2)
