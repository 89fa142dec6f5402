"""SSH worlds: one connection per host for all of a world's ssh and scp, and every host started at once.

ipyparallel's SSH engine set starts its engines one after another, each through four ssh sessions
(the remote shell, its Python, the profile folder, the start), each a TCP connection and a key
exchange of its own: a world of 2 hosts spent 3.7 s there before any rank ran. Here:

- every ssh and scp of the world goes over one master connection per host (OpenSSH's
  `ControlMaster`), opened for all hosts at once while the controller starts. Its socket is in the
  world's private folder; the world's stop ends each master, and a master left by a kernel that
  died ends by itself `PERSIST_SECONDS` after its last session. Where the user's own `--ssh-args`
  already say how to share connections, theirs are kept as they are;
- each rank starts in one ssh session: a shell script on its stdin makes the folder, sets the
  environment (the connection key never on a command line) and starts the rank in a session of its
  own. ipyparallel's start ran Python on the host three times first (a check, the profile folder, a
  start helper), about a second each on a loaded host;
- each rank's log on its host is read and removed as soon as the rank ends (ipyparallel removed only
  the logs of the ranks it stopped itself: not of a rank lost and replaced, or left in a resize);
- the hosts start, and stop, at once, as ipyparallel's own launchers (selected like any engine
  launcher): the first engine of each host alone (it makes the remote profile folder), then the
  rest of that host's engines together, `STARTS_PER_HOST` at a time (they stop `STOPS_PER_HOST` at
  a time). Each engine is told its rank
  (the list's order), as ipyparallel's one-after-another start made it: rank 0 on the first host,
  whichever registers first;
- one short ssh session every `WATCH_SECONDS` asks a host which of its ranks still run, for all of
  them (`_HostWatch`). ipyparallel held a session open per engine for its whole life, waiting on it:
  past about 8 ranks a host, sshd's `MaxSessions` (10 by default) refused the sessions beyond it over
  the shared connection, and ssh said so on the kernel's stderr, under the user's cell, as it fell
  back to a connection of its own;
- a world's stop ends what still runs of its ranks in one ssh session per host (`end_on_hosts`),
  before ipyparallel's stop, engine after engine, would.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher
from traitlets import Integer

from ...cell.ipp_adapter import WatchedExit
from ...platform.processes import SLOT_ENV

log = logging.getLogger("ddp_notebook")

# a master with no session left ends this long after the last one (a kernel that died cannot end it)
PERSIST_SECONDS = 10
# how long opening the masters, or ending one, may take
OPEN_SECONDS = 20.0
END_SECONDS = 5.0
SIGNAL_SECONDS = 30.0  # a signal to a rank over ssh (ipyparallel's own waits without a bound)
SSH_FAILED = 255  # ssh's exit status when it could not run the command on the host
# how often a host is asked which of its ranks still run, and how long one asking may take
WATCH_SECONDS = 3.0
WATCH_SSH_SECONDS = 20.0
LOG_SECONDS = 20.0  # reading (and removing) a rank's log on its host
# engines of one host starting at once: each start is a few ssh sessions in turn, and sshd refuses
# a shared connection's sessions past its MaxSessions (10 by default)
STARTS_PER_HOST = 6
# engines of one host stopping at once: each holds two sessions (its signal, the wait for its exit)
STOPS_PER_HOST = 4
# at a world's stop, the ranks still running on a host are ended in one ssh session for all of them:
# SIGTERM, up to this long for them to go, SIGKILL, as long again; the session itself is bounded too
SWEEP_GRACE_SECONDS = 2.0
SWEEP_SSH_SECONDS = 30.0
# a join with no limit (ipyparallel's default) still ends
JOIN_SECONDS = 30.0
# the host's side of a sweep: POSIX sh and ps; "left:" lists what still runs (zombies have ended)
_SWEEP = """p='{pids}'
left() {{ ps -o pid= -o stat= -p "$p" 2>/dev/null | awk '$2 !~ /^Z/ {{printf "%s ", $1}}'; }}
for s in TERM KILL; do
  l=$(left); [ -z "$l" ] && break
  kill -$s $l 2>/dev/null
  i=0; while [ $i -lt {ticks} ]; do l=$(left); [ -z "$l" ] && break; sleep 0.1; i=$((i+1)); done
