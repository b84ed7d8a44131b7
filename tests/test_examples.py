"""The examples and the command line run as a user runs them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["mlp", "gpt", "vgg"])
def test_example_runs_and_matches_the_unsharded_step(name):
  r = _run(os.path.join("examples", f"{name}.py"))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "OK: the planned steps compute the unsharded steps' losses" in \
      r.stdout
  for baseline in ("data parallel", "FSDP", "Megatron", "autoddl_jax"):
    assert baseline in r.stdout


def test_cli_plans_saves_and_shows(tmp_path):
  path = tmp_path / "plan.json"
  r = _run("-m", "autoddl_jax", "plan", "examples/mlp.py:example", "--mesh",
           "data=4,model=2", "--devices-per-node", "4", "--memory-budget",
           "1GiB", "--save", str(path))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "{'data': 4, 'model': 2}" in r.stdout and path.exists()
  r = _run("-m", "autoddl_jax", "show", str(path))
  assert r.returncode == 0 and "0/w0" in r.stdout


def test_cli_errors_are_clear(tmp_path):
  r = _run("-m", "autoddl_jax", "plan", "examples/mlp.py:example", "--mesh",
           "data=4,model")
  assert r.returncode == 2 and "axis=size pairs" in r.stderr
  bad = tmp_path / "bad.json"
  bad.write_text("{\"format\": \"autoddl_jax.plan\", \"vers")
  r = _run("-m", "autoddl_jax", "show", str(bad))
  assert r.returncode == 2 and "truncated or corrupted" in r.stderr
  r = _run("-m", "autoddl_jax", "plan", "examples/mlp.py:nope", "--mesh",
           "data=8")
  assert r.returncode != 0 and "has no function 'nope'" in r.stderr


def test_readme_cli_example_shards_and_module_form_works():
  # The README's command: GPT-2 medium's shape on 128 devices must come out
  # sharded (a replicated plan would say why, but this one should not be).
  r = _run("-m", "autoddl_jax", "plan", "examples.gpt:example_large",
           "--mesh", "data=16,model=8", "--rows", "12")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "every argument is replicated" not in r.stdout
  # The MLP's weights use the fast axis inside a node (tensor parallel).
  w1 = [ln for ln in r.stdout.splitlines() if ln.startswith("0/0/w1 ")]
  assert w1 and "'model'" in w1[0], r.stdout[-3000:]
  assert "made for: 8 devices per node" in r.stdout
  assert "read by" in r.stdout and "times/step" in r.stdout
