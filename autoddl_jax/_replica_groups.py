"""Replica groups of an HLO collective, and the mesh axes they span.

XLA writes a collective's device groups as an explicit list
(``replica_groups={{0,1},{2,3}}``) or as an iota over a reshaped,
transposed device array (``replica_groups=[2,4]<=[4,2]T(1,0)``);
:func:`parse_groups` reads both, and :func:`group_axes` names the mesh axes
a group spans (which links its bytes cross).
"""

from __future__ import annotations

import math
import re

import numpy as np


def parse_groups(attrs: str, num_devices: int) -> list[list[int]]:
  """Device groups of a collective from its attribute text."""
  m = re.search(r"replica_groups=(\{\{[0-9,{}\s]*\}\}|\{\})", attrs)
  if m:
    text = m.group(1)
    groups = [[int(x) for x in g.split(",") if x.strip()]
              for g in re.findall(r"\{([0-9,\s]*)\}", text[1:-1])]
    groups = [g for g in groups if g]
    return groups or [list(range(num_devices))]
  m = re.search(r"replica_groups=(\[([0-9,]+)\]<=\[[0-9,]+\]"
                r"(?:T\([0-9,]+\))?)", attrs)
  if m:  # iota form: [groups, size]<=[dims]T(perm)
    n_groups = int(m.group(2).split(",")[0])
    return _iota_or_list(m.group(1), num_devices).reshape(
        n_groups, -1).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\("
                r"(.*?)\)\s*)?\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
    arr = np.arange(math.prod(sizes))
    if m.group(2):  # the mesh's device ids, in iota form or listed
      arr = _iota_or_list(m.group(2), math.prod(sizes))
    arr = arr.reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in chosen]
    arr = arr.transpose(rest + chosen).reshape(-1, math.prod(
        sizes[i] for i in chosen) if chosen else 1)
    return arr.tolist()
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if m:
    return [[int(x) for x in p.split(",")]
            for p in re.findall(r"\{([0-9,]+)", m.group(1) + "}")]
  return [list(range(num_devices))]


def _iota_or_list(text: str, n: int) -> np.ndarray:
  """``[2,4]T(1,0)`` or ``[4,2]<=[8]`` or ``0,4,1,5`` -> device ids."""
  text = text.strip()
  m = re.fullmatch(r"\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?",
                   text)
  if not m:
    return np.array([int(x) for x in re.findall(r"\d+", text)][:n])
  dims = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
  arr = np.arange(math.prod(dims)).reshape(dims)
  if m.group(3):
    arr = arr.transpose([int(x) for x in m.group(3).split(",")])
  return arr.reshape(-1)


def group_axes(groups, axis_names: tuple[str, ...],
               axis_sizes: tuple[int, ...]) -> tuple[str, ...]:
  """The mesh axes along which members of a group differ (in mesh order)."""
  span = set()
  for g in groups:
    if len(g) < 2:
      continue
    coords = np.array(np.unravel_index(np.asarray(g), axis_sizes))
    span.update(int(a) for a in np.nonzero((coords != coords[:, :1]).any(
        axis=1))[0])
  return tuple(axis_names[a] for a in sorted(span))
