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
            parts.extend(output.get("traceback", []))
    return "\n".join(parts)


def widget_models(notebook: nbformat.NotebookNode) -> list[dict]:
    """The widget models the kernel created, in the state its comm messages left them."""
    saved = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return [{"_model_name": model["model_name"], **model["state"]} for model in saved.get("state", {}).values()]


def check_live_metrics(notebook: nbformat.NotebookNode, text: str) -> None:
    """The live view's widgets ended complete; a rank's own tqdm bar and figure came through."""
    models = widget_models(notebook)
    bars = [m for m in models if m["_model_name"] == "IntProgressModel"]
    assert len(bars) == 4 and all(m["value"] == m["max"] and m["bar_style"] == "success" for m in bars)
    html = " ".join(str(m.get("value", "")) for m in models if m["_model_name"] == "HTMLModel")
    assert html.count(">done<") == 2, "both ranks end 'done' in the status table"
    assert "rank 0 · epoch" in html and "rank 1 · batch" in html
    assert "<Metrics: 360 points; loss (rank 0: 160, rank 1: 160)" in text
    # rank 0's own widgets: a tqdm.auto bar that reached its end, and a plotly FigureWidget
    tqdm_bars = [m for m in models if m["_model_name"] == "FloatProgressModel"]
    assert [(m["value"], m["max"]) for m in tqdm_bars] == [(4.0, 4.0)]
    figures = [m for m in models if m.get("_anywidget_id", "").endswith("FigureWidget")]
    assert len(figures) == 2 and any("'type': 'bar'" in str(m.get("_widget_data")) for m in figures)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them"
    )
    shutil.copy(path, tmp_path / path.name)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    for index, cell in enumerate(notebook.cells):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if "raises-exception" in cell.metadata.get("tags", []):
            assert errors, f"cell {index} is tagged raises-exception but raised nothing"
        else:
            assert errors == [], f"cell {index} failed: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    text = outputs_text(notebook)
    assert "stopped the world" in text, "every notebook ends by stopping its world"
    if path.name == "01_quickstart.ipynb":
        accuracy = float(re.search(r"\[rank 0\] test accuracy: ([\d.]+)%", text).group(1))
        assert accuracy >= 85.0
        assert "[rank 1] test accuracy" in text
        assert (tmp_path / "iris_model.pt").exists()
        assert re.search(r"reloaded model, test accuracy: ([\d.]+)%", text)
    if path.name == "03_failures_and_recovery.ipynb":
        assert "rank 1 failed first (root cause)" in text or "bad batch at step 15" in text
        assert "weights identical on all ranks: True" in text
        assert "rank 0: waiting in torch.distributed.all_reduce" in text
        assert "all-reduce works again: 2.0 - step is still 20" in text
        assert "broken (rank 1 gone): %ddp_restart" in text
        assert "fresh process, 'model' defined: False" in text
    if path.name == "02_live_metrics.ipynb":
        check_live_metrics(notebook, text)


def test_there_are_notebooks() -> None:
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
