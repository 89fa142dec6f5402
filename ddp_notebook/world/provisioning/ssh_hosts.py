"""SSH worlds: one connection per host for all of a world's ssh and scp, and every host started at once.

ipyparallel's SSH engine set starts its engines one after another, each through four ssh sessions
(the remote shell, its Python, the profile folder, the start), each a TCP connection and a key
exchange of its own: a world of 2 hosts spent 3.7 s there before any rank ran. Here:

- every ssh and scp of the world goes over one master connection per host (OpenSSH's
  `ControlMaster`), opened for all hosts at once while the controller starts. Its socket is in the
  world's private folder; the world's stop ends each master, and a master left by a kernel that
  died ends by itself `PERSIST_SECONDS` after its last session. Where the user's own `--ssh-args`
  already say how to share connections, theirs are kept as they are;
- each rank's log on its host is read and removed as soon as the rank ends (ipyparallel removed only
  the logs of the ranks it stopped itself: not of a rank lost and replaced, or left in a resize);
- the hosts start, and stop, at once, as ipyparallel's own launchers (selected like any engine
  launcher): the first engine of each host alone (it makes the remote profile folder), then the
  rest of that host's engines together. Each engine is told its rank (the list's order), as
  ipyparallel's one-after-another start made it: rank 0 on the first host, whichever registers
  first.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher
from traitlets import Integer

from ...platform.processes import SLOT_ENV

log = logging.getLogger("ddp_notebook")

# a master with no session left ends this long after the last one (a kernel that died cannot end it)
PERSIST_SECONDS = 10
# how long opening the masters, or ending one, may take
OPEN_SECONDS = 20.0
END_SECONDS = 5.0
SIGNAL_SECONDS = 30.0  # a signal to a rank over ssh (ipyparallel's own waits without a bound)
SSH_FAILED = 255  # ssh's exit status when it could not run the command on the host
_SOCKET_PREFIX = "ssh-"
_SHARING_OPTIONS = ("controlmaster", "controlpath", "controlpersist")


def sharing_options(folder: str, user_args: Sequence[str]) -> list[str]:
    """ssh options that make a world's sessions to a host share one connection, their sockets in
    `folder`; none where the user's own ssh arguments already set how connections are shared."""
    if any(option in str(arg).lower().replace(" ", "") for arg in user_args for option in _SHARING_OPTIONS):
        return []
    if "-S" in user_args:
        return []
    return [
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={os.path.join(folder, _SOCKET_PREFIX)}%C",  # %C: a hash of host, port and user
        "-o",
        f"ControlPersist={PERSIST_SECONDS}",
    ]


def host_arguments(listed: str) -> list[str]:
    """`user@host:port` as the hosts list spells it -> ssh's arguments for it (`-p PORT user@host`)."""
    location, _, port = listed.rpartition(":") if ":" in listed else (listed, "", "")
    return ["-p", port, location] if port else [location]


def open_masters(ssh_cmd: Sequence[str], ssh_args: Sequence[str], hosts: Iterable[str]) -> list[Any]:
    """Start a session to each host at once (each becomes its host's master); `wait_opened` waits."""
    sessions = []
    for host in hosts:
        try:
            sessions.append(_quiet([*ssh_cmd, *ssh_args, "-o", "BatchMode=yes", *host_arguments(host), "true"]))
        except OSError:
            log.debug("opening a shared ssh connection to %s failed", host, exc_info=True)
    return sessions


def wait_opened(sessions: Sequence[Any], seconds: float = OPEN_SECONDS) -> None:
    """Wait for the sessions `open_masters` started; one that takes too long is ended (ipyparallel's
    own steps then connect, and say what went wrong)."""
    _wait_or_kill(sessions, time.monotonic() + seconds)


def end_masters(folder: str, ssh_cmd: Sequence[str] = ("ssh",), seconds: float = END_SECONDS) -> list[str]:
    """Ask every master whose socket is in `folder` to end; the sockets it could not end (none when all went)."""
    deadline = time.monotonic() + seconds
    sockets = sorted(glob.glob(os.path.join(folder, f"{_SOCKET_PREFIX}*")))
    # the socket names its master: the host argument is not used for a control command
    _wait_or_kill(
        [_quiet([*ssh_cmd, "-o", f"ControlPath={path}", "-O", "exit", "ddp-notebook-master"]) for path in sockets],
        deadline,
    )
    while time.monotonic() < deadline and any(os.path.exists(path) for path in sockets):
        time.sleep(0.02)  # a master removes its socket as it ends
    return [path for path in sockets if os.path.exists(path)]


def _quiet(command: list[str]) -> subprocess.Popen[bytes]:
    devnull = subprocess.DEVNULL  # nothing captured: a master keeps what it was given open for its life
    return subprocess.Popen(command, stdin=devnull, stdout=devnull, stderr=devnull)


