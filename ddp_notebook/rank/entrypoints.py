"""Start-up of the processes a world is made of (rank engines, the controller).

Both run ipyparallel's own entry points, with two additions:
- an owner watch: if the kernel that started the world dies (even by SIGKILL, when no
  clean-up can run there), these processes notice within a second or two and exit, so a
  dead kernel never leaves engines holding GPUs (a detached world's processes outlive the
  kernel instead: its controller ends the world once idle past its limit, `idle_limit`);
- on ranks, torch is imported in a background thread while the engine registers with the
  controller, so the two waits overlap instead of adding up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time

from ddp_notebook.platform.cluster_files import remove_cluster_files
from ddp_notebook.platform.processes import (
    OWNER_FOLDERS_ENV,
    OWNER_HOST_ENV,
    OWNER_PID_ENV,
    PRELOAD_ENV,
    descendants,
    pid_alive,
)

OWNER_POLL_SECONDS = 1.0
CONTROLLER_ENV = "DDP_NOTEBOOK_IS_CONTROLLER"


def _owner_alive(owner_pid: int, parent_pid: int) -> bool:
    # re-parenting means the process that launched us is gone, even if its PID was reused
    if os.getppid() != parent_pid:
        return False
    # a killed kernel stays a zombie until its own parent reaps it: a rank started by a launcher
    # (mpiexec's child, not the kernel's) must not take that for a live kernel
    return pid_alive(owner_pid)


def watch_owner() -> None:
    """Exit this process once the owning kernel is gone (polls, never blocks start-up)."""
    text = os.environ.get(OWNER_PID_ENV, "")
    if not text.isdigit():
        return
    owner_host = os.environ.get(OWNER_HOST_ENV)
    if owner_host is not None and owner_host != socket.gethostname():
        # on another host the kernel's PID means nothing: such ranks exit when the
        # controller's heartbeats stop (ipyparallel's own engine-side check)
        return
    owner_pid, parent_pid = int(text), os.getppid()

    def watch() -> None:
        while _owner_alive(owner_pid, parent_pid):
            time.sleep(OWNER_POLL_SECONDS)
        # no clean shutdown is possible: the peers and the controller are going away too
        end_here(code=3)

    threading.Thread(target=watch, name="ddp-owner-watch", daemon=True).start()


def end_here(code: int) -> None:
    """Exit now, with the processes this one started, and (the controller) the world's files.

    The launcher made this process the leader of its own process group; the group holds the
    helpers it forked (the controller's schedulers), which must go too."""
    _kill_children()
    _remove_cluster_files()
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(code)


def _kill_children() -> None:
    """SIGKILL the processes this one started: an engine's nanny runs in a session of its own,
    out of reach of the process-group kill, and would wait for a controller that is gone."""
    for child in descendants([os.getpid()]):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:  # gone meanwhile; best effort: this process is about to exit anyway
            continue


def _remove_cluster_files() -> None:
    """Delete this cluster's files (its connection files hold its key) and the world's private
    folders, as a clean stop would."""
    if not os.environ.get(CONTROLLER_ENV):
        return
    cluster_id, profile_dir = os.environ.get("IPP_CLUSTER_ID"), os.environ.get("IPP_PROFILE_DIR")
    if cluster_id and profile_dir:
        remove_cluster_files(profile_dir, cluster_id)
    for folder in filter(None, os.environ.get(OWNER_FOLDERS_ENV, "").split(os.pathsep)):
        shutil.rmtree(folder, ignore_errors=True)


def _preload() -> None:
    try:
        import torch._dynamo  # noqa: F401  (must come before the process group: see rank.release_group)

        import ddp_notebook.rank.membership  # noqa: F401  (imports torch and torch.distributed)
    except Exception:  # noqa: BLE001
        # the same import runs again when the world is set up, and reports the error there
        pass


def _wait_for_connection_file(limit: float = 120.0) -> None:
    """Wait until the controller's engine connection file is complete.

    The controller writes it in place; ipyparallel's engine reads it as soon as it exists
    and dies on a half-written file (seen on a loaded machine). Only a parseable file counts.
    """
    if os.environ.get("IPP_CONNECTION_INFO"):
        return  # the connection info came in the environment
    cluster_id, profile_dir = os.environ.get("IPP_CLUSTER_ID"), os.environ.get("IPP_PROFILE_DIR")
    if cluster_id is None or not profile_dir:
        return
    name = f"ipcontroller-{cluster_id}-engine.json" if cluster_id else "ipcontroller-engine.json"
    path = os.path.join(profile_dir, "security", name)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as handle:
                json.load(handle)
            return
        except (OSError, ValueError):
            time.sleep(0.02)


def engine_main() -> None:
    watch_owner()
    if "--mpi" in sys.argv and importlib.util.find_spec("mpi4py") is None:
        # ipyparallel's MPI launcher asks engines to take their id from mpi4py; ranks are
        # numbered from the launcher's environment instead, so mpi4py is optional
        sys.argv.remove("--mpi")
    if os.environ.get(PRELOAD_ENV, "1") != "0":
        threading.Thread(target=_preload, name="ddp-preload", daemon=True).start()
    _wait_for_connection_file()
    from ipyparallel.engine.app import main

    from ..wire.results import ERROR_RAISED_KEY
    from .ipp_process_adapter import publish_no_execute_input, stamp_errors_when_raised

    publish_no_execute_input()
    stamp_errors_when_raised(ERROR_RAISED_KEY)
    main()


def controller_main() -> None:
    os.environ[CONTROLLER_ENV] = "1"  # only the controller removes connection files
    watch_owner()
    from .idle_limit import watch_idle

    watch_idle(end_here)  # a detached world's only: it has no owner to watch
    from ipyparallel.controller.app import main

    from .ipp_process_adapter import skip_hub_settle_sleep

    skip_hub_settle_sleep()
    main()


if __name__ == "__main__":
    role = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    if role == "engine":
        engine_main()
    elif role == "controller":
        controller_main()

    else:
        sys.exit("usage: python -m ddp_notebook.rank.entrypoints engine|controller [ipyparallel args]")
