"""The logs SSH ranks leave on their hosts (world/provisioning/remote_logs.py): removed when a rank
ends, and a host that does not answer costs a bounded wait and leaves no process. The real SSH
path runs in tests/test_multinode.py (a rank replaced and one resized away leave no log)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ddp_notebook.world.provisioning.remote_logs import RemoteLogs


class StoppedLauncher:
    """What RemoteLogs reads of ipyparallel's SSHLauncher, with `ssh_cmd` standing for ssh: it runs
    the remote command here (dropping the host), or never answers."""

    def __init__(self, ssh_cmd: list[str], remote_output_file: str) -> None:
        self.ssh_cmd, self.ssh_args = ssh_cmd, ["-o", "BatchMode=yes"]
        self.location, self.remote_output_file = "node2", remote_output_file
        self.callbacks: list[Callable[[Any], None]] = []

    def on_stop(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def stopped(self) -> None:
        for callback in self.callbacks:
            callback({"exit_code": 0})


# runs "rm -f PATH" here: drops the ssh options and the host as ssh would consume them
RUN_HERE = ["sh", "-c", 'shift 3; exec "$@"', "ssh"]
NEVER_ANSWERS = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_ranks_log_is_removed_once_its_process_ended(tmp_path: Path) -> None:
    log_file = tmp_path / "ipengine-1764200000.1234.out"
    log_file.write_text("2026-11-27 [IPEngine] Completed registration with id 3\n")
    logs = RemoteLogs()
    launcher = StoppedLauncher(RUN_HERE, str(log_file))
    logs.watch(launcher)
    logs.watch(launcher)  # watched once
    assert len(launcher.callbacks) == 1 and log_file.exists()  # nothing before the rank ends
    launcher.stopped()
    logs.close()
    assert not log_file.exists()
    assert logs.removed == [f"node2:{log_file}"]


def test_a_host_that_does_not_answer_costs_a_bounded_wait_and_leaves_no_process(tmp_path: Path) -> None:
    logs = RemoteLogs(seconds=1.0)
    launcher = StoppedLauncher(NEVER_ANSWERS, str(tmp_path / "ipengine-1.out"))
    logs.watch(launcher)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    launcher.stopped()
    began = time.monotonic()
    logs.close()
    assert time.monotonic() - began < 3.0
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    assert left == [] and logs.removed == []
    launcher.stopped()  # after close: nothing more is started
    time.sleep(0.2)
    assert [child for child in psutil.Process().children(recursive=True) if child.pid not in before] == []
