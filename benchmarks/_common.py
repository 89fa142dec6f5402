"""Helpers shared by the benchmark scripts: options, statistics, tables, JSON, process checks.

Kept independent of ddp_notebook's own helpers on purpose: the leak check must not trust
the code it is checking.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
# a process that exits within this long after its stop() returned is slow, not leaked
LEAK_GRACE_SECONDS = 5.0


def make_parser(description: str, *, repeats: int, repeats_help: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int, default=2, help="ranks (engines) per world (default: 2)")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} (default: {repeats})")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    return parser


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into SystemExit, so `finally` blocks stop the clusters."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def check_positive(parser: argparse.ArgumentParser, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    # first column left-aligned (labels), the rest right-aligned (numbers)
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def verdict(met: bool) -> str:
    return "meets goal" if met else "MISSES goal"


def machine_info() -> dict[str, Any]:
    versions = {}
    for package in ("ddp_notebook", "ipyparallel", "torch", "pyzmq"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": os.getloadavg(),
        "versions": versions,
    }


def print_header(title: str, info: dict[str, Any], settings: dict[str, Any]) -> None:
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    load = ", ".join(f"{x:.2f}" for x in info["load_average"])
    print(f"== {title}")
    print(f"   {info['usable_cpus']} CPUs, load {load}; {versions}")
    print("   " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print()


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # write then rename, so a reader never sees half a file
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf8")
    tmp.replace(path)
    print(f"\nwrote {path}")


def warm_file_cache() -> None:
    """Import torch and ipyparallel once in a throwaway process.

    Whatever is timed first would otherwise pay for reading them from disk.
    """
    import subprocess

    subprocess.run([sys.executable, "-c", "import torch, ipyparallel"], check=True, timeout=300)


# ---------------------------------------------------------------- our own processes


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass  # not our child, or reaped already: look it up instead
    fields = stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return fields[0] != "Z"


def kill_survivors(pids: Sequence[int], wait: float = 3.0) -> list[int]:
    """SIGKILL those of `pids` (processes this script launched) still alive after `wait` s."""
    deadline = time.monotonic() + wait
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if pid_alive(pid)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def run_with_timeout(function: Callable[[], Any], seconds: float) -> bool:
    """Run `function` in a daemon thread; False if it had not finished after `seconds`."""
    worker = threading.Thread(target=function, name="bench-stop", daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()


def raw_cluster_pids(cluster: Any) -> list[int]:
    """PIDs of an ipyparallel Cluster's controller and engines, from its launchers."""
    launchers = []
    if cluster.controller is not None:
        launchers.append(cluster.controller)
    for engine_set in cluster.engines.values():
        launchers.extend(getattr(engine_set, "launchers", {}).values())
    return [launcher.pid for launcher in launchers if (getattr(launcher, "pid", None) or -1) > 0]


def stop_raw_cluster(cluster: Any, client: Any, seconds: float = 15.0) -> float:
    """Stop a raw ipyparallel cluster and clean up after it.

    Returns how long the user-visible part took (closing the client, `stop_cluster_sync`),
    not the clean-up this benchmark adds.
    """
    # the whole tree: each engine launcher is a nanny whose engine process outlives it briefly
    pids = process_tree(raw_cluster_pids(cluster))
    began = time.perf_counter()
    if client is not None:
        try:
            client.close()
        except Exception as failure:  # noqa: BLE001  (stopping must go on regardless)
            print(f"warning: closing the raw client failed: {failure}", file=sys.stderr)
    # stop_cluster_sync has no timeout of its own
    if not run_with_timeout(cluster.stop_cluster_sync, seconds):
        print(f"warning: raw cluster did not stop within {seconds:g} s", file=sys.stderr)
    took = time.perf_counter() - began
    killed = kill_survivors(pids)
    if killed:
        print(f"note: SIGKILLed {len(killed)} raw-cluster process(es) still alive 3 s after stop", file=sys.stderr)
    try:
        cluster.remove_cluster_file()
    except Exception:  # noqa: BLE001  (already removed by stop_cluster)
        pass
    return took


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(roots: Sequence[int]) -> list[int]:
    """Live processes below `roots` (Linux /proc), found by parent PID.

    Launcher PIDs alone miss processes their processes start: ipyparallel's controller
    forks its hub and schedulers, torchrun starts each worker in a session of its own.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    frontier = list(roots)
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def process_tree(pids: Sequence[int]) -> list[int]:
    """`pids` and every live process below them: what a leak check must look at."""
    return sorted(set(pids) | set(descendants(pids)))


def leak_report(pids: Sequence[int], grace: float = LEAK_GRACE_SECONDS) -> tuple[list[int], str]:
    """Which of `pids` are still alive after `grace` seconds, and one line saying so."""
    deadline = time.monotonic() + grace
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if pid_alive(pid)]
    if alive:
        return (
            alive,
            f"PID check: {len(alive)} of {len(pids)} recorded PIDs STILL ALIVE {grace:g} s after stop: {alive}",
        )
    return alive, f"PID check: all {len(pids)} recorded PIDs (launched processes and their children) are gone"
