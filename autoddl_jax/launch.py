"""Start N local processes of one script, joined over loopback.

    python -m autoddl_jax.launch --nproc 2 --devices-per-proc 4 SCRIPT [ARGS...]

Each process gets a free loopback coordinator address, its process id and its
CPU device count through the environment (``ad.distributed.initialize()``
reads them), runs on CPU devices with gloo collectives, and has its output
forwarded line by line with a ``[pN]`` prefix.

Every way out is bounded:

* One process fails: the launcher names it and its exit code (the first
  to raise, when a peer dies of its exit in the same moment), stops the
  others (SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with
  that code. A process that raises after ``ad.distributed.initialize()``
  exits at once (``initialize`` installs an excepthook that skips
  jax.distributed's shutdown, which would wait for peers stuck in a
  collective), so the job ends within ``--grace`` plus about a second.
* The launcher gets SIGTERM, SIGINT or SIGHUP (Ctrl-C, ``timeout``, a batch
  scheduler): it stops every process the same way, within ``--grace``, and
  exits with 128 + the signal's number.
* ``--timeout`` bounds the whole run (exit 124).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from autoddl_jax.distributed import (ENV_COORDINATOR, ENV_DEVICES,
                                     ENV_FAILURES, ENV_NUM_PROCESSES,
                                     ENV_PROCESS_ID)


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _forward(i: int, stream, out, lock: threading.Lock) -> None:
  for line in iter(stream.readline, ""):
    with lock:
      out.write(f"[p{i}] {line}" if line.endswith("\n") else f"[p{i}] {line}\n")
      out.flush()
  stream.close()


def _describe(rc: int) -> str:
  if rc < 0:
    try:
      return f"was killed by {signal.Signals(-rc).name}"
    except ValueError:
      return f"was killed by signal {-rc}"
  return f"exited with code {rc}"


def _first_failure(failed: list[tuple[int, int]], notes: str) -> tuple[int, int]:
  """The failure to name: of the processes that exited non-zero, the one
  whose excepthook noted the earliest time (see
  ``distributed._note_failure``); without notes, the lowest index. Two exits
  often fall in one poll, since a peer dies of the first one's exit."""
  def noted(i):
    try:
      with open(os.path.join(notes, str(i))) as f:
        return float(f.read())
    except (OSError, ValueError):
      return float("inf")
  return min(failed, key=lambda f: (noted(f[0]), f[0]))


def _stop(procs, grace: float) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
  deadline = time.monotonic() + grace
  for p in procs:
    left = deadline - time.monotonic()
    try:
      p.wait(timeout=max(left, 0.01))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait(timeout=5)


class _Stopped(Exception):
  """The launcher got a signal that ends the job."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class _Signals:
  """While active, SIGTERM/SIGINT/SIGHUP to the launcher raise
  :class:`_Stopped` in its main loop, so the workers are stopped too: they
  run in sessions of their own, which the terminal's and ``timeout``'s
  signals do not reach. Only the first signal raises; later ones are
  ignored, so they cannot cut the stopping short."""

  SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP")
                  if hasattr(signal, n))

  def __init__(self, out, lock, grace: float):
    self._out, self._lock, self._grace = out, lock, grace
    self._old: dict[int, object] = {}
    self.armed = True

  def _handler(self, signum, frame):
    if not self.armed:
      return
    self.armed = False
    with self._lock:  # an RLock: the main thread may hold it already
      print(f"[launch] got {signal.Signals(signum).name}; stopping every "
            f"process (at most {self._grace:g} s)", file=self._out,
            flush=True)
    raise _Stopped(signum)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._old = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def launch(script: str, args: list[str], nproc: int, devices_per_proc: int,
           timeout: float | None = None, grace: float = 5.0,
           port: int | None = None, out=None) -> int:
  """Runs ``script`` in ``nproc`` processes; returns the launcher's exit
  code (0, the first failure's code, 124 on timeout, 128 + N on signal N)."""
  out = sys.stdout if out is None else out
  if nproc < 1 or devices_per_proc < 1:
    raise ValueError("--nproc and --devices-per-proc must be >= 1")
  if not os.path.exists(script):
    print(f"[launch] no such script: {script}", file=out, flush=True)
    return 2
  addr = f"127.0.0.1:{port or free_port()}"
  lock = threading.RLock()
  procs, threads = [], []
  start, code = time.monotonic(), 0
  notes = tempfile.TemporaryDirectory(prefix="autoddl_launch_")
  with notes, _Signals(out, lock, grace) as signals:
    try:
      for i in range(nproc):
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: addr, ENV_NUM_PROCESSES: str(nproc),
                    ENV_PROCESS_ID: str(i), ENV_DEVICES: str(devices_per_proc),
                    ENV_FAILURES: notes.name, "PYTHONUNBUFFERED": "1"})
        env.setdefault("JAX_PLATFORMS", "cpu")
        p = subprocess.Popen([sys.executable, script, *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_forward, args=(i, p.stdout, out, lock),
                             daemon=True)
        t.start()
        threads.append(t)
      while True:
        rcs = [p.poll() for p in procs]
        failed = [(i, rc) for i, rc in enumerate(rcs) if rc not in (None, 0)]
        if failed:
          i, rc = _first_failure(failed, notes.name)
          with lock:
            print(f"[launch] process {i} {_describe(rc)}; stopping the "
                  f"others (at most {grace:g} s)", file=out, flush=True)
          code = rc if rc > 0 else 128 - rc
          break
        if all(rc == 0 for rc in rcs):
          break
        if timeout is not None and time.monotonic() - start > timeout:
          with lock:
            print(f"[launch] still running after {timeout:g} s; stopping "
                  "all", file=out, flush=True)
          code = 124
          break
        time.sleep(0.05)
    except _Stopped as e:
      code = 128 + e.signum
    finally:
      signals.armed = False
      _stop(procs, grace)
      for t in threads:
        t.join(timeout=2)
  return code


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m autoddl_jax.launch",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--nproc", type=int, required=True)
  ap.add_argument("--devices-per-proc", type=int, default=1)
  ap.add_argument("--timeout", type=float, default=None,
                  help="seconds for the whole run (default: none)")
  ap.add_argument("--grace", type=float, default=5.0,
                  help="seconds between SIGTERM and SIGKILL when stopping")
  ap.add_argument("--port", type=int, default=None,
                  help="coordinator port on 127.0.0.1 (default: a free one)")
  ap.add_argument("script")
  ap.add_argument("args", nargs=argparse.REMAINDER)
  a = ap.parse_args(argv)
  return launch(a.script, a.args, a.nproc, a.devices_per_proc, a.timeout,
                a.grace, a.port)


if __name__ == "__main__":
  sys.exit(main())
