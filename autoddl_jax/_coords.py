"""Which coordinates move together: state ties and repeated layers.

A train step returns its state updated (``step(params, opt, batch) ->
(params, opt, loss)``): each result leaf is tied to the argument it replaces
(:func:`state_ties`), and each optimizer moment to its parameter, so that
the search decides one layout for all of them. Unrolled layers repeat their
parameters (``layers/3/wq`` ~ ``layers/7/wq``): :func:`merge_repeated_params`
joins them so a layer's layout is decided once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from autoddl_jax._opgraph import OpGraph
from autoddl_jax._trace import Traced

def _same_type(a, b) -> bool:
  return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def state_ties(tr: Traced) -> tuple[dict[int, int], list[list[int]]]:
  """Output leaf -> input leaf it updates; and groups of tied input leaves.

  An output ties to the input with the same tree path (``step(params, opt,
  batch) -> (params, opt, loss)``) and the same type. Among those state
  leaves, optimizer moments tie to their parameter: same type, different depth,
  and the longest common key suffix (``[1][0].mu['w']`` <-> ``[0]['w']``).
  """
  by_key = {k: i for i, k in enumerate(tr.in_keys)}
  out_to_in = {}
  for j, k in enumerate(tr.out_keys):
    i = by_key.get(k)
    if i is not None and _same_type(tr.in_avals[i], tr.out_avals[j]):
      out_to_in[j] = i
  state = sorted(set(out_to_in.values()))
  parent = {i: i for i in state}

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for b in state:
    kb = tr.in_keys[b]
    best, best_c = [], 0
    for a in state:
      ka = tr.in_keys[a]
      if a == b or len(ka) == len(kb) or not _same_type(tr.in_avals[a],
                                                        tr.in_avals[b]):
        continue
      c = 0
      while c < min(len(ka), len(kb)) and ka[-1 - c] == kb[-1 - c]:
        c += 1
      if c > best_c:
        best, best_c = [a], c
      elif c == best_c and c:
        best.append(a)
    for a in best:
      parent[find(a)] = find(b)
  groups: dict[int, list[int]] = {}
  for i in state:
    groups.setdefault(find(i), []).append(i)
  return out_to_in, [sorted(g) for g in groups.values() if len(g) > 1]



def param_and_moments(tr: Traced, group: Sequence[int]
                       ) -> tuple[int, list[int]]:
  """Of a group of tied state leaves (:func:`state_ties`): the parameter
  (the shortest path: ``[0]['w']`` beside ``[1][0].mu['w']``) and the
  optimizer moments."""
  order = sorted(group, key=lambda i: (len(tr.in_keys[i]), i))
  return order[0], order[1:]


def moments(tr: Traced) -> set[int]:
  """The input leaves that are optimizer moments (:func:`param_and_moments`
  of every group of tied state)."""
  return {i for g in state_ties(tr)[1] for i in param_and_moments(tr, g)[1]}


def layerless(keys: tuple[str, ...]) -> tuple[str, ...]:
  return tuple("#" if k.isdigit() else k for k in keys)


def merge_repeated_params(groups, graph: OpGraph, tokens, min_repeats=4):
  """Joins the state groups of the same parameter in unrolled layers: paths
  equal up to integer keys (``layers/3/wq`` ~ ``layers/7/wq``), same type,
  when it repeats at least ``min_repeats`` times."""
  leaf_of = {o: graph.ops[o].leaf for o in graph.input_ops}
  merged: dict[Any, list[int]] = {}
  out = []
  for g in groups:
    leaves = sorted(leaf_of[o] for o in g if o in leaf_of)
    if not leaves:
      out.append(g)
      continue
    key = tuple(tokens[i] for i in leaves)
    merged.setdefault(key, []).append(g)
  for gs in merged.values():
    if len(gs) >= min_repeats:
      out.append([o for g in gs for o in g])
    else:
      out.extend(gs)
  return out


def repeat_key(eqn, in_avals, out_avals, weight):
  """Ops of structurally identical unrolled blocks share this key: the same
  source location (a Python loop's body), transform (forward or backward),
  primitive, shapes and parameters."""
  si = eqn.source_info
  if si is None or si.traceback is None:
    return None
  try:
    params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items()
                          if not isinstance(v, (jcore.Jaxpr,
                                                jcore.ClosedJaxpr))))
    return (si.traceback, str(si.name_stack), eqn.primitive.name,
            tuple(in_avals), tuple(out_avals), params, weight)
  except TypeError:  # an unhashable traceback or parameter
    return None


def repeat_groups(graph: OpGraph, input_tokens: Sequence[Any],
                  depth: int = 6, min_repeats: int = 4) -> list[list[int]]:
  """Groups of ops that are the same op of repeated (unrolled) blocks.

  Two ops match when they have the same :func:`repeat_key` and so do their
  producers, ``depth`` levels up the dataflow (a Merkle hash); the program's
  inputs hash by ``input_tokens`` (parameter paths with layer numbers
  removed). Two multiplies from one source line inside one block then stay
  apart, while the same multiply in block 3 and block 7 share one decision.
  Only ops repeated ``min_repeats`` times or more are tied: for a model of two
  or three blocks, the blocks next to the embedding and the head differ too
  much for one decision to fit them all, and the search is cheap anyway.
  """
  tok: list[Any] = []
  for op in graph.ops:
    if op.kind == "input":
      tok.append(("input", input_tokens[op.leaf]))
    elif op.key is not None:
      tok.append(op.key)
    else:
      tok.append((op.prim, op.kind, tuple(op.in_avals)))
  h = [hash(t) for t in tok]
  for _ in range(depth):
    nh = []
    for op in graph.ops:
      ins = tuple(h[graph.tensors[t].producer[0]] if t is not None else 0
                  for t in op.ins)
      nh.append(hash((h[op.id], ins)))
    h = nh
  by_key: dict[int, list[int]] = {}
  for op in graph.ops:
    if op.kind == "eqn" and op.key is not None:
      by_key.setdefault(h[op.id], []).append(op.id)
  return [g for g in by_key.values() if len(g) >= min_repeats]
