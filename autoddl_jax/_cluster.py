"""The hardware a plan is costed for: links, compute rate and memory.

A :class:`Cluster` gives per-link latency (alpha, s) and bandwidth (beta, bytes/s
per device), the peak FLOP/s and the memory of one device. Devices are assigned
to nodes by their position in ``mesh.devices.flat``: positions ``0..k-1`` form
node 0, the next ``k`` node 1, and so on (``k = devices_per_node``). A mesh axis
whose every device group stays inside one node uses the intra-node link; any
other axis (inter-node or mixed) is costed with the inter-node link, the ring's
bottleneck.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
import jax
from jax.sharding import AbstractMesh, Mesh

__all__ = ["Cluster", "H100_NODE", "MeshInfo", "mesh_info", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def format_bytes(b: float) -> str:
  """Bytes for people: ``"1.69 GiB"`` (three significant digits)."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(b) < 1024 or unit == "TiB":
      return f"{b:.3g} {unit}"
    b /= 1024
  return f"{b:.3g}"


def parse_bytes(value: float | str, what: str = "size") -> float:
  """A positive number of bytes from a number or a string (``"16GiB"``,
  ``"512MB"``, ``"1e9"``). ``bool`` is refused (``True`` is not 1 byte).

  Raises ``TypeError`` for another type and ``ValueError`` for a string that
  is not a size or a value that is not positive and finite.
  """
  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
                     r"([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
      raise ValueError(f"{what}={value!r} is not a size; write e.g. '16GiB', "
                       "'512MB' or a number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
  elif isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{what} must be a number of bytes or a string such as "
                    f"'16GiB', got {type(value).__name__} {value!r}")
  value = float(value)
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{what} must be a positive, finite number of bytes, got "
                     f"{value!r}")
  return value


