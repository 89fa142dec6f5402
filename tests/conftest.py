"""Shared fixtures: one real 2-rank gloo world per session, and process-leak checks."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from ddp_notebook import DDPCluster


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


def child_pids() -> set[int]:
    """PIDs of this test process's children (the processes our tests may have started)."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children", encoding="ascii") as handle:
            return {int(p) for p in handle.read().split()}
    except OSError:
        return set()


@pytest.fixture(scope="session")
def world() -> Iterator[DDPCluster]:
    """A 2-rank gloo world shared by tests that do not need their own."""
    cluster = DDPCluster(2, backend="gloo", timeout=60)
    cluster.start()
    pids = cluster.pids
    try:
        yield cluster
    finally:
        cluster.stop()
        assert wait_gone(pids) == [], "processes of the shared world outlived stop()"


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves child processes behind."""
    before = child_pids()
    yield
    leftover = wait_gone(sorted(child_pids() - before))
    assert leftover == [], f"processes left running: {leftover}"
