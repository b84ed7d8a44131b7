"""Every signature rule against the real thing.

For each equation of a set of small programs covering every primitive with a
rule, and each of its 1-D signatures on a 2-device axis:

* inputs S/B: compile the op alone with those input shardings (and the output
  shardings the signature claims) and check that XLA needs *no* collective
  when the outputs are S/B -- the signature is computable locally -- and only
  a reduction when they are P; then check the values against the unsharded op;
* inputs with P: run the op eagerly on each device's piece (addends for P,
  slices for S, the whole for B) and check that the pieces recombine (sum for
  P, concatenation for S) into the unsharded result.
"""

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax._src.lax import lax as _lax_internal  # eq_to/le_to/lt_to

from autoddl_jax import _hlo, _rules, pipeline
from autoddl_jax._jaxpr import INLINE, bodies, to_aval
from autoddl_jax._lower import bind_eqn
from autoddl_jax._sbp import B_CODE, P_CODE

rng = np.random.default_rng(0)


def f32(*s):
  return rng.normal(size=s).astype(np.float32)


def _pool(x):
  return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                           "VALID")


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _patch_conv(x, w):  # a ViT / MLP-Mixer patch embedding
  return lax.conv_general_dilated(x, w, (4, 4), "VALID",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


PROGRAMS = {
    "unary": (lambda x: [
        jnp.exp(x), jnp.log(jnp.abs(x) + 1), jnp.tanh(x), jax.nn.sigmoid(x),
        lax.erf(x), jnp.sqrt(jnp.abs(x)), lax.rsqrt(jnp.abs(x) + 1),
        jnp.sign(x), x ** 3, jnp.square(x), -x, jnp.isfinite(x), jnp.floor(x),
        jnp.ceil(x), jnp.round(x), lax.round(x), jnp.sin(x), jnp.cos(x), jnp.log1p(
            jnp.abs(x)), jnp.expm1(x), lax.stop_gradient(x),
        x.astype(jnp.int32), x.astype(jnp.float16), ~(x > 0)], [f32(4, 6)]),
    "binary": (lambda x, y: [
        x + y, x - y, x * y, x / (jnp.abs(y) + 1), jnp.maximum(x, y),
        jnp.minimum(x, y), jnp.abs(x) ** y, x == y, x != y, x < y, x <= y,
        x > y, x >= y, (x > 0) & (y > 0), (x > 0) | (y > 0),
        jnp.arctan2(x, y), lax.rem(x, jnp.abs(y) + 1), jnp.where(x > y, x, y),
        lax.clamp(-0.5, x, 0.5), lax.add(x, y) * 2.0,
        jax.grad(lambda x: (jnp.sin(x) * jnp.cos(x)).sum())(x)],
               [f32(4, 6), f32(4, 6)]),
    "shapes": (lambda x, z: [
        jnp.broadcast_to(x[:, None, :], (4, 2, 6)), x.reshape(24),
        x.reshape(2, 2, 6), x.reshape(4, 2, 3), x.T, lax.squeeze(z, (1,)),
        lax.expand_dims(x, (1,)), jnp.transpose(x.reshape(2, 2, 6),
                                                (2, 0, 1))],
               [f32(4, 6), f32(4, 1, 6)]),
    "reductions": (lambda x: [
        x.sum(0), x.sum(1), x.sum(), x.max(0), x.min(1), x.prod(1),
        jnp.argmax(x, 1), jnp.argmin(x, 0), jnp.all(x > 0, 1),
        jnp.any(x > 0, 0)], [f32(4, 6)]),
    "scans": (lambda x: [
        jnp.cumsum(x, 1), jnp.cumprod(x, 0), lax.cumsum(x, 0),
        lax.cumprod(x, 1), lax.cummax(x, 1),
        lax.cumlogsumexp(x, 1), jnp.sort(x, 1), lax.top_k(x, 2)[0]],
              [f32(4, 6)]),
    "slicing": (lambda x, u, i: [
        x[1:3], x[:, 2:4], lax.dynamic_slice(x, (i, 0), (2, 6)),
        lax.dynamic_slice(x, (i, i + 1), (2, 4)),
        lax.dynamic_update_slice(x, u, (i, 0)),
        lax.dynamic_update_slice(x, u[:, :4], (i, i)), jnp.concatenate([x, x], 0),
        jnp.concatenate([x, x], 1), *jnp.split(x, 2, 1),
        jnp.pad(x, ((1, 1), (0, 0))), lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 0))), jnp.flip(x, 0), jnp.arange(8) * 1.0,
        lax.broadcasted_iota(jnp.int32, (4, 6), 1)],
                [f32(4, 6), f32(2, 6), np.int32(1)]),
    "dot": (lambda a, b, c, d: [a @ b, jnp.einsum("bij,bjk->bik", c, d),
                                jnp.einsum("ij,kj->ik", a, b.T)],
            [f32(4, 6), f32(6, 8), f32(2, 4, 6), f32(2, 6, 8)]),
    "conv": (lambda x, w: [_conv(x, w), *jax.grad(
        lambda x, w: _conv(x, w).sum(), (0, 1))(x, w)],
             [f32(2, 4, 4, 2), f32(3, 3, 2, 4)]),
    "patch_conv": (lambda x, w: [_patch_conv(x, w), *jax.grad(
        lambda x, w: _patch_conv(x, w).sum(), (0, 1))(x, w)],
                   [f32(2, 8, 8, 3), f32(4, 4, 3, 5)]),
    "pool": (lambda x: [_pool(x), lax.reduce_window(
        x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                        jax.grad(lambda x: _pool(x).sum())(x)],
             [f32(2, 4, 4, 2)]),
    "random": (lambda x, key: [
        x + jax.random.normal(jax.random.fold_in(key, 3), x.shape),
        jax.random.split(key, 2), lax.bitcast_convert_type(x, jnp.int32),
        jax.random.key(7), jax.random.wrap_key_data(
            jax.random.key_data(key) + 1)], [f32(4, 6), jax.random.key(0)]),
    "stacking": (lambda x: [
        jnp.stack([x, 2 * x], 1), jnp.stack([x, x, x], 0),
        jnp.tile(x, (2, 1)), jnp.tile(x, (1, 3)), jnp.tile(x, (2, 1, 1)),
        *jnp.unstack(x.reshape(4, 2, 3), axis=1)], [f32(4, 6)]),
    "scatters": (lambda x, i: [
        x.at[i].set(1.0), x.at[i].mul(2.0), x.at[i].max(0.5),
        x.at[i].min(0.5), x.at[:, i].set(0.0)],
                 [f32(4, 6), np.array([1, 3], np.int32)]),
    "total_order": (lambda x, y: [
        _lax_internal.eq_to_p.bind(x, y), _lax_internal.le_to_p.bind(x, y),
        _lax_internal.lt_to_p.bind(x, y)], [f32(4, 6), f32(4, 6)]),
    # ad.pipeline's shift: split on its axis, each block moves one stage
    # on (a collective-permute, which the problem charges to the op).
    "stage_shift": (lambda x: [
        pipeline.stage_shift(x, "x"), pipeline.stage_shift(x, "x", -1),
        pipeline.stage_shift(x, "x", axis=1), jax.grad(lambda x: (
            pipeline.stage_shift(x, "x") ** 2).sum())(x)], [f32(4, 6)]),
    "gather": (lambda t, ids, lg, lab: [
        t[ids], jnp.take_along_axis(lg, lab[:, None], axis=1),
        *jax.grad(lambda t, lg: t[ids].sum() + jnp.take_along_axis(
            lg, lab[:, None], axis=1).sum(), (0, 1))(t, lg)],
               [f32(8, 4), np.array([1, 7, 0, 3, 3, 5], np.int32),
                f32(4, 10), np.array([2, 9, 0, 4], np.int32)]),
}

