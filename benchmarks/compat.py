"""The compatibility matrix: the core tests on each supported combination of torch, Jupyter and plotly.

    python benchmarks/compat.py                 # every combination below
    python benchmarks/compat.py --only oldest   # some of them (comma-separated names)
    python benchmarks/compat.py --reuse         # keep each combination's environment between runs
    python benchmarks/compat.py --smoke         # also: the wheel in a fresh environment, the quick start
    python benchmarks/compat.py --smoke --smoke-beside  # its environment installed beside the core tests

Per combination: a virtual environment under ~/.cache/ddp_notebook_compat/NAME (override with
$DDP_NOTEBOOK_COMPAT_DIR) gets the combination's releases from the registry, then the package's
*built wheel* (with its `test-core` extra) in a second pip call that must leave every release of the
combination as it was (installing never replaces a torch in range). The core tests (`pytest -m core`)
then run from a copy of tests/, notebooks/ and docs/ outside the repository, so the ranks and the
kernels import the installed wheel, never this checkout. The smoke test installs the wheel into a
fresh environment holding only a torch and runs the quick-start notebook from a folder outside the
repository.

Writes benchmarks/results/compat.json and prints the table of docs/compatibility.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "compat.json"
HOME = Path(os.environ.get("DDP_NOTEBOOK_COMPAT_DIR", Path.home() / ".cache" / "ddp_notebook_compat"))

# the releases people have: the oldest and newest of each range, and mixes of the two
OLD_JUPYTER = {
    "ipykernel": "6.29.5",
    "ipyparallel": "8.8.0",
    "ipython": "8.12.3",
    "plotly": "6.0.1",
    "ipywidgets": "8.0.7",
    "anywidget": "0.9.0",
    "numpy": "1.24.4",
}
NEW_JUPYTER = {
    "ipykernel": "7.4.0",
    "ipyparallel": "9.2.0",
    "ipython": "9.18.1",
    "plotly": "7.1.0",
    "ipywidgets": "8.1.9",
    "anywidget": "0.11.0",
    "numpy": "2.4.6",
}
MIDDLE_JUPYTER = {
    "ipykernel": "6.31.0",
    "ipyparallel": "9.0.2",
    "ipython": "8.37.0",
    "plotly": "6.5.2",
    "ipywidgets": "8.1.5",
    "anywidget": "0.9.18",
    "numpy": "2.1.3",
}
COMBINATIONS: dict[str, dict[str, str]] = {
    "oldest": {"torch": "2.6.0", **OLD_JUPYTER},
    "newest": {"torch": "2.15.0", **NEW_JUPYTER},
    "old-jupyter-new-torch": {"torch": "2.15.0", **OLD_JUPYTER},
    "new-jupyter-old-torch": {"torch": "2.6.0", **NEW_JUPYTER},
    "middle": {"torch": "2.9.1", **MIDDLE_JUPYTER},
    # what .ci/install gives the main suite (torch's CPU build, from this machine's wheel folder; the
    # IPython the machine came with, which the range keeps)
    "ci": {
        "torch": "2.13.0",
        "ipykernel": "7.4.0",
        "ipyparallel": "9.2.0",
        "ipython": "8.12.3",
        "plotly": "7.1.0",
        "ipywidgets": "8.1.9",
        "numpy": "2.4.6",
    },
}
# the torch the smoke test's fresh environment holds before the wheel comes (the CI set's)
SMOKE_TORCH = "2.13.0"
# a pip constraint file may cap torch below a release of the matrix (this machine's caps it at 2.14.1):
# for the combinations that need a newer torch, pip is told to read no constraint file
NEEDS_NO_CAP = ("2.15",)

INSTALL_SECONDS = 3600
TESTS_SECONDS = 3600
SMOKE_SECONDS = 900


def log(text: str) -> None:
    print(f"[compat {time.strftime('%H:%M:%S')}] {text}", flush=True)


def run(command: list[str], seconds: float, **options: object) -> subprocess.CompletedProcess[str]:
    """Run `command`, its output kept; fail with its tail when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, check=False, **options)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:6])} ... exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return done  # type: ignore[no-any-return]


def pip_environment(torch_release: str) -> dict[str, str]:
    environment = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if torch_release.startswith(NEEDS_NO_CAP):
        environment["PIP_CONSTRAINT"] = "/dev/null"
    return environment


def build_wheel(folder: Path) -> Path:
    """The package's wheel, built from this checkout as a release would be."""
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(folder), str(ROOT)], 900)
    (wheel,) = folder.glob("ddp_notebook-*.whl")
    return wheel


