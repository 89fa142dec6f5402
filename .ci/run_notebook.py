"""Execute notebooks headless in a real kernel and print what each cell printed.

Usage: python .ci/run_notebook.py notebooks/01_quickstart.ipynb [more.ipynb ...]
Exits non-zero if any cell fails. The notebook runs in a temporary copy of its folder,
so files it writes (checkpoints) do not land in the repository.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def text_of(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return f"{output.get('ename')}: {output.get('evalue')}\n"
    data = output.get("data", {})
    return data.get("text/plain", "") + ("\n" if "text/plain" in data else "")


def run(path: Path, timeout: int) -> bool:
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="ddp-notebook-run-") as workdir:
        for sibling in path.parent.iterdir():
            if sibling.is_file() and sibling.suffix != ".ipynb":
                shutil.copy(sibling, workdir)
        client = NotebookClient(
            notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": workdir}}
        )
        began = time.monotonic()
        ok = True
        try:
            client.execute()
        except CellExecutionError:
            ok = False
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code":
                continue
            print(f"--- cell {index}: {cell.source.splitlines()[0] if cell.source else ''}")
            for output in cell.get("outputs", []):
                sys.stdout.write(text_of(output))
        print(f"=== {path}: {'ok' if ok else 'FAILED'} in {time.monotonic() - began:.1f} s")
        return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args()
    results = [run(path, args.timeout) for path in args.notebooks]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