def _axis_size(name, size) -> int:
  if isinstance(size, bool) or not isinstance(size, numbers.Integral):
    raise TypeError(f"mesh axis {name!r} has size {size!r} "
                    f"({type(size).__name__}); sizes must be integers")
  return int(size)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Hardware description used by the cost model. All numbers per device.

  The default is an H100 SXM node preset (see :data:`H100_NODE`).
  """

  # Devices sharing the fast intra-node link (NVLink): consecutive positions in
  # ``mesh.devices.flat``.
  devices_per_node: int = 8
  # Ring bandwidth per device, bytes/s. NVLink 4 on H100 SXM: ~450 GB/s each way.
  intra_node_bandwidth: float = 450e9
  # One 400 Gb/s InfiniBand NIC per GPU: 50 GB/s.
  inter_node_bandwidth: float = 50e9
  # Per ring step latency, s (NCCL's small-message latency is a few us).
  intra_node_latency: float = 3e-6
  inter_node_latency: float = 10e-6
  # Dense bf16 tensor-core peak of an H100 SXM.
  peak_flops: float = 989e12
  # HBM3 of an H100 SXM (80 GiB).
  memory_per_device: float = 80 * 2**30
  # The sustained fraction of peak_flops that the step's kernels reach (what
  # a profiler measures as model FLOPs / peak): compute_s = flops / (peak *
  # eff), with flops as XLA's cost_analysis counts them (multiply-add = 2;
  # replicated work counted on every device that does it).
  flops_efficiency: float = 0.5

  def __post_init__(self):
    if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
      raise ValueError(f"Cluster.devices_per_node must be a positive int, got "
                       f"{self.devices_per_node!r}")
    for name in ("intra_node_bandwidth", "inter_node_bandwidth", "peak_flops",
                 "memory_per_device", "flops_efficiency"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
        raise ValueError(f"Cluster.{name} must be a positive finite number, "
                         f"got {v!r}")
    for name in ("intra_node_latency", "inter_node_latency"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
        raise ValueError(f"Cluster.{name} must be >= 0 seconds, got {v!r}")


H100_NODE = Cluster()


# What a JAX process may allocate of a GPU's memory: XLA's allocator takes
# XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 unless set); the rest is left to
# the CUDA context, cuDNN/cuBLAS workspaces and other processes.
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = 0.75


def default_budget(cluster: Cluster) -> tuple[float, float]:
  """(bytes per device a plan must fit in by default, the fraction of
  ``cluster.memory_per_device`` that is): the share XLA's allocator may use
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default)."""
  text = os.environ.get(MEM_FRACTION_ENV, "")
  try:
    frac = float(text) if text.strip() else DEFAULT_MEM_FRACTION
  except ValueError:
    raise ValueError(f"{MEM_FRACTION_ENV}={text!r} is not a number") from None
  if not 0 < frac <= 1:
    raise ValueError(f"{MEM_FRACTION_ENV}={text!r} must be in (0, 1]")
  return cluster.memory_per_device * frac, frac


@dataclasses.dataclass(frozen=True)
class MeshInfo:
  """What the planner needs to know about a mesh: names, sizes and links."""

  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  alpha: tuple[float, ...]  # per-axis latency, s
  beta: tuple[float, ...]  # per-axis bandwidth, bytes/s per device
  link: tuple[str, ...]  # "intra" | "inter" | "mixed"
  # All-reduces and reduce-scatters costed with this view are combined by
  # XLA with the others of their kind in their loop body (its combiners
  # merge independent ones into one): they pay bandwidth only, and the body
  # pays each kind's latency once (``Problem.combined_latency``).
  combined: bool = False

  @property
  def size(self) -> int:
    return math.prod(self.axis_sizes)

  @property
  def ndim(self) -> int:
    return len(self.axis_names)


def _axis_link(shape: Sequence[int], axis: int, per_node: int) -> str:
  pos = np.arange(math.prod(shape)).reshape(shape)
  groups = np.moveaxis(pos, axis, -1).reshape(-1, shape[axis]) // per_node
  same = (groups == groups[:, :1]).all(axis=1)
  if same.all():
    return "intra"
  # Every pair of members in a group on distinct nodes -> purely inter-node.
  distinct = np.array([len(set(g)) == len(g) for g in groups])
  return "inter" if distinct.all() else "mixed"


def mesh_info(mesh: Mesh | AbstractMesh | Mapping[str, int],
              cluster: Cluster) -> MeshInfo:
  """Normalizes a concrete mesh, an abstract mesh or a name->size mapping."""
  if isinstance(mesh, Mapping):
    names = tuple(mesh.keys())
    sizes = tuple(_axis_size(n, s) for n, s in mesh.items())
  elif isinstance(mesh, (Mesh, AbstractMesh)):
    names, sizes = tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes)
  else:
    raise TypeError(f"mesh must be a jax.sharding.Mesh, an AbstractMesh or a "
                    f"dict of axis name -> size, got {type(mesh).__name__}")
  if not 1 <= len(names) <= 4:
    raise ValueError(f"autoddl_jax plans for meshes of 1 to 4 axes; this mesh "
                     f"has {len(names)}: {names}")
  if len(set(names)) != len(names):
    raise ValueError(f"mesh axis names must be distinct, got {names}")
  for n, s in zip(names, sizes):
    if not isinstance(n, str):
      raise TypeError(f"mesh axis names must be strings, got {n!r}")
    if s < 1:
      raise ValueError(f"mesh axis {n!r} has size {s}; sizes must be >= 1")
  if isinstance(mesh, Mesh):
    have = mesh.devices.size
    if have != math.prod(sizes):
      raise ValueError(f"mesh {dict(zip(names, sizes))} needs {math.prod(sizes)}"
                       f" devices but holds {have}")
    n_avail = len(jax.devices())
    if have > n_avail:
      raise ValueError(f"mesh uses {have} devices but jax sees {n_avail}")
    ids = [d.id for d in mesh.devices.flat]
    if len(set(ids)) != len(ids):
      twice = sorted({i for i in ids if ids.count(i) > 1})
      raise ValueError(f"mesh holds device(s) {twice} more than once; each "
                       "device may appear once (build it with jax.make_mesh "
                       "or from distinct jax.devices())")
  links = tuple(_axis_link(sizes, a, cluster.devices_per_node)
                for a in range(len(names)))
  alpha = tuple(cluster.intra_node_latency if l == "intra"
                else cluster.inter_node_latency for l in links)
  beta = tuple(cluster.intra_node_bandwidth if l == "intra"
               else cluster.inter_node_bandwidth for l in links)
  return MeshInfo(names, sizes, alpha, beta, links)
