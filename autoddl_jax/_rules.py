"""Signature rules: for each primitive, the 1-D SBP signatures that are correct.

A signature is ``(input SBPs, output SBPs)`` for one mesh axis such that running
the op on each device's local shards gives the right global result, with no
communication. Signatures on different mesh axes are independent, so the n-D
candidates of an op are the product of its 1-D list over the mesh axes, minus
those that split a dim by more than it divides (see ``_graph``).

Most rules are *factor maps*, as in einsum: every dim of every operand is
labelled with a factor; splitting a factor splits it on every operand that has
it, and the output gets ``S`` where the factor survives or ``P`` where it is
summed away. ``B`` everywhere is always allowed. On top come the *linearity*
signatures that carry partial sums (``P + P -> P``, ``P * B -> P``, ...).

A rule sees shapes only: ``ins``/``outs`` are tuples of :class:`Aval`.
Codes: ``S(d) = d``, ``B = -1``, ``P = -2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autoddl_jax._sbp import B_CODE as B, P_CODE as P

Sig = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Aval:
  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def rank(self) -> int:
    return len(self.shape)

  @property
  def is_float(self) -> bool:
    return np.issubdtype(self.dtype, np.floating) or np.issubdtype(
        self.dtype, np.complexfloating)


Rule = Callable[[Sequence[Aval], Sequence[Aval], dict[str, Any]], list[Sig]]


def _all_b(ins, outs) -> Sig:
  return (tuple(B for _ in ins), tuple(B for _ in outs))


def _dedup(sigs: list[Sig]) -> list[Sig]:
  seen, out = set(), []
  for s in sigs:
    if s not in seen:
      seen.add(s)
      out.append(s)
  return out


# ----------------------------------------------------------------- factor maps
def factor_sigs(ins: Sequence[Aval], outs: Sequence[Aval],
                in_factors: Sequence[str], out_factors: Sequence[str],
                summed: str = "", blocked: str = "") -> list[Sig]:
  """Signatures from an einsum-like factor map.

  ``in_factors[i]`` labels each dim of input ``i`` with one character ('' for a
  scalar or an operand the factors do not touch, '.' for a dim that is never
  split). A factor missing from every output is *summed* (split -> P) if listed
  in ``summed``, otherwise not splittable. Factors in ``blocked`` never split.
  """
  sigs = [_all_b(ins, outs)]
  factors = sorted({f for fs in (*in_factors, *out_factors) for f in fs} - {"."})
  for f in factors:
    if f in blocked:
      continue
    in_codes = tuple(fs.index(f) if f in fs else B for fs in in_factors)
    if any(f in fs for fs in out_factors):
      out_codes = tuple(fs.index(f) if f in fs else B for fs in out_factors)
    elif f in summed:
      out_codes = tuple(P for _ in out_factors)
    else:
      continue
    sigs.append((in_codes, out_codes))
  return sigs


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _dims(rank: int, start: int = 0) -> str:
  return _LETTERS[start:start + rank]


def _elementwise(ins, outs, params) -> list[Sig]:
  r = outs[0].rank
  out = outs[0].shape
  # A size-1 dim against a longer result dim broadcasts (lax's elementwise
  # ops take them, e.g. RoPE's ``x * cos[None, :, None, :]``): that operand
  # stays whole along it while the others split it.
  fs = ["".join("." if a.shape[d] == 1 and out[d] != 1 else f
                for d, f in enumerate(_dims(r))) if a.rank == r else ""
        for a in ins]
  return factor_sigs(ins, outs, fs, [_dims(r)] * len(outs))


def _linear(*patterns: str) -> Callable[[Rule], Rule]:
  """Adds partial-sum signatures to a rule.

  Each pattern has one char per input: 'P' (partial), 'B' (replicated), '*'
  (P if the input is a float array, else B); its last char repeats for any
  further inputs ("BP": a predicate, then any number of partial cases). The
  output is P.
  """

  def wrap(rule: Rule) -> Rule:

    def with_p(ins, outs, params):
      sigs = rule(ins, outs, params)
      if not all(o.is_float for o in outs):
        return sigs
      for pat in patterns:
        pat = (pat + pat[-1] * len(ins))[:len(ins)]
        codes = []
        for ch, a in zip(pat, ins):
          codes.append(P if ch == "P" or (ch == "*" and a.is_float and a.rank)
                       else B)
        if P in codes:
          sigs = sigs + [(tuple(codes), tuple(P for _ in outs))]
      return _dedup(sigs)

    return with_p

  return wrap


# --------------------------------------------------------------- shape rules
def _broadcast_in_dim(ins, outs, params):
  bd = params["broadcast_dimensions"]
  x, y = ins[0], outs[0]
  letters = _dims(y.rank)
  # A size-1 dim broadcast to a larger one never splits on the input side; the
  # output dims the input lacks can split (each device broadcasts its slice).
  xf = "".join(letters[bd[i]] if x.shape[i] == y.shape[bd[i]] else "."
               for i in range(x.rank))
  return _pad_ins(factor_sigs(ins[:1], outs, [xf], [letters]), len(ins))


def _pad_ins(sigs: list[Sig], n_ins: int) -> list[Sig]:
  """Extends signatures over the first inputs with B for trailing operands."""
  return [(i + (B,) * (n_ins - len(i)), o) for i, o in sigs]


def _reshape_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
  """Dims i of src that split exactly like dim j of dst (same major prefix)."""
  out, pre_s = {}, 1
  pre_d = np.cumprod([1, *dst])
  for i, s in enumerate(src):
    for j in range(len(dst)):
      if pre_d[j] == pre_s and dst[j] > 1 and s > 1:
        out[i] = j
        break
    pre_s *= s
  return out


def _reshape(ins, outs, params):
  m = _reshape_map(ins[0].shape, outs[0].shape)
  sigs = [_all_b(ins, outs)]
  for i, j in m.items():
    sigs.append(((i,) + (B,) * (len(ins) - 1), (j,)))
  return sigs


def _transpose(ins, outs, params):
  perm = params["permutation"]
  letters = _dims(ins[0].rank)
  return factor_sigs(ins, outs, [letters], ["".join(letters[p] for p in perm)])


def _reduce(summed: bool) -> Rule:

  def rule(ins, outs, params):
    axes = set(params["axes"])
    letters = _dims(ins[0].rank)
    of = "".join(c for d, c in enumerate(letters) if d not in axes)
    red = "".join(c for d, c in enumerate(letters) if d in axes)
    return factor_sigs(ins, outs, [letters] * len(ins), [of] * len(outs),
                       summed=red if summed else "")

  return rule


def _along_axis(param: str) -> Rule:
  """Ops that mix along one axis (cumsum, sort, ...): that axis never splits."""

  def rule(ins, outs, params):
    ax = params[param]
    ax = ax if ax >= 0 else ins[0].rank + ax
    letters = "".join("." if d == ax else c
                      for d, c in enumerate(_dims(ins[0].rank)))
    return factor_sigs(ins, outs, [letters] * len(ins), [letters] * len(outs))

  return rule


def _top_k(ins, outs, params):
  # Splitting the rows would be local, but XLA's partitioner gathers top_k's
  # operand anyway (tests/test_rules.py): keep it replicated.
  return [_all_b(ins, outs)]


def _squeeze(ins, outs, params):
  drop = {d % ins[0].rank for d in params["dimensions"]}
  letters = _dims(ins[0].rank)
  return factor_sigs(ins, outs, [letters],
                     ["".join(c for d, c in enumerate(letters) if d not in drop)])


def _full_dims(operand: Aval, window: Sequence[int]) -> str:
  return "".join(c if w == s else "." for c, w, s in
                 zip(_dims(operand.rank), window, operand.shape))


def _slice(ins, outs, params):
  x, y = ins[0], outs[0]
  letters = "".join(c if a == b else "."
                    for c, a, b in zip(_dims(x.rank), x.shape, y.shape))
  return factor_sigs(ins, outs, [letters], [letters])


def _dynamic_slice(ins, outs, params):
  letters = _full_dims(ins[0], params["slice_sizes"])
  return factor_sigs(ins, outs, [letters] + [""] * (len(ins) - 1), [letters])


def _dynamic_update_slice(ins, outs, params):
  x, u = ins[0], ins[1]
  letters = "".join(c if a == b else "."
                    for c, a, b in zip(_dims(x.rank), x.shape, u.shape))
  return factor_sigs(ins, outs, [letters, letters] + [""] * (len(ins) - 2),
                     [letters])


def _concatenate(ins, outs, params):
  d = params["dimension"]
  letters = "".join("." if i == d else c
                    for i, c in enumerate(_dims(outs[0].rank)))
  return factor_sigs(ins, outs, [letters] * len(ins), [letters])


def _stack(ins, outs, params):
  # The new dim holds one operand each: it never splits; the others map.
  out = _dims(outs[0].rank)
  letters = out[:params["axis"]] + out[params["axis"] + 1:]
  return factor_sigs(ins, outs, [letters] * len(ins),
                     [out[:params["axis"]] + "." + out[params["axis"] + 1:]])


def _unstack(ins, outs, params):
  x = _dims(ins[0].rank)
  letters = x[:params["axis"]] + x[params["axis"] + 1:]
  return factor_sigs(ins, outs, [x[:params["axis"]] + "." +
                                 x[params["axis"] + 1:]],
                     [letters] * len(outs))


def _tile(ins, outs, params):
  # A repeated dim does not split (the local tile of a shard repeats the
  # shard, not the whole); dims tiled once map through. Leading new dims
  # (more reps than the operand has dims) are never split.
  reps = tuple(params["reps"])
  new = outs[0].rank - ins[0].rank
  x = _dims(ins[0].rank, new)
  letters = "".join(c if r == 1 else "." for c, r in zip(x, reps[new:]))
  return factor_sigs(ins, outs, [letters], ["." * new + letters])


def _split(ins, outs, params):
  d = params["axis"]
  letters = "".join("." if i == d else c
                    for i, c in enumerate(_dims(ins[0].rank)))
  return factor_sigs(ins, outs, [letters], [letters] * len(outs))


def _rev(ins, outs, params):
  rev = set(params["dimensions"])
  letters = "".join("." if d in rev else c
                    for d, c in enumerate(_dims(ins[0].rank)))
  return factor_sigs(ins, outs, [letters], [letters])


def _pad(ins, outs, params):
  letters = "".join(c if cfg == (0, 0, 0) else "." for c, cfg in
                    zip(_dims(ins[0].rank), params["padding_config"]))
  return factor_sigs(ins, outs, [letters, ""], [letters])


def _iota(ins, outs, params):
  # Each device can produce its own slice of an iota (offset by its index).
  return factor_sigs(ins, outs, [""] * len(ins), [_dims(outs[0].rank)])


def _dot_general(ins, outs, params):
  (lc, rc), (lb, rb) = params["dimension_numbers"]
  lhs, rhs = ins
  lf, rf = ["."] * lhs.rank, ["."] * rhs.rank
  it = iter(_LETTERS)
  out = []
  for a, b in zip(lb, rb):
    c = next(it)
    lf[a] = rf[b] = c
    out.append(c)
  summed = ""
  for a, b in zip(lc, rc):
    c = next(it)
    lf[a] = rf[b] = c
    summed += c
  for d in range(lhs.rank):
    if d not in lc and d not in lb:
      lf[d] = next(it)
      out.append(lf[d])
  for d in range(rhs.rank):
    if d not in rc and d not in rb:
      rf[d] = next(it)
      out.append(rf[d])
  return factor_sigs(ins, outs, ["".join(lf), "".join(rf)], ["".join(out)],
                     summed=summed)


def _conv(ins, outs, params):
  dn = params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  lf, rf, of = ["."] * ins[0].rank, ["."] * ins[1].rank, ["."] * outs[0].rank
  groups = params["feature_group_count"] != 1
  bgroups = params["batch_group_count"] != 1
  if not bgroups:
    lf[lhs_spec[0]] = of[out_spec[0]] = "n"
  if not groups and not bgroups:
    rf[rhs_spec[0]] = of[out_spec[1]] = "o"
    lf[lhs_spec[1]] = rf[rhs_spec[1]] = "c"
  # A patch embedding (window == stride, no padding or dilation) maps each
  # block of the input's spatial dim to one of the output's: split together,
  # every device convolves its own patches (no halo).
  strides = params["window_strides"]
  pads = params["padding"]
  lhs_dil = params.get("lhs_dilation") or (1,) * len(strides)
  rhs_dil = params.get("rhs_dilation") or (1,) * len(strides)
  for i, letter in zip(range(len(strides)), "hwdtuv"):
    li, ri, oi = lhs_spec[2 + i], rhs_spec[2 + i], out_spec[2 + i]
    if (ins[1].shape[ri] == strides[i] and tuple(pads[i]) == (0, 0)
        and lhs_dil[i] == 1 and rhs_dil[i] == 1
        and ins[0].shape[li] == strides[i] * outs[0].shape[oi]):
      lf[li] = of[oi] = letter
  return factor_sigs(ins, outs, ["".join(lf), "".join(rf)], ["".join(of)],
                     summed="c")


def _window_letters(x: Aval, params) -> str:
  ok = []
  for d, c in enumerate(_dims(x.rank)):
    trivial = (params["window_dimensions"][d] == 1
               and params["window_strides"][d] == 1
               and tuple(params["padding"][d]) == (0, 0)
               and params.get("base_dilation", (1,) * x.rank)[d] == 1
               and params.get("window_dilation", (1,) * x.rank)[d] == 1)
    ok.append(c if trivial else ".")
  return "".join(ok)


def _reduce_window(ins, outs, params):
  n = len(outs)
  letters = _window_letters(ins[0], params)
  # Operands then init values (scalars).
  return factor_sigs(ins, outs, [letters] * n + [""] * (len(ins) - n),
                     [letters] * n)


def _select_and_scatter_add(ins, outs, params):
  # (source, operand) -> like operand; windowed dims never split.
  letters = _window_letters(ins[1], params)
  return factor_sigs(ins, outs, [letters, letters], [letters])


def _select_and_gather_add(ins, outs, params):
  letters = _window_letters(ins[1], params)
  return factor_sigs(ins, outs, [letters, letters], [letters])


def _gather(ins, outs, params):
  operand, idx = ins
  out = outs[0]
  dn = params["dimension_numbers"]
  slice_sizes = params["slice_sizes"]
  offset_dims = tuple(dn.offset_dims)
  collapsed = set(dn.collapsed_slice_dims)
  obatch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
  ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()) or ())
  start_map = tuple(dn.start_index_map)
  sigs = [_all_b(ins, outs)]
  # Operand dims that pass through whole into the output's offset dims.
  passthrough = [d for d in range(operand.rank)
                 if d not in collapsed and d not in obatch]
  for d, od in zip(passthrough, offset_dims):
    if slice_sizes[d] == operand.shape[d] and d not in start_map:
      sigs.append(((d, B), (od,)))
  # Index batch dims -> output batch dims (the index vector dim is last).
  out_batch = [d for d in range(out.rank) if d not in offset_dims]
  for i, od in zip(range(idx.rank - 1), out_batch):
    if i in ibatch:
      sigs.append(((obatch[ibatch.index(i)], i), (od,)))
    else:
      sigs.append(((B, i), (od,)))
  # A table split on an indexed dim: each device looks up what it owns and
  # zeros the rest (XLA masks), so the result is a partial sum.
  if out.is_float:
    for d in start_map:
      if slice_sizes[d] == 1 and d not in obatch:
        sigs.append(((d, B), (P,)))
  return _dedup(sigs)


def _scatter_add(ins, outs, params):
  operand, idx, upd = ins
  dn = params["dimension_numbers"]
  uwd = tuple(dn.update_window_dims)
  inserted = set(dn.inserted_window_dims)
  obatch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
  ibatch = tuple(getattr(dn, "scatter_indices_batching_dims", ()) or ())
  s2o = tuple(dn.scatter_dims_to_operand_dims)
  sigs = [_all_b(ins, outs)]
  window_operand = [d for d in range(operand.rank)
                    if d not in inserted and d not in obatch]
  for d, ud in zip(window_operand, uwd):
    if upd.shape[ud] == operand.shape[d] and d not in s2o:
      sigs.append(((d, B, ud), (d,)))
  upd_scatter = [d for d in range(upd.rank) if d not in uwd]
  for i, ud in zip(range(idx.rank - 1), upd_scatter):
    if i in ibatch:
      od = obatch[ibatch.index(i)]
      sigs.append(((od, i, ud), (od,)))
    elif outs[0].is_float:
      # Each device scatters its share of the updates: partial sums.
      sigs.append(((P, i, ud), (P,)))
  for d in s2o:
    if d in inserted and d not in obatch:
      sigs.append(((d, B, B), (d,)))  # each device keeps its rows (masked)
  if outs[0].is_float:
    sigs.append(((P, B, P), (P,)))
  return _dedup(sigs)


def _scatter(ins, outs, params):
  """scatter (set), scatter-mul/-max/-min: the window and batch dims split
  as for scatter-add; no partial sums (the combiner is not a sum)."""
  return [s for s in _scatter_add(ins, outs, params)
          if P not in s[0] and P not in s[1]]


def _convert(ins, outs, params):
  sigs = _elementwise(ins, outs, params)
  # Partial sums survive a cast only if it does not round them: float to a
  # float at least as wide.
  if ins[0].is_float and outs[0].is_float and (
      outs[0].dtype.itemsize >= ins[0].dtype.itemsize):
    sigs.append(((P,), (P,)))
  return sigs


def _replicated(ins, outs, params):
  return [_all_b(ins, outs)]


def _bitcast(ins, outs, params):
  if ins[0].rank == outs[0].rank:  # same width: elementwise
    return _elementwise(ins, outs, params)
  return [_all_b(ins, outs)]


def _clamp(ins, outs, params):
  return _elementwise(ins, outs, params)


# ------------------------------------------------------------------ the table
UNARY = """abs acos acosh asin asinh atan atanh cbrt ceil clz conj cos cosh
  digamma erf erf_inv erfc exp exp2 expm1 floor imag is_finite lgamma log log1p
  logistic not population_count real round rsqrt sign sin sinh sqrt square tan
  tanh integer_pow reduce_precision""".split()
LINEAR_UNARY = """neg copy stop_gradient sharding_constraint reshard
  device_put""".split()
BINARY = """atan2 rem pow max min nextafter and or xor eq ne lt le gt ge
  eq_to le_to lt_to shift_left shift_right_logical shift_right_arithmetic
  complex""".split()

RULES: dict[str, Rule] = {}
for _name in UNARY:
  RULES[_name] = _elementwise
for _name in LINEAR_UNARY:
  RULES[_name] = _linear("P")(_elementwise)
for _name in BINARY:
  RULES[_name] = _elementwise
for _name in ("add", "sub", "add_any"):
  RULES[_name] = _linear("PP")(_elementwise)
RULES["mul"] = _linear("PB", "BP")(_elementwise)
RULES["div"] = _linear("PB")(_elementwise)
RULES["select_n"] = _linear("BP")(_elementwise)
RULES["clamp"] = _clamp
RULES["convert_element_type"] = _convert
RULES["broadcast_in_dim"] = _linear("PB")(_broadcast_in_dim)
RULES["reshape"] = _linear("P")(_reshape)
RULES["transpose"] = _linear("P")(_transpose)
RULES["squeeze"] = _linear("P")(_squeeze)
RULES["reduce_sum"] = _linear("P")(_reduce(summed=True))
for _name in ("reduce_max", "reduce_min", "reduce_prod", "reduce_and",
              "reduce_or", "reduce_xor", "argmax", "argmin"):
  RULES[_name] = _reduce(summed=False)
RULES["cumsum"] = _linear("P")(_along_axis("axis"))
for _name in ("cumprod", "cummax", "cummin", "cumlogsumexp"):
  RULES[_name] = _along_axis("axis")
RULES["sort"] = _along_axis("dimension")
RULES["top_k"] = _top_k
RULES["slice"] = _linear("P")(_slice)
RULES["dynamic_slice"] = _linear("PB")(_dynamic_slice)
RULES["dynamic_update_slice"] = _linear("PPB")(_dynamic_update_slice)
RULES["concatenate"] = _linear("P")(_concatenate)
RULES["split"] = _linear("P")(_split)
RULES["stack"] = _linear("P")(_stack)
RULES["unstack"] = _linear("P")(_unstack)
RULES["tile"] = _linear("P")(_tile)
RULES["pad"] = _pad
RULES["bitcast_convert_type"] = _bitcast
# Random bits must come out identical to the unsharded program's: generated
# replicated (jax's partitionable threefry is a config flag we do not assume).
for _name in ("random_bits", "random_seed", "random_wrap", "random_unwrap",
              "random_fold_in", "random_split", "threefry2x32"):
  RULES[_name] = _replicated
RULES["rev"] = _linear("P")(_rev)
RULES["iota"] = _iota
RULES["empty2"] = _iota  # uninitialised: each device makes its own piece
RULES["dot_general"] = _linear("PB", "BP")(_dot_general)
RULES["conv_general_dilated"] = _linear("PB", "BP")(_conv)
RULES["reduce_window_max"] = _reduce_window
RULES["reduce_window_min"] = _reduce_window
RULES["reduce_window_sum"] = _linear("PB")(_reduce_window)
RULES["reduce_window"] = _reduce_window
RULES["select_and_scatter_add"] = _linear("PB")(_select_and_scatter_add)
RULES["select_and_gather_add"] = _linear("PB")(_select_and_gather_add)
RULES["gather"] = _linear("PB")(_gather)
RULES["scatter-add"] = _scatter_add
for _name in ("scatter", "scatter-mul", "scatter-max", "scatter-min"):
  RULES[_name] = _scatter


def signatures(prim: str, ins: Sequence[Aval], outs: Sequence[Aval],
               params: dict[str, Any]) -> list[Sig] | None:
  """The 1-D signatures of one equation, or None when there is no rule."""
  rule = RULES.get(prim)
  if rule is None:
    return None
  return _dedup(rule(ins, outs, params))
