"""Transitions as XLA does them: the cost model's reshards against the
collectives XLA emits for the same reshard alone.

    python benchmarks/transitions.py [--meshes 4,2x4,2x2x2] [--ranks 2,3]

For every pair (src, dst) of nd-SBPs of a rank-2 and a rank-3 tensor on 1-,
2- and 3-axis meshes of 8 simulated CPU devices (S on each dim, B, and P),
the reshard is compiled alone and XLA's collectives (``ad.collectives``:
ring-model bytes per device, a CPU all-reduce whose result is only sliced
read as the reduce-scatter a GPU emits) are held against
``_cost.transition_steps`` by collective kind. A partial sum is made the way
programs make one, by a contraction whose contracted dim is split over the P
axes; the contraction emits nothing, so every collective of the program is
the transition's.

This table is the ground truth for ``_cost``; ``tests/test_transitions.py``
keeps every pair of the 1-axis mesh and a fixed sample of the others.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import autoddl_jax as ad  # noqa: E402
from autoddl_jax._cluster import mesh_info  # noqa: E402
from autoddl_jax._cost import (transition_states, transition_steps,  # noqa: E402
                              valid_states)
from autoddl_jax._lower import Pins  # noqa: E402
from autoddl_jax._regions import local_reduce, reductions  # noqa: E402
from autoddl_jax._sbp import B_CODE, P_CODE, codes_to_spec  # noqa: E402

MESHES = {"4": (4,), "8": (8,), "2x4": (2, 4), "4x2": (4, 2),
          "2x2x2": (2, 2, 2)}
NAMES = ("x", "y", "z")
SHAPES = {2: (32, 64), 3: (8, 32, 16)}
TOLERANCE = 0.10


@functools.lru_cache(maxsize=None)
def make_mesh(shape: tuple[int, ...], kind: AxisType = AxisType.Auto):
  n = math.prod(shape)
  return jax.make_mesh(shape, NAMES[:len(shape)],
                       axis_types=(kind,) * len(shape),
                       devices=jax.devices()[:n])


def _bytes_by_kind(compiled, mesh) -> dict[str, float]:
  """Ring-model bytes per device of the program's collectives, by kind."""
  got: dict[str, float] = collections.defaultdict(float)
  for c in ad.collectives(compiled, mesh):
    got[c.kind] += c.total_bytes_per_device
  return dict(got)


def _explicit_spec(codes, rank: int, names) -> PartitionSpec:
  """The PartitionSpec of nd codes on Explicit axes, P as ``unreduced``."""
  spec = codes_to_spec(tuple(B_CODE if c == P_CODE else c for c in codes),
                       rank, names)
  unreduced = {n for n, c in zip(names, codes) if c == P_CODE}
  return PartitionSpec(*spec, unreduced=unreduced) if unreduced else spec


def _explicit_bytes(mesh, shape, src, dst, path=()) -> dict[str, float]:
  """As :func:`_xla_bytes`, lowered the Explicit-axes way (issue 12's first
  mechanism): ``jax.sharding.reshard`` to each layout of ``path`` in turn
  (or to ``dst`` in one call), a partial sum made by a contraction with
  ``out_sharding=PartitionSpec(..., unreduced=...)`` and reduced by the
  reshard that leaves it."""
  names = mesh.axis_names
  rank = len(shape)
  steps = [c for c in path if c != src] or [dst]
  p_axes = tuple(n for n, c in zip(names, src) if c == P_CODE)

  def go(v):
    for c in steps:
      v = jax.sharding.reshard(v, _explicit_spec(c, rank, names))
    return v

  with jax.set_mesh(mesh):
    if not p_axes:
      x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(
          mesh, codes_to_spec(src, rank, names)))
      fn, args = jax.jit(go), (x,)
    else:
      k = math.prod(mesh.shape[n] for n in p_axes)
      a_codes = tuple(rank if c == P_CODE else c for c in src)
      b_codes = tuple(0 if c == P_CODE else -1 for c in src)
      a = jax.ShapeDtypeStruct(shape + (k,), jnp.float32,
                               sharding=NamedSharding(mesh, codes_to_spec(
                                   a_codes, rank + 1, names)))
      b = jax.ShapeDtypeStruct((k,), jnp.float32, sharding=NamedSharding(
          mesh, codes_to_spec(b_codes, 1, names)))
      out = _explicit_spec(src, rank, names)
      fn = jax.jit(lambda u, w: go(lax.dot_general(
          u, w, (((rank,), (0,)), ((), ())), out_sharding=out)))
      args = (a, b)
    return _bytes_by_kind(fn.lower(*args).compile(), mesh)


