"""How an SSH world reaches its hosts (world/provisioning/ssh_hosts.py): the options that share one
connection per host, and the hosts started at once. The real ssh path (masters opened, used and
ended on the network-namespace hosts) runs in tests/test_multinode.py."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time

import pytest

from ddp_notebook.world.provisioning.ssh_hosts import (
    _HostStarts,
    _QueuedSSHEngineLauncher,
    host_arguments,
    sharing_options,
)


def test_a_worlds_sessions_share_a_connection_unless_the_user_says_how() -> None:
    options = sharing_options("/tmp/ddp-notebook-x/ssh", ["-F", "/home/me/.ssh/cluster_config"])
    assert options == [
        "-o",
        "ControlMaster=auto",
        "-o",
        "ControlPath=/tmp/ddp-notebook-x/ssh/ssh-%C",
        "-o",
        "ControlPersist=10",
    ]
    # the user's own choice is kept, in any spelling
    theirs_spelled = (
        ["-o", "ControlMaster=no"],
        ["-oControlPath=~/.ssh/cm-%r@%h:%p"],
        ["-S", "/s"],
        ["-o", "controlpersist 60"],
    )
    for theirs in theirs_spelled:
        assert sharing_options("/tmp/f", theirs) == [], theirs


def test_a_listed_host_becomes_sshs_arguments() -> None:
    assert host_arguments("node1") == ["node1"]
    assert host_arguments("me@node1") == ["me@node1"]
    assert host_arguments("me@node1:2222") == ["-p", "2222", "me@node1"]


def test_hosts_start_at_once_and_each_hosts_first_engine_alone() -> None:
    events: list[str] = []
    lock = threading.Lock()
    firsts_running = threading.Barrier(2, timeout=5)  # passes only if both hosts' first starts run together

    def start(name: str, first: bool) -> None:
        with lock:
            events.append(f"begin {name}")
        if first:
            firsts_running.wait()
        time.sleep(0.05)
        with lock:
            events.append(f"end {name}")

    starts = _HostStarts()
    for host in ("h1", "h2"):
        for index in range(3):
            starts.add(host, lambda name=f"{host}/{index}", first=index == 0: start(name, first))
    began = time.monotonic()
    starts.run()
    assert time.monotonic() - began < 1.0  # 6 starts of 0.05 s: about 0.1 s at once, 0.3 s one after another
    everything = [f"{what} {host}/{i}" for what in ("begin", "end") for host in ("h1", "h2") for i in range(3)]
    assert sorted(events) == sorted(everything)
    for host in ("h1", "h2"):
        first_end = events.index(f"end {host}/0")
        assert all(events.index(f"begin {host}/{i}") > first_end for i in (1, 2)), events


def test_a_host_that_fails_stops_its_own_starts_and_its_error_is_raised() -> None:
    ran: list[str] = []

    def fail() -> None:
        raise RuntimeError("Unable to get remote shell information")

    starts = _HostStarts()
    starts.add("bad", fail)
    starts.add("bad", lambda: ran.append("bad/1"))
    starts.add("good", lambda: ran.append("good/0"))
    starts.add("good", lambda: ran.append("good/1"))
    with pytest.raises(RuntimeError, match="remote shell"):
        starts.run()
    assert "bad/1" not in ran and "good/0" in ran


class RecordingEngine(_QueuedSSHEngineLauncher):
    """The stop's logic, with ipyparallel's ssh steps (signal, join) recorded instead of run."""

    def __init__(self, joins: list[BaseException | None]) -> None:
        super().__init__()
        self.joins, self.sent, self.waits = joins, [], []

    def signal(self, sig: int) -> None:
        self.sent.append(sig)
        if sig == signal.SIGTERM:
            raise subprocess.CalledProcessError(1, ["ssh"])  # e.g. the process was gone already

    async def join(self, timeout: float | None = None) -> None:
        self.waits.append(timeout)
        outcome = self.joins.pop(0)
        if outcome is not None:
            raise outcome


@pytest.mark.parametrize(
    ("joins", "sent"),
    [
        ([None], [signal.SIGTERM]),  # exited after SIGTERM (its signal's failure changes nothing)
        ([TimeoutError("still running")], [signal.SIGTERM, signal.SIGKILL]),  # stopped or hung
        ([subprocess.CalledProcessError(255, ["ssh"]), None], [signal.SIGTERM, signal.SIGKILL]),  # ssh failed
    ],
)
def test_an_engine_still_there_after_sigterm_gets_sigkill_whatever_the_wait_met(
    joins: list[BaseException | None], sent: list[int]
) -> None:
    engine = RecordingEngine([*joins, TimeoutError("still running")])
    asyncio.run(engine.stop())
    assert engine.sent == sent
    assert engine.waits[0] == 2  # not ipyparallel's 5 s: the world asked its ranks to exit before
