"""A detached world's entry in its user's registry, and its status: the files the kernels and the
world's controller share.

A world started with `--detach` outlives the kernel that started it. Its entry, one JSON file
(mode 0600) per world in a folder only its user can open (0700, under `$XDG_STATE_HOME`, by
default `~/.local/state/ddp_notebook/worlds`), says where the world is and who its processes are:
a kernel writes it when the world forms and whenever it attaches; the controller reads it (the
processes to end, the kernel attached) and removes it when the world ends. The controller writes
the world's status (a cell running or not, idle since when) into the world's private folder.
Standard library only: both sides import this.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal, TypedDict

# a field added as optional keeps the version; a changed meaning needs the next one
ENTRY_VERSION = 1
# the controller and the ranks of a detached world carry their entry's path in this variable: the
# controller ends the world from it, and a process of the world can be told from any other by it
DETACHED_ENV = "DDP_NOTEBOOK_DETACHED"
# seconds the world may stay idle (no cell running, no kernel attached) before its controller ends it
IDLE_LIMIT_ENV = "DDP_NOTEBOOK_IDLE_LIMIT"
# on JupyterHub, the user's server the world belongs to, as "PID:start time": the world ends with it
SERVER_ENV = "DDP_NOTEBOOK_SERVER"
# the status file the controller keeps in the world's private folder
STATUS_FILE = "detached-status.json"


class Entry(TypedDict):
    """One detached world, as a kernel recorded it."""

    version: int
    id: str  # the ipyparallel cluster id
    connection_file: str  # the controller's client connection file (in the world's private folder)
    private_dir: str  # the world's private folder (0700): its profile, key, X-ray sockets
    size: int
    backend: str
    started: float  # time.time() when its group first formed
    notebook: str  # the notebook of the kernel that started it ("" when not known)
    idle_limit: float
    controller_pid: int
    rank_pids: list[int]
    # the template the ranks were forked from, which ends after the last of them (0: none; read
    # with .get: an entry written before it has none)
    template_pid: int
    # who each rank is and where it runs, as the last kernel that formed or healed the group saw it
    ranks: list[dict[str, Any]]
    placements: list[dict[str, Any]]
    routes: dict[str, list[Any]]  # rank -> [MASTER_ADDR, interface]
    config: dict[str, Any]  # the world's settings a kernel attaching again needs (timeouts, ...)
    attached_pid: int  # the kernel attached now (0: none); its start time tells a reused PID apart
    attached_started: str
    # where it runs and since when (read with .get: an entry written before them has neither)
    attached_notebook: str
    attached_at: float
    # the machine the world runs on (a home shared between machines shares the registry): its
    # name and boot id; an entry written before them (read with .get) is taken as this machine's
    host: str
    boot: str


class CellOwner(TypedDict):
    """The kernel whose cells a detached world's ranks run (`rank.cell_owner`)."""

    session: str  # its ipyparallel session (each message's header names the session that sent it)
    refusal: str  # what a cell of any other session is told instead of running


class OwnerRequest(TypedDict):
    """A kernel attached to a detached world: from now on, the rank runs the cells of its session only."""

    v: int
    ask: Literal["owner"]
    session: str
    refusal: str


class OwnerAnswer(TypedDict):
    v: int
    owner: str  # the session whose cells the rank runs now


def owner_request(session: str, refusal: str) -> OwnerRequest:
    from .xray_messages import XRAY_VERSION

    return {"v": XRAY_VERSION, "ask": "owner", "session": session, "refusal": refusal}


class Status(TypedDict):
    """What the world's controller last saw (written every few seconds)."""

    busy: bool  # a cell (or any request) running or queued on a rank
    attached: bool  # a kernel is attached
    idle_since: float  # time.time() since when neither is true (now while one is)
    checked: float


def registry_dir() -> Path:
    """The user's folder of detached worlds (made 0700 when missing)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    folder = Path(base) / "ddp_notebook" / "worlds"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)  # an older folder, or one made under a wide umask, is made private
    return folder


def entry_path(world_id: str) -> Path:
    return registry_dir() / f"{world_id}.json"


def write_private(path: Path, data: object) -> None:
    """Write `data` as JSON to `path`, readable by this user only, all at once (a reader never sees half)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_json(path: Path | str) -> Any:
    """The JSON in `path`, or None when it is missing or unreadable (being replaced, or removed)."""
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def read_entry(path: Path | str) -> Entry | None:
    found = read_json(path)
    if not isinstance(found, dict) or found.get("version") != ENTRY_VERSION or "id" not in found:
        return None
    return found  # type: ignore[return-value]


def read_status(private_dir: str) -> Status | None:
    found = read_json(os.path.join(private_dir, STATUS_FILE))
    return found if isinstance(found, dict) and "idle_since" in found else None  # type: ignore[return-value]
