"""One rank template kept for the whole session, the suite's spares forked from it.

A spare template imports torch when it starts: about 8 s of one core (`python -c "from
ddp_notebook.rank import template_process as t; t.preload()"`), on each of the hundreds of worlds
the suite starts in its own process, where a world started in a kernel pays it once. This process
(the source) imports it once; each spare is then a fork of it (milliseconds) that runs the
template's own `template_main` in a fresh session, with the environment a template started at
that moment would have, and is handed to `ddp_notebook.world.spare` as the spare the next world
takes (tests/support/spare_keeper.py). A fork is only made while the source is equivalent to a
template started now: the same interpreter and the same variables Python reads at start-up.

Run as `python -m tests.support.template_source SOCKET` (from the repository's root, as pytest
runs): it answers fork requests (JSON lines: the new template's socket, log and environment) on
a Unix socket only this user can reach, reaps its forks, starts no thread, and exits with the test
process that started it (whose PID its environment names, as a template watches its kernel).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ddp_notebook.platform.processes import OWNER_PID_ENV, owner_environment
from ddp_notebook.world import template  # the standard library only: nothing a template lacks
from tests.support.processes import pid_alive

READY_SECONDS = 90.0  # its imports, on a machine the tests keep busy
REPLY_SECONDS = 10.0
SHOWN_SECONDS = 5.0  # a fork's first steps, on a machine the tests keep busy
MODULE = "tests.support.template_source"


# ------------------------------------------------------------------ the source process


def serve(socket_path: str) -> None:
    """Import what a template imports, then fork a template for each request until the owner is gone."""
    from ddp_notebook.rank import template_process

    template_process.preload()
    gc.freeze()  # as a template does: the forks do not copy torch's objects page by page
    if threading.active_count() != 1:
        sys.exit(f"the source started threads while importing ({threading.enumerate()}): forking is not safe")
    owner, parent = int(os.environ.get(OWNER_PID_ENV, "0") or 0), os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(4)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    connections: dict[socket.socket, bytes] = {}
    while os.getppid() == parent and _alive(owner):
        for key, _ in selector.select(0.2):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                connections[connection] = b""
                selector.register(connection, selectors.EVENT_READ)
                continue
            connection = key.fileobj  # type: ignore[assignment]
            data = connection.recv(65536)
            if not data:
                selector.unregister(connection)
                connections.pop(connection, None)
                connection.close()
                continue
            *lines, connections[connection] = (connections[connection] + data).split(b"\n")
            for line in lines:
                pid, shown = _fork_template(json.loads(line), listener, list(connections))
                connection.sendall(json.dumps({"pid": pid, "environ_shown": shown}).encode() + b"\n")
        _reap()
    os._exit(0)  # its forks see their parent gone and end, with their ranks


def _alive(pid: int) -> bool:
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _fork_template(
    request: dict[str, Any], listener: socket.socket, connections: list[socket.socket]
) -> tuple[int, bool]:
    """The fork's PID, and whether its /proc/PID/environ is the request's environment."""
    shown, showing = os.pipe()  # the child says when its /proc/PID/environ is the request's
    pid = os.fork()
    if pid:
        os.close(showing)
        readable, _, _ = select.select([shown], [], [], SHOWN_SECONDS)
        said = os.read(shown, 1) if readable else b""  # b"" also where it ended first
        os.close(shown)
        return pid, said == b"1"
    try:  # the child: what `python -m ddp_notebook.rank.template_process SOCKET` would be, torch imported
        os.close(shown)
        os.setsid()  # as TemplateClient.start starts one: a session of its own
        listener.close()
        for connection in connections:
            connection.close()
        with open(os.devnull, "rb") as devnull:
            os.dup2(devnull.fileno(), 0)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.write(showing, b"1" if show_environment(request["env"]) else b"0")
        os.close(showing)
        from ddp_notebook.rank import template_process

        template_process.template_main(request["socket"])
    except BaseException:  # noqa: BLE001  (the child reports and exits; it must never return here)
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


_SHOWN_ENVIRONMENT: list[Any] = []  # the block /proc/self/environ points at: it lives as long as the process


_MEMORY_MAP_ADDRESSES = (
    "start_code end_code start_data end_data start_brk brk start_stack arg_start arg_end env_start env_end auxv"
)


class _MemoryMap(ctypes.Structure):  # struct prctl_mm_map, <linux/prctl.h>
    _fields_ = [
        *((name, ctypes.c_uint64) for name in _MEMORY_MAP_ADDRESSES.split()),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    ]


PR_SET_MM, PR_SET_MM_MAP = 35, 14
KEEP_EXE = 0xFFFFFFFF  # exe_fd -1: the executable's link stays as it is


def show_environment(env: dict[str, str]) -> bool:
    """Point this process's /proc/PID/environ at `env`, as a process started with it would show.

    A fork's /proc/PID/environ is its parent's start-up block, whatever os.environ holds since: the
    leak checks, which find a kernel's processes by the owner named there, would take a kernel's
    template and its ranks for the test process's. Linux lets a process move that block with
    prctl(PR_SET_MM_MAP), unprivileged (checkpoint/restore sets it so); where it cannot, the
    fork keeps its parent's (False).
    """
    block = b"".join(f"{name}={value}".encode() + b"\0" for name, value in env.items())
    buffer = ctypes.create_string_buffer(block, len(block))
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        field = lambda number: int(fields[number - 3])  # noqa: E731  (proc(5) numbers them from 1, the state is 3)
        layout = _MemoryMap(
            start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46),
            start_brk=field(47), brk=libc.sbrk(0), start_stack=field(28), arg_start=field(48),
            arg_end=field(49), env_start=ctypes.addressof(buffer), env_end=ctypes.addressof(buffer) + len(block),
            auxv=0, auxv_size=0, exe_fd=KEEP_EXE,
        )  # fmt: skip
        if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(layout), ctypes.sizeof(layout), 0) != 0:
            return False
    except (OSError, AttributeError, IndexError, ValueError):
        return False
    _SHOWN_ENVIRONMENT.append(buffer)
    return True


# ------------------------------------------------------------------ the test process's side


class ForkedProcess:
    """The part of subprocess.Popen a TemplateClient uses, for a template the source forked
    (not this process's child: the source reaps it, so its exit code is not known here)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not pid_alive(self.pid):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 3600)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"template {self.pid}", timeout or 0)
            time.sleep(0.02)
        return self.returncode or -1

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def fork_template(source_socket: str, environ_shown: bool = False) -> template.TemplateClient | None:
    """A template forked by the source listening at `source_socket`, for this process as one it
    started now (its environment, its PID as the owner); None if the source does not answer, or,
    with `environ_shown`, if the fork's /proc/PID/environ could not be made this environment (a
    kernel's processes would be taken for the test process's: the kernel starts its own)."""
    client = template.TemplateClient(sys.executable, owner_environment())
    env = template.start_environment(client.environment)
    request = {"socket": client.socket_path, "log": client.log_path, "env": env}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(REPLY_SECONDS)
            connection.connect(source_socket)
            connection.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(connection.makefile("rb").readline())
    except (OSError, ValueError):
        shutil.rmtree(client.directory, ignore_errors=True)
        return None
    client.process = ForkedProcess(int(reply["pid"]))  # type: ignore[assignment]
    if environ_shown and not reply.get("environ_shown"):
        client.stop()
        return None
    return client


class TemplateSource:
    """The source process, started on first use and kept for the session; `socket_path` where
    it listens once ready (None where it cannot serve: another start-up environment now)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.directory = ""
        self.path = ""
        self.signature = template.start_signature()
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def socket_path(self) -> str | None:
        with self._lock:
            if self.pid is None and not self._start():
                return None
            return self.path if template.start_signature() == self.signature else None

    def fork_template(self) -> template.TemplateClient | None:
        path = self.socket_path()
        return fork_template(path) if path is not None else None

    def _start(self) -> bool:
        self._end()
        if not (Path.cwd() / Path(*MODULE.split("."))).with_suffix(".py").is_file():
            return False  # `-m` needs the repository's root here, where pytest runs from
        self.directory = tempfile.mkdtemp(prefix="ddp-template-source-")
        self.path = os.path.join(self.directory, "source.sock")
        with open(os.path.join(self.directory, "source.log"), "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", MODULE, self.path],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=template.start_environment(owner_environment()),
                start_new_session=True,
            )
        self.signature = template.start_signature()
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline and self.process.poll() is None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(self.path)  # it listens once its imports are done
                    return True
                except (FileNotFoundError, ConnectionRefusedError):
                    pass
            time.sleep(0.05)
        self._end()
        return False

    def _end(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = self.path = ""

    def stop(self) -> None:
        with self._lock:
            self._end()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {MODULE} SOCKET")
    serve(sys.argv[1])