def _wait_or_kill(children: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class _HostStarts:
    """The engine starts of one engine set, run host by host at once."""

    def __init__(self) -> None:
        self.by_host: dict[str, list[Callable[[], None]]] = {}
        self.count = 0

    def add(self, host: str, start: Callable[[], None]) -> None:
        self.by_host.setdefault(host, []).append(start)
        self.count += 1

    def run(self) -> None:
        errors: list[BaseException] = []

        def run_one(start: Callable[[], None]) -> None:
            try:
                start()
            except BaseException as error:  # noqa: BLE001  (raised again below, in the caller's thread)
                errors.append(error)

        def run_host(starts: list[Callable[[], None]]) -> None:
            run_one(starts[0])  # makes the remote profile folder the others' logs go to
            if not errors:
                _together([lambda start=start: run_one(start) for start in starts[1:]])

        _together([lambda starts=starts: run_host(starts) for starts in self.by_host.values()])
        if errors:
            raise errors[0]


def _together(jobs: Sequence[Callable[[], None]]) -> None:
    if len(jobs) == 1:
        jobs[0]()
        return
    threads = [threading.Thread(target=job, name="ddp-ssh-start", daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # each ssh step is ipyparallel's own, with its own ends (a host that does not answer fails it)


class _QueuedSSHEngineLauncher(SSHEngineLauncher):
    """ipyparallel's SSH engine launcher whose start is queued by its engine set, which runs the
    queue host by host at once; and whose stop signals and whose log is read off the engine set's
    event loop, so that the engines of a set stop at once too."""

    def start(self, hostname: Any = None, user: Any = None, port: Any = None) -> None:
        self.loop  # noqa: B018  (bound to the engine set's loop, not the thread that starts it)
        queue = self.parent.queued_starts
        if SLOT_ENV not in self.environment:
            # ranks follow the hosts list whichever host registers first: the n-th engine is rank n
            self.environment = {**self.environment, SLOT_ENV: str(queue.count)}
        real_start = super().start
        queue.add(f"{user or ''}@{hostname}:{port or ''}", lambda: real_start(hostname=hostname, user=user, port=port))

    # the world asked its ranks to exit through the controller before any launcher stops: an engine
    # still there is stopped or hung (ipyparallel waits 5 s after SIGTERM, one engine after another)
    stop_seconds_until_kill = Integer(2, config=True, help="seconds from SIGTERM to SIGKILL at stop")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reading = threading.Lock()  # the waiting thread and a join's thread may both read the log

    def signal(self, sig: int) -> None:
        # ipyparallel's remote kill lets the traceback of a process already gone there through to
        # this process's stderr, which a notebook kernel shows under the user's cell: the same kill
        # over the same connection, what it says kept for the log; an ssh that fails still raises
        if self.state != "running":
            return
        command = [*self.ssh_cmd, *self.ssh_args, self.location, f"kill -{int(sig)} {int(self.pid)}"]
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SIGNAL_SECONDS, check=False
        )
        if done.returncode == SSH_FAILED:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
        if done.returncode:
            log.debug("signal %s to rank %s on %s: %s", sig, self.pid, self.location, done.stderr.strip())

    def wait_one(self, timeout: float) -> int:
        code: int = super().wait_one(timeout)  # raises TimeoutError while the engine runs
        # ended: its log is read (and removed from its host) here, in this engine's waiting thread;
        # ipyparallel reads it on the engine set's loop, engine after engine, and keeps what it read.
        # Whether that worked changes nothing about how the engine ended
        try:
            with self.reading:
                self.get_output(remove=True)
        except Exception:
            log.debug("reading the log of rank %s on %s failed", self.pid, self.location, exc_info=True)
        return code

    async def stop(self) -> None:
        # ipyparallel signals over ssh on the engine set's loop (0.6 s an engine, one after another)
        # and gives up at the first ssh that fails; here SIGKILL follows whatever SIGTERM's wait met
        for signum, seconds in ((signal.SIGTERM, self.stop_seconds_until_kill), (signal.SIGKILL, self.stop_timeout)):
            try:
                await asyncio.to_thread(self.signal, signum)
            except Exception:
                log.debug("signal %s over ssh failed", signum, exc_info=True)
            try:
                await self.join(timeout=seconds)
                return
            except Exception:  # TimeoutError: still running; else ssh did not answer
                log.debug("rank %s on %s still there after signal %s", self.pid, self.location, signum, exc_info=True)


class ConcurrentSSHEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set, starting (and, through its engines, stopping) its hosts at once."""

    launcher_class = _QueuedSSHEngineLauncher

    def start(self, n: int) -> list[str]:
        self.queued_starts = _HostStarts()
        started = super().start(n)  # builds each engine's launcher, which queues its start
        self.queued_starts.run()
        return started  # type: ignore[no-any-return]
