"""How an SSH world reaches its hosts (world/provisioning/ssh_hosts.py): the options that share one
connection per host, and the hosts started at once. The real ssh path (masters opened, used and
ended on the network-namespace hosts) runs in tests/test_multinode.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ddp_notebook.world.provisioning.ssh_hosts import (
    STARTS_PER_HOST,
    STOPS_PER_HOST,
    _HostStarts,
    _QueuedSSHEngineLauncher,
    end_on_hosts,
    host_arguments,
    running_pids,
    sharing_options,
    start_script,
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


def test_a_hosts_engines_start_a_few_at_a_time_under_sshds_session_limit() -> None:
    """sshd refuses a shared connection's sessions past MaxSessions (10 by default): 16 engines of
    one host start STARTS_PER_HOST at a time after the first, and every one of them starts."""
    lock = threading.Lock()
    running, most, started = [0], [0], []

    def start(index: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
            started.append(index)

    starts = _HostStarts()
    for index in range(16):
        starts.add("h1", lambda index=index: start(index))
    starts.run()
    assert sorted(started) == list(range(16))
    assert most[0] == STARTS_PER_HOST < 10


def test_a_hosts_running_ranks_are_asked_for_in_one_command() -> None:
    """`running_pids` runs `ps` through the command given (ssh to a host; a local shell here): a
    running process is listed, one that exited or is a zombie (ended, not yet waited for) is not,
    and a command that fails (ssh's 255) says nothing rather than "none runs"."""
    alive = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["true"])
    exited = subprocess.Popen(["true"])
    exited.wait()
    try:
        deadline = time.monotonic() + 5
        while (
            subprocess.run(["ps", "-o", "stat=", "-p", str(zombie.pid)], capture_output=True, text=True).stdout.strip()[
                :1
            ]
            != "Z"
        ):
            assert time.monotonic() < deadline, "the zombie never showed"
            time.sleep(0.01)
        local = ("sh", "-c")
        assert running_pids(local, [alive.pid, zombie.pid, exited.pid]) == {alive.pid}
        assert running_pids(local, [exited.pid]) == set()  # ps says 1 when none of them runs
        assert running_pids(("sh", "-c", "exit 255", "ssh"), [alive.pid]) is None
    finally:
        alive.kill()
        alive.wait()
        zombie.wait()


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

    def __init__(self, joins: list[BaseException | None], running: bool | None = True) -> None:
        super().__init__()
        self.joins, self.sent, self.waits = joins, [], []
        self.on_host = running

    def still_running(self) -> bool | None:
        return self.on_host

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


def test_an_engine_its_hosts_watch_found_gone_is_not_stopped_over_ssh_again() -> None:
    """A world that replaced many ranks holds a launcher for each lost one; in a script nothing runs
    ipyparallel's loop, so their state still says running: the stop sends them nothing."""
    engine = RecordingEngine([None])
    engine.notify_start({"host": "h1", "pid": 4242})
    engine.gone = True
    asyncio.run(engine.stop())
    assert engine.sent == [] and engine.waits == []
    # the real signal sends nothing either (an ssh that does not exist fails it when it runs)
    engine.ssh_cmd = ["/nonexistent/ssh"]
    _QueuedSSHEngineLauncher.signal(engine, signal.SIGKILL)
    engine.gone = False
    with pytest.raises(subprocess.CalledProcessError):
        _QueuedSSHEngineLauncher.signal(engine, signal.SIGKILL)


@pytest.mark.parametrize("running", [True, None], ids=["still-there", "host-did-not-say"])
def test_an_engine_is_signalled_at_stop_only_if_it_did_not_exit_already(running: bool | None) -> None:
    """The world asked its ranks to exit before the stop: one that did is neither signalled nor
    waited for (ipyparallel starts Python on its host to wait); one still there, or whose host did
    not say, is."""
    exited = RecordingEngine([None], running=False)
    asyncio.run(exited.stop())
    assert exited.sent == [] and exited.waits == [] and exited.gone
    there = RecordingEngine([None], running=running)
    asyncio.run(there.stop())
    assert there.sent == [signal.SIGTERM] and not there.gone


def test_a_hosts_engines_stop_a_few_at_a_time_under_sshds_session_limit() -> None:
    """Each stopping engine holds two ssh sessions (its signal, the wait for its exit): 12 engines of
    one host stop STOPS_PER_HOST at a time, those of another host alongside."""
    inside: dict[str, int] = {}
    most: dict[str, int] = {}

    class Slow(RecordingEngine):
        async def join(self, timeout: float | None = None) -> None:
            inside[self.location] = inside.get(self.location, 0) + 1
            most[self.location] = max(most.get(self.location, 0), inside[self.location])
            await asyncio.sleep(0.02)
            inside[self.location] -= 1

    async def stop_all() -> None:
        engines = []
        for host, count in (("h1", 12), ("h2", 3)):
            for _ in range(count):
                engine = Slow([])
                engine.location = host
                engines.append(engine)
        await asyncio.gather(*(engine.stop() for engine in engines))

    asyncio.run(stop_all())
    assert most == {"h1": STOPS_PER_HOST, "h2": 3} and 2 * STOPS_PER_HOST < 10