MESH = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))


def _walk(prog, jaxpr, consts, args):
  """Evaluates a jaxpr eagerly, yielding each ruled equation with its values;
  nested jit / custom_jvp / custom_vjp bodies are walked too."""
  env = dict(zip(jaxpr.invars, args))
  env.update(zip(jaxpr.constvars, consts))
  for i, eqn in enumerate(jaxpr.eqns):
    ins = [v.val if isinstance(v, jcore.Literal) else env[v]
           for v in eqn.invars]
    name = eqn.primitive.name
    if name in INLINE:
      [(_, sub, sub_consts)] = bodies(eqn, ())
      outs = yield from _walk(prog, sub, sub_consts,
                              ins[len(ins) - len(sub.invars):])
    else:
      outs = bind_eqn(eqn, ins)
      outs = outs if eqn.primitive.multiple_results else [outs]
      if name in _rules.RULES:
        yield f"{prog}-{i}-{name}", eqn, ins, outs
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [v.val if isinstance(v, jcore.Literal) else env[v]
          for v in jaxpr.outvars]


def _cases():
  for prog, (fn, args) in PROGRAMS.items():
    closed = jax.make_jaxpr(fn)(*args)
    seen = set()
    for name, eqn, ins, outs in _walk(prog, closed.jaxpr, closed.consts, args):
      while name in seen:
        name += "'"
      seen.add(name)
      yield name, eqn, ins, outs


