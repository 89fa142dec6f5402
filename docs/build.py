"""Build the docs site: execute the tour's notebooks, then Sphinx (warnings are errors).

    python3 docs/build.py            # the site in build/docs/html (open build/docs/html/index.html)

Each notebook runs in a real kernel on 2 CPU ranks, as the test suite runs it (docs/notebook_runner.py);
a notebook that fails, a broken internal link, a reference that does not resolve or a widget
with no static form fails the build. Takes a few minutes on 2 cores, most of it the notebooks.
`--executed DIR` builds from notebooks executed already (DIR/<name>.ipynb), as the tests do.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))

from notebook_runner import execute, failed_cells, tour

ROOT = Path(__file__).resolve().parent.parent
SPHINX_SECONDS = 600


def sphinx_command(executed: Path, out: Path) -> list[str]:
    """sphinx-build on the repository with docs/conf.py, every warning an error (all reported)."""
    return [
        sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-E",
        "-c", str(ROOT / "docs"), "-d", str(out / "doctrees"),
        "-D", f"ddp_executed_notebooks={executed}",
        str(ROOT), str(out / "html"),
    ]  # fmt: skip


def execute_tour(folder: Path) -> list[str]:
    """Run every notebook into `folder`; what failed, one line each."""
    problems = []
    for path in tour():
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ddp-notebook-docs-") as workdir:
            try:
                notebook = execute(path, Path(workdir))
            except Exception as error:  # noqa: BLE001  (reported with the others, then the build fails)
                problems.append(f"{path.name}: {type(error).__name__}: {str(error).strip().splitlines()[-1]}")
                continue
        problems += [f"{path.name}: {problem}" for problem in failed_cells(notebook)]
        nbformat.write(notebook, folder / path.name)
        print(f"executed {path.name} in {time.monotonic() - began:.0f} s", flush=True)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "docs", help="default: build/docs")
    parser.add_argument("--executed", type=Path, help="notebooks executed already: skip running them")
    args = parser.parse_args()
    executed = args.executed
    if executed is None:
        executed = args.out / "executed"
        executed.mkdir(parents=True, exist_ok=True)
        problems = execute_tour(executed)
        if problems:
            print("\n".join(["notebooks failed:", *problems]), file=sys.stderr)
            return 1
    result = subprocess.run(sphinx_command(executed.resolve(), args.out), timeout=SPHINX_SECONDS, check=False)
    if result.returncode == 0:
        print(f"the site: {args.out / 'html' / 'index.html'}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