class LocalEngine(_QueuedSSHEngineLauncher):
    """A launcher of a real local process whose "host" is a local shell (`sh -c` for ssh): what it
    records is what the world's stop told ipyparallel."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path, command: tuple[str, ...] = ("sh", "-c")) -> None:
        super().__init__()
        self.process, self.command, self.told = process, command, []
        self.notify_start({"host": "local", "pid": process.pid})
        self.pid, self.remote_output_file = process.pid, str(log)

    def host_command(self) -> tuple[str, ...]:
        return self.command

    def exited(self, exit_code: int) -> None:
        self.told.append(exit_code)


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
)


def test_a_worlds_stop_ends_each_hosts_ranks_in_one_session_sigterm_then_sigkill(tmp_path: Path) -> None:
    """What still runs of a world's ranks at its stop is ended host by host, one ssh session each:
    SIGTERM, then SIGKILL for what ignored it; an engine that had exited (a zombie here) counts as
    ended; every log goes; each engine is marked gone and reported as exited. A host that does not
    answer (ssh's 255) leaves its engines as they were, to their own stop."""
    polite = subprocess.Popen(["sleep", "60"])
    stubborn = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    done = subprocess.Popen(["true"])
    lost = subprocess.Popen(["sleep", "60"])
    logs = [tmp_path / f"ipengine-{n}.out" for n in range(4)]
    for log in logs:
        log.write_text("a rank's output\n")
    engines = [LocalEngine(process, log) for process, log in zip((polite, stubborn, done), logs)]
    on_lost_host = LocalEngine(lost, logs[3], ("sh", "-c", "exit 255", "ssh"))
    try:
        time.sleep(0.2)  # `true` has exited: a zombie until waited for
        began = time.monotonic()
        end_on_hosts([*engines, on_lost_host])
        took = time.monotonic() - began
        for process in (polite, stubborn, done):
            assert process.wait(timeout=5) is not None
        assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
        assert 1.5 < took < 10, took  # SIGKILL came after SIGTERM's grace, not at once
        assert all(engine.gone and engine.told == [-1] and engine.log_removed for engine in engines)
        assert [log.exists() for log in logs] == [False, False, False, True]
        assert lost.poll() is None and not on_lost_host.gone and on_lost_host.told == []
        # a launcher of another class (ipyparallel's own, configured by the user) is left to its own stop
        other = object()
        end_on_hosts([other])
        assert not hasattr(other, "gone")
    finally:
        for process in (polite, stubborn, done, lost):
            process.kill()
            process.wait()


def test_waiting_for_an_ssh_engine_asks_its_host_with_ps(tmp_path: Path) -> None:
    """A join asks the host with `ps` over the world's connection, never starting Python there
    (ipyparallel's way, an ssh session that makes a shared connection of its own once the world's
    ended): still running past the limit is TimeoutError, ended is -1, a host that does not say is
    an error."""
    sleeper = subprocess.Popen(["sleep", "60"])
    log = tmp_path / "ipengine-0.out"
    log.write_text("its output\n")
    engine: Any = LocalEngine(sleeper, log)
    try:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            engine.wait_one(0.6)
        assert 0.5 < time.monotonic() - began < 5
        sleeper.terminate()
        sleeper.wait()
        assert engine.wait_one(5) == -1
        assert engine.log_text == "its output\n" and not log.exists()  # read, and removed, once it ended
        engine.command = ("sh", "-c", "exit 255", "ssh")
        with pytest.raises(RuntimeError, match="did not say"):
            engine.wait_one(1)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_rank_starts_from_one_script_its_key_never_on_a_command_line(tmp_path: Path) -> None:
    """The script an SSH rank is started with, run by this machine's sh as the host's would: the
    profile folder made private, the environment set from stdin (not visible in `ps`), the rank in a
    session of its own, its output in its log, and its PID printed."""
    profile, log_file = tmp_path / "remote profile", tmp_path / "remote profile" / "log" / "engine.log"
    secret = "key with 'quotes' and $dollars"
    rank = [
        sys.executable,
        "-c",
        "import os, time; print(os.environ['IPP_KEY'], os.getsid(0) == os.getpid()); time.sleep(30)",
    ]
    script = start_script(str(profile), {"IPP_KEY": secret, "not a name": "x"}, rank, str(log_file))
    done = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=30, check=True)
    pid = int(done.stdout.strip())
    try:
        deadline = time.monotonic() + 20
        while not (log_file.exists() and log_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (
            log_file.read_text().split("\n")[0] == f"{secret} True"
        )  # its own session: the ssh session's end spares it
        assert secret not in Path(f"/proc/{pid}/cmdline").read_text()
        for folder in ("log", "security", "pid", "startup"):
            assert (profile / folder).stat().st_mode & 0o077 == 0
    finally:
        os.kill(pid, signal.SIGKILL)
