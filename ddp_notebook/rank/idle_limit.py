"""A detached world ends itself when nobody uses it (or on JupyterHub, when the user's server stops):
a thread of its controller's process.

Every few seconds the controller asks its own hub, as an ipyparallel client, whether a request
(a cell) is queued or running on any rank, and reads the world's entry for the kernel attached
(alive, and the same process as recorded). It writes what it saw into the world's private folder
(`%ddp_worlds` shows it). Once neither has been true for the idle limit, it ends the world as a
stop would: the ranks leave their group and exit (killed when they do not), the world's entry,
its cluster files and its private folder are removed, and the controller exits. A cell that runs
for days keeps the world; so does a kernel attached and idle.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_notebook.platform.processes import OWNER_FOLDERS_ENV, descendants, pid_alive, started_at, wait_gone
from ddp_notebook.wire import detached as wire

CHECK_SECONDS = 2.0
# before a kernel first recorded the world (its ranks still starting), the limit is at least this:
# a kernel killed while its world starts leaves a world nobody can attach to, ended after this long
START_GRACE_SECONDS = 300.0
# how long the ranks get to leave their group and exit before they are killed
LEAVE_SECONDS = 5.0


def watch_idle(exit_process: Callable[[int], None]) -> None:
    """In a detached world's controller: end the world once idle past its limit (polls, never blocks),
    then this process with `exit_process(0)` (which ends the controller's helpers and its files)."""
    entry_file = os.environ.get(wire.DETACHED_ENV)
    if not entry_file:
        return
    limit = float(os.environ.get(wire.IDLE_LIMIT_ENV) or 3600)
    folders = [folder for folder in os.environ.get(OWNER_FOLDERS_ENV, "").split(os.pathsep) if folder]
    watch = IdleWatch(Path(entry_file), limit, folders[0] if folders else None)
    server, _, server_started = os.environ.get(wire.SERVER_ENV, "").partition(":")
    if server.isdigit():
        watch.server = (int(server), server_started)

    def run() -> None:
        watch.run()
        exit_process(0)

    threading.Thread(target=run, name="ddp-idle-limit", daemon=True).start()


class IdleWatch:
    def __init__(self, entry_file: Path, limit: float, private_dir: str | None) -> None:
        self.entry_file = entry_file
        self.limit = limit
        self.private_dir = private_dir
        self.idle_since = time.time()
        self.recorded = False  # a kernel recorded the world (its group formed)
        self.client: Any = None
        self.server: tuple[int, str] | None = None  # on JupyterHub: the user's server (PID, start time)

    def run(self) -> None:
        period = max(0.2, min(CHECK_SECONDS, self.limit / 4))
        while True:
            time.sleep(period)
            entry = wire.read_entry(self.entry_file)
            if self.server is not None and not (
                pid_alive(self.server[0]) and started_at(self.server[0]) == self.server[1]
            ):
                self.end(entry)  # the user's server stopped: its world goes with it
                return
            self.recorded = self.recorded or entry is not None
            busy, attached = self.busy(), entry is not None and kernel_attached(entry)
            now = time.time()
            if busy or attached:
                self.idle_since = now
            self.write_status(busy, attached, now)
            limit = self.limit if self.recorded else max(self.limit, START_GRACE_SECONDS)
            if now - self.idle_since >= limit:
                self.end(entry)
                return

    def busy(self) -> bool:
        """Whether a request is queued or running on a rank (True while the hub cannot be asked yet)."""
        try:
            if self.client is None:
                self.client = _connect()
            if self.client is None:
                return not self.recorded
            status = self.client.queue_status()
        except Exception:  # noqa: BLE001  (a hub that does not answer: the world is ending anyway)
            return False
        pending = [value for key, value in status.items() if isinstance(value, dict)]
        return bool(status.get("unassigned")) or any(value["queue"] or value["tasks"] for value in pending)

    def write_status(self, busy: bool, attached: bool, now: float) -> None:
        if self.private_dir is None or not os.path.isdir(self.private_dir):
            return
        status: wire.Status = {"busy": busy, "attached": attached, "idle_since": self.idle_since, "checked": now}
        try:
            wire.write_private(Path(self.private_dir) / wire.STATUS_FILE, status)
        except OSError:
            pass  # the folder went with the world

    def end(self, entry: wire.Entry | None) -> None:
        """End the ranks (asked to leave their group and exit, killed when they do not) and the entry."""
        ranks = entry["rank_pids"] if entry is not None else []
        family = ranks + descendants(ranks)  # their DataLoader workers
        # and the template they were forked from, which ends by itself after the last of them
        family += [template] if entry is not None and (template := entry.get("template_pid")) else []
        if self.client is not None:
            try:
                from ddp_notebook.rank import calls

                self.client[:].apply_async(calls.shutdown_world).get(timeout=LEAVE_SECONDS)
                self.client.shutdown(targets="all", block=False)
            except Exception:  # noqa: BLE001  (they are killed below)
                pass
        for pid in wait_gone(family, LEAVE_SECONDS):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        self.entry_file.unlink(missing_ok=True)


def kernel_attached(entry: wire.Entry) -> bool:
    pid = entry.get("attached_pid") or 0
    return bool(pid) and pid_alive(pid) and started_at(pid) == entry.get("attached_started", "")


def _connect() -> Any:
    """A client of this controller's hub, once its connection file is written (None before)."""
    cluster_id, profile_dir = os.environ.get("IPP_CLUSTER_ID"), os.environ.get("IPP_PROFILE_DIR")
    if cluster_id is None or not profile_dir:
        return None
    path = os.path.join(profile_dir, "security", f"ipcontroller-{cluster_id}-client.json")
    if wire.read_json(path) is None:
        return None
    import ipyparallel as ipp

    return ipp.Client(path, timeout=10)
