"""Every notebook in notebooks/ runs top to bottom without an error."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # a notebook that writes files writes them here
  monkeypatch.setenv("MPLBACKEND", "Agg")
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in notebook.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"]
  assert not errors
