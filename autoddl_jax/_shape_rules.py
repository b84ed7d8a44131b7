"""The rules of ops that move, reshape, reduce, contract or index data.

Each rule maps an equation's operand and result shapes (and its parameters)
to its 1-D signatures (:mod:`autoddl_jax._factors`): most as factor maps,
wrapped in the linearity signatures that carry partial sums. The table
that names them per primitive is :data:`autoddl_jax._rules.RULES`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.lax import GatherScatterMode

from autoddl_jax._factors import LETTERS, Aval, Sig, SigFn, all_b, dedup
from autoddl_jax._factors import dims, elementwise, factor_sigs
from autoddl_jax._sbp import B_CODE as B, P_CODE as P


# --------------------------------------------------------------- shape rules
def broadcast_in_dim(ins, outs, params):
  bd = params["broadcast_dimensions"]
  x, y = ins[0], outs[0]
  letters = dims(y.rank)
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


def reshape(ins, outs, params):
  m = _reshape_map(ins[0].shape, outs[0].shape)
  sigs = [all_b(ins, outs)]
  for i, j in m.items():
    sigs.append(((i,) + (B,) * (len(ins) - 1), (j,)))
  return sigs


def transpose(ins, outs, params):
  perm = params["permutation"]
  letters = dims(ins[0].rank)
  return factor_sigs(ins, outs, [letters], ["".join(letters[p] for p in perm)])


def reduce(summed: bool) -> SigFn:

  def rule(ins, outs, params):
    axes = set(params["axes"])
    letters = dims(ins[0].rank)
    of = "".join(c for d, c in enumerate(letters) if d not in axes)
    red = "".join(c for d, c in enumerate(letters) if d in axes)
    return factor_sigs(ins, outs, [letters] * len(ins), [of] * len(outs),
                       summed=red if summed else "")

  return rule


def along_axis(param: str) -> SigFn:
  """Ops that mix along one axis (cumsum, sort, ...): that axis never splits."""

  def rule(ins, outs, params):
    ax = params[param]
    ax = ax if ax >= 0 else ins[0].rank + ax
    letters = "".join("." if d == ax else c
                      for d, c in enumerate(dims(ins[0].rank)))
    return factor_sigs(ins, outs, [letters] * len(ins), [letters] * len(outs))

  return rule


def top_k(ins, outs, params):
  # Splitting the rows would be local, but XLA's partitioner gathers top_k's
  # operand anyway (tests/test_rules.py): keep it replicated.
  return [all_b(ins, outs)]


def squeeze(ins, outs, params):
  drop = {d % ins[0].rank for d in params["dimensions"]}
  letters = dims(ins[0].rank)
  return factor_sigs(ins, outs, [letters],
                     ["".join(c for d, c in enumerate(letters) if d not in drop)])


def _full_dims(operand: Aval, window: Sequence[int]) -> str:
  return "".join(c if w == s else "." for c, w, s in
                 zip(dims(operand.rank), window, operand.shape))


def slice(ins, outs, params):
  x, y = ins[0], outs[0]
  letters = "".join(c if a == b else "."
                    for c, a, b in zip(dims(x.rank), x.shape, y.shape))
  return factor_sigs(ins, outs, [letters], [letters])


def dynamic_slice(ins, outs, params):
  letters = _full_dims(ins[0], params["slice_sizes"])
  return factor_sigs(ins, outs, [letters] + [""] * (len(ins) - 1), [letters])


def dynamic_update_slice(ins, outs, params):
  x, u = ins[0], ins[1]
  letters = "".join(c if a == b else "."
                    for c, a, b in zip(dims(x.rank), x.shape, u.shape))
  return factor_sigs(ins, outs, [letters, letters] + [""] * (len(ins) - 2),
                     [letters])


def concatenate(ins, outs, params):
  d = params["dimension"]
  letters = "".join("." if i == d else c
                    for i, c in enumerate(dims(outs[0].rank)))
  return factor_sigs(ins, outs, [letters] * len(ins), [letters])


def stack(ins, outs, params):
  # The new dim holds one operand each: it never splits; the others map.
  out = dims(outs[0].rank)
  letters = out[:params["axis"]] + out[params["axis"] + 1:]
  return factor_sigs(ins, outs, [letters] * len(ins),
                     [out[:params["axis"]] + "." + out[params["axis"] + 1:]])


def unstack(ins, outs, params):
  x = dims(ins[0].rank)
  letters = x[:params["axis"]] + x[params["axis"] + 1:]
  return factor_sigs(ins, outs, [x[:params["axis"]] + "." +
                                 x[params["axis"] + 1:]],
                     [letters] * len(outs))


def tile(ins, outs, params):
  # A repeated dim does not split (the local tile of a shard repeats the
  # shard, not the whole); dims tiled once map through. Leading new dims
  # (more reps than the operand has dims) are never split.
  reps = tuple(params["reps"])
  new = outs[0].rank - ins[0].rank
  x = dims(ins[0].rank, new)
  letters = "".join(c if r == 1 else "." for c, r in zip(x, reps[new:]))
  return factor_sigs(ins, outs, [letters], ["." * new + letters])


def split(ins, outs, params):
  d = params["axis"]
  letters = "".join("." if i == d else c
                    for i, c in enumerate(dims(ins[0].rank)))
  return factor_sigs(ins, outs, [letters], [letters] * len(outs))


def rev(ins, outs, params):
  rev = set(params["dimensions"])
  letters = "".join("." if d in rev else c
                    for d, c in enumerate(dims(ins[0].rank)))
  return factor_sigs(ins, outs, [letters], [letters])


def pad(ins, outs, params):
  letters = "".join(c if cfg == (0, 0, 0) else "." for c, cfg in
                    zip(dims(ins[0].rank), params["padding_config"]))
  return factor_sigs(ins, outs, [letters, ""], [letters])


def iota(ins, outs, params):
  # Each device can produce its own slice of an iota (offset by its index).
  return factor_sigs(ins, outs, [""] * len(ins), [dims(outs[0].rank)])


def dot_general(ins, outs, params):
  (lc, rc), (lb, rb) = params["dimension_numbers"]
  lhs, rhs = ins
  lf, rf = ["."] * lhs.rank, ["."] * rhs.rank
  it = iter(LETTERS)
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


def conv(ins, outs, params):
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
  for d, c in enumerate(dims(x.rank)):
    trivial = (params["window_dimensions"][d] == 1
               and params["window_strides"][d] == 1
               and tuple(params["padding"][d]) == (0, 0)
               and params.get("base_dilation", (1,) * x.rank)[d] == 1
               and params.get("window_dilation", (1,) * x.rank)[d] == 1)
    ok.append(c if trivial else ".")
  return "".join(ok)


def reduce_window(ins, outs, params):
  n = len(outs)
  letters = _window_letters(ins[0], params)
  # Operands then init values (scalars).
  return factor_sigs(ins, outs, [letters] * n + [""] * (len(ins) - n),
                     [letters] * n)


def select_and_scatter_add(ins, outs, params):
  # (source, operand) -> like operand; windowed dims never split.
  letters = _window_letters(ins[1], params)
  return factor_sigs(ins, outs, [letters, letters], [letters])


def select_and_gather_add(ins, outs, params):
  letters = _window_letters(ins[1], params)
  return factor_sigs(ins, outs, [letters, letters], [letters])


def _clamped(params) -> bool:
  """Whether out-of-range start indices are clamped (or promised in range).

  A dim sliced whole can then only start at 0, whatever its index says, so
  it passes through like a dim the index does not name: vmapped
  `dynamic_slice`/`dynamic_update_slice` name every dim (a per-stage ring
  buffer's slot read), and XLA splits such dims with no collective
  (measured). Under FILL_OR_DROP a nonzero start would fill or drop the
  slice instead, so that mode keeps the stricter rule.
  """
  mode = params.get("mode")  # a GatherScatterMode in a jaxpr
  return mode is not None and (GatherScatterMode.from_any(mode)
                               != GatherScatterMode.FILL_OR_DROP)


def gather(ins, outs, params):
  operand, idx = ins
  out = outs[0]
  dn = params["dimension_numbers"]
  slice_sizes = params["slice_sizes"]
  offset_dims = tuple(dn.offset_dims)
  collapsed = set(dn.collapsed_slice_dims)
  obatch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
  ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()) or ())
  start_map = tuple(dn.start_index_map)
  sigs = [all_b(ins, outs)]
  # Operand dims that pass through whole into the output's offset dims.
  passthrough = [d for d in range(operand.rank)
                 if d not in collapsed and d not in obatch]
  for d, od in zip(passthrough, offset_dims):
    if slice_sizes[d] == operand.shape[d] and (
        d not in start_map or _clamped(params)):
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
  return dedup(sigs)


def scatter_add(ins, outs, params):
  operand, idx, upd = ins
  dn = params["dimension_numbers"]
  uwd = tuple(dn.update_window_dims)
  inserted = set(dn.inserted_window_dims)
  obatch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
  ibatch = tuple(getattr(dn, "scatter_indices_batching_dims", ()) or ())
  s2o = tuple(dn.scatter_dims_to_operand_dims)
  sigs = [all_b(ins, outs)]
  window_operand = [d for d in range(operand.rank)
                    if d not in inserted and d not in obatch]
  for d, ud in zip(window_operand, uwd):
    if upd.shape[ud] == operand.shape[d] and (
        d not in s2o or _clamped(params)):
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
  return dedup(sigs)


def scatter(ins, outs, params):
  """scatter (set), scatter-mul/-max/-min: the window and batch dims split
  as for scatter-add; no partial sums (the combiner is not a sum)."""
  return [s for s in scatter_add(ins, outs, params)
          if P not in s[0] and P not in s[1]]


def convert(ins, outs, params):
  sigs = elementwise(ins, outs, params)
  # Partial sums survive a cast only if it does not round them: float to a
  # float at least as wide.
  if ins[0].is_float and outs[0].is_float and (
      outs[0].dtype.itemsize >= ins[0].dtype.itemsize):
    sigs.append(((P,), (P,)))
  return sigs


def replicated(ins, outs, params):
  return [all_b(ins, outs)]


def bitcast(ins, outs, params):
  if ins[0].rank == outs[0].rank:  # same width: elementwise
    return elementwise(ins, outs, params)
  return [all_b(ins, outs)]


def clamp(ins, outs, params):
  return elementwise(ins, outs, params)
