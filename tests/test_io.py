"""Plan files (``_io``): saved and loaded whole, refused with what differs."""

import jax
import numpy as np
import optax
import pytest

import autoddl_jax as ad
from autoddl_jax.testing import models
from conftest import TEST_CLUSTER
from helpers import make_mesh


def _mlp_step():
  return models.mlp(optimizer=optax.adam(1e-2))


def test_save_load_gives_the_same_shardings_and_numbers(tmp_path):
  ex = _mlp_step()
  mesh = make_mesh((2, 4))
  plan = ad.plan(ex.step, *ex.args, mesh=mesh, cluster=TEST_CLUSTER)
  path = tmp_path / "plan.json"
  plan.save(path)
  loaded = ad.load_plan(path, ex.step, *ex.args, mesh=mesh,
                        cluster=TEST_CLUSTER)
  assert loaded.in_specs == plan.in_specs
  assert loaded.out_specs == plan.out_specs
  assert loaded.cost == plan.cost
  a = plan.jit()(*ex.args)
  b = loaded.jit()(*ex.args)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not [p for p in tmp_path.iterdir() if p.name != "plan.json"]


def test_load_against_another_program_says_what_differs(saved):
  ex, path = saved
  other = models.mlp(batch=64, optimizer=optax.adam(1e-2))
  with pytest.raises(ad.PlanFileError, match=r"another program \(arguments "
                     r"differ: .*2/x"):
    ad.load_plan(path, other.step, *other.args, mesh=make_mesh((2, 4)),
                 cluster=TEST_CLUSTER)


def _edit_version(text):
  return text.replace('"version": 1', '"version": 99')


def _drop_choices(text):
  import json
  data = json.loads(text)
  data["choice"] = data["choice"][:-3]
  return json.dumps(data)


@pytest.mark.parametrize("edit,shape,cluster,match", [
    (None, (4, 2), TEST_CLUSTER,
     r"made for mesh \{'data': 2, 'model': 4\}, not \{'data': 4, 'model': 2\}"),
    (None, (2, 4), ad.Cluster(devices_per_node=2),
     "another cluster.*devices_per"),
    (_edit_version, (2, 4), TEST_CLUSTER, "format version 99"),
    (lambda t: t[:200], (2, 4), TEST_CLUSTER, "truncated or corrupted"),
    (_drop_choices, (2, 4), TEST_CLUSTER, "does not fit this program"),
], ids=["mesh", "cluster", "version", "truncated", "choices"])
def test_load_errors_say_what_differs(saved, edit, shape, cluster, match):
  ex, path = saved
  if edit is not None:
    path.write_text(edit(path.read_text()))
  with pytest.raises(ad.PlanFileError, match=match):
    ad.load_plan(path, ex.step, *ex.args, mesh=make_mesh(shape),
                 cluster=cluster)


def test_save_leaves_the_old_file_whole_when_writing_fails(saved,
                                                          monkeypatch):
  ex, path = saved
  before = path.read_text()
  plan = ad.load_plan(path, ex.step, *ex.args, mesh=make_mesh((2, 4)),
                      cluster=TEST_CLUSTER)

  def boom(*a, **k):
    raise OSError("disk full")

  monkeypatch.setattr("autoddl_jax._io.os.replace", boom)
  with pytest.raises(OSError, match="disk full"):
    plan.save(path)
  assert path.read_text() == before
  assert [p.name for p in path.parent.iterdir()] == ["plan.json"]
