"""Every notebook in notebooks/ runs top to bottom in a real kernel (nbclient)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def outputs_text(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them"
    )
    shutil.copy(path, tmp_path / path.name)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    text = outputs_text(notebook)
    assert "stopped the world" in text, "every notebook ends by stopping its world"
    if path.name == "01_quickstart.ipynb":
        accuracy = float(re.search(r"\[rank 0\] test accuracy: ([\d.]+)%", text).group(1))
        assert accuracy >= 85.0
        assert "[rank 1] test accuracy" in text
        assert (tmp_path / "iris_model.pt").exists()
        assert re.search(r"reloaded model, test accuracy: ([\d.]+)%", text)


def test_there_are_notebooks() -> None:
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
