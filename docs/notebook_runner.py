"""Run a tour notebook top to bottom in a real kernel, as the test suite and the docs build both do.

One implementation: tests/test_binder.py executes each notebook through `execute` inside the Binder
environment, and tests/support/notebooks.py through the same function for any notebook that run did
not serve (tests/test_notebooks.py checks what it printed, tests/test_docs_site.py builds the site
from it); docs/build.py executes them through the same function for a local build.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_SECONDS = 300
RAISES = "raises-exception"


def tour() -> list[Path]:
    """Every notebook of the tour, in its order."""
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def execute(
    path: Path, workdir: Path, timeout: int = CELL_SECONDS, kernel_name: str = "python3", startup_timeout: int = 60
) -> nbformat.NotebookNode:
    """The notebook at `path`, executed with `workdir` as its folder (files it writes land there),
    in the kernel named `kernel_name` (python3: the kernel of the python running this).

    The kernel inherits this process's environment, so a setting the notebooks read (a shorter
    run under test) reaches them the same way from pytest and from the docs build. A cell that
    raises and is not tagged raises-exception stops the run (nbclient's CellExecutionError).
    """
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, workdir / path.name)  # as where it is opened: next to itself
    # the kernel listens on unix sockets in a private folder: TCP ports picked free may be taken by
    # another process before the kernel binds them (a parallel test run), and the kernel then hangs
    sockets = tempfile.mkdtemp(prefix="ddp-kernel-")
    try:
        manager = KernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "kernel"))
        NotebookClient(
            notebook,
            km=manager,
            timeout=timeout,
            startup_timeout=startup_timeout,
            kernel_name=kernel_name,
            resources={"metadata": {"path": str(workdir)}},
        ).execute(cleanup_kc=True)  # a kernel manager of ours: nbclient shuts its kernel down only when told
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return notebook


def failed_cells(notebook: nbformat.NotebookNode) -> list[str]:
    """What went wrong, one line per cell: an error in a cell not tagged raises-exception, or a
    cell tagged raises-exception that raised nothing."""
    problems = []
    for index, cell in enumerate(notebook.cells):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if RAISES in cell.metadata.get("tags", []):
            if not errors:
                problems.append(f"cell {index} is tagged {RAISES} but raised nothing")
        elif errors:
            problems.append(f"cell {index} failed: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    return problems
