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


def plotly_figures(notebook: nbformat.NotebookNode) -> list[dict]:
    """The plotly figures the notebook's own kernel showed (fig.show() under nbclient)."""
    mime = "application/vnd.plotly.v1+json"
    return [o["data"][mime] for cell in notebook.cells for o in cell.get("outputs", []) if mime in o.get("data", {})]


STEPS_ROW = re.compile(
    # method, processes, devices, threads each, batch each, steps/s, samples/s
    r"^(one process(?:, 1 thread)?|DataParallel|DDP, \d+ ranks) +(\d+) +\d+ (?:cpu|cuda)"
    r" +(\d+) +(\d+) +([\d.]+) +(\d+)$",
    re.MULTILINE,
)


def check_dataparallel_vs_ddp(notebook: nbformat.NotebookNode, text: str) -> None:
    """A steps/s row per method, the verdict computed from them, the shards and the averaged gradients."""
    rows = {m.group(1): float(m.group(5)) for m in STEPS_ROW.finditer(text)}
    assert "one process" in rows and any(method.startswith("DDP, ") for method in rows), rows
    assert all(rate > 0 for rate in rows.values()), rows
    assert "DataParallel" in rows or "DataParallel skipped:" in text
    ddp = next(rate for method, rate in rows.items() if method.startswith("DDP, "))
    # the verdicts are computed from the measured rates, one per other method
    verdicts = re.findall(
        r"^DDP, \d+ ranks ran ([\d.]+)x the steps/s of (.+): (faster|slower|about as fast)\.$", text, re.MULTILINE
    )
    assert sorted(method for _, method, _ in verdicts) == sorted(m for m in rows if not m.startswith("DDP, "))
    for ratio, method, verdict in verdicts:
        # the table rounds rates to 0.1 steps/s, the verdict uses them unrounded
        assert float(ratio) == pytest.approx(ddp / rows[method], rel=0.06 / min(ddp, rows[method]) + 0.01, abs=0.006)
        if min(abs(float(ratio) - 1.1), abs(float(ratio) - 0.9)) > 0.01:
            assert verdict == ("faster" if float(ratio) > 1.1 else "slower" if float(ratio) < 0.9 else "about as fast")
    assert re.search(r"\[rank 1\] \d+ thread\(s\), \d+ samples per step: [\d.]+ steps/s", text)
    # DistributedSampler: two epochs, each dealt out disjointly over all 20 samples
    assert text.count("20 samples dealt, disjoint: True, all 20 covered: True") == 2
    assert "[rank 1] epoch 1: [" in text
    # the gradient after backward() is the same on every rank and is the mean of the local ones
    assert "[rank 0] every rank holds the same gradient: True" in text
    assert re.search(r"\[rank 0\] it is the mean of the \d+ local gradients: True", text)
    after = re.findall(r"\[rank \d+\] after backward (\[.*\])", text)
    assert len(after) >= 2 and len(set(after)) == 1
    shards, gradients = plotly_figures(notebook)
    assert {trace["name"] for trace in shards["data"]} >= {"rank 0", "rank 1"}
    assert [trace["type"] for trace in gradients["data"]][-1] == "scatter"
    assert sum(trace["type"] == "bar" for trace in gradients["data"]) >= 2


def check_notebook_to_script(text: str, directory: Path) -> None:
    """%%ddp cells, a DDPCluster script and a torchrun job end with the same loss and parameters."""
    text = text.replace("\r\n", "\n")  # `!command` output comes through a terminal
    losses = re.findall(r"^(\[rank 0\] |\[default0\]:)final training loss ([\d.]+)$", text, re.MULTILINE)
    assert [prefix for prefix, _ in losses] == ["[rank 0] ", "[rank 0] ", "[default0]:"], losses
    assert len({loss for _, loss in losses}) == 1, losses
    pulled = re.search(r"final_loss on each rank: \{0: ([\d.]+), 1: ([\d.]+)\}", text)
    assert pulled and pulled.group(1) == pulled.group(2) and f"{float(pulled.group(1)):.6f}" == losses[0][1]
    assert "[default1]:rank 1 of 2 on cpu, LOCAL_RANK=1" in text
    assert text.count("parameters identical to the notebook's: True") == 3
    assert {p.name for p in directory.glob("*_model.pt")} == {"notebook_model.pt", "api_model.pt", "torchrun_model.pt"}


def check_multi_node(text: str) -> None:
    """Ranks follow the MPI ranks (where Open MPI is installed), train in step; attaching leaves the engines."""
    launcher = "mpi" if shutil.which("mpiexec") else "local"
    assert f"starting the ranks with the {launcher} launcher" in text
    mpi_rank = "OMPI_COMM_WORLD_RANK=1" if launcher == "mpi" else "OMPI_COMM_WORLD_RANK=-"
    assert f"[rank 1] {mpi_rank}, RANK=1, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, WORLD_SIZE=2" in text
    weights = re.findall(r"\[rank (\d)\] accuracy ([\d.]+), weights sum (-?[\d.]+)", text)
    assert sorted(rank for rank, _, _ in weights) == ["0", "1"] and len({w for _, _, w in weights}) == 1
    assert float(weights[0][1]) >= 0.85
    assert re.search(r"attached to profile \S+, cluster demo", text)
    assert text.count("sum of ranks + 1: 3.0") == 2
    assert "its engines keep running in their cluster" in text and "engines still registered: 2" in text
    assert "skipped: no Slurm cluster answers here" in text or "world of 2 ranks (gloo)" in text


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
    if path.name == "04_dataparallel_vs_ddp.ipynb":
        check_dataparallel_vs_ddp(notebook, text)
    if path.name == "05_notebook_to_script.ipynb":
        check_notebook_to_script(text, tmp_path)
    if path.name == "06_multi_node.ipynb":
        check_multi_node(text)
    if path.name == "07_elastic.ipynb":
        assert re.search(r"rank 1 was killed by SIGKILL\. Rank 1 came back in [\d.]+ s", text)
        assert "every rank is back at the snapshot taken at epoch 1, batch 3" in text
        assert "step 16; weights identical on all ranks: True" in text
        assert "each sample once per epoch: True" in text
        assert "the world has 3 ranks now" in text and "the world has 2 ranks now" in text
        assert "3 ranks, step 22; weights identical on all ranks: True" in text
        assert "third epoch used every sample: True" in text
        assert "2 ranks, step 30; weights identical on all ranks: True" in text


def test_there_are_notebooks() -> None:
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
