"""Binder, reproduced without Docker: an environment built only from binder/, every notebook run in it.

What repo2docker does with this repository, and what this test does in its place:

1. Python of the version in binder/runtime.txt: here the same version's interpreter from this
   machine (the test is skipped, saying so, where there is none).
2. The repository is copied in, and from its root  pip install -r binder/requirements.txt  runs
   (the local `.` line installs this package). Here: the files a clone would hold (tracked, and
   untracked ones not ignored) are copied to a temporary folder, a fresh `python -m venv` is made,
   and the same pip command runs from the copy's root, with nothing else installed first.
3. binder/postBuild runs once after the install, and binder/start wraps the server's command at
   every launch (each only if present). Here: the same, around the notebook runner.
4. JupyterLab opens the notebooks. Here: every notebooks/*.ipynb runs top to bottom with nbclient
   inside the venv, in a kernel whose kernelspec is installed into the venv (its python is
   asserted to be the venv's, and so is the ranks'), while the memory of the kernel and all its
   processes is sampled: Binder gives a session at most about 2 GB.

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
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from ddp_notebook.platform import devices
from tests.conftest import QUICK_NOTEBOOKS

pytestmark = [pytest.mark.binder, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
MEMORY_LIMIT_MB = 2048  # mybinder.org: at least 1 GB, at most 2 GB per session
PIP_SECONDS = 480
NOTEBOOK_CELL_SECONDS = 300
RUNNER_SECONDS = 600


def runtime_python() -> str:
    """An interpreter of the Python version binder/runtime.txt names (python-X.Y)."""
    text = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(\d+)\.(\d+)(\.\d+)?", text)
    assert match, f"binder/runtime.txt should read python-X.Y, not {text!r}"
    wanted = (int(match.group(1)), int(match.group(2)))
    if sys.version_info[:2] == wanted:
        return sys.executable
    found = shutil.which(f"python{wanted[0]}.{wanted[1]}")
    if found is None:
        pytest.skip(f"binder/runtime.txt asks for Python {wanted[0]}.{wanted[1]}, which this machine lacks")
    return found


def copy_repository(target: Path) -> None:
    """Copy what a clone of the repository would hold (tracked files, and new files not ignored)."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell which files a clone (and so Binder) would have")
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not there
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def index_answers(url: str, seconds: float = 5.0) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 443), timeout=seconds):
            return True
    except OSError:
        return False


def drop_unreachable_indexes(requirements: Path) -> list[str]:
    """Comment out the extra indexes that do not answer from here; return their URLs."""
    dropped = []
    lines = requirements.read_text().splitlines()
    for number, line in enumerate(lines):
        option = re.match(r"\s*--extra-index-url[\s=]+(\S+)", line)
        if option and not index_answers(option.group(1)):
            dropped.append(option.group(1))
            lines[number] = f"# left out by tests/test_binder.py, unreachable from here: {line}"
    requirements.write_text("\n".join(lines) + "\n")
    return dropped


def run_checked(command: list[str], cwd: Path, env: dict[str, str], seconds: float, log: Path) -> None:
    """Run a command in its own process group, output to `log`; kill the group if it overruns."""
    with log.open("ab") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            pytest.fail(f"{' '.join(command[:4])} ... did not finish within {seconds:g} s; see {log}")
    if code != 0:
        tail = log.read_text(errors="replace")[-4000:]
        pytest.fail(f"{' '.join(command[:4])} ... exited with {code}:\n{tail}")


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

    argv: kernel name, report path, seconds per cell, notebook paths. While each notebook runs,
    the processes under this one (the kernel, the controller, the ranks) are sampled: their
    memory, the python they run and the OMP_NUM_THREADS they were given.
    """
    import json
    import threading
    import time
    from pathlib import Path

    import nbformat
    import psutil
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    kernel_name, report_path, cell_seconds, *paths = argv
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
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        client = NotebookClient(
            notebook,
            timeout=int(cell_seconds),
            startup_timeout=120,
            kernel_name=kernel_name,
            resources={"metadata": {"path": str(Path(path).parent)}},
        )
        seen: dict[int, dict] = {}
        peak = [0.0]
        running = threading.Event()
        running.set()
        sampler = threading.Thread(target=sample, args=(seen, peak, running), daemon=True)
        sampler.start()
        began = time.monotonic()
        error = None
        try:
            client.execute()
        except CellExecutionError as failure:
            error = str(failure).strip().splitlines()[-1][:500]
        except Exception as failure:  # noqa: BLE001  (a timeout or a dead kernel: report it, go on)
            error = f"{type(failure).__name__}: {failure}"[:500]
        running.clear()
        sampler.join(5)
        texts = []
        for cell in notebook.cells:
            for output in cell.get("outputs", []):
                texts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
        report["notebooks"].append(
            {
                "name": Path(path).name,
                "error": error,
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


def test_binder_environment_runs_every_notebook(tmp_path: Path) -> None:
    python = runtime_python()
    repo, venv, log = tmp_path / "repo", tmp_path / "venv", tmp_path / "build.log"
    repo.mkdir()
    copy_repository(repo)
    notebooks = sorted((repo / "notebooks").glob("*.ipynb"))
    assert any(p.name == "01_quickstart.ipynb" for p in notebooks)
    dropped = drop_unreachable_indexes(repo / "binder" / "requirements.txt")

    # the same steps as repo2docker, in a fresh venv
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_PROGRESS_BAR": "off"}
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    began = time.monotonic()
    run_checked([python, "-m", "venv", str(venv)], repo, env, 120, log)
    vpython = str(venv / "bin" / "python")
    run_checked([vpython, "-m", "pip", "install", "-r", "binder/requirements.txt"], repo, env, PIP_SECONDS, log)
    if (repo / "binder" / "postBuild").exists():
        os.chmod(repo / "binder" / "postBuild", 0o755)
        run_checked([str(repo / "binder" / "postBuild")], repo, env, 300, log)
    build_seconds = time.monotonic() - began

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
    command = [vpython, str(script), kernel_name, str(report), str(NOTEBOOK_CELL_SECONDS), *map(str, notebooks)]
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
    summary = "\n".join(
        f"  {r['name']}: {'ok' if r['error'] is None else 'FAILED: ' + r['error']}, "
        f"{r['seconds']} s, peak memory {r['peak_memory_mb']} MB"
        for r in results["notebooks"]
    )
    print(
        f"\nBinder environment built in {build_seconds:.0f} s (indexes left out: {dropped or 'none'}); "
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
