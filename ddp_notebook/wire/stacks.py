"""Seeing into ranks that do not answer: where each one is stuck.

A rank blocked inside a collective cannot run anything ipyparallel sends it, and SIGINT does
not break a gloo collective. `faulthandler` can still print the Python stacks of such a
process from a signal handler, in C, without the GIL or the main thread. Each rank registers
it for SIGUSR1 once, writing to a file of its own in a directory only the user can read; the
notebook signals the PIDs it started and reads the files.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Mapping
from pathlib import Path

STACK_SIGNAL = signal.SIGUSR1
_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)
_COLLECTIVE_PATH = re.compile(r"torch/distributed/")


def stack_file(directory: str, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.stack"


def enable_stack_dumps(directory: str, rank: int) -> None:
    """On a rank: dump every thread's Python stack to this rank's file on SIGUSR1."""
    import faulthandler

    # append mode: the notebook truncates the file before each request
    handle = open(stack_file(directory, rank), "a", encoding="utf8")
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)


def request_stacks(pids: Mapping[int, int], directory: str, wait: float = 0.5) -> dict[int, str]:
    """Ask ranks {rank: pid} for their stacks; return {rank: dump text} (empty if no answer)."""
    for rank, pid in pids.items():
        path = stack_file(directory, rank)
        try:
            path.write_text("")
            os.kill(pid, STACK_SIGNAL)
        except (OSError, ProcessLookupError):
            continue
    deadline = time.monotonic() + wait
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        pending = {rank for rank in pending if not _has_text(stack_file(directory, rank))}
        time.sleep(0.02)
    time.sleep(0.05)  # the handler writes the whole dump at once; let the last one finish
    return {
        rank: stack_file(directory, rank).read_text(encoding="utf8", errors="replace")
        for rank in pids
        if rank not in pending
    }


def _has_text(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def main_thread_frames(dump: str, main_thread_id: int) -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread in a faulthandler dump, innermost first."""
    wanted = f"0x{main_thread_id:016x}"
    blocks = _THREAD_HEADER.split(dump)
    # split gives [before, kind, id, body, kind, id, body, ...]
    for index in range(1, len(blocks) - 2, 3):
        if blocks[index + 1] == wanted:
            body = blocks[index + 2]
            return [(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(body)]
    return []


def describe_stuck_rank(frames: list[tuple[str, int, str]], in_flight: bool = False) -> str:
    """One line per rank: in which collective it waits, or what it is doing instead.

    `in_flight`: the rank's X-ray sees a collective of its own under way. One started from C++
    (DDP's gradient all-reduce, inside backward) has no torch.distributed frame to name it."""
    if not frames:
        return "no stack (the rank did not answer)"
    in_collective = next((f for f in frames if _COLLECTIVE_PATH.search(f[0])), None)
    user = next((f for f in frames if is_cell(f[0])), None)
    if user is None and in_collective is None:
        return "idle (not running a cell)"
    where = f"cell line {user[1]}" if user else f"{Path(frames[0][0]).name}:{frames[0][1]}"
    if in_collective is not None:
        return f"waiting in torch.distributed.{in_collective[2]} (at {where})"
    if in_flight:
        return f"waiting in a collective started by {frames[0][2]} (at {where})"
    return f"running {frames[0][2]} (at {where}), never reached the collective"


def is_cell(filename: str) -> bool:
    # IPython names cell code "<ipython-input-...>" or /tmp/ipykernel_*/*.py
    return filename.startswith("<ipython-input") or "ipykernel_" in filename or filename.startswith("<cell")