def _xla_bytes(mesh, shape, src, dst, path=()) -> dict[str, float]:
  """Bytes per device by kind that XLA emits to take a float32 tensor of
  ``shape`` from ``src`` to ``dst`` (nd codes), through the layouts of
  ``path`` pinned in turn (the lowering's staging) when given."""
  names = mesh.axis_names
  pins = Pins(mesh, {}, {}, {})
  stage = lambda v: pins.constrain_path(v, [c for c in path  # noqa: E731
                                             if P_CODE not in c])
  out_sh = NamedSharding(mesh, codes_to_spec(dst, len(shape), names))
  p_axes = tuple(n for n, c in zip(names, src) if c == P_CODE)
  if not p_axes:
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(
        mesh, codes_to_spec(src, len(shape), names)))
    fn = jax.jit(stage, out_shardings=out_sh)
    args = (x,)
  else:
    # A partial sum on p_axes: contract a dim split over them, lowered as
    # the planner lowers it (reduced explicitly where it can be).
    k = math.prod(mesh.shape[n] for n in p_axes)
    rank = len(shape)
    a_codes = tuple(rank if c == P_CODE else c for c in src)
    b_codes = tuple(0 if c == P_CODE else -1 for c in src)
    a = jax.ShapeDtypeStruct(shape + (k,), jnp.float32, sharding=NamedSharding(
        mesh, codes_to_spec(a_codes, rank + 1, names)))
    b = jax.ShapeDtypeStruct((k,), jnp.float32, sharding=NamedSharding(
        mesh, codes_to_spec(b_codes, 1, names)))
    contract = lambda u, w: lax.dot_general(  # noqa: E731
        u, w, (((rank,), (0,)), ((), ())))
    eqn = jax.make_jaxpr(contract)(a, b).jaxpr.eqns[0]
    mi = mesh_info(mesh, ad.H100_NODE)
    red = reductions(src, dst, math.prod(shape) * 4, shape, mi) \
        if path else None
    if red is not None:
      spec = ((a_codes, b_codes), (red,))
      fn = jax.jit(lambda u, w: stage(local_reduce(eqn, [u, w], spec, mesh)),
                   out_shardings=out_sh)
    else:
      fn = jax.jit(lambda u, w: stage(contract(u, w)), out_shardings=out_sh)
    args = (a, b)
  return _bytes_by_kind(fn.lower(*args).compile(), mesh)


def _model_bytes(mi, shape, src, dst) -> dict[str, float]:
  got: dict[str, float] = collections.defaultdict(float)
  for kind, _, b in transition_steps(src, dst, math.prod(shape) * 4, shape,
                                     mi):
    got[kind] += b
  return dict(got)


def compare(mesh_shape: tuple[int, ...], shape: tuple[int, ...], src, dst,
            staged: bool = True, explicit: bool = False):
  """(model bytes by kind, XLA bytes by kind) of one transition, lowered
  as the planner lowers it (staged through the model's path) or, with
  ``staged=False``, as one constraint left to XLA; ``explicit`` lowers it
  with ``jax.sharding.reshard`` on Explicit axes instead."""
  mesh = make_mesh(mesh_shape, AxisType.Explicit if explicit
                   else AxisType.Auto)
  mi = mesh_info(mesh, ad.H100_NODE)
  path = transition_states(src, dst, math.prod(shape) * 4, shape, mi) \
      if staged else ()
  lower = _explicit_bytes if explicit else _xla_bytes
  return (_model_bytes(mi, shape, src, dst),
          lower(mesh, shape, src, dst, path))


