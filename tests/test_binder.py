"""Binder, reproduced without Docker: an environment built only from binder/, every notebook run in it.

What repo2docker does with this repository, and what this test does in its place: steps 1-3 (the
runtime's Python, the repository copied in, a fresh venv,  pip install -r binder/requirements.txt
from its root, binder/postBuild) are tests/support/binder_build.py's, which tests/conftest.py starts in
the background when the session starts; then:

4. JupyterLab opens the notebooks. Here: every notebooks/*.ipynb runs top to bottom with nbclient
   inside the venv, through docs/notebook_runner.py (the runner of the docs build and of
   tests/support/notebooks.py), in a kernel whose kernelspec is installed into the venv (its python is
   asserted to be the venv's, and so is the ranks'), while the memory of the kernel and all its
   processes is sampled: Binder gives a session at most about 2 GB. Each notebook runs in a
   folder of its own, as in a fresh session; the runs serve tests/test_notebooks.py and the docs
   site too, so the tour runs once per test session, not twice. binder/start, where present,
   wraps the runner as it wraps the server's command at every launch.

Differences, on purpose:
- The CPU index that requirements.txt names (download.pytorch.org) is unreachable from the
  machines this project tests on. When it does not answer, that one line is left out of the
  copy's requirements.txt, and pip takes the same CPU build of the pinned torch from wherever
  this machine's pip is configured to look (a local wheel here); the test asserts that the CPU
  build ("+cpu") is what got installed. Where the index answers, the file is used unchanged.
- Binder's base image already has JupyterLab; the venv starts empty and gets it from
  requirements.txt, so the same file must be enough on its own.
- No container and no Jupyter server: no browser, the notebooks run headless.
- The notebooks run their short setting (DDP_NOTEBOOK_QUICK=1, as in tests/test_notebooks.py):
  the same cells with fewer steps, so that all of them fit the runner's time limit.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from ddp_notebook.platform import devices
from tests.support.binder_build import PIP_SECONDS, POSTBUILD_SECONDS, VENV_SECONDS, BinderBuild, run_checked
from tests.support.notebooks import QUICK_NOTEBOOKS, ExecutedNotebooks

# the build (where the session did not start it: under pytest -n) and the tour, beside another worker
pytestmark = [pytest.mark.binder, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parent.parent
MEMORY_LIMIT_MB = 2048  # mybinder.org: at least 1 GB, at most 2 GB per session
NOTEBOOK_CELL_SECONDS = 300
BUILT_HERE_SECONDS = VENV_SECONDS + PIP_SECONDS + POSTBUILD_SECONDS  # each step's own limit, one after another
RUNNER_SECONDS = 900  # the whole tour: about 300 s alone, more beside a second worker (pytest -n)


def processes_under(prefix: Path) -> list[int]:
    """PIDs of live processes running an executable from `prefix` (the venv)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv0 = handle.read().split(b"\0", 1)[0].decode(errors="replace")
            with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if argv0.startswith(str(prefix) + os.sep) and not zombie:
            found.append(int(entry))
    return found


