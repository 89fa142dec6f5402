"""The tour's notebooks as the tests read them: each executed once per session by the docs build's
runner (`ExecutedNotebooks`, in their short setting, `QUICK_NOTEBOOKS`), the text of a run's outputs, and
the checks of notebook 04 (DataParallel against DDP) that the CPU run and the GPU run share."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # the conftest imports this module: no nbformat at the start of every run
    import nbformat


@dataclass
class ExecutedNotebook:
    notebook: Any  # nbformat.NotebookNode, with the outputs and widget state of the run
    folder: Path  # the notebook's folder while it ran: the files it wrote are there


class ExecutedNotebooks:
    """Each notebook executed once per session by docs/notebook_runner.py (the docs build's
    runner): tests/test_notebooks.py checks the outputs, tests/test_docs_site.py publishes them.

    tests/test_binder.py (which runs first) shares the runs it made in the Binder environment,
    through the same runner; a notebook it did not run, or whose run there failed, runs here on
    first use. The Binder environment is this package and the newest releases pip resolves, as
    a clean install of the test extra gets them.
    """

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "docs"))
        import notebook_runner

        self.runner = notebook_runner
        self._factory = factory
        self._runs: dict[Path, ExecutedNotebook | BaseException] = {}

    def get(self, path: Path) -> ExecutedNotebook:
        """The executed notebook; a run that raised raises the same error again, without re-running."""
        if path not in self._runs:
            folder = self._factory.mktemp(f"notebook-{path.stem}")
            try:
                self._runs[path] = ExecutedNotebook(self.runner.execute(path, folder), folder)
            except Exception as error:  # noqa: BLE001  (kept for every test that asks)
                self._runs[path] = error
        run = self._runs[path]
        if isinstance(run, BaseException):
            raise run
        return run

    def share(self, path: Path, notebook: Any, folder: Path) -> None:
        """Take a run of `path` made elsewhere without an error (its executed notebook, and the
        folder it ran in); a notebook already run here keeps its own run."""
        self._runs.setdefault(path, ExecutedNotebook(notebook, folder))


# the notebooks read it and run their short setting (the same cells, fewer steps)
QUICK_NOTEBOOKS = {"DDP_NOTEBOOK_QUICK": "1"}


def outputs_text(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
            parts.extend(output.get("traceback", []))
    return "\n".join(parts)


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