done
rm -f {logs}
echo "left: $(left)"
"""
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
            rest = starts[1:]
            for first in range(0, len(rest), STARTS_PER_HOST):
                if errors:
                    return
                _together([lambda start=start: run_one(start) for start in rest[first : first + STARTS_PER_HOST]])

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


def start_script(profile_dir: str, environment: dict[str, str], command: Sequence[str], output_file: str) -> str:
    """A POSIX shell script that makes an engine's profile folder (private), sets its environment and
    starts it in a session of its own, its output to `output_file`; it prints the engine's PID."""
    quote = shlex.quote
    folders = " ".join(quote(os.path.join(profile_dir, name)) for name in ("log", "security", "pid", "startup"))
    exports = "".join(f"export {name}={quote(value)}\n" for name, value in environment.items() if name.isidentifier())
    return (
        "umask 077\n"
        f"mkdir -p {folders} || exit 71\n"
        f"{exports}"
        # setsid: the rank is not in the ssh session's process group, so the session's end spares it
        "if command -v setsid >/dev/null 2>&1; then detach=setsid; else detach=nohup; fi\n"
        f"$detach {' '.join(quote(part) for part in command)} > {quote(output_file)} 2>&1 < /dev/null &\n"
        "echo $!\n"
    )


def run_on_host(ssh: Sequence[str], remote: str, seconds: float) -> subprocess.CompletedProcess[str] | None:
    """`remote` run on the host `ssh` (ssh and its arguments, up to the host) reaches, its output
    kept (never on the kernel's stderr); None when it did not end within `seconds` or could not start."""
    try:
        return subprocess.run(
            [*ssh, remote], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=seconds, check=False
        )
    except (subprocess.TimeoutExpired, OSError):
        return None


def running_pids(command: Sequence[str], pids: Sequence[int]) -> set[int] | None:
    """Which of `pids` still run on the host `command` (ssh and its arguments, up to the host)
    reaches; None when the host did not say (it did not answer, or has no POSIX ps)."""
    listing = f"ps -o pid= -o stat= -p {','.join(str(int(pid)) for pid in pids)}"
    done = run_on_host(command, listing, WATCH_SSH_SECONDS)
    # ps says 1 when none of them runs; ssh 255 when it failed
    if done is None or done.returncode not in (0, 1):
        log.debug("asking %s which ranks run failed: %s", command[-1], done and done.stderr.strip())
        return None
    running = set()
    for line in done.stdout.splitlines():
        fields = line.split()
        # a zombie has ended: only its parent's wait is missing
        if len(fields) >= 2 and fields[0].isdigit() and not fields[1].startswith("Z"):
            running.add(int(fields[0]))
    return running


def _running_by_host(engines: Sequence[Any]) -> dict[tuple[str, ...], list[Any]]:
    """The engines of ours among `engines` that still run, by the ssh command that reaches their host
    (another launcher class, ipyparallel's own configured, is left to its own stop and signals)."""
    by_host: dict[tuple[str, ...], list[Any]] = {}
    for engine in engines:
        if not isinstance(engine, _QueuedSSHEngineLauncher):
            continue
        if engine.state == "running" and not engine.gone and int(engine.pid or -1) > 0:
            by_host.setdefault(engine.host_command(), []).append(engine)
    return by_host


