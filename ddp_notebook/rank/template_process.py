"""What runs in the warm template process local ranks are forked from (see `world/template.py`).

It imports what a rank needs once, then serves fork requests on a private Unix socket (JSON
lines), reaps its children and reports how each one ended, and exits when its kernel dies,
taking its children with it. A detached world's template outlives the kernel as its world does: it
lasts while its children do (the world's controller ends them once idle), and ends after the last.
It starts no thread of its own, so its forks are clean.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_notebook.platform.processes import OWNER_FOLDERS_ENV, OWNER_PID_ENV, SLOT_ENV, pid_alive
from ddp_notebook.wire.detached import DETACHED_ENV

OWNER_POLL_SECONDS = 0.2


def preload() -> None:
    """Import what every rank needs, once (a process forked after this imports nothing again)."""
    import torch._dynamo  # before any process group: see rank.release_group
    import torch.distributed  # noqa: F401
    from ipyparallel.controller import app as controller_app  # noqa: F401
    from ipyparallel.engine import app  # noqa: F401

    # a rank's kernel imports its debugger while it registers: debugpy's import runs `uname -p`
    # in a subprocess (platform.processor()), 0.3 s in a process this size; done here, the
    # answer is cached for every fork (the file check it warns about is for debugging sessions)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    import ipykernel.debugger  # noqa: F401

    import ddp_notebook.rank.membership  # noqa: F401
    from ddp_notebook.rank import reloading

    reloading.note_template_modules()  # each rank's first look for the user's modules starts from here


def template_main(socket_path: str) -> None:
    """Serve fork requests on `socket_path` until told to stop or the owning kernel dies."""
    preload()
    # what was imported stays for good: kept out of the collector, a fork's first collections
    # do not walk (and so copy, page by page) torch's hundreds of thousands of objects
    gc.freeze()
    if threading.active_count() != 1:
        sys.exit(f"the template started threads while importing ({threading.enumerate()}): forking is not safe")
    owner = int(os.environ.get(OWNER_PID_ENV, "0") or 0)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(8)
    _Template(listener, owner, parent, detached=bool(os.environ.get(DETACHED_ENV))).serve()


class _Template:
    def __init__(self, listener: socket.socket, owner: int, parent: int, detached: bool = False) -> None:
        self.listener = listener
        self.owner, self.parent = owner, parent
        self.detached = detached
        self.forked_any = False
        self.connections: dict[socket.socket, bytes] = {}
        self.children: set[int] = set()
        self.exits: dict[int, int] = {}
        # the folders each controller forked here removes when its kernel goes (its world's private
        # folder): killed with the rest below, it never does, so this process does it for it
        self.owned_folders: dict[int, list[str]] = {}

    def serve(self) -> None:
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        try:
            while self._owner_alive():
                for key, _ in selector.select(OWNER_POLL_SECONDS):
                    if key.fileobj is self.listener:
                        connection, _ = self.listener.accept()
                        self.connections[connection] = b""
                        selector.register(connection, selectors.EVENT_READ)
                    elif not self._read(key.fileobj):  # type: ignore[arg-type]
                        selector.unregister(key.fileobj)
                        self.connections.pop(key.fileobj, None)  # type: ignore[call-overload]
                        key.fileobj.close()  # type: ignore[union-attr]
                self._reap()
        except _Stop:
            pass
        else:  # the kernel is gone, and nobody else removes the template's folder (its socket, its log)
            shutil.rmtree(os.path.dirname(self.listener.getsockname()), ignore_errors=True)
            for pid in self.children:
                _kill_group(pid)
            for folder in (folder for pid in self.children for folder in self.owned_folders.get(pid, ())):
                shutil.rmtree(folder, ignore_errors=True)  # the world's, as its controller would have
            os._exit(0)
        for pid in self.children:
            _kill_group(pid)
        os._exit(0)

    def _owner_alive(self) -> bool:
        if self.detached:
            # a detached world's: while its world has a process here; before the first, while the
            # kernel that started it lives (one killed as the world starts leaves nothing to serve)
            return bool(self.children) if self.forked_any else os.getppid() == self.parent
        if os.getppid() != self.parent:
            return False  # re-parented: whoever started us is gone
        # a killed kernel stays a zombie until its own parent reaps it: a template that is not the
        # kernel's child (one the test suite forks from a source of its own) must not take that for
        # a live kernel, as a rank started by a launcher does not
        return not self.owner or pid_alive(self.owner)

    def _read(self, connection: socket.socket) -> bool:
        data = connection.recv(65536)
        if not data:
            return False
        buffered = self.connections[connection] + data
        *lines, rest = buffered.split(b"\n")
        self.connections[connection] = rest
        for line in lines:
            self._tell(connection, self._answer(json.loads(line)))
        return True

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "fork":
            role = request.get("role", "engine")
            if role not in ("engine", "controller"):
                return {"reply": "error", "error": f"unknown role {role!r}"}
            pid = self._fork(role, request["argv"], request["env"], request["output"], request["cwd"])
            self.children.add(pid)
            self.forked_any = True
            if role == "controller":
                folders = request["env"].get(OWNER_FOLDERS_ENV, "")
                self.owned_folders[pid] = [folder for folder in folders.split(os.pathsep) if folder]
            return {"reply": "fork", "pid": pid}
        if op == "stop":
            raise _Stop
        return {"reply": "error", "error": f"unknown request {op!r}"}

    def _tell(self, connection: socket.socket, message: dict[str, Any]) -> None:
        try:
            connection.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # that client is gone

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.owned_folders.pop(pid, None)
            code = self.exits[pid] = os.waitstatus_to_exitcode(status)
            # what it started (DataLoader workers, subprocesses) goes with it, now: left alone, torch's
            # workers notice a dead parent only at their watchdog's next look, 5 s later
            _kill_group(pid)
            for connection in list(self.connections):
                self._tell(connection, {"exited": pid, "code": code})

    def _fork(self, role: str, argv: Sequence[str], env: Mapping[str, str], output: str, cwd: str) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.setsid()  # a session of its own, as a freshly started rank has: signals reach it alone
            self.listener.close()
            for connection in self.connections:
                connection.close()
            with open(os.devnull, "rb") as devnull:
                os.dup2(devnull.fileno(), 0)
            log_fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            _name_process("ddp-controller" if role == "controller" else f"ddp-rank{env.get(SLOT_ENV, '')}")
            _fresh_random_state()
            sys.argv = ["ddp_notebook.rank.entrypoints", *argv]
            from ddp_notebook.rank.entrypoints import controller_main, engine_main

            controller_main() if role == "controller" else engine_main()
            code = 0
        except SystemExit as ended:
            code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
        except BaseException:  # noqa: BLE001  (the child reports and exits; it must never return)
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


class _Stop(Exception):
    pass


def _kill_group(pid: int) -> None:
    """SIGKILL a child and every process of its group: each child leads a session of its own
    (`_fork`), and what it starts stays in its group unless it moves out by itself."""
    for kill in (os.killpg, os.kill):  # the group; the child alone if its group is gone
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def _name_process(name: str) -> None:
    """Name the process as `ps -o comm`, `top` and psutil's name() show it: a fork keeps the
    template's command line, and this is what tells a rank from the controller."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # a name is a convenience; the process works without it


def _fresh_random_state() -> None:
    # Python's random reseeds itself in a forked child; numpy's global state does not, and a
    # fresh process would have drawn its own from the OS
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ddp_notebook.rank.template_process SOCKET")
    template_main(sys.argv[1])
