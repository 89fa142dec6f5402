"""The user's detached worlds, seen from a kernel: recording one, finding the one to attach again,
listing them (`%ddp_worlds`).

An entry (`wire.detached.Entry`) is written when a detached world's group forms and again whenever
it changes (a heal, a comeback, a resize) or a kernel attaches to it; it is removed when the world
ends. An entry whose controller is gone (the machine rebooted, the processes killed) is stale: it is
removed, with the world's private folder, the first time a kernel looks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import DDPUsageError
from ..live.notebook_session import notebook_path
from ..platform.processes import pid_alive, started_at, this_machine
from ..wire import detached as wire
from ..wire.results import RankInfo
from . import layout as world_layout
from .config import AttachTarget, WorldConfig
from .users_server import find_users_server, on_jupyterhub

if TYPE_CHECKING:
    from .running import RunningWorld

# the settings of a detached world that a kernel attaching again takes over (WorldConfig's fields,
# as its entry records them), and the build keyword of each field spelled otherwise
KEPT_SETTINGS = ("timeout", "cell_timeout", "start_timeout", "max_restarts", "check_collectives", "autoreload")
BUILD_KEYWORDS = {"timeout": "collective_timeout"}


def world_id_of(world: RunningWorld) -> str:
    target = world.provisioner.config.launch.attach
    if target is not None and target.world:
        return target.world
    return str(world.provisioner.cluster.cluster_id)  # type: ignore[attr-defined]  (a world started here)


def record(world: RunningWorld) -> None:
    """Write (or update) the entry of `world`, a detached world whose group formed again; this
    kernel is the one attached to it now."""
    world_id = world_id_of(world)
    path = wire.entry_path(world_id)
    previous = wire.read_entry(path)
    config = world.provisioner.config
    if previous is None:
        cluster = world.provisioner.cluster  # type: ignore[attr-defined]
        security = os.path.join(cluster.profile_dir, "security")
        previous = {
            "connection_file": os.path.join(security, f"ipcontroller-{world_id}-client.json"),
            "started": time.time(),
            "notebook": notebook_path(),
            "config": {name: getattr(config, name) for name in KEPT_SETTINGS},
        }
    ranks = [world.ranks[rank] for rank in sorted(world.ranks)]
    me, started = os.getpid(), started_at(os.getpid())
    # since when this kernel is attached: kept while it stays the one (the entry is written again at a heal)
    stays = previous.get("attached_pid") == me and previous.get("attached_started") == started
    since = float(previous.get("attached_at", 0.0)) if stays else time.time()
    entry: wire.Entry = {
        "version": wire.ENTRY_VERSION,
        "id": world_id,
        "connection_file": previous["connection_file"],
        "private_dir": world.private_dir,
        "size": len(ranks),
        "backend": world.layout.backend,
        "started": previous["started"],
        "notebook": previous["notebook"],
        "idle_limit": config.idle_limit,
        "controller_pid": world.provisioner.controller_pid or 0,
        "rank_pids": [info.pid for info in ranks],
        "template_pid": world.provisioner.template_pid or int(previous.get("template_pid") or 0),
        "ranks": [dataclasses.asdict(info) for info in ranks],
        "placements": [dataclasses.asdict(placement) for placement in world.layout.placements],
        "routes": {str(rank): list(route) for rank, route in world.layout.routes.items()},
        "config": previous["config"],
        "attached_pid": me,
        "attached_started": started,
        "attached_notebook": notebook_path(),
        "attached_at": since or time.time(),
        "host": this_machine()[0],
        "boot": this_machine()[1],
    }
    wire.write_private(path, entry)


def environment(world_id: str, idle_limit: float) -> dict[str, str]:
    """What the processes of a detached world are told: their entry (the controller ends the world
    from it), the idle limit, and on JupyterHub the user's server (`users_server`): the world
    belongs to the server, whose stop ends it, whatever the spawner ends of the server's processes."""
    told = {wire.DETACHED_ENV: str(wire.entry_path(world_id)), wire.IDLE_LIMIT_ENV: f"{idle_limit:g}"}
    server = find_users_server().pid if on_jupyterhub() else None
    if server is not None:
        told[wire.SERVER_ENV] = f"{server}:{started_at(server)}"
    return told


