"""A warm template process that local ranks are forked from.

Most of a rank's start is the same work done once per rank: starting Python and importing
torch. The template does it once; each rank is then a fork of it (milliseconds), with its
own environment, session and log file, running the same engine entry point a fresh process
runs. Importing torch does not initialise CUDA, and the template never touches a GPU or
starts a thread of its own, so a fork of it is as clean as a fresh process. The template
reaps its children and reports how each one ended; it exits when its kernel dies, taking
its children with it.

The template process itself is `template_process.py`; this is the notebook side
(`TemplateClient`), which talks to it over a Unix socket in a directory only this
user can read, in JSON lines (nothing is unpickled).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger("ddp_notebook")

REPLY_SECONDS = 10.0
# Python reads these when it starts: a fork cannot honour them, so such worlds start fresh processes
_STARTUP_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")


def can_fork_ranks(rank_env: Mapping[str, str]) -> str | None:
    """Why ranks with extra environment `rank_env` cannot be forked from a template here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "forking a process that imported torch is only safe on Linux"
    startup = sorted(name for name in rank_env if reads_at_startup(name))
    if startup:
        return f"{', '.join(startup)} must be read by a fresh interpreter"
    return None


def reads_at_startup(name: str) -> bool:
    """Whether the environment variable `name` is read when a process starts (so a fork cannot change it)."""
    return name in _STARTUP_VARIABLES or name.startswith("LD_")


def start_signature() -> tuple[str, tuple[tuple[str, str], ...]]:
    """What a template depends on from the moment it starts: the interpreter and its start-up variables."""
    startup = {name: value for name, value in os.environ.items() if reads_at_startup(name)}
    return sys.executable, tuple(sorted(startup.items()))


def start_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """The environment a template started now gets: this process's, with `environment` on top."""
    env = {**os.environ, **environment, "PYTHONUNBUFFERED": "1"}
    # the template's own BLAS pool stays at one thread; each rank sets its threads when it joins
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class TemplateClient:
    """Starts a template process and asks it for ranks; hears how each one ended."""

    def __init__(self, python: str, environment: Mapping[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="ddp-template-")  # 0700: only this user connects
        self.socket_path = os.path.join(self.directory, "template.sock")
        self.log_path = os.path.join(self.directory, "template.log")
        self.python = python
        self.environment = dict(environment)
        self.process: subprocess.Popen[bytes] | None = None
        self._connection: socket.socket | None = None
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._request_lock = threading.Lock()  # one request and its reply at a time
        self._exit_lock = threading.Condition()  # the exit record and its callbacks; notified on each exit
        self.exits: dict[int, int] = {}
        self.forked: set[int] = set()  # every process it forked for us: it reports how each one ends
        self._on_exit: dict[int, Callable[[int], None]] = {}

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        """Started and not ended (it may still be importing)."""
        return self.process is not None and self.process.poll() is None

    @property
    def alive(self) -> bool:
        """Running and connected: ready to fork."""
        return self.running and self._connection is not None

    def start(self) -> None:
        """Start the template (its imports then run while other things start)."""
        env = start_environment(self.environment)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [self.python, "-m", "ddp_notebook.rank.template_process", self.socket_path],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        """Connect once the template listens; RuntimeError if it exited, TimeoutError past the deadline."""
        assert self.process is not None
        if self._connection is not None:
            return  # connected already (a template handed over from an earlier world)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the rank template exited with code {self.process.returncode}: {self._log_tail()}")
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(self.socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if time.monotonic() > deadline:
                    raise TimeoutError("the rank template did not start in time") from None
                time.sleep(0.01)
        self._connection = connection
        threading.Thread(target=self._listen, args=(connection,), name="ddp-template", daemon=True).start()

    def try_connect(self) -> bool:
        """Connect if the template is listening already (its imports done); never waits."""
        try:
            self.wait_ready(deadline=0.0)
        except (TimeoutError, RuntimeError):
            return False
        return True

    def fork(self, argv: Sequence[str], env: Mapping[str, str], output: str, cwd: str, role: str = "engine") -> int:
        """A new process forked from the template, running entry point `role` (engine, controller); its PID."""
        request = {"op": "fork", "role": role, "argv": list(argv), "env": dict(env), "output": output, "cwd": cwd}
        with self._request_lock:
            if self._connection is None:
                raise RuntimeError("the rank template is not running")
            self._connection.sendall(json.dumps(request).encode() + b"\n")
            try:
                reply = self._replies.get(timeout=REPLY_SECONDS)
            except queue.Empty:
                raise RuntimeError(f"the rank template did not answer within {REPLY_SECONDS:g} s") from None
        if reply.get("reply") != "fork":
            raise RuntimeError(f"the rank template refused: {reply.get('error')}")
        pid = int(reply["pid"])
        self.forked.add(pid)
        return pid

    def exit_code(self, pid: int, wait: float = 0.0) -> int | None:
        """How `pid` ended, waiting up to `wait` seconds for the template's report; None if not reported."""
        with self._exit_lock:
            self._exit_lock.wait_for(lambda: pid in self.exits, timeout=wait)
            return self.exits.get(pid)

    def on_exit(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call `callback(exit code)` (on a helper thread) once `pid` has ended."""
        with self._exit_lock:
            code = self.exits.get(pid)
            if code is None:
                self._on_exit[pid] = callback
        if code is not None:
            callback(code)

    def _listen(self, connection: socket.socket) -> None:
        buffered = b""
        while True:
            try:
                data = connection.recv(65536)
            except OSError:
                data = b""
            if not data:
                return
            *lines, buffered = (buffered + data).split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "exited" in message:
                    pid, code = int(message["exited"]), int(message["code"])
                    with self._exit_lock:
                        self.exits[pid] = code
                        callback = self._on_exit.pop(pid, None)
                        self._exit_lock.notify_all()
                    if callback is not None:
                        callback(code)
                else:
                    self._replies.put(message)

    def stop(self) -> None:
        """End the template (and any rank still alive under it)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.sendall(b'{"op": "stop"}\n')
            except OSError:
                pass
            connection.close()
        elif self.process is not None and self.process.poll() is None:
            self.process.kill()  # still importing, so it has forked nothing: no need to wait for it
        if self.process is not None:
            try:
                self.process.wait(3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(3)
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf8", errors="replace") as handle:
                return " | ".join(handle.read().strip().splitlines()[-5:])
        except OSError:
            return ""