def run_notebooks(argv: list[str]) -> int:
    """Runs INSIDE the Binder venv (shipped as source): execute notebooks, write a JSON report.

    argv: kernel name, report path, seconds per cell, the folder of docs/notebook_runner.py, the
    folder to run in, notebook paths. Each notebook runs through the docs build's runner in a
    folder of its own (as a fresh Binder session opens it), its executed copy written next to
    that folder. While each notebook runs, the processes under this one (the kernel, the
    controller, the ranks) are sampled: their memory, the python they run and the
    OMP_NUM_THREADS they were given.
    """
    import json
    import sys
    import threading
    import time
    from pathlib import Path

    import nbformat
    import psutil
    from nbclient.exceptions import CellExecutionError

    kernel_name, report_path, cell_seconds, runner_folder, runs_folder, *paths = argv
    sys.path.insert(0, runner_folder)
    from notebook_runner import execute

    me = psutil.Process()

    def sample(seen: dict[int, dict], peak: list[float], running: threading.Event) -> None:
        while running.is_set():
            total = 0
            for process in me.children(recursive=True):
                try:
                    total += process.memory_full_info().pss
                    # looked at again while "other": a process seen between its fork and its exec
                    # still shows its parent's command line
                    if seen.get(process.pid, {}).get("role", "other") == "other":
                        argv = process.cmdline()
                        role = "other"
                        if "ipykernel_launcher" in argv:
                            role = "kernel"
                        elif argv[1:3] == ["-m", "ddp_notebook.rank.entrypoints"]:  # a rank (or the controller) itself,
                            role = "rank" if "engine" in argv else "controller"  # not a launcher such as mpiexec
                        elif argv[1:3] == ["-m", "ddp_notebook.rank.template_process"]:
                            # the warm template, or a rank or the controller forked from it (which keep
                            # its argv; the fork names itself ddp-rankN or ddp-controller)
                            forked = process.parent().cmdline()[1:3] == argv[1:3]
                            name = process.name()
                            role = "template" if not forked else "controller" if name == "ddp-controller" else "rank"
                        omp = process.environ().get("OMP_NUM_THREADS")
                        seen[process.pid] = {"role": role, "argv0": argv[0], "omp": omp}
                except psutil.Error:
                    continue
            peak[0] = max(peak[0], total / 2**20)
            time.sleep(0.5)

    report: dict = {"notebooks": []}
    for path in map(Path, paths):
        folder = Path(runs_folder) / path.stem
        executed = Path(runs_folder) / f"{path.stem}.executed.ipynb"
        notebook = None
        seen: dict[int, dict] = {}
        peak = [0.0]
        running = threading.Event()
        running.set()
        sampler = threading.Thread(target=sample, args=(seen, peak, running), daemon=True)
        sampler.start()
        began = time.monotonic()
        error = None
        try:
            notebook = execute(path, folder, int(cell_seconds), kernel_name=kernel_name, startup_timeout=120)
            nbformat.write(notebook, executed)
        except CellExecutionError as failure:
            error = str(failure).strip().splitlines()[-1][:500]
        except Exception as failure:  # noqa: BLE001  (a timeout or a dead kernel: report it, go on)
            error = f"{type(failure).__name__}: {failure}"[:500]
        running.clear()
        sampler.join(5)
        texts = []
        for cell in notebook.cells if notebook is not None else []:
            for output in cell.get("outputs", []):
                texts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
        report["notebooks"].append(
            {
                "name": path.name,
                "error": error,
                "folder": str(folder),
                "executed": str(executed) if error is None else None,
                "seconds": round(time.monotonic() - began, 1),
                "peak_memory_mb": round(peak[0]),
                "processes": list(seen.values()),
                "output": "".join(texts)[-20000:],
            }
        )
    deadline = time.monotonic() + 20
    while me.children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.2)
    report["left_running"] = [p.pid for p in me.children(recursive=True)]
    Path(report_path).write_text(json.dumps(report, indent=1))
    return 0


def runner_script() -> str:
    return (
        textwrap.dedent(inspect.getsource(run_notebooks))
        + "\n\nif __name__ == '__main__':\n    import sys\n\n    sys.exit(run_notebooks(sys.argv[1:]))\n"
    )


