"""Several processes on loopback through autoddl_jax.launch: the same numbers
as one process, one plan everywhere, faults that end cleanly, checkpoints that
reshard. Every wait is bounded."""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import autoddl_jax as ad
from autoddl_jax.testing import models
from autoddl_jax.launch import free_port
from helpers import make_mesh, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_worker.py")


def _env():
  return {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}


def _launch(*args, timeout=240, grace=3):
  t0 = time.monotonic()
  r = subprocess.run(
      [sys.executable, "-m", "autoddl_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", "--timeout", str(timeout - 20), "--grace",
       str(grace), *args], cwd=ROOT, env=_env(), capture_output=True,
      text=True, timeout=timeout)
  return r, time.monotonic() - t0



def _example_config(src: str) -> models.GptConfig:
  """The example's ``CONFIG = models.GptConfig(...)``, read from its source
  (importing the example would configure jax's devices): keyword literals
  only, so a change there that this cannot read fails here, loudly."""
  import ast
  for node in ast.parse(src).body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", None)
                                         for t in node.targets] == ["CONFIG"]:
      call = node.value
      assert isinstance(call, ast.Call) and not call.args
      return models.GptConfig(**{k.arg: ast.literal_eval(k.value)
                                 for k in call.keywords})
  raise AssertionError("examples/multihost.py has no CONFIG")

def test_two_processes_train_like_one(tmp_path):
  # Each process loads only its part of the batch (from_local); parameters
  # and optimizer state are placed from whole values (global_array).
  out = tmp_path / "mh.npz"
  r, _ = _launch("examples/multihost.py", "--local-data", "--out", str(out))
  assert r.returncode == 0, r.stdout[-4000:]
  assert "[p0] step 2: loss" in r.stdout
  held = re.search(r"\[p0\] process 0 holds batch rows (.*) of (.*)",
                   r.stdout)
  assert held, r.stdout[-4000:]
  assert held.group(1) != held.group(2)  # a part, not the whole batch
  got = np.load(out)
  # The same step on one process with 8 devices.
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "mh", os.path.join(ROOT, "examples", "multihost.py"))
  cfg = _example_config(open(spec.origin).read())
  ex = models.gpt(cfg, optimizer=optax.adamw(1e-3))
  step = ad.auto_shard(ex.step, mesh=make_mesh((2, 4), explicit=False))
  params, opt_state, losses = ex.params, ex.opt_state, []
  for _ in range(3):
    params, opt_state, loss = step(params, opt_state, ex.batch)
    losses.append(float(loss))
  np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
  for k, v in jax.tree_util.tree_leaves_with_path(params):
    assert rel_err(got[jax.tree_util.keystr(k)], v) <= 1e-5, k


def test_every_process_has_the_same_plan():
  r, _ = _launch(WORKER, "fingerprint")
  assert r.returncode == 0, r.stdout[-4000:]
  fps = dict(re.findall(r"\[p(\d)\] fingerprint ([0-9a-f]+)", r.stdout))
  assert set(fps) == {"0", "1"} and fps["0"] == fps["1"]


def test_a_different_plan_on_one_process_is_caught():
  r, _ = _launch(WORKER, "mismatch")
  assert r.returncode != 0
  assert "processes [1] differ from process 0" in r.stdout, r.stdout[-4000:]


def test_a_killed_process_ends_the_other_within_the_bound():
  grace = 3
  r, took = _launch(WORKER, "die", grace=grace)
  assert "[p1] dying" in r.stdout, r.stdout[-4000:]
  assert "[launch] process 1 was killed by SIGKILL" in r.stdout
  assert r.returncode == 128 + 9
  # Bound: the launcher polls every 0.05 s, then SIGTERM, SIGKILL after
  # `grace`. Start-up and the first two steps take the rest.
  steps_done = r.stdout.rindex("[p1] dying")
  assert steps_done > 0 and took < 200


def _raised_at(stdout: str) -> float:
  m = re.search(r"\[p1\] raising at ([0-9.]+)", stdout)
  assert m, stdout[-4000:]
  return float(m.group(1))