def end_on_hosts(engines: Sequence[Any], seconds: float = SWEEP_SSH_SECONDS) -> None:
    """End what still runs of `engines` (SSH engine launchers of one world) and remove their logs,
    in one ssh session per host for all of its engines, the hosts at once.

    Meant for a world's stop, once its ranks were asked to exit: ipyparallel's stop, engine after
    engine, signals each over ssh and starts Python on its host to wait for it, and a world waits
    for that only so long. With 16 ranks a host on a loaded machine it gave up with ranks still
    running there, and its late ssh sessions, after the world's shared connections had ended, each
    tried to open one of its own in the removed folder ("unix_listener: cannot bind to path") on the
    kernel's stderr. An engine found ended is marked gone (its own stop then sends nothing); a host
    that does not answer leaves its engines to that stop."""
    by_host = _running_by_host(engines)

    def sweep(command: tuple[str, ...], group: list[Any]) -> None:
        logs = " ".join(shlex.quote(engine.remote_output_file) for engine in group if not engine.log_removed)
        remote = _SWEEP.format(
            pids=",".join(str(int(engine.pid)) for engine in group),
            ticks=int(SWEEP_GRACE_SECONDS * 10),
            logs=logs or "/dev/null/nothing",
        )
        done = run_on_host(command, remote, seconds)
        said = [line for line in (done.stdout.splitlines() if done is not None else []) if line.startswith("left:")]
        if done is None or done.returncode != 0 or not said:
            log.debug("ending the ranks on %s failed: %s", command[-1], done and done.stderr.strip())
            return
        left = {int(pid) for pid in said[-1].removeprefix("left:").split() if pid.isdigit()}
        for engine in group:
            if int(engine.pid) in left:
                continue
            with engine.reading:
                engine.log_text = engine.log_text if engine.log_text is not None else ""
                engine.log_removed = True
            engine.gone = True
            engine.end_watch()
            engine.exited(-1)

    _together([lambda command=command, group=group: sweep(command, group) for command, group in by_host.items()])


def signal_on_hosts(engines: Sequence[Any], signum: int) -> None:
    """Send `signum` to `engines` (SSH engine launchers of one world), in one ssh session per host
    for all its engines, the hosts at once, off the caller's thread: an SSH world's ranks run
    without ipyparallel's nanny, which would take a second of each rank's start only to relay the
    controller's signals. A host that does not answer is left to its watch."""

    def send(command: tuple[str, ...], group: list[Any]) -> None:
        pids = " ".join(str(int(engine.pid)) for engine in group)
        done = run_on_host(command, f"kill -{int(signum)} {pids}", SIGNAL_SECONDS)
        if done is None or done.returncode != 0:
            log.debug("signal %s to ranks %s on %s failed: %s", signum, pids, command[-1], done and done.stderr.strip())

    jobs = [
        lambda command=command, group=group: send(command, group)
        for command, group in _running_by_host(engines).items()
    ]
    threading.Thread(target=_together, args=(jobs,), name="ddp-ssh-signal", daemon=True).start()


class _HostWatch:
    """Notices which engines of one host ended, asking for all of them in one short ssh session
    every `WATCH_SECONDS`; ends once none is left to watch."""

    _all: ClassVar[dict[tuple[str, ...], _HostWatch]] = {}
    _lock = threading.Lock()

    def __init__(self, command: tuple[str, ...]) -> None:
        self.command = command
        self.engines: list[_QueuedSSHEngineLauncher] = []
        self.thread = threading.Thread(target=self._run, name=f"ddp-ssh-watch {command[-1]}", daemon=True)

    @classmethod
    def add(cls, engine: _QueuedSSHEngineLauncher) -> None:
        command = engine.host_command()
        with cls._lock:
            watch = cls._all.get(command)
            if watch is None:
                watch = cls._all[command] = cls(command)
                watch.thread.start()
            watch.engines.append(engine)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            with self._lock:
                self.engines = [engine for engine in self.engines if engine.watched]
                if not self.engines:
                    del self._all[self.command]
                    return
                watched = list(self.engines)
            running = running_pids(self.command, [engine.pid for engine in watched])
            if running is None:
                continue  # the host did not answer: a lost host's ranks are the world's to name
            for engine in watched:
                if engine.pid not in running:
                    with self._lock:
                        if engine in self.engines:
                            self.engines.remove(engine)
                    engine.ended()


# per event loop (a semaphore belongs to the loop it is used on), per host: the engines stopping there
_stopping: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def _stop_slots(host: str) -> asyncio.Semaphore:
    """What bounds the engines of `host` stopping at once, whichever engine sets they belong to."""
    per_host = _stopping.setdefault(asyncio.get_running_loop(), {})
    return per_host.setdefault(host, asyncio.Semaphore(STOPS_PER_HOST))