def test_binder_environment_runs_every_notebook(
    tmp_path: Path, binder_build: BinderBuild | None, executed_notebooks: ExecutedNotebooks
) -> None:
    # steps 1-3, built since the session started (or now, where the session did not start it)
    began = time.monotonic()
    if binder_build is not None:
        build = binder_build.wait()
    else:
        build = BinderBuild(tmp_path / "build", background=False).start().wait(BUILT_HERE_SECONDS)
    waited = time.monotonic() - began
    repo, venv, log, env, dropped = build.repo, build.venv, build.log, build.env, build.dropped
    vpython = str(build.python)
    notebooks = sorted((repo / "notebooks").glob("*.ipynb"))
    assert any(p.name == "01_quickstart.ipynb" for p in notebooks)

    # what was installed: the pinned CPU build of torch, this package from the copy, widgets in JupyterLab
    facts = subprocess.run(
        [
            vpython,
            "-c",
            "import json, sys, torch, ddp_notebook, ipywidgets, anywidget, plotly, nbclient;"
            "print(json.dumps({'prefix': sys.prefix, 'torch': torch.__version__,"
            " 'ddp_notebook': ddp_notebook.__file__, 'ipywidgets': ipywidgets.__version__}))",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    installed = json.loads(facts.stdout)
    pinned = re.search(r"^torch==(\S+)", (repo / "binder" / "requirements.txt").read_text(), re.M)
    assert pinned, "binder/requirements.txt pins torch (torch==X.Y.Z) so Binder builds stay reproducible"
    assert installed["torch"] == f"{pinned.group(1)}+cpu", f"expected the CPU build, got torch {installed['torch']}"
    assert Path(installed["prefix"]) == venv
    assert Path(installed["ddp_notebook"]).is_relative_to(venv), "the package must come from the venv"
    assert installed["ipywidgets"].startswith("8.")
    extensions = subprocess.run(
        [str(venv / "bin" / "jupyter"), "labextension", "list"],
        env={**env, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    listed = re.sub(r"\x1b\[[0-9;]*m", "", extensions.stdout + extensions.stderr)
    for name in ("@jupyter-widgets/jupyterlab-manager", "anywidget", "jupyterlab-plotly"):
        assert re.search(rf"{re.escape(name)} v\S+ enabled OK", listed), f"{name} missing from JupyterLab:\n{listed}"

    # a kernelspec of the venv's own python, under a name nothing else uses
    kernel_name = f"binder-test-{uuid.uuid4().hex[:8]}"
    run_checked(
        [vpython, "-m", "ipykernel", "install", "--prefix", str(venv), "--name", kernel_name], repo, env, 120, log
    )
    spec = json.loads((venv / "share" / "jupyter" / "kernels" / kernel_name / "kernel.json").read_text())
    assert Path(spec["argv"][0]) == venv / "bin" / "python"

    # run every notebook as Binder would start the server: through binder/start, with a fresh home
    script = tmp_path / "run_notebooks.py"
    script.write_text(runner_script())
    report = tmp_path / "report.json"
    home = tmp_path / "home"
    run_env = {
        **env,
        **QUICK_NOTEBOOKS,
        "IPYTHONDIR": str(home / ".ipython"),
        "JUPYTER_CONFIG_DIR": str(home / ".jupyter"),
        "JUPYTER_DATA_DIR": str(home / ".local" / "share" / "jupyter"),
        "JUPYTER_RUNTIME_DIR": str(home / ".local" / "share" / "jupyter" / "runtime"),
    }
    runs = tmp_path / "runs"
    runs.mkdir()
    command = [vpython, str(script), kernel_name, str(report), str(NOTEBOOK_CELL_SECONDS), str(repo / "docs")]
    command += [str(runs), *map(str, notebooks)]
    start = repo / "binder" / "start"
    if start.exists():
        os.chmod(start, 0o755)
        command = [str(start), *command]
    began = time.monotonic()
    try:
        run_checked(command, repo, run_env, RUNNER_SECONDS, tmp_path / "notebooks.log")
    finally:
        leftover = processes_under(venv)
        deadline = time.monotonic() + 15
        while leftover and time.monotonic() < deadline:
            time.sleep(0.2)
            leftover = processes_under(venv)
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
    run_seconds = time.monotonic() - began

    results = json.loads(report.read_text())
    # each run that went through serves tests/test_notebooks.py and the docs site (tests/conftest.py)
    for result in results["notebooks"]:
        if result["executed"] is not None:
            notebook = nbformat.read(result["executed"], as_version=4)
            executed_notebooks.share(ROOT / "notebooks" / result["name"], notebook, Path(result["folder"]))
    summary = "\n".join(
        f"  {r['name']}: {'ok' if r['error'] is None else 'FAILED: ' + r['error']}, "
        f"{r['seconds']} s, peak memory {r['peak_memory_mb']} MB"
        for r in results["notebooks"]
    )
    print(
        f"\nBinder environment built in {build.seconds:.0f} s, {waited:.0f} s of it waited for here "
        f"(indexes left out: {dropped or 'none'}); "
        f"notebooks run in {run_seconds:.0f} s:\n{summary}"
    )
    ran = results["notebooks"]
    failed = [r for r in ran if r["error"] is not None]
    assert not failed, "notebooks failed in the Binder environment:\n" + summary
    python_of_venv = str(venv / "bin" / "python")
    for result in ran:
        kernels = [p for p in result["processes"] if p["role"] == "kernel"]
        ranks = [p for p in result["processes"] if p["role"] == "rank"]
        assert kernels and all(p["argv0"] == python_of_venv for p in kernels), f"kernel not the venv's: {kernels}"
        assert all(p["argv0"] == python_of_venv for p in ranks), f"ranks not the venv's: {ranks}"
        if result["name"] == "01_quickstart.ipynb":  # others may set the threads themselves (%env)
            assert len(ranks) == 2, f"the quick start runs 2 ranks (Binder has 1-2 cores): {ranks}"
            # nothing sets OMP_NUM_THREADS: each rank gets its share of the cores the CPU quota
            # allows (Binder's 1-2), not of the node's
            assert not kernels[0]["omp"], "the kernel should start without OMP_NUM_THREADS"
            threads = str(max(1, devices.usable_cpus() // 2))
            assert all(p["omp"] == threads for p in ranks), result["processes"]
    for result in ran:
        assert "stopped the world" in result["output"], f"{result['name']} should end with %ddp_stop"
        assert result["peak_memory_mb"] < MEMORY_LIMIT_MB, f"{result['name']} needs more memory than Binder has"
    assert results["left_running"] == [], "processes outlived the notebooks' kernels"
    assert leftover == [], f"processes of the venv still running after the notebooks: {leftover}"
    shutil.rmtree(venv, ignore_errors=True)  # 1.3 GB; kept when the test fails, to look into