def forget(world_id: str) -> None:
    """Remove the entry of a world that ended."""
    wire.entry_path(world_id).unlink(missing_ok=True)


def ranks_of(entry: wire.Entry) -> dict[int, RankInfo]:
    """The rank map an entry holds, as `forming` made it."""
    ranks = {}
    for fields in entry["ranks"]:
        address = fields.get("xray_address")
        kept = {**fields, "xray_address": tuple(address) if address else None, "off_here": tuple(fields["off_here"])}
        ranks[int(fields["rank"])] = RankInfo(**kept)
    return ranks


def layout_of(entry: wire.Entry) -> tuple[str, list[world_layout.Placement], dict[int, tuple[str, str | None]]]:
    """(backend, placements, routes) of the world's layout (`forming.WorldLayout`'s fields)."""
    placements = [world_layout.Placement(**fields) for fields in entry["placements"]]
    routes = {int(rank): (str(route[0]), route[1]) for rank, route in entry["routes"].items()}
    return entry["backend"], placements, routes


def host_of(entry: wire.Entry) -> str | None:
    """The machine the world runs on, where that is another than this one (None: this one)."""
    host = entry.get("host") or this_machine()[0]
    return None if host == this_machine()[0] else host


def alive(entry: wire.Entry) -> bool:
    """Whether the world's controller still runs (and its connection file is there). Only the
    world's own machine can tell: a world of another (a home shared between machines) is taken
    as running; on this one, a boot since the entry was written ended it, whatever its PIDs say now."""
    if host_of(entry) is not None:
        return True
    boot = entry.get("boot") or ""
    if boot and boot != this_machine()[1]:
        return False
    return pid_alive(entry["controller_pid"]) and os.path.isfile(entry["connection_file"])


def attached_kernel(entry: wire.Entry) -> int | None:
    """The PID of the kernel attached to the world, or None (none, or it is gone)."""
    pid = entry.get("attached_pid") or 0
    if pid and pid_alive(pid) and started_at(pid) == entry.get("attached_started", ""):
        return pid
    return None


def worlds() -> list[wire.Entry]:
    """The user's detached worlds that still run, oldest first; stale entries are removed here."""
    found = []
    for path in sorted(wire.registry_dir().glob("*.json")):
        entry = wire.read_entry(path)
        if entry is None:
            continue
        if alive(entry):
            found.append(entry)
        else:
            _clean_stale(path, entry)
    return sorted(found, key=lambda entry: entry["started"])


def _clean_stale(path: os.PathLike[str], entry: wire.Entry) -> None:
    """An entry whose world is gone: it goes, with the world's private folder once no rank holds it."""
    rebooted = bool(entry.get("boot")) and entry.get("boot") != this_machine()[1]
    if not rebooted and any(pid_alive(pid) for pid in entry["rank_pids"]):
        return  # its ranks outlive their controller for a moment (they end on its missing heartbeats)
    os.unlink(path)
    folder = entry["private_dir"]
    if os.path.dirname(folder) == tempfile.gettempdir() and os.path.basename(folder).startswith("ddp-notebook-"):
        shutil.rmtree(folder, ignore_errors=True)


