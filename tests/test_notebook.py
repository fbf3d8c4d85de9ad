"""notebooks/compare.ipynb: committed without outputs, and runs top to bottom against a fixture store."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="dev dependency: pip install nbformat nbclient ipykernel")
nbclient = pytest.importorskip("nbclient", reason="dev dependency: pip install nbformat nbclient ipykernel")
pytest.importorskip("ipykernel", reason="dev dependency: pip install nbformat nbclient ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "compare.ipynb"


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert any("parameters" in c.metadata.get("tags", []) for c in code)


def test_notebook_runs_top_to_bottom(store_dir, tmp_path, monkeypatch):
    from ipykernel.kernelspec import write_kernel_spec

    # A private "python3" kernelspec launching *this* interpreter, found first through JUPYTER_PATH: no
    # global registration, and a user-wide python3 kernel pointing elsewhere cannot be picked up.
    write_kernel_spec(str(tmp_path / "kernels" / "python3"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("KVBENCH_RESULTS", str(store_dir))
    # The kernel imports this checkout's kvbench, not whichever copy is installed in the environment.
    root = str(NOTEBOOK.parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 6  # pareto pooled and per task, latency, memory, one needle map per task
    assert any("text/markdown" in o.get("data", {}) and "Claim check" in o["data"]["text/markdown"]
               for o in outputs)
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
