"""Several hosts: join the job, agree on one plan, move data in and out.

Under ``python -m autoddl_jax.launch`` (or on a cluster) every process runs
the same script::

    import autoddl_jax as ad
    ad.distributed.initialize()          # before any other JAX call
    mesh = jax.make_mesh((2, 4), ("data", "model"))   # global devices
    step = ad.auto_shard(train_step, mesh=mesh)       # checks plans agree
    rows = NamedSharding(mesh, P("data"))             # what a loader yields
    batch = ad.distributed.from_local(
        load(ad.distributed.process_slice(rows, shape)), rows, shape)

Every process plans from the same abstract program, so the plans are equal;
:func:`check_same_plan` proves it before anything compiles (``auto_shard``
calls it when there is more than one process).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from autoddl_jax._errors import DistributedError
from autoddl_jax._io import program_fingerprint

if TYPE_CHECKING:  # for annotations only
  from autoddl_jax._plan import Plan

# What the launcher tells each process (see autoddl_jax.launch).
ENV_COORDINATOR = "AUTODDL_COORDINATOR"
ENV_NUM_PROCESSES = "AUTODDL_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTODDL_PROCESS_ID"
ENV_DEVICES = "AUTODDL_DEVICES_PER_PROC"
# A folder where a process that raises notes when it did, so the launcher
# names the process that failed first and not a peer that died of it.
ENV_FAILURES = "AUTODDL_FAILURE_DIR"


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               local_device_count: int | None = None,
               timeout_s: int = 60) -> None:
  """Joins this process to the job; call it before any other JAX call.

  Explicit arguments win; else the variables ``python -m autoddl_jax.launch``
  sets (loopback coordinator, process id, CPU devices per process); else
  ``jax.distributed.initialize()``'s own detection (SLURM, Open MPI,
  Kubernetes, Cloud TPU). ``local_device_count`` sets how many CPU devices
  this process simulates. A coordinator that cannot be reached within
  ``timeout_s`` raises :class:`DistributedError`.
  """
  env = os.environ
  if coordinator_address is None and ENV_COORDINATOR in env:
    coordinator_address = env[ENV_COORDINATOR]
    num_processes = int(env[ENV_NUM_PROCESSES]) if num_processes is None \
        else num_processes
    process_id = int(env[ENV_PROCESS_ID]) if process_id is None \
        else process_id
  if local_device_count is None and ENV_DEVICES in env:
    local_device_count = int(env[ENV_DEVICES])
  if local_device_count is not None:
    if _backends_started():
      raise DistributedError(
          "ad.distributed.initialize() must run before any JAX computation "
          "(the number of CPU devices is fixed when the backend starts); "
          "move it to the top of the script")
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  explicit = (coordinator_address, num_processes, process_id)
  if any(x is not None for x in explicit) and not all(
      x is not None for x in explicit):
    raise DistributedError(
        "give coordinator_address, num_processes and process_id together "
        f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r}), "
        "or none of them to let JAX detect the cluster")
  if coordinator_address is not None and process_id not in (None, 0):
    # XLA aborts the whole process when it cannot connect; look first.
    _wait_for(coordinator_address, timeout_s, process_id)
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id, initialization_timeout=int(timeout_s))
  except Exception as e:  # noqa: BLE001 (jaxlib raises XlaRuntimeError etc.)
    if coordinator_address is None:
      raise DistributedError(
          f"no coordinator given and none detected ({e}). On one machine, "
          "start the script with `python -m autoddl_jax.launch --nproc N "
          "SCRIPT`; on a cluster, run under SLURM / Open MPI / Kubernetes or "
          "pass coordinator_address, num_processes and process_id") from e
    where = coordinator_address
    raise DistributedError(
        f"process {process_id} could not join the job through the coordinator "
        f"at {where} within {timeout_s} s: {e}. Check that every process was "
        "started with the same address and process count, and that process 0 "
        "is running") from e
  n_dev, n_local = jax.device_count(), jax.local_device_count()
  if n_dev != n_local * jax.process_count():
    raise DistributedError(
        f"processes have different device counts: {n_dev} devices in all, "
        f"{n_local} here, {jax.process_count()} processes; give every "
        "process the same --devices-per-proc")
  if jax.process_count() > 1:
    _exit_at_once_on_uncaught()


def _exit_at_once_on_uncaught() -> None:
  """An uncaught exception ends this process at once, with exit code 1.

  Python's normal exit runs jax.distributed's shutdown, which waits for
  every other process; a peer blocked in a collective that this process
  will never join then waits forever, and so does this process: the job
  hangs with nobody named. Exiting with ``os._exit`` after the traceback is
  printed lets the launcher (or the cluster's scheduler) see the failure and
  stop the rest.
  """
  previous = sys.excepthook

  def hook(kind, value, tb):
    try:
      _note_failure(jax.process_index())
      previous(kind, value, tb)
      print(f"[autoddl_jax] process {jax.process_index()} raised "
            f"{kind.__name__}; exiting now (jax.distributed's shutdown would "
            "wait for the other processes)", file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(1)

  sys.excepthook = hook


def _note_failure(process_id: int) -> None:
  """Writes this failure's wall-clock time where the launcher looks for it.
  A peer's own failure is caused by this process's exit (its collectives
  lose their partner), which comes after this note, so the earliest note is
  the first failure even when both exits fall in one poll of the launcher."""
  folder = os.environ.get(ENV_FAILURES)
  if not folder:
    return
  try:
    with open(os.path.join(folder, str(process_id)), "w") as f:
      f.write(repr(time.time()))
  except OSError:  # a note lost only makes the launcher guess by exit order
    pass


def _wait_for(address: str, timeout_s: float, process_id: int) -> None:
  import socket
  import time
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise DistributedError(
            f"process {process_id} could not join the job through the "
            f"coordinator at {address} within {timeout_s} s ({e}). Check "
            "that process 0 is running and that every process was started "
            "with the same address") from e
      time.sleep(0.2)


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge._backends)  # noqa: SLF001
  except (ImportError, AttributeError):  # another jax: cannot tell; assume not
    return False


def plan_fingerprint(plan: Plan) -> str:
  """sha256 of the program, mesh, cluster and every choice of a plan."""
  h = hashlib.sha256(program_fingerprint(plan.traced).encode())
  mi = plan.mesh_info
  h.update(repr((mi.axis_names, mi.axis_sizes, plan.cluster)).encode())
  h.update(np.asarray(plan.choice, dtype=np.int64).tobytes())
  return h.hexdigest()


def check_same_plan(plan: Plan) -> None:
  """Raises :class:`DistributedError` naming the processes whose plan differs
  from process 0's. Every process must call it (it is a collective)."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  mine = np.frombuffer(bytes.fromhex(plan_fingerprint(plan)), dtype=np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  differ = [i for i in range(every.shape[0])
            if not np.array_equal(every[i], every[0])]
  if differ:
    raise DistributedError(
        f"the processes planned differently: processes {differ} differ from "
        f"process 0 (this is process {jax.process_index()}, plan "
        f"{mine.tobytes().hex()[:12]}...). Every process must trace the same "
        "step with the same argument shapes, mesh and cluster")


