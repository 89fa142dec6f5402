"""Data in and out of the ranks' namespaces, and the notebook's files to their working folders:
`DDPCluster.push`, `.pull` and `.sync` (`%ddp_sync`). A rank lost since the last cell is gone on
after first (`cell_run.go_on_if_lost`), nothing being sent; one lost while a push or a pull is on
its way is named within a second, and the world goes on after it the same way. Notebook side (no torch).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDPError, DDPUsageError, name_ranks, one_line
from ..rank import calls as rank_calls
from ..wire.results import Death
from . import cell_run, comeback
from . import sync as file_sync
from .config import select_ranks
from .running import RunningWorld
from .state import WorldLifecycle

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

    from .cluster import DDPCluster  # the facade calls in; this module never imports it

PULL_SECONDS = cell_run.PULL_SECONDS
PUSH_SECONDS = 300.0  # a large value to a rank on another host
WATCH_SECONDS = 0.5  # how often the ranks are looked at while a push or a pull is on its way
AGAIN = {  # what a comeback after a loss during a push or a pull ends with
    "push": "the push may have reached the other ranks: push again",
    "pull": "nothing was pulled: pull again",
}
TOWARD = {"push": "to", "pull": "from"}


def _delivered(
    cluster: DDPCluster,
    world: RunningWorld,
    lifecycle: WorldLifecycle,
    targets: tuple[int, ...],
    pending: AsyncResult,
    doing: str,
    seconds: float,
) -> Any:
    """`pending`'s result, the ranks watched meanwhile: a rank that dies (or that the controller
    drops) while it is on its way is named within a second and the world goes on after it, as
    after a loss before sending; anything else that stops it, in one line naming the ranks."""
    deadline = time.monotonic() + seconds
    dead: dict[int, Death] = {}
    while not pending.ready() and not dead and time.monotonic() < deadline:
        pending.wait(WATCH_SECONDS)
        dead = {} if pending.ready() else world.supervisor.find_dead(targets)
    if not dead and not pending.ready():
        raise DDPError(
            f"the {doing} {TOWARD[doing]} {name_ranks(targets)} did not end within {seconds:.0f} s: "
            "%ddp_status shows what the ranks are doing"
        )
    if not dead:
        try:
            return pending.get(timeout=0)
        except Exception as failure:  # noqa: BLE001  (a lost rank is named; anything else said in one line)
            dead = comeback.lost_before_sending(world, targets) or world.supervisor.find_dead(targets)
            if not dead:
                where = f"{TOWARD[doing]} {name_ranks(targets)}"
                raise DDPError(f"could not {doing} {where}: {one_line(failure)}") from None
    what_now = AGAIN[doing]
    error = cell_run.go_on_after_lost(cluster, world, targets, dead, lifecycle, what_now).error()
    raise error or DDPError(f"{name_ranks(sorted(dead))} died during the {doing}: {what_now}")


def push(
    cluster: DDPCluster,
    world: RunningWorld,
    lifecycle: WorldLifecycle,
    namespace: Mapping[str, Any],
    ranks: Iterable[int] | str | None,
) -> None:
    """`namespace`'s values into the user namespace of `ranks` (default: all), each checked first."""
    targets = select_ranks(ranks, world.layout.world_size)
    for name, value in namespace.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise DDPUsageError(f"cannot push {name!r}: names must be valid Python identifiers")
        try:
            pickle.dumps(value)
        except Exception as failure:  # noqa: BLE001
            raise DDPUsageError(
                f"cannot push '{name}': {type(value).__name__} cannot be pickled ({one_line(failure)}); "
                "send what it is built from and build it on the ranks instead"
            ) from None
    if (went_on := cell_run.go_on_if_lost(cluster, world, targets, lifecycle, "push")) is not None:
        went_on.raise_for_error()
    pending = world.client[world.engines(targets)].push(dict(namespace), block=False)
    _delivered(cluster, world, lifecycle, targets, pending, "push", PUSH_SECONDS)


def pull(
    cluster: DDPCluster, world: RunningWorld, lifecycle: WorldLifecycle, name: str, ranks: Iterable[int] | str | None
) -> dict[int, Any]:
    """`name`'s value on each of `ranks` (default: all), as {rank: value}."""
    targets = select_ranks(ranks, world.layout.world_size)
    if (went_on := cell_run.go_on_if_lost(cluster, world, targets, lifecycle, "pull")) is not None:
        went_on.raise_for_error()
    pending = {
        rank: world.client[world.ranks[rank].engine_id].apply_async(rank_calls.pull_names, [name]) for rank in targets
    }
    values: dict[int, Any] = {}
    missing: list[int] = []
    for rank, result in pending.items():
        reply = _delivered(cluster, world, lifecycle, (rank,), result, "pull", PULL_SECONDS)
        if reply["missing"]:
            missing.append(rank)
        else:
            values[rank] = reply["found"][name]
    if missing:
        raise DDPUsageError(f"'{name}' is not defined on {name_ranks(missing)}")
    return values


def sync(
    world: RunningWorld, syncer: file_sync.Syncer, paths: Iterable[str] | str | None, max_mb: float | None
) -> file_sync.SyncReport:
    """`DDPCluster.sync`: the files asked for (default: the notebook folder's Python modules and
    packages) to the ranks' working folders that lack them, refused past `max_mb`."""
    if max_mb is not None:
        if not max_mb > 0:
            raise DDPUsageError(f"--max-mb must be a positive number of MB, got {max_mb:g}")
        syncer.limit_mb = float(max_mb)
    if paths is None:
        files = file_sync.default_files(syncer.folder)
    else:
        files = file_sync.chosen_files([paths] if isinstance(paths, str) else list(paths), syncer.folder)
    if not files:
        raise DDPUsageError(f"nothing to sync: no Python module or package in {syncer.folder}; name the files")
    return syncer.sync(world.client, world.engines(), files)