CASES = list(_cases())


def _divides(sig, eqn) -> bool:
  avals = [v.aval for v in eqn.invars] + [v.aval for v in eqn.outvars]
  for code, a in zip(sig[0] + sig[1], avals):
    if code >= 0 and a.shape[code] % 2:
      return False
  return True


def _spec(code, rank):
  if code >= 0:
    return P(*([None] * code + ["x"]))
  return P()


def _close(got, want):
  if jax.dtypes.issubdtype(getattr(want, "dtype", None), jax.dtypes.prng_key):
    got, want = jax.random.key_data(got), jax.random.key_data(want)
  got, want = np.asarray(got), np.asarray(want)
  if np.issubdtype(want.dtype, np.floating):
    np.testing.assert_allclose(got.astype(np.float32),
                               want.astype(np.float32), rtol=2e-3 if
                               want.dtype == np.float16 else 1e-5, atol=1e-5)
  else:
    np.testing.assert_array_equal(got, want)


def _check_xla(eqn, ins, outs, sig):
  var_pos = [j for j, v in enumerate(eqn.invars)
             if not isinstance(v, jcore.Literal)]

  def op(*xs):
    full = list(ins)
    for j, x in zip(var_pos, xs):
      full[j] = x
    r = bind_eqn(eqn, full)
    return list(r) if eqn.primitive.multiple_results else [r]

  in_sh = [NamedSharding(MESH, _spec(sig[0][j], np.ndim(ins[j])))
           for j in var_pos]
  out_sh = [NamedSharding(MESH, _spec(c, np.ndim(o)) if c != P_CODE else P())
            for c, o in zip(sig[1], outs)]
  f = jax.jit(op, in_shardings=in_sh, out_shardings=out_sh)
  args = [ins[j] for j in var_pos]
  compiled = f.lower(*args).compile()
  kinds = {c.kind for c in _hlo.collectives(compiled)}
  if eqn.primitive.name == "stage_shift" and sig[1][0] == eqn.params["axis"]:
    assert kinds == {"collective-permute"}, kinds
  elif P_CODE in sig[1]:
    assert kinds and kinds <= {"all-reduce", "reduce-scatter"}, kinds
  else:
    assert not kinds, f"signature {sig} needed collectives {kinds}"
  for g, w in zip(compiled(*args), outs):
    _close(g, w)


def _check_local(eqn, ins, outs, sig):
  pieces = []
  addends = {}
  for j, (code, x) in enumerate(zip(sig[0], ins)):
    if code == P_CODE:
      a = rng.normal(size=np.shape(x)).astype(np.asarray(x).dtype)
      addends[j] = [a, np.asarray(x) - a]
  for dev in range(2):
    local = []
    for j, (code, x) in enumerate(zip(sig[0], ins)):
      if code == P_CODE:
        local.append(addends[j][dev])
      elif code >= 0:
        local.append(np.split(np.asarray(x), 2, axis=code)[dev])
      else:
        local.append(x)
    r = bind_eqn(eqn, local)
    pieces.append(list(r) if eqn.primitive.multiple_results else [r])
  for k, (code, want) in enumerate(zip(sig[1], outs)):
    got = [np.asarray(p[k]) for p in pieces]
    if code == P_CODE:
      _close(got[0] + got[1], want)
    elif code >= 0:
      _close(np.concatenate(got, axis=code), want)
    else:
      _close(got[0], want)
      _close(got[1], want)


