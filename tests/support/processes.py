"""The processes a test leaves or waits for: whether a pid is alive (a zombie is not), waiting for pids
to exit, every live process started on behalf of a test process (found by the owner mark in their
environment), and the files of the ipyparallel profile a leak check compares before and after."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddp_notebook.platform.processes import OWNER_PID_ENV


def pid_alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    """PIDs still alive after waiting up to `seconds` for them to exit."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if pid_alive(pid)]
        if alive:
            time.sleep(0.1)
    return alive


def owned_pids(owner: int | None = None) -> set[int]:
    """Every live process started on behalf of `owner` (default: this test process).

    The controller, the ranks and whatever they fork carry DDP_NOTEBOOK_OWNER_PID in their
    environment, so this finds them even after they were re-parented.
    """
    marker = f"{OWNER_PID_ENV}={owner or os.getpid()}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0") and pid_alive(int(entry)):
                    found.add(int(entry))
        except OSError:
            continue
    return found


def profile_files() -> set[str]:
    """The files of the default ipyparallel profile's logs and connection files."""
    profile = Path(os.environ.get("IPYTHONDIR", Path.home() / ".ipython")) / "profile_default"
    return {str(path) for folder in ("log", "security") for path in (profile / folder).glob("*")}
