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


def test_a_log_tail_puts_why_the_process_gave_up_first(tmp_path: pathlib.Path) -> None:
    """ipyparallel's engine that gives up on its registration logs why, then a paragraph of advice:
    the reason leads the tail a start error quotes."""
    log = tmp_path / "engine.log"
    log.write_text(
        "[IPEngineApp] Registering with controller at tcp://127.0.0.1:5000\n"
        "[IPEngineApp] CRITICAL | Registration timed out after 5.0 seconds\n"
        "[IPEngineApp] CRITICAL | \n"
        "            If the controller and engines are not on the same machine,\n"
        "            you will have to instruct the controller to listen on an external IP:\n"
        "                c.IPController.ip = '0.0.0.0'\n"
        "                c.IPController.ip = '192.168.1.101'\n"
        "            or tunnel connections via ssh.\n"
    )
    tail = processes.log_tail(str(log))
    assert tail.startswith("[IPEngineApp] CRITICAL | Registration timed out after 5.0 seconds | ... | ")
    assert tail.endswith("or tunnel connections via ssh.")
    assert "            " not in tail  # the advice's indentation is not carried into one line
    assert processes.log_tail(str(log), why_first=False).startswith("If the controller and engines")
    log.write_text("one\ntwo\n")
    assert processes.log_tail(str(log)) == "one | two"
    assert processes.log_tail(str(tmp_path / "missing.log")) == ""
