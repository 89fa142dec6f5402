"""Every rank of a running world moved at once, their Python state kept: `heal` (a new process
group after a cell broke it), `resize` (ranks added or ended), `rollback` (every rank back to the
newest snapshot all hold); and the group left before a world stops. The `DDPCluster` methods of
the same names delegate here; the steps on the ranks are `forming`'s and `comeback`'s.
Notebook side (no torch).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..cell import busy as busy_ranks
from ..errors import DDPUsageError, failing_as
from ..rank import calls as rank_calls
from ..wire.results import Death, RankInfo
from . import comeback, config, forming
from .config import WorldConfig
from .running import RunningWorld
from .supervision import RELEASE_SECONDS

if TYPE_CHECKING:
    from .cluster import DDPCluster  # the facade calls in; this module never imports it

LEAVE_GROUP_SECONDS = 3.0
# how long a heal waits for ranks it released from a collective to end their cell
BUSY_SETTLE_SECONDS = 5.0


def heal(world: RunningWorld, settings: WorldConfig) -> float:
    """Every rank leaves the old group; rank 0 opens a fresh rendezvous port; all join a new
    default group; models wrapped by `prepare_model` are moved onto it. Returns seconds.

    Refused (DDPUsageError) while a rank is still busy once released; a failure leaves the group
    broken (the next cell tries again)."""
    began = time.perf_counter()
    busy = world.controller.busy(_infos(world))
    if busy:
        # a rank still waiting in a collective of the broken group (its peers left it): release
        # it through the X-ray too, and give it a moment to end its cell
        world.supervisor.release_blocked(tuple(busy))
        settle_by = time.monotonic() + BUSY_SETTLE_SECONDS
        while busy and time.monotonic() < settle_by:
            time.sleep(0.1)
            busy = world.controller.busy([info for info in _infos(world) if info.rank in busy])
    if busy:
        raise DDPUsageError(busy_ranks.refusal(busy, world.supervisor.collectives(tuple(busy))))
    with failing_as("set the process group up again", "; %ddp_restart", keep_ddp_errors=True):
        world.client[world.engines()].apply_async(rank_calls.release_group).get(timeout=RELEASE_SECONDS)
        deadline = time.perf_counter() + settings.start_timeout
        ranks = forming.join_process_group(world.client, settings, world.layout, world.private_dir, deadline)
        world.regrouped(ranks)
    return time.perf_counter() - began


def resize(cluster: DDPCluster, world: RunningWorld, n_ranks: int) -> float:
    """`DDPCluster.resize`: the world grown or shrunk to `n_ranks` ranks, its config saying the
    new size (and the GPUs the ranks use now) for a restart; returns seconds."""
    config.check_rank_count(n_ranks)
    size = world.layout.world_size
    if n_ranks == size:
        return 0.0
    settings = cluster.config
    if n_ranks > size:
        if not world.provisioner.starts_ranks:
            what = (
                "an attached world"
                if settings.launch.attach is not None
                else f"a world started with --launcher {settings.launch.launcher}"
            )
            raise DDPUsageError(f"{what} cannot add ranks; it can shrink (%ddp_resize N with N < {size})")
        # GPU ranks started here: the new processes see the world's GPUs and free ones of this
        # machine (one line, the world untouched, when there are too few)
        world.provisioner.prepare_gpus(n_ranks, [p.gpu for p in world.layout.placements if p.gpu is not None])
    ready_for_regroup(cluster, world)
    with failing_as(f"resize the world to {n_ranks} ranks", "; %ddp_restart"):
        done = comeback.resize(world, cluster.config, n_ranks)
    world.regrouped(done.ranks)
    # a restart starts this size again, on the GPUs the ranks use now
    gpus = cluster.config.gpus
    if gpus:
        used = {p.gpu for p in world.layout.placements}
        gpus = tuple(gpu for gpu in world.provisioner.world_gpus if gpu in used)
    cluster.config = world.provisioner.config = dataclasses.replace(cluster.config, n_ranks=n_ranks, gpus=gpus)
    return done.seconds


def rollback(cluster: DDPCluster, world: RunningWorld) -> str | None:
    """`DDPCluster.rollback`: every rank at the newest snapshot all hold, on a fresh group; returns
    where that snapshot was taken (None: nothing is tracked)."""
    healed = cluster.needs_heal
    ready_for_regroup(cluster, world)
    if not healed:
        # a cell cut short can leave a collective half-done on the group (DDP's backward queues
        # its all-reduces on gloo's threads): a fresh group, so the rollback's own collectives meet
        cluster.heal()
    with failing_as("roll back"):
        done = comeback.rollback(world, cluster.config)
    cluster.last_rollback_seconds = done.seconds
    return done.resumed_from


def ready_for_regroup(cluster: DDPCluster, world: RunningWorld) -> None:
    """Before every rank is moved at once (a resize, a rollback): the group whole, no rank busy."""
    if cluster.needs_heal:
        cluster.heal()
    busy = world.controller.busy(_infos(world))
    if busy:
        raise DDPUsageError(busy_ranks.refusal(busy, world.supervisor.collectives(tuple(busy))))


def leave_process_group(world: RunningWorld, broken: Mapping[int, Death]) -> None:
    """Every idle rank destroys its process group (before its process ends: gloo/nccl abort on an
    exit with one); best effort, the processes end next in any case."""
    if world.controller.lost(now_please=True) is not None:
        return  # nobody to ask; the processes go anyway
    try:
        infos = _infos(world)
        skip = set(world.controller.busy(infos)) | set(broken)  # dead ranks cannot answer
        idle = [info.engine_id for info in infos if info.rank not in skip]
        if idle:
            world.client[idle].apply_async(rank_calls.shutdown_world).get(timeout=LEAVE_GROUP_SECONDS)
    except Exception:  # noqa: BLE001  (the processes are ended next in any case)
        pass


def _infos(world: RunningWorld) -> list[RankInfo]:
    """The world's ranks in rank order (`DDPCluster.ranks`)."""
    return [world.ranks[rank] for rank in sorted(world.ranks)]
