"""What fraction of peak an H100-class GPU sustains on the 175B GPT's layers.

``Cluster.flops_efficiency`` turns the FLOPs XLA's cost analysis counts into
seconds (``compute_s = flops / (peak * eff)``). This script measures that
fraction on one GPU for the work one device does in the 175B GPT's pipelined
plan (``pipeline_175b.py``): a stage's stack of layers in ``lax.scan``, the
layer sharded Megatron-style over 8 devices (12 of 96 heads, 6144 of 49152
MLP columns), one 2048-token sequence per microbatch, bf16, forward and
backward, under each remat policy the planner tries. The layer is the same
as ``autoddl_jax.testing.models.gpt``'s block (pre-LN, separate q/k/v,
causal softmax attention, GELU MLP); it is written out here so the script
runs under whatever JAX the GPU machine has, without the package.

  python benchmarks/gpu_efficiency.py [--out results.json]     # on a GPU
  python benchmarks/gpu_efficiency.py --predict results.json   # here

On the GPU it prints XLA's own FLOP count and the fraction of peak from it;
XLA:GPU's cost analysis counts a while loop's body once, so for the stages
(layers in ``lax.scan``) those two columns undercount. ``--predict`` gives
the efficiency that matters: the planner's FLOP count of the same step /
(median wall time x peak). A single GPU has no collectives: this is the
compute term alone.
"""

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp

PEAK = 989e12  # dense bf16 tensor-core peak, H100 SXM (the H200's is the same)


def layer_norm(x, scale, bias, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def block(x, lp, heads, fused=False):
  b, s, _ = x.shape
  dh = 128
  y = layer_norm(x, lp["ln1_scale"], lp["ln1_bias"])
  q = (y @ lp["wq"]).reshape(b, s, heads, dh)
  k = (y @ lp["wk"]).reshape(b, s, heads, dh)
  v = (y @ lp["wv"]).reshape(b, s, heads, dh)
  if fused:  # cuDNN's fused (flash) attention: the same function
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation="cudnn")
  else:
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    mask = jnp.tril(jnp.ones((s, s), bool))
    att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
    att = jax.nn.softmax(att, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
  o = o.reshape(b, s, heads * dh)
  x = x + o @ lp["wo"]
  y = layer_norm(x, lp["ln2_scale"], lp["ln2_bias"])
  return x + jax.nn.gelu(y @ lp["w1"]) @ lp["w2"]


def stage_params(key, layers, d, heads, ff, dtype=jnp.bfloat16):
  ks = iter(jax.random.split(key, 8))
  n = lambda shape, fan: (jax.random.normal(next(ks), (layers,) + shape,
                                            jnp.float32)
                          / math.sqrt(fan)).astype(dtype)
  hd = heads * 128
  return {
      "ln1_scale": jnp.ones((layers, d), dtype),
      "ln1_bias": jnp.zeros((layers, d), dtype),
      "wq": n((d, hd), d), "wk": n((d, hd), d), "wv": n((d, hd), d),
      "wo": n((hd, d), hd),
      "ln2_scale": jnp.ones((layers, d), dtype),
      "ln2_bias": jnp.zeros((layers, d), dtype),
      "w1": n((d, ff), d), "w2": n((ff, d), ff),
  }


def flops_of(compiled):
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0]
  return float(ca["flops"])


def timed(fn, args, iters):
  out = fn(*args)
  jax.block_until_ready(out)
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def matmul_case(n=8192, iters=100):
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  t = timed(f, (a, b), iters)
  fl = 2.0 * n ** 3
  return {"case": f"matmul {n}^3 bf16", "policy": "-", "flops": fl,
          "seconds": t, "tflops": fl / t / 1e12, "eff": fl / t / PEAK}


STAGES = {  # name -> (layers, d_model, local heads, local MLP width, batch)
    # Megatron-sharded over 8: 12 of 96 heads, 6144 of 49152 MLP columns.
    "tp8": (12, 12288, 12, 6144, 1),
    "tp8-b2": (12, 12288, 12, 6144, 2),
    # The whole layer on one device (no tensor parallelism), 2 layers.
    "full": (2, 12288, 96, 49152, 1),
    # tp8 with cuDNN's fused attention (GPU only; --predict counts the
    # FLOPs of the same attention written out).
    "tp8-fused": (12, 12288, 12, 6144, 1),
}
SEQ = 2048
DEFAULT_CASES = ("matmul", "tp8:nothing_saveable", "tp8:dots_saveable",
                 "tp8:dots_with_no_batch_dims_saveable", "tp8:none",
                 "tp8-b2:nothing_saveable", "full:nothing_saveable")


def stage_grad(heads, policy, fused=False):
  """The gradient of a stage of layers in ``lax.scan`` w.r.t. its weights
  and input, each layer under ``jax.checkpoint(policy)`` (``"none"``: as
  written)."""

  def body(c, lp):
    return block(c, lp, heads, fused), None

  if policy != "none":
    body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies,
                                               policy), prevent_cse=False)

  def loss(p, x, cot):
    y, _ = jax.lax.scan(body, x, p)
    # A linear functional of the output: its backward carries a full
    # cotangent through every layer, as the next stage's gradient would.
    return jnp.sum((y * cot).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1))