def agrees(model: dict[str, float], xla: dict[str, float]) -> bool:
  """Every kind's bytes within the tolerance (a kind absent counts 0)."""
  for k in set(model) | set(xla):
    m, x = model.get(k, 0.0), xla.get(k, 0.0)
    if abs(m - x) > TOLERANCE * max(m, x) and abs(m - x) > 1.0:
      return False
  return True


def pairs(mesh_shape: tuple[int, ...], rank: int):
  states = valid_states(SHAPES[rank], mesh_shape)
  return [(s, d) for s in states for d in states
          if s != d and P_CODE not in d]


def _fmt(d: dict[str, float]) -> str:
  return " ".join(f"{k}={v / 1024:.4g}K" for k, v in sorted(d.items())) or "-"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--meshes", default="4,2x4,2x2x2")
  ap.add_argument("--ranks", default="2,3")
  ap.add_argument("--unstaged", action="store_true",
                  help="one constraint per reshard, XLA finds the way")
  ap.add_argument("--explicit", action="store_true",
                  help="lower with jax.sharding.reshard on Explicit axes, "
                       "partial sums as unreduced")
  ap.add_argument("--all", action="store_true",
                  help="print agreeing pairs too")
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  total = ok = failures = 0
  by_reason: collections.Counter = collections.Counter()
  for mkey in args.meshes.split(","):
    for rank in (int(r) for r in args.ranks.split(",")):
      ps = pairs(MESHES[mkey], rank)
      n_ok = 0
      print(f"[transitions] mesh {mkey} rank {rank}: {len(ps)} pairs",
            file=sys.stderr, flush=True)
      for i, (src, dst) in enumerate(ps):
        if i and i % 500 == 0:  # 3-axis rank 3: 7936 pairs, ~17 min
          print(f"[transitions]   {i}/{len(ps)} pairs, {n_ok} agree, "
                f"{time.perf_counter() - t0:.0f} s", file=sys.stderr,
                flush=True)
        try:
          model, xla = compare(MESHES[mkey], SHAPES[rank], src, dst,
                               staged=not args.unstaged,
                               explicit=args.explicit)
        except Exception as e:  # noqa: BLE001 (a lowering jax refuses)
          model, xla = {}, {f"error: {type(e).__name__}": 1e30}
          if args.all or failures < 3:
            print(f"{mkey:6} {str(SHAPES[rank]):12} {src} -> {dst}: "
                  f"{type(e).__name__}: {str(e)[:200]}")
          failures += 1
        good = agrees(model, xla)
        n_ok += good
        if not good:
          by_reason[(tuple(sorted(model)), tuple(sorted(xla)))] += 1
        if args.all or not good:
          print(f"{mkey:6} {str(SHAPES[rank]):12} {str(src):14} -> "
                f"{str(dst):14} {'ok ' if good else 'OFF'} model: "
                f"{_fmt(model):40} xla: {_fmt(xla)}")
      print(f"mesh {mkey} rank {rank}: {n_ok}/{len(ps)} pairs agree")
      total += len(ps)
      ok += n_ok
  print(f"\ntransitions: {ok}/{total} pairs agree by kind within "
        f"{TOLERANCE:.0%}; {time.perf_counter() - t0:.0f} s")
  for (m, x), n in by_reason.most_common(12):
    print(f"  {n:5d}  model {'+'.join(m) or '-'}  xla {'+'.join(x) or '-'}")


if __name__ == "__main__":
  main()