def test_partial_sums_never_reach_integer_or_index_operands():
  """P on an index or a predicate would sum positions: never allowed."""
  for name, eqn, ins, outs in CASES:
    sigs = _rules.signatures(eqn.primitive.name,
                             [to_aval(v.aval) for v in eqn.invars],
                             [to_aval(v.aval) for v in eqn.outvars], eqn.params)
    for sig in sigs:
      for code, v in zip(sig[0], eqn.invars):
        if code == P_CODE:
          assert np.issubdtype(np.dtype(v.aval.dtype), np.floating), (
              name, sig)


@pytest.mark.parametrize("name,eqn,ins,outs", CASES, ids=[c[0] for c in CASES])
def test_every_signature_is_correct(name, eqn, ins, outs):
  sigs = _rules.signatures(eqn.primitive.name,
                           [to_aval(v.aval) for v in eqn.invars],
                           [to_aval(v.aval) for v in eqn.outvars], eqn.params)
  assert sigs and all(c == B_CODE for c in sigs[0][0] + sigs[0][1])
  literal = [isinstance(v, jcore.Literal) for v in eqn.invars]
  checked = 0
  for sig in sigs:
    if not _divides(sig, eqn) or any(
        lit and c != B_CODE for lit, c in zip(literal, sig[0])):
      continue
    if P_CODE in sig[0]:
      _check_local(eqn, ins, outs, sig)
    else:
      _check_xla(eqn, ins, outs, sig)
    checked += 1
  assert checked >= 1


SEEN = """abs add add_any and broadcast_in_dim conv_general_dilated
  convert_element_type div dot_general eq exp gather ge gt integer_pow iota
  is_finite log lt max min mul neg pow reduce_max reduce_sum reduce_window_max
  reshape rsqrt scatter-add select_and_scatter_add select_n sign sqrt square
  stop_gradient sub tanh transpose sharding_constraint reshard concatenate
  dynamic_slice dynamic_update_slice squeeze cumsum argmax logistic
  erf sort stack tile unstack empty2 lt_to scatter scatter-mul scatter-max
  scatter-min""".split()


def test_rules_cover_the_primitives_of_real_train_steps():
  missing = [p for p in SEEN if p not in _rules.RULES]
  assert not missing


def test_every_rule_names_a_primitive_of_this_jax():
  """A rule keyed by a name no primitive has is dead code (jax 0.10 has no
  ``expand_dims``, ``copy_p`` or ``scatter_add`` primitive)."""
  import gc
  from jax._src import core
  names = {o.name for o in gc.get_objects() if isinstance(o, core.Primitive)}
  assert not set(_rules.RULES) - names, sorted(set(_rules.RULES) - names)


def test_every_primitive_with_a_rule_is_exercised_here():
  exercised = {c[1].primitive.name for c in CASES}
  # Primitives that plain jnp programs here do not produce on this jax.
  not_produced = {"copy", "sharding_constraint", "reshard",
                  "device_put", "reduce_xor",
                  "reduce_precision", "imag", "real", "conj", "complex", "not",
                  "shift_left", "shift_right_logical", "clz",
                  "shift_right_arithmetic", "population_count", "digamma",
                  "lgamma", "erf_inv", "erfc", "acos", "acosh", "asin",
                  "asinh", "atan", "atanh", "cbrt", "cosh", "sinh", "tan",
                  "exp2", "nextafter", "xor", "reduce_window",
                  "reduce_window_min", "select_and_gather_add", "cummin",
                  "or", "threefry2x32",
                  # Uninitialised values (symbolic zeros in cond's
                  # gradients): nothing to compare. Its rule is iota's.
                  "empty2"}
  untested = set(_rules.RULES) - exercised - not_produced
  assert not untested, sorted(untested)