def global_array(x: Any, sharding: Any) -> jax.Array:
  """One global array from a value every process holds whole: each process
  keeps only its devices' shards."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def global_batch(full: Any, shardings: Any) -> Any:
  """Global arrays from a batch every process holds whole (same values on
  every process, e.g. from the same seed): :func:`global_array` per leaf."""
  return jax.tree.map(global_array, full, shardings)


def process_slice(sharding: Any, global_shape: Sequence[int]
                  ) -> tuple[slice, ...]:
  """The part of a global array this process's devices hold under
  ``sharding``: what a per-process data loader should read (e.g. its rows
  of the global batch) and pass to :func:`from_local`.

  Raises ValueError when that part is not one box (a mesh whose devices
  interleave processes along a split dim), which ``from_local`` cannot take.
  """
  shape = tuple(int(d) for d in global_shape)
  boxes = [[sl.indices(n)[:2] for sl, n in zip(idx, shape)]
           for idx in sharding.addressable_devices_indices_map(
               shape).values()]
  lo = [min(b[d][0] for b in boxes) for d in range(len(shape))]
  hi = [max(b[d][1] for b in boxes) for d in range(len(shape))]
  covered = {tuple(map(tuple, b)) for b in boxes}
  per_box = math.prod(boxes[0][d][1] - boxes[0][d][0]
                      for d in range(len(shape))) if boxes else 0
  if len(covered) * per_box != math.prod(b - a for a, b in zip(lo, hi)):
    raise ValueError(
        f"this process's devices do not hold one contiguous part of the "
        f"{shape} array under {sharding}; order the mesh's devices so that "
        "each process's devices are adjacent along the split dims (as "
        "jax.make_mesh does)")
  return tuple(slice(a, b) for a, b in zip(lo, hi))


def from_local(local: Any, shardings: Any, global_shapes: Any) -> Any:
  """Global arrays from each process's own part of a batch (what a
  per-process data loader yields; :func:`process_slice` says which part),
  through ``jax.make_array_from_process_local_data``."""
  return jax.tree.map(
      lambda x, s, g: jax.make_array_from_process_local_data(
          s, np.asarray(x), tuple(g)), local, shardings, global_shapes,
      is_leaf=lambda x: isinstance(x, (np.ndarray, jax.Array)))


def to_host(x: Any) -> Any:
  """Full values of global arrays on every process (metrics, checks)."""
  from jax.experimental import multihost_utils
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, x)
  return jax.tree.map(
      lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
      x)


__all__: Sequence[str] = [
    "DistributedError", "check_same_plan", "from_local", "global_batch",
    "initialize", "plan_fingerprint", "process_slice", "to_host"]