def installed(python: Path, names: list[str]) -> dict[str, str]:
    """{distribution: installed release} in the environment of `python`."""
    code = "import importlib.metadata as m, json, sys\nprint(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    return json.loads(run([str(python), "-c", code, *names], 120).stdout)  # type: ignore[no-any-return]


def prepare_releases(name: str, releases: dict[str, str], reuse: bool) -> Path:
    """The combination's environment with its releases (not yet the package): its python."""
    folder = HOME / name
    python = folder / "bin" / "python"
    if folder.exists() and not reuse:
        shutil.rmtree(folder)
    if not python.exists():
        run([sys.executable, "-m", "venv", str(folder)], 300)
    pins = [f"{package}=={release}" for package, release in releases.items()]
    log(f"{name}: installing {' '.join(pins)}")
    run(
        [str(python), "-m", "pip", "install", "--quiet", *pins], INSTALL_SECONDS, env=pip_environment(releases["torch"])
    )
    return python


def prepare(name: str, releases: dict[str, str], wheel: Path, reuse: bool) -> Path:
    """The combination's environment: its releases, then the wheel, which must change none of them."""
    python = prepare_releases(name, releases, reuse)
    environment = pip_environment(releases["torch"])
    before = installed(python, list(releases))
    # the wheel as a user installs it into the environment they have: no pins, no --no-deps
    run([str(python), "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(wheel)], 600)
    run([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[test-core]"], INSTALL_SECONDS, env=environment)
    after = installed(python, list(releases))
    replaced = {package: (before[package], after[package]) for package in releases if before[package] != after[package]}
    if replaced:
        raise RuntimeError(f"installing the wheel replaced {replaced}")
    return python


def prepare_ahead(names: list[str]) -> int:
    """Build the combinations' environments with their releases, not yet the package (a later run
    with --reuse finds them ready and only adds the wheel): CI runs this beside the main suite, at
    the lowest CPU and disk priority, so that the oldest lane's CUDA torch (about 3 GB) is
    downloaded and unpacked while the suite's tests leave the network and the disk idle."""
    HOME.mkdir(parents=True, exist_ok=True)
    for name in names:
        prepare_releases(name, COMBINATIONS[name], reuse=True)
    return 0


def work_copy(into: Path) -> Path:
    """tests/, notebooks/, docs/ and the pytest settings, outside the repository: nothing there is the package."""
    for part in ("tests", "notebooks", "docs"):
        shutil.copytree(ROOT / part, into / part, ignore=shutil.ignore_patterns("__pycache__", "*.pt", "_build"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    return into


# what %ddp_start says is off in an environment: its lines, from a real world of 2 CPU ranks
OFF_HERE = (
    "from ddp_notebook import DDPCluster\n"
    "with DDPCluster(2, backend='gloo', collective_timeout=60) as world:\n"
    "    print(*world.missing_features, sep='\\n')\n"
)


def core_files(work: Path) -> list[str]:
    """The test files holding core tests (the others may import what only the full test extra has)."""
    return sorted(str(p.relative_to(work)) for p in (work / "tests").glob("test_*.py") if "mark.core" in p.read_text())


def run_core(name: str, python: Path, work: Path) -> dict[str, object]:
    """`pytest -m core` in the combination's environment; its counts, time and the lines said at start."""
    environment = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    environment["PATH"] = f"{python.parent}{os.pathsep}{environment.get('PATH', '')}"  # the kernels' python
    environment["IPYTHONDIR"] = str(work / f"ipython-{name}")
    environment["JUPYTER_PATH"] = str(python.parent.parent / "share" / "jupyter")
    where = run(
        [str(python), "-c", "import ddp_notebook, sys; print(ddp_notebook.__file__)"], 120, env=environment, cwd=work
    ).stdout.strip()
    if not where.startswith(str(python.parent.parent)):
        raise RuntimeError(f"{name}: ddp_notebook came from {where}, not the installed wheel")
    off = run([str(python), "-c", OFF_HERE], 300, env=environment, cwd=work).stdout.split("\n")
    junit = work / f"junit-{name}.xml"
    pytest = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "core", f"--junitxml={junit}"]
    began = time.monotonic()
    done = subprocess.run(
        [*pytest, *core_files(work)],
        capture_output=True,
        text=True,
        timeout=TESTS_SECONDS,
        check=False,
        env=environment,
        cwd=work,
    )
    took = time.monotonic() - began
    tail = (done.stdout + done.stderr).strip().splitlines()
    summary = next(
        (line for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)", line)), tail[-1] if tail else ""
    )
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    failed = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
    log(f"{name}: {summary} ({took:.0f} s)")
    for line in failed:
        log(f"{name}:   {line}")
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
        "skipped": counts.get("skipped", 0),
        "failures": failed,
        "seconds": round(took),
        "exit": done.returncode,
        "off_here": [line for line in off if line.strip()],
        "output_tail": "\n".join(tail[-60:]) if done.returncode else "",
    }


def smoke_environment(wheel: Path, beside: bool = False) -> dict[str, object]:
    """A fresh environment holding a torch, the wheel installed into it as a user would: its
    python, the torch it kept, the seconds installing took. `beside`: while other work runs (the
    core tests), at nice 19, its temporary files in its own folder (not the shared one, which
    some tests watch)."""
    folder = HOME / "smoke"
    shutil.rmtree(folder, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(folder)], 300)
    python = folder / "bin" / "python"
    environment = pip_environment(SMOKE_TORCH)
    low = ["nice", "-n", "19"] if beside else []
    if beside:
        (folder / "tmp").mkdir()
        environment["TMPDIR"] = str(folder / "tmp")
    began = time.monotonic()
    pip = [*low, str(python), "-m", "pip", "install", "--quiet"]
    run([*pip, f"torch=={SMOKE_TORCH}"], INSTALL_SECONDS, env=environment)
    run([*pip, str(wheel), "nbclient", "nbformat"], INSTALL_SECONDS, env=environment)
    torch_after = installed(python, ["torch"])["torch"]
    if not torch_after.startswith(SMOKE_TORCH):
        raise RuntimeError(f"installing the wheel replaced torch {SMOKE_TORCH} by {torch_after}")
    return {"python": python, "torch": torch_after, "install_seconds": time.monotonic() - began, "beside": beside}


def smoke(prepared: dict[str, object]) -> dict[str, object]:
    """The quick start, run from a folder outside the repository in the smoke test's environment
    (smoke_environment)."""
    python, folder = Path(str(prepared["python"])), HOME / "smoke"
    installing = float(prepared["install_seconds"])  # type: ignore[arg-type]
    torch_after = prepared["torch"]
    with tempfile.TemporaryDirectory(prefix="ddp-notebook-smoke-") as outside:
        shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", outside)
        shutil.copy(ROOT / ".ci" / "run_notebook.py", outside)
        environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        environment["PATH"] = f"{python.parent}{os.pathsep}{environment.get('PATH', '')}"
        environment["JUPYTER_PATH"] = str(folder / "share" / "jupyter")
        environment["IPYTHONDIR"] = str(Path(outside) / "ipython")
        began = time.monotonic()
        done = subprocess.run(
            [str(python), "run_notebook.py", "01_quickstart.ipynb"],
            capture_output=True,
            text=True,
            timeout=SMOKE_SECONDS,
            check=False,
            env=environment,
            cwd=outside,
        )
    output = done.stdout + done.stderr
    ok = done.returncode == 0 and "test accuracy" in output
    log(
        f"smoke: quick start {'passed' if ok else 'FAILED'} ({time.monotonic() - began:.0f} s; "
        f"installing {installing:.0f} s{' beside the core tests' if prepared['beside'] else ''})"
    )
    if not ok:
        print(output[-4000:])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "passed": ok,
        "torch": torch_after,
        "install_seconds": round(installing),
        "install_beside_core_tests": prepared["beside"],
        "seconds": round(time.monotonic() - began),
    }


def table(results: dict[str, dict[str, object]]) -> str:
    names = ["torch", "ipykernel", "ipyparallel", "ipython", "plotly", "ipywidgets", "numpy"]
    lines = [
        "| combination | " + " | ".join(names) + " | core tests | off here |",
        "|---" * (len(names) + 3) + "|",
    ]
    for name, result in results.items():
        versions = result["versions"]  # type: ignore[index]
        core = result["core"]  # type: ignore[index]
        outcome = f"{core['passed']} passed" + (f", **{core['failed']} failed**" if core["failed"] else "")  # type: ignore[index]
        outcome += f", {core['skipped']} skipped" if core.get("skipped") else ""  # type: ignore[union-attr]
        off = "; ".join(line.split(":")[0] for line in core["off_here"]) or "nothing"  # type: ignore[index, arg-type]
        lines.append(f"| {name} | " + " | ".join(versions.get(n, "?") for n in names) + f" | {outcome} | {off} |")  # type: ignore[union-attr]
    return "\n".join(lines)


def write_docs_table(results: dict[str, dict[str, object]], record: dict[str, object]) -> None:
    """The table of docs/compatibility.md, between its markers: every combination's latest run."""
    page = ROOT / "docs" / "compatibility.md"
    text = page.read_text()
    start, end = "<!-- compat table start -->", "<!-- compat table end -->"
    dates: dict[str, list[str]] = {}
    for result in results.values():
        dates.setdefault(str(result["command"]), []).append(str(result["date"]))
    runs = [
        f"`{command}` ({min(when)}{'' if min(when) == max(when) else ' to ' + max(when)})"
        for command, when in dates.items()
    ]
    ordered = {name: results[name] for name in COMBINATIONS if name in results}
    body = f"Run on Python {record['python']}, {record['machine']}: " + "; ".join(runs) + ".\n\n" + table(ordered)
    if record.get("smoke"):
        smoked = record["smoke"]
        body += (
            f"\n\nWheel smoke test ({smoked['date']}): quick start "  # type: ignore[index]
            f"{'passed' if smoked['passed'] else 'FAILED'} in a fresh environment holding torch {smoked['torch']}, "  # type: ignore[index]
            f"which installing the wheel kept ({smoked['install_seconds']} s installing"  # type: ignore[index]
            f"{' beside the core tests' if smoked.get('install_beside_core_tests') else ''}, "  # type: ignore[attr-defined]
            f"{smoked['seconds']} s running)."  # type: ignore[index]
        )
    head, rest = text.split(start, 1)
    page.write_text(f"{head}{start}\n{body}\n{end}{rest.split(end, 1)[1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated combination names: " + ", ".join(COMBINATIONS))
    parser.add_argument("--reuse", action="store_true", help="keep the environments of an earlier run")
    parser.add_argument("--smoke", action="store_true", help="also the wheel smoke test (quick start, fresh env)")
    parser.add_argument(
        "--smoke-beside",
        action="store_true",
        help="with --smoke: install its environment beside the core tests, at nice 19 (the lane takes less "
        "time; the install's seconds then say little)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results/compat.json")
    parser.add_argument(
        "--prepare-ahead",
        action="store_true",
        help="only build the combinations' environments with their releases (a later --reuse run adds the wheel)",
    )
    arguments = parser.parse_args()
    chosen = (
        list(COMBINATIONS) if arguments.only is None else [n.strip() for n in arguments.only.split(",") if n.strip()]
    )
    unknown = [name for name in chosen if name not in COMBINATIONS]
    if unknown:
        parser.error(f"unknown combination {', '.join(unknown)}: one of {', '.join(COMBINATIONS)}")
    if arguments.prepare_ahead:
        return prepare_ahead(chosen)
    HOME.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="ddp-notebook-compat-") as scratch:
        wheel = build_wheel(Path(scratch) / "dist")
        log(f"built {wheel.name}")
        # pip on one core, mostly: it can take what the core tests leave idle
        early = ThreadPoolExecutor(max_workers=1) if arguments.smoke and arguments.smoke_beside else None
        smoke_ready = early.submit(smoke_environment, wheel, True) if early else None
        for name in chosen:
            releases = COMBINATIONS[name]
            began = time.monotonic()
            try:
                python = prepare(name, releases, wheel, arguments.reuse)
                versions = installed(python, [*releases, "jupyter_client"])
                prepared = time.monotonic() - began
                work = work_copy(Path(scratch) / f"work-{name}")
                core = run_core(name, python, work)
            except (RuntimeError, subprocess.TimeoutExpired) as problem:
                log(f"{name}: {problem}")
                versions, prepared, core = (
                    releases,
                    time.monotonic() - began,
                    {"passed": 0, "failed": 1, "failures": [str(problem)[:2000]], "off_here": [], "seconds": 0},
                )
            failed = failed or bool(core["failed"]) or not core["passed"]
            results[name] = {
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "command": "python " + " ".join(["benchmarks/compat.py", *sys.argv[1:]]),
                "versions": versions,
                "prepare_seconds": round(prepared),
                "core": core,
            }
        smoked = None
        if arguments.smoke:
            smoked = smoke(smoke_ready.result() if smoke_ready else smoke_environment(wheel))
        if early:
            early.shutdown()
        failed = failed or (smoked is not None and not smoked["passed"])
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join(["benchmarks/compat.py", *sys.argv[1:]]),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU (torch's CUDA builds run on CPU)",
        "combinations": results,
        "smoke": smoked,
    }
    if not arguments.no_write:
        previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        merged = {**previous.get("combinations", {}), **results}  # a run of some combinations keeps the others'
        record["smoke"] = record["smoke"] or previous.get("smoke")  # and the last smoke test's
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({**record, "combinations": merged}, indent=1) + "\n")
        write_docs_table(merged, record)
    print(table(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
