"""The benchmark harness: alternation, statistics, the leak check, machine facts, JSON, signals.

The leak check reads /proc itself and uses nothing of ddp_notebook's: it must not trust the
code it checks.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
LEAK_GRACE = 5.0  # a process that exits within this long after its stop is slow, not leaked
VERSIONS = ("ddp_notebook", "ipyparallel", "torch", "pyzmq", "jupyter_client", "ipykernel", "nbdistributed")
VERSIONS += ("accelerate",)
T = TypeVar("T")
# how a training run reads its batches (run.py training --data; train_workload.py): "tensors",
# batches made up front and indexed; "loader", a DataLoader over a TensorDataset with a
# DistributedSampler, as a torchrun script reads in-memory data; "helpers", the same data and model
# through ddp_notebook.prepare_loader and prepare_model, as a %%ddp cell written with the helpers reads it
DATA_KINDS = ("tensors", "loader", "helpers")


class Unsupported(Exception):
    """A subject cannot take part in a scenario; the message says why."""


def rounds(group: Sequence[T], count: int) -> Iterator[tuple[int, T]]:
    """Every member once per round; the order reverses every other round, so load that comes
    and goes hits every member alike and none always runs right after the same other."""
    for index in range(count):
        for member in group if index % 2 == 0 else list(reversed(group)):
            yield index, member


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its 95% interval (normal approximation)."""
    mean = statistics.fmean(values)
    margin = 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return mean, mean - margin, mean + margin


# ---------------------------------------------------------------- our processes


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state, ppid, ..., utime and stime at [11]
    and [12], starttime at [19]; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(roots: Sequence[int]) -> list[int]:
    """`roots` and every live process below them, found by parent PID.

    ipyparallel's controller forks its hub and schedulers, torchrun starts each worker in a
    session of its own, a kernel starts ranks: PIDs of launched processes alone miss those.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := proc_stat(int(entry))) and fields[0] not in "ZX":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = set(roots), list(roots)
    while frontier:
        below = children.get(frontier.pop(), [])
        found.update(below)
        frontier += below
    return sorted(found)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by those of `pids` still alive."""
    total = sum(int(f[11]) + int(f[12]) for pid in pids if (f := proc_stat(pid)))
    return total / os.sysconf("SC_CLK_TCK")


class Tracker:
    """Every process this run started, noted with its start time (a reused PID is not ours)."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}

    def note(self, roots: Sequence[int] = ()) -> list[int]:
        """Note everything below this process and below `roots`; returns the tree of `roots`."""
        below = tree(list(roots))
        for pid in set(tree([os.getpid()])) | set(below):
            if pid != os.getpid() and (fields := proc_stat(pid)):
                self.seen.setdefault(pid, fields[19])
        return [pid for pid in below if pid in self.seen]

    def alive(self, pids: Sequence[int] | None = None) -> list[int]:
        pids = self.seen if pids is None else pids
        return [
            pid
            for pid in pids
            if pid in self.seen and (f := proc_stat(pid)) and f[19] == self.seen[pid] and f[0] not in "ZX"
        ]

    def leaked(self, pids: Sequence[int] | None = None, grace: float = LEAK_GRACE) -> list[int]:
        """Those of `pids` (default: all noted) still alive `grace` s from now; they are killed."""
        deadline = time.monotonic() + grace
        while (alive := self.alive(pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return alive


def bounded(function: Callable[[], Any], seconds: float, what: str) -> None:
    """Run `function` with a time limit (in a daemon thread); warn if it did not finish."""
    worker = threading.Thread(target=function, name=what, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        print(f"warning: {what} did not finish within {seconds:g} s", file=sys.stderr)


def exit_on_sigterm() -> None:
    """SIGTERM (from `timeout`, a CI runner) becomes SystemExit: `finally` blocks stop everything."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def warm_file_cache() -> None:
    """Whatever is timed first would otherwise pay for reading torch from disk."""
    subprocess.run([sys.executable, "-c", "import torch, ipyparallel"], check=True, timeout=300)


# ---------------------------------------------------------------- facts and output


def machine_line(info: dict[str, Any]) -> str:
    """What a benchmark prints first: the machine, its load and the versions measured (`machine_info`)."""
    return f"== {info['usable_cpus']} CPUs ({info['cpu']}), load {info['load_average']}; {info['versions']}"


def machine_info() -> dict[str, Any]:
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import ddp_notebook

    where = Path(ddp_notebook.__file__).resolve().parent
    git = ["git", "-C", str(where)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
    changed = subprocess.run([*git, "status", "--porcelain", "."], capture_output=True, text=True, timeout=30)
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu.group(1) if cpu else "?",
        "usable_cpus": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
        "versions": versions,
        "ddp_notebook_path": str(where),
        "ddp_notebook_commit": commit.stdout.strip() + (" + uncommitted changes" if changed.stdout.strip() else ""),
    }


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[fmt(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    print(line(headers))
    print("-" * len(line(headers)))
    for row in cells:
        print(line(row))


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # then renamed: a reader never sees half a file
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf8")
    tmp.replace(path)
    print(f"wrote {path}")