def choose(world_id: str | None) -> wire.Entry:
    """The detached world to attach to: `world_id` (or a unique start of it); without one, this
    notebook's newest, else the user's only one. One line when there is no clear choice."""
    listed = worlds()
    running = [entry for entry in listed if host_of(entry) is None]
    elsewhere = [entry for entry in listed if host_of(entry) is not None]
    if world_id:
        matches = [entry for entry in listed if entry["id"] == world_id] or [
            entry for entry in listed if entry["id"].startswith(world_id)
        ]
        if len(matches) != 1:
            found = "no detached world" if not matches else f"{len(matches)} detached worlds"
            raise DDPUsageError(f"{found} of yours has the id '{world_id}'; {_listing(running)}")
        host = host_of(matches[0])
        if host is not None:
            raise DDPUsageError(
                f"detached world {matches[0]['id']} runs on {host}, not on this machine "
                f"({this_machine()[0]}): attach to it from a kernel on {host}"
            )
        return matches[0]
    if not running:
        here, there = (" on this machine", f"; on other machines: {_listing(elsewhere)}") if elsewhere else ("", "")
        raise DDPUsageError(
            f"no detached world of yours is running{here} (start one with %ddp_start N --detach; "
            f"%ddp_attach --ipp-profile P attaches to an ipcluster){there}"
        )
    notebook = notebook_path()
    mine = [entry for entry in running if notebook and entry["notebook"] == notebook]
    if mine:
        return mine[-1]
    if len(running) == 1:
        return running[0]
    raise DDPUsageError(f"{len(running)} detached worlds of yours run, none from this notebook; {_listing(running)}")


def _listing(running: Iterable[wire.Entry]) -> str:
    ids = [f"{entry['id']} ({entry['size']} ranks, from {_notebook_name(entry)}{_on(entry)})" for entry in running]
    if not ids:
        return "none runs now (%ddp_worlds lists them)"
    return f"pick one with %ddp_attach --world ID: {', '.join(ids)}"


def _on(entry: wire.Entry) -> str:
    host = host_of(entry)
    return f", on {host}" if host else ""


def _notebook_name(entry: wire.Entry) -> str:
    return os.path.basename(entry["notebook"]) if entry["notebook"] else "an unnamed kernel"


def attach_config(entry: wire.Entry, take_over: bool = False, **options: Any) -> WorldConfig:
    """The settings of a kernel's world attached to the detached world `entry` (`options` win);
    `take_over`: even while another live kernel is attached to it (`world.ownership`)."""
    kept = {BUILD_KEYWORDS.get(name, name): value for name, value in entry["config"].items()}
    settings = {**kept, **options}
    return WorldConfig.build(
        entry["size"],
        backend=entry["backend"],
        attach=AttachTarget(url_file=entry["connection_file"], world=entry["id"], take_over=take_over),
        detach=True,
        idle_limit=entry["idle_limit"],
        **settings,
    )


def state_of(entry: wire.Entry, now: float | None = None) -> tuple[str, str]:
    """(state, idle since) of a world for the listing: attached, running a cell, or idle."""
    now = time.time() if now is None else now
    host = host_of(entry)
    if host is not None:  # its status and processes are that machine's
        return f"on {host}", "-"
    status = wire.read_status(entry["private_dir"])
    busy = bool(status and status["busy"])
    attached = attached_kernel(entry) is not None
    if busy:
        state = "running a cell" + (", attached" if attached else "")
    else:
        state = "attached" if attached else "idle"
    if busy or attached or status is None:
        return state, "-"
    left = entry["idle_limit"] - (now - status["idle_since"])
    return state, f"{ago(now - status['idle_since'])} (ends in {ago(max(0.0, left))})"


def ago(seconds: float) -> str:
    """A span in words a listing can show: 45 s, 12 min, 3.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe(running: list[wire.Entry], now: float | None = None) -> str:
    """The table %ddp_worlds prints."""
    if not running:
        return "no detached world of yours is running (%ddp_start N --detach starts one)"
    now = time.time() if now is None else now
    rows = [("world", "ranks", "state", "started", "idle for", "notebook")]
    for entry in running:
        state, idle = state_of(entry, now)
        started = f"{ago(now - entry['started'])} ago"
        rows.append((entry["id"], f"{entry['size']} {entry['backend']}", state, started, idle, _notebook_name(entry)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("%ddp_attach (this notebook's newest) or %ddp_attach --world ID attaches; %ddp_stop there ends it")
    hosts = sorted({host for entry in running if (host := host_of(entry)) is not None})
    if hosts:
        lines.append(f"a world on {', '.join(hosts)} is attached to from a kernel on that machine")
    return "\n".join(lines)
