"""The processes a world is made of, found and ended by PID: real processes, no mocks."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ddp_notebook.platform import processes

# a child that starts a grandchild, prints its PID, and both sleep until killed
TREE = (
    "import subprocess, sys, time\n"
    "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(grandchild.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def tree() -> Iterator[tuple[int, int]]:
    child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())  # type: ignore[union-attr]
    yield child.pid, grandchild
    processes.kill_survivors([grandchild, child.pid], wait=0.0)
    child.wait(timeout=10)


def test_descendants_go_down_every_generation(tree: tuple[int, int]) -> None:
    child, grandchild = tree
    assert processes.descendants([child]) == [grandchild]
    found = processes.descendants([os.getpid()])
    assert found.index(child) < found.index(grandchild)  # nearest generation first
    assert processes.descendants([grandchild]) == []


def test_descendants_read_with_ps_without_proc(tree: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    child, grandchild = tree
    from_proc = processes._parents()
    monkeypatch.setattr(processes, "Path", lambda _: pathlib.Path("/nonexistent-proc"))
    from_ps = processes._parents()
    assert from_ps[grandchild] == from_proc[grandchild] == child
    assert processes.descendants([child]) == [grandchild]


def test_a_process_that_ended_has_no_descendants() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    time.sleep(0.05)
    assert processes.descendants([done.pid]) == []


def test_run_with_timeout_keeps_errors_out_of_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """ipyparallel's stop calls can race its own loop and raise in our thread: the caller hears
    False and ends the processes by PID; no thread traceback reaches the cell's output."""
    import threading

    escaped: list[object] = []
    monkeypatch.setattr(threading, "excepthook", lambda arguments: escaped.append(arguments.exc_value))

    def races() -> None:
        raise RuntimeError("dictionary changed size during iteration")

    assert processes.run_with_timeout(races, 5.0) is False
    assert processes.run_with_timeout(lambda: None, 5.0) is True
    started = time.monotonic()
    assert processes.run_with_timeout(lambda: time.sleep(3.0), 0.2) is False  # still running: not done
    assert time.monotonic() - started < 2.0
    assert escaped == []
