"""notebooks/quickstart.ipynb runs top to bottom (its cells assert)."""

import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_runs():
  path = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
  nb = nbformat.read(path, as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
      "commit the notebook with outputs stripped"
  os.environ["MPLBACKEND"] = "Agg"
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