@pytest.mark.parametrize("mode", ["raise", "raise_early"])
def test_a_process_that_raises_is_named_and_ends_the_job(mode):
  # "raise": process 1 raises in step 2 while process 0 waits in the step's
  # collectives (the job used to hang at exit, for ever without --timeout).
  # "raise_early": it raises before the first step (process 0 used to be
  # named, after 44 s). No --timeout: the bound is the excepthook that
  # ad.distributed.initialize installs, plus the launcher's --grace.
  grace = 3
  t0 = time.monotonic()
  r = subprocess.run(
      [sys.executable, "-m", "autoddl_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", "--grace", str(grace), WORKER, mode],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
  ended = time.time()
  assert r.returncode == 1, r.stdout[-4000:]
  assert "[launch] process 1 exited with code 1" in r.stdout, r.stdout[-4000:]
  assert "process 0 exited" not in r.stdout
  # From the raise to the launcher's exit: the launcher's 0.05 s poll, then
  # at most `grace` for process 0 (which catches SIGTERM: SIGKILL ends it).
  assert ended - _raised_at(r.stdout) < grace + 5, r.stdout[-3000:]
  assert time.monotonic() - t0 < 150


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
  except FileNotFoundError:
    return False


def _start_sleepers(cmd_prefix=()):
  """The launcher (optionally under a wrapper such as `timeout`) running two
  sleeping workers; returns the process and the workers' pids, once both
  printed them (bounded)."""
  import threading
  p = subprocess.Popen(
      [*cmd_prefix, sys.executable, "-m", "autoddl_jax.launch", "--nproc",
       "2", "--devices-per-proc", "4", "--grace", "3", WORKER, "sleep"],
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  lines: list[str] = []
  threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")),
                   daemon=True).start()
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    pids = [int(m) for m in re.findall(r"\[p\d\] pid (\d+)", "".join(lines))]
    if len(pids) == 2:
      return p, pids, lines
    time.sleep(0.1)
  p.kill()
  raise AssertionError("the workers did not start: " + "".join(lines)[-3000:])


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT", "timeout"])
def test_a_signal_to_the_launcher_stops_every_worker(sig):
  if sig == "timeout":  # `timeout` sends SIGTERM to the launcher alone
    p, pids, lines = _start_sleepers(("timeout", "-s", "TERM", "12"))
    rc, want = p.wait(timeout=60), 124
  else:
    p, pids, lines = _start_sleepers()
    t0 = time.monotonic()
    p.send_signal(getattr(signal, sig))
    rc, want = p.wait(timeout=30), 128 + getattr(signal, sig)
    assert time.monotonic() - t0 < 3 + 3  # --grace, plus the stopping
  assert rc == want, "".join(lines)[-3000:]
  time.sleep(0.2)
  assert not [q for q in pids if _alive(q)], "workers left running"
  if sig != "timeout":
    assert f"[launch] got {sig}; stopping every process" in "".join(lines)


def test_an_unreachable_coordinator_is_a_clear_error():
  env = dict(os.environ, AUTODDL_COORDINATOR=f"127.0.0.1:{free_port()}",
             AUTODDL_NUM_PROCESSES="2", AUTODDL_PROCESS_ID="1",
             AUTODDL_DEVICES_PER_PROC="4", JAX_PLATFORMS="cpu",
             JOIN_TIMEOUT="3")
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, WORKER, "join"], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 3, r.stdout + r.stderr[-2000:]
  assert "could not join the job through the coordinator at 127.0.0.1" in \
      r.stdout
  assert time.monotonic() - t0 < 60


def test_checkpoint_from_a_2x4_plan_restores_under_an_8_plan(tmp_path):
  ex = models.mlp()
  a = ad.plan(ex.step, *ex.args, mesh=make_mesh((2, 4), explicit=False))
  b = ad.plan(ex.step, *ex.args, mesh=make_mesh((8,), explicit=False))
  params = jax.device_put(ex.params, a.in_shardings[0])
  ad.checkpoint.save(tmp_path / "ckpt", params)
  back = ad.checkpoint.restore(tmp_path / "ckpt", b.in_shardings[0],
                               like=ex.params)
  for x, y, s in zip(jax.tree.leaves(back), jax.tree.leaves(ex.params),
                     jax.tree.leaves(b.in_shardings[0])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert x.sharding.is_equivalent_to(s, x.ndim)


def test_initialize_after_jax_started_says_to_move_it():
  jax.devices()
  with pytest.raises(ad.distributed.DistributedError, match="must run before"):
    ad.distributed.initialize(local_device_count=4)


def test_mismatched_device_counts_are_a_clear_error():
  port = free_port()
  procs = []
  for i, devices in enumerate((4, 2)):
    env = dict(os.environ, AUTODDL_COORDINATOR=f"127.0.0.1:{port}",
               AUTODDL_NUM_PROCESSES="2", AUTODDL_PROCESS_ID=str(i),
               AUTODDL_DEVICES_PER_PROC=str(devices), JAX_PLATFORMS="cpu")
    procs.append(subprocess.Popen([sys.executable, WORKER, "join"], env=env,
                                  cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=90)[0])
    finally:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 3, out[-2000:]
    assert "processes have different device counts: 6 devices in all" in out


def test_process_slice_and_from_local_on_one_process():
  # One process holds every device, so its part is the whole array; the
  # multi-process case is test_two_processes_train_like_one.
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh((2, 4), explicit=False)
  x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
  s = NamedSharding(mesh, P("data", "model"))
  part = ad.distributed.process_slice(s, x.shape)
  assert part == (slice(0, 16), slice(0, 8))
  g = ad.distributed.from_local(x[part], s, x.shape)
  assert g.sharding == s and np.array_equal(np.asarray(g), x)


def test_the_launcher_names_the_first_process_to_raise(tmp_path):
  # Process 1 raised first (its note is earlier); process 0 died of it in
  # the same poll, with or without a note of its own (a C++ abort has none).
  from autoddl_jax.launch import _first_failure
  (tmp_path / "1").write_text("100.0")
  assert _first_failure([(0, -6), (1, 1)], str(tmp_path)) == (1, 1)
  (tmp_path / "0").write_text("100.5")
  assert _first_failure([(0, 1), (1, 1)], str(tmp_path)) == (1, 1)
  assert _first_failure([(0, 1), (1, 1)], str(tmp_path / "none")) == (0, 1)