class _QueuedSSHEngineLauncher(WatchedExit, SSHEngineLauncher):
    """ipyparallel's SSH engine launcher whose start is queued by its engine set, which runs the
    queue host by host at once; whose exit is noticed by its host's watch; and whose stop signals
    and whose log is read off the engine set's event loop, so that the engines of a set stop at
    once too."""

    def start(self, hostname: Any = None, user: Any = None, port: Any = None) -> None:
        self.loop  # noqa: B018  (bound to the engine set's loop, not the thread that starts it)
        queue = self.parent.queued_starts
        if SLOT_ENV not in self.environment:
            # ranks follow the hosts list whichever host registers first: the n-th engine is rank n
            self.environment = {**self.environment, SLOT_ENV: str(queue.count)}
        queue.add(f"{user or ''}@{hostname}:{port or ''}", lambda: self._start_on_host(hostname, user, port))

    def _start_on_host(self, hostname: Any, user: Any, port: Any) -> None:
        """Start the engine in one ssh session, its folder made and its environment set by a POSIX
        shell script on the session's stdin (never on a command line, where `ps` shows it).

        ipyparallel's own start runs Python on the host three times (is there a Python, make the
        profile folder, start the engine through a Python helper), each a second on a loaded host:
        2.5 s of a 2-host world's 7 s start. A host whose shell is Windows' gets ipyparallel's start."""
        if hostname is not None:
            self.hostname = hostname
        if user is not None:
            self.user = user
        if port is not None and "-p" not in self.ssh_args:
            self.ssh_args = [*self.ssh_args, "-p", str(port)]
            self.scp_args = [*self.scp_args, "-P", str(port)]
        _system, shell = self.ssh_sender.get_shell_info()
        if shell in ("cmd.exe", "powershell.exe"):
            super().start(hostname=hostname, user=user, port=port)
            return
        self.send_files()
        try:
            done = subprocess.run(
                [*self.host_command(), "sh", "-s"],
                input=start_script(
                    self.remote_profile_dir, self.get_env(), self.program + self.program_args, self.remote_output_file
                ),
                capture_output=True,
                text=True,
                timeout=SIGNAL_SECONDS,
                check=False,
            )
        except (subprocess.TimeoutExpired, OSError) as failure:
            raise RuntimeError(f"could not start a rank on {self.location}: {failure}") from None
        pid = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        if done.returncode != 0 or not pid.isdigit():
            said = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(
                f"could not start a rank on {self.location}: {said[-1] if said else f'exit {done.returncode}'}"
            )
        self.started(int(pid))
        self.fetch_files()

    # the world asked its ranks to exit through the controller before any launcher stops: an engine
    # still there is stopped or hung (ipyparallel waits 5 s after SIGTERM, one engine after another)
    stop_seconds_until_kill = Integer(2, config=True, help="seconds from SIGTERM to SIGKILL at stop")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reading = threading.RLock()  # the host's watch and a join's thread may both read the log
        self.log_text: str | None = None
        self.log_removed = False
        # its host's watch found the engine gone: told to ipyparallel on its loop, which a script's
        # world does not run, so its state may still say running; nothing is sent to it any more
        self.gone = False

    def signal(self, sig: int) -> None:
        # ipyparallel's remote kill lets the traceback of a process already gone there through to
        # this process's stderr, which a notebook kernel shows under the user's cell: the same kill
        # over the same connection, what it says kept for the log; an ssh that fails still raises
        if self.state != "running" or self.gone:
            return
        kill = f"kill -{int(sig)} {int(self.pid)}"
        done = run_on_host(self.host_command(), kill, SIGNAL_SECONDS)
        if done is None or done.returncode == SSH_FAILED:
            said = ("", "ssh did not end, or could not start") if done is None else (done.stdout, done.stderr)
            raise subprocess.CalledProcessError(SSH_FAILED, [*self.host_command(), kill], *said)
        if done.returncode:
            log.debug("signal %s to rank %s on %s: %s", sig, self.pid, self.location, done.stderr.strip())

    def watch_exit(self) -> None:
        _HostWatch.add(self)

    def host_command(self) -> tuple[str, ...]:
        """ssh to this engine's host, up to the remote command; over the world's shared connection but
        never a master of its own (after the world's stop ended the masters, one would outlive it)."""
        return (*self.ssh_cmd, "-o", "ControlMaster=no", *self.ssh_args, self.location)

    def ended(self) -> None:
        """Its host's watch found the engine gone: its log is read, then ipyparallel is told."""
        self.gone = True
        self._read_log()
        self.exited(-1)  # not the host's child: its exit status is not known there (ipyparallel's -1 too)

    def wait_one(self, timeout: float | None) -> int:
        """Until the engine has ended (-1: its status is not known off its host) or `timeout` passed
        (TimeoutError). ipyparallel starts Python on the host to wait there, over an ssh session that
        would open a shared connection of its own once the world's had ended."""
        deadline = time.monotonic() + (JOIN_SECONDS if timeout is None else timeout)
        while True:
            running = running_pids(self.host_command(), [self.pid])
            if running is None:
                raise RuntimeError(f"{self.location} did not say whether rank process {self.pid} still runs")
            if self.pid not in running:
                self._read_log()
                return -1
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("still running")
            time.sleep(min(0.5, left))

    def _read_log(self) -> None:
        # read (and removed from its host) as soon as the engine ends, off the engine set's loop;
        # ipyparallel reads it there, engine after engine, and keeps what it read. Whether that
        # worked changes nothing about how the engine ended
        try:
            self.get_output(remove=True)
        except Exception:
            log.debug("reading the log of rank %s on %s failed", self.pid, self.location, exc_info=True)

    def get_output(self, remove: bool = False) -> str:
        """The engine's log on its host, read in one ssh session (and removed there with `remove`).
        ipyparallel's takes three, each starting Python on the host, and says a failure at ERROR
        level on the kernel's stderr, under the user's cell. A host that does not answer leaves it
        unread (""), and is not asked again."""
        with self.reading:
            if self.log_text is not None and (self.log_removed or not remove):
                return self.log_text
            path = shlex.quote(self.remote_output_file)
            if self.log_text is not None:
                command = f"rm -f {path}"
            else:
                command = f"cat {path}" + (f" && rm -f {path}" if remove else "")
            done = run_on_host(self.host_command(), command, LOG_SECONDS)
            if done is None or done.returncode != 0:
                log.debug("the log of rank %s on %s: %s", self.pid, self.location, done and done.stderr.strip())
                self.log_text = self.log_text if self.log_text is not None else ""
                self.log_removed = True
                return self.log_text
            if self.log_text is None:
                self.log_text = done.stdout
            self.log_removed = self.log_removed or remove
            return self.log_text

    async def stop(self) -> None:
        # ipyparallel signals over ssh on the engine set's loop (0.6 s an engine, one after another)
        # and gives up at the first ssh that fails; here the engines of a host stop a few at a time
        # (sshd's MaxSessions), and an engine its host's watch found gone is not asked again (a
        # world that replaced many ranks would stop each of them over ssh, all at once)
        if not self.gone:
            async with _stop_slots(self.location):
                await self._end_on_host()
        self.end_watch()  # stopped or not (its host may be gone), nobody waits for it now

    async def _end_on_host(self) -> None:
        # the world asked its ranks to exit before: one `ps` says whether this one did (ipyparallel
        # signals it and starts Python on its host to wait for it)
        if await asyncio.to_thread(self.still_running) is False:
            self.gone = True
            return
        # SIGKILL follows whatever SIGTERM's wait met
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

    def still_running(self) -> bool | None:
        """Whether the engine's process still runs on its host (None: the host did not say)."""
        running = running_pids(self.host_command(), [self.pid])
        return None if running is None else self.pid in running


class ConcurrentSSHEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set, starting (and, through its engines, stopping) its hosts at once."""

    launcher_class = _QueuedSSHEngineLauncher

    def start(self, n: int) -> list[str]:
        self.queued_starts = _HostStarts()
        started = super().start(n)  # builds each engine's launcher, which queues its start
        self.queued_starts.run()
        return started  # type: ignore[no-any-return]