def stage_args(name, abstract=False):
  layers, d, heads, ff, batch = STAGES[name]
  make = lambda: (stage_params(jax.random.key(0), layers, d, heads, ff),
                  *(jax.random.normal(jax.random.key(i), (batch, SEQ, d),
                                      jnp.float32).astype(jnp.bfloat16)
                    for i in (1, 2)))
  return jax.eval_shape(make) if abstract else make()


def stage_case(name, policy, iters=10):
  heads = STAGES[name][2]
  args = stage_args(name)
  step = jax.jit(stage_grad(heads, policy, fused=name.endswith("-fused")))
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  # XLA:GPU's cost analysis counts a while loop's body once (not per
  # trip); --predict counts the FLOPs as the planner does.
  fl = flops_of(compiled)
  t = timed(compiled, args, iters)
  return {"case": name, "policy": policy, "flops": fl, "seconds": t,
          "tflops": fl / t / 1e12, "eff": fl / t / PEAK,
          "compile_s": compile_s}


def predict(path):
  """The planner's compute time for each measured stage (the same step,
  planned on one device with the row's remat policy), beside the time
  measured on the GPU."""
  from jax.sharding import AbstractMesh
  import autoddl_jax as ad
  with open(path) as f:
    meas = json.load(f)
  cl = ad.Cluster()
  mesh = AbstractMesh((1,), ("data",))
  planned = {}  # (stage, policy) -> plan: a case measured twice is planned once
  print(f"measured on {meas['device']} (jax {meas['jax']}); predicted by "
        f"the default Cluster (peak {cl.peak_flops / 1e12:.0f} TFLOP/s x "
        f"flops_efficiency {cl.flops_efficiency})")
  print(f"{'stage':<10} {'remat':<32} {'FLOPs':>10} {'predicted':>10} "
        f"{'measured':>9} {'pred/meas':>9} {'eff':>6} {'6ND MFU':>8}")
  for r in meas["rows"]:
    if r["case"] not in STAGES:
      print(f"{r['case']}: {r['tflops']:.1f} TFLOP/s, {r['eff']:.1%} of "
            "peak")
      continue
    layers, d, heads, ff, batch = STAGES[r["case"]]
    key = (r["case"], r["policy"])
    if key not in planned:
      planned[key] = ad.plan(stage_grad(heads, "none"),
                             *stage_args(r["case"], True), mesh=mesh,
                             remat=r["policy"], memory_budget=float("inf"),
                             pipeline=1)
    p = planned[key]
    flops = p.cost.compute_s * cl.peak_flops * cl.flops_efficiency
    n = layers * (4 * d * heads * 128 + 2 * d * ff)  # the stage's weights
    six_nd = 6 * n * batch * SEQ
    print(f"{r['case']:<10} {r['policy']:<32} {flops / 1e12:8.2f} T "
          f"{p.cost.compute_s * 1e3:8.2f} ms {r['seconds'] * 1e3:7.2f} ms "
          f"{p.cost.compute_s / r['seconds']:9.3f} "
          f"{flops / r['seconds'] / PEAK:6.1%} "
          f"{six_nd / r['seconds'] / PEAK:8.1%}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=None, help="write the rows as JSON here")
  ap.add_argument("--predict", metavar="JSON", default=None,
                  help="no GPU: print the planner's compute time for each "
                  "stage measured in JSON beside the measured time")
  ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                  type=lambda t: t.split(","),
                  help="comma-separated: 'matmul' and STAGE:POLICY "
                  f"(default: {','.join(DEFAULT_CASES)})")
  args = ap.parse_args(argv)
  if args.predict:
    return predict(args.predict)
  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.device_kind} ({dev.platform})",
        flush=True)
  cases = [lambda: matmul_case()] if "matmul" in args.cases else []
  for case in args.cases:
    if case != "matmul":
      name, policy = case.split(":")
      cases.append(lambda name=name, policy=policy: stage_case(name, policy))
  rows = []
  print(f"{'case':<40} {'remat':<32} {'XLA TFLOP':>10} {'ms':>9} "
        f"{'TFLOP/s':>8} {'of peak':>8}", flush=True)
  for make in cases:
    try:
      r = make()
    except Exception as e:  # noqa: BLE001 -- report and go on to the next
      print(f"failed: {type(e).__name__}: {e}"[:400], flush=True)
      continue
    rows.append(r)
    print(f"{r['case']:<40} {r['policy']:<32} {r['flops'] / 1e12:10.2f} "
          f"{r['seconds'] * 1e3:9.2f} {r['tflops']:8.1f} {r['eff']:8.1%}",
          flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "device": dev.device_kind,
                   "peak": PEAK, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
