"""What a test harness started (tests/support/multihost.py, tests/support/hub.py): its processes,
known by pid and start time so that a reused pid is never hit, and its record on disk, so that a run
killed before its clean-up is cleaned up by the next one. Not a test module."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import psutil

T = TypeVar("T")


@dataclass
class RunRecord:
    """A harness's record (a dataclass adding its own fields after `run_id`), saved as JSON in
    `state_dir`, with the process that made it: once that is gone, the next run undoes the rest.

    `pid_maps` names its fields that map pids to start times (JSON keeps their keys as text)."""

    state_dir: ClassVar[Path]
    pid_maps: ClassVar[tuple[str, ...]] = ()
    run_id: str
    owner: int = field(default_factory=os.getpid, kw_only=True)
    owner_start: float | None = field(default_factory=lambda: start_time(os.getpid()), kw_only=True)

    @property
    def path(self) -> Path:
        return self.state_dir / f"{self.run_id}.json"

    def save(self) -> None:
        self.state_dir.mkdir(mode=0o700, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__))
        tmp.replace(self.path)  # a reader never sees half a record

    @classmethod
    def load(cls, path: Path) -> Any:
        data = json.loads(path.read_text())
        for name in cls.pid_maps:
            data[name] = {int(pid): start for pid, start in data[name].items()}
        return cls(**data)


def reap_stale_runs(record_type: type[RunRecord], remove: Callable[[Any], list[str]]) -> None:
    """Undo, with `remove`, what runs whose owner process is gone (killed before their teardown)
    left behind; a record goes once `remove` reports no problem."""
    if not record_type.state_dir.is_dir():
        return
    for path in record_type.state_dir.glob("*.json"):
        try:
            record = record_type.load(path)
        except (OSError, ValueError, TypeError):
            continue
        if alive(record.owner, record.owner_start):
            continue
        if not remove(record):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(state_dir: Path) -> Iterator[None]:
    """One run at a time reads and changes the records of `state_dir`."""
    state_dir.mkdir(mode=0o700, exist_ok=True)
    with open(state_dir / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def start_time(pid: int) -> float | None:
    """When `pid` started (psutil's create_time), None if it is gone or a zombie."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None


def alive(pid: int, start: float | None = None) -> bool:
    """Whether `pid` runs, and is the process that started at `start` (when given)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    now = start_time(pid)
    return now is not None and (start is None or now == start)


def stop_pids(pids: dict[int, float | None], seconds: float = 5.0) -> list[int]:
    """SIGTERM each pid (pid -> start time, so a reused pid is never hit), SIGKILL what is left
    after `seconds`; the pids still alive after that."""
    running: list[int] = []
    for sig, wait in ((signal.SIGTERM, seconds), (signal.SIGKILL, 5.0)):
        # no start time: it was gone when recorded, and its pid may be someone else's now
        running = [pid for pid, start in pids.items() if start is not None and alive(pid, start)]
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = [pid for pid in running if alive(pid, pids[pid])]
        if not running:
            return []
    return running


def left_after(find: Callable[[], T], seconds: float, pause: float) -> T:
    """What `find()` finds once it finds nothing, or after `seconds`: the processes a harness started
    that are still exiting after its stop."""
    deadline = time.monotonic() + seconds
    while True:
        found = find()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(pause)
