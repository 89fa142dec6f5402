"""The processes a world is made of: waiting for them, ending them, saying how they ended.

Only PIDs this package started (and what they forked) are ever signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .limits import OomVerdict

log = logging.getLogger("ddp_notebook")

# what the notebook side tells the processes it starts, through their environment
OWNER_PID_ENV = "DDP_NOTEBOOK_OWNER_PID"  # the kernel's PID: its processes exit when it dies
OWNER_HOST_ENV = "DDP_NOTEBOOK_OWNER_HOST"  # the kernel's host: a PID means nothing elsewhere
# the world's private folders (os.pathsep between them): the controller removes them if the kernel dies
OWNER_FOLDERS_ENV = "DDP_NOTEBOOK_OWNER_FOLDERS"
SLOT_ENV = "DDP_NOTEBOOK_SLOT"  # the rank a locally launched engine was started for
PRELOAD_ENV = "DDP_NOTEBOOK_PRELOAD"  # "0" turns off importing torch while the rank registers
# how often a wait on ranks (a running cell, a comeback) checks that their processes are alive
DEATH_CHECK_SECONDS = 0.25


def owner_environment() -> dict[str, str]:
    """Tells the processes we start whose they are: they exit when this kernel dies."""
    return {OWNER_PID_ENV: str(os.getpid()), OWNER_HOST_ENV: socket.gethostname()}


def describe_exit(code: int | None, oom: OomVerdict | None = None) -> str:
    """How a rank process ended, in words a user can act on.

    `oom` says whether the out-of-memory killer struck meanwhile, from the cgroup's own
    counters (`limits.Platform.oom_since`): a SIGKILL is then named for what it was instead
    of guessed at.
    """
    oom_killed = oom.killed if oom is not None else None
    if code is None:
        return "exited"
    if code == -signal.SIGKILL and oom_killed and oom is not None:
        return f"was killed by the out-of-memory killer ({oom.cause})"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if name == "SIGKILL" and oom_killed is False:
            return "was killed by SIGKILL"  # not for memory: the counters did not move
        hint = {
            "SIGKILL": " (often the out-of-memory killer)",
            "SIGSEGV": " (a crash in native code)",
            "SIGABRT": " (aborted, e.g. by a failed check in native code)",
        }.get(name, "")
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


# a log line that says why a process gave up (ipyparallel's and Python's logging)
FATAL_MARKS = ("CRITICAL", "FATAL", "Traceback", "Error:")


def log_tail(path: str, lines: int = 5, why_first: bool = True) -> str:
    """The last `lines` lines of a log, joined by " | "; the last line that says why the process
    gave up goes first when it is further up (ipyparallel's engine follows its "Registration
    timed out" with a paragraph of advice)."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf8", errors="replace") as handle:
            every = [line.strip() for line in handle.read().splitlines() if line.strip()]
    except OSError:
        return ""
    tail = every[-lines:]
    # (a logged message that starts with a newline leaves a line that ends at its level's "|")
    fatal = [line for line in every if any(mark in line for mark in FATAL_MARKS) and not line.endswith("|")]
    if why_first and fatal and fatal[-1] not in tail:
        tail = [fatal[-1], "...", *tail[-(lines - 1) :]]
    return " | ".join(tail)


def run_with_timeout(function: Callable[[], Any], seconds: float) -> bool:
    """Runs `function` in a thread for at most `seconds`; True when it ended without an error.

    For ipyparallel's stop calls: they spin their own event loop, which must never hold the
    notebook forever, and they race the cluster's own loop over the same dicts of launchers
    ("dictionary changed size during iteration"). What they leave, the caller ends by PID, so
    their errors go to the log, never into the cell's output as a thread's traceback.
    """
    outcome: list[bool] = []

    def guarded() -> None:
        try:
            function()
        except Exception:
            log.debug("%s failed; what it left is ended by PID", function, exc_info=True)
            outcome.append(False)
        else:
            outcome.append(True)

    worker = threading.Thread(target=guarded, name="ddp-stop", daemon=True)
    worker.start()
    worker.join(seconds)
    return outcome == [True]


def descendants(pids: list[int]) -> list[int]:
    """Every living process started by one of `pids`, or by one of those, and so on down."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    seen = set(pids)
    pending = list(pids)
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in seen:
                seen.add(child)
                found.append(child)
                pending.append(child)
    return found


def ancestors(pid: int) -> list[int]:
    """The parent of `pid`, its parent, and so on up to the first process (nearest first): a few
    reads of /proc on Linux (every rank a detached world starts asks), a listing of all elsewhere."""
    parents = None if Path("/proc/self/stat").exists() else _parents()
    found: list[int] = []
    while (pid := _parent_of(pid) if parents is None else parents.get(pid, 0)) > 0 and pid not in found:
        found.append(pid)
    return found


def _parent_of(pid: int) -> int:
    try:
        return _parent_in(Path(f"/proc/{pid}/stat").read_text())
    except OSError:  # it ended meanwhile
        return 0


def _parent_in(stat: str) -> int:
    """The parent PID in a /proc/PID/stat line ("pid (comm) state ppid ...": comm may hold spaces
    and parentheses)."""
    return int(stat.rpartition(")")[2].split()[1])


def command_line(pid: int) -> str:
    """The command line process `pid` runs, its arguments joined by spaces ("" when unknown: it
    ended, or this is not Linux)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process visible here: /proc on Linux, `ps` elsewhere."""
    proc = Path("/proc")
    if (proc / "self" / "stat").exists():
        parents = {}
        for entry in proc.iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:  # it ended meanwhile
                    continue
                parents[int(entry.name)] = _parent_in(stat)
        return parents
    listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    return {int(pid): int(parent) for pid, parent in (line.split() for line in listing.splitlines() if line.strip())}


def controller_pid(cluster: Any) -> int | None:
    controller = getattr(cluster, "controller", None)
    return getattr(controller, "pid", None) if controller is not None else None


def wait_gone(pids: list[int], wait: float) -> list[int]:
    """Wait up to `wait` seconds for `pids` to exit; return those still alive."""
    deadline = time.monotonic() + wait
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if pid_alive(pid)]
        if alive:
            time.sleep(0.02)
    return alive


def kill_survivors(pids: list[int], wait: float = 3.0) -> None:
    """SIGKILL any of our own processes still alive after a clean stop was asked for."""
    for pid in wait_gone(pids, wait):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def started_at(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot ("" when unknown): with its PID, it names
    one process, however often the PID is reused (Linux's /proc; elsewhere always "")."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return ""
    fields = text.rpartition(")")[2].split()  # the name in parentheses may hold spaces
    return fields[19] if len(fields) > 19 else ""


def this_machine() -> tuple[str, str]:
    """(host name, boot id) of this machine: the PIDs a process records mean something only on its
    host, and only until that host boots again (the boot id is Linux's; "" elsewhere). The name is
    the kernel's own (uname), no lookup."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return os.uname().nodename, boot


def pid_alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass  # not our child (or already reaped): fall back to a signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
