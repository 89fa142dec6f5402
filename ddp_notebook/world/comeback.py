"""A dead rank comes back: a new process, the setup cells replayed, the group formed again at
the same size, and every rank brought to the last snapshot of the tracked state. Going on
without it (`shrink`) and resizing a world (`resize`) are the same steps with ranks left out,
added or ended.

Notebook side (no torch). `recover` is the loss policy: when a cell (or a push, a pull) found a
rank's process gone, it goes on as `on_loss` says (`bring_back`, `shrink`, or stop) within
`max_restarts`, and returns a `Recovery` saying what it did (`report.describe_recovery` words
it). `resize` and `rollback` serve `DDPCluster.resize` and `.rollback`. Each works on a
`RunningWorld` (whose layout they change in place); the rank side of all of them is
`rank/elastic.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping
from typing import Any

from ..errors import DDPError, name_ranks, one_line
from ..platform.processes import DEATH_CHECK_SECONDS
from ..rank import calls as rank_calls
from ..wire.join import Identity
from ..wire.results import Death, RankInfo
from . import forming, layout
from .config import WorldConfig
from .provisioning import Provisioner
from .running import RunningWorld

POLL_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class Comeback:
    """What `bring_back` or `resize` did."""

    ranks: dict[int, RankInfo]  # the new rank map
    seconds: float
    resumed_from: str | None  # where the restored snapshot was taken; None when nothing is tracked


class Recovered(str, enum.Enum):
    """What the world did after a loss."""

    REPLACED = "replaced"  # new processes took the lost ranks' places
    SHRUNK = "shrunk"  # the survivors went on as a smaller world
    STOPS = "stops"  # on_loss='stop': the world is broken
    NO_RESTARTS_LEFT = "no restarts left"  # past max_restarts: the world is broken
    CANNOT_START_RANKS = "cannot start ranks"  # replace asked of a launcher that starts none
    FAILED = "failed"  # the comeback itself failed: the world is broken


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What `recover` did after `lost` were lost, with what a report says of it."""

    how: Recovered
    lost: Mapping[int, Death]
    restarts: int  # lost ranks the world went on after so far, these included where it tried
    max_restarts: int
    size_before: int  # ranks before the loss
    comeback: Comeback | None = None  # the new world (REPLACED, SHRUNK)
    setup_cells: int = 0  # the setup cells replayed on the new processes (REPLACED)
    launcher: str = ""  # the world's launcher (CANNOT_START_RANKS)
    failure: str = ""  # what went wrong, one line (FAILED)
    policy: str = ""  # replace, shrink or stop

    @property
    def went_on(self) -> bool:
        """The world runs on; otherwise it is broken and the lost ranks are its dead."""
        return self.comeback is not None


def loss_policy(running: RunningWorld, config: WorldConfig) -> str:
    """replace, shrink or stop: `on_loss`, with auto resolved for this world's provisioner."""
    if config.on_loss != "auto":
        return config.on_loss
    # ranks elsewhere go on with the survivors unless asked to wait for new processes there
    return "replace" if running.provisioner.starts_ranks_here else "shrink"


def recover(
    running: RunningWorld,
    config: WorldConfig,
    lost: Mapping[int, Death],
    unfinished: tuple[int, ...],
    restarts: int,
) -> Recovery:
    """Go on after a loss, as `config.on_loss` says: new processes for the lost ranks
    (`bring_back`), or the survivors on their own (`shrink`), every rank at the last snapshot;
    past `config.max_restarts` (`restarts`: lost ranks gone on after so far), with
    `on_loss='stop'`, or where that fails, the world is broken (the caller marks it so).
    Survivors still in the cell (`unfinished`) are interrupted first: the comeback waits for them."""
    policy = loss_policy(running, config)
    size = running.layout.world_size

    def said(how: Recovered, restarts: int, **what: Any) -> Recovery:
        return Recovery(how, dict(lost), restarts, config.max_restarts, size, policy=policy, **what)

    if policy == "stop":
        return said(Recovered.STOPS, restarts)
    if config.max_restarts - restarts < len(lost):
        return said(Recovered.NO_RESTARTS_LEFT, restarts)
    if policy == "replace" and not running.provisioner.starts_ranks:
        return said(Recovered.CANNOT_START_RANKS, restarts, launcher=str(config.launch.launcher))
    restarts += len(lost)
    survivors = tuple(rank for rank in unfinished if rank not in lost)
    if survivors:
        running.supervisor.interrupt(survivors)  # survivors still in the cell: the comeback waits for them
    try:
        done = bring_back(running, config, lost) if policy == "replace" else shrink(running, config, lost)
    except Exception as failure:  # noqa: BLE001  (any failure leaves the world broken, as a death did)
        return said(Recovered.FAILED, restarts, failure=one_line(failure))
    running.regrouped(done.ranks)
    how = Recovered.REPLACED if policy == "replace" else Recovered.SHRUNK
    return said(how, restarts, comeback=done, setup_cells=len(running.setup_cells))


def lost_before_sending(running: RunningWorld, targets: tuple[int, ...]) -> dict[int, Death]:
    """Ranks of `targets` whose engine the controller no longer knows (a process stopped past the
    heartbeat while the world was idle, a host gone), with how they ended."""
    registered = set(running.client.ids)
    gone = tuple(rank for rank in targets if running.ranks[rank].engine_id not in registered)
    if not gone:
        return {}
    found = running.supervisor.find_dead(gone)
    return {rank: found.get(rank) or Death("lost", "was lost (the controller dropped it)") for rank in gone}


def bring_back(running: RunningWorld, config: WorldConfig, dead: Mapping[int, Death]) -> Comeback:
    """Replace the ranks in `dead` by new processes and bring the world back to one consistent point.

    A new process on the host of the one it replaces takes its place; one that had to start on
    another host (its own was lost) joins after the survivors, the ranks numbered again host by
    host. Raises DDPError with what went wrong; the world is then left as it was found (dead ranks).
    """
    began = time.perf_counter()
    deadline = began + config.start_timeout
    provisioner, world = running.provisioner, running.layout
    lost = sorted(dead)
    survivors = [info for rank, info in sorted(running.ranks.items()) if rank not in lost]
    replacing = {rank: (running.ranks[rank], dead[rank]) for rank in lost}
    provisioner.end_lost(running.ranks[rank] for rank in lost if dead[rank].cause == "lost")
    started = _start_ranks(provisioner, lost, deadline, survivors, replacing)
    if all(started[rank].host == world.placements[rank].host for rank in lost):
        for rank, new in started.items():  # the same place, another process
            world.placements[rank] = dataclasses.replace(world.placements[rank], engine_id=new.engine_id, pid=new.pid)
        new_ranks = lost
    else:
        _renumber(world, [p for p in world.placements if p.rank not in dead], [started[rank] for rank in lost])
        forming.plan_routes(provisioner, world, deadline)  # a host joined, rank 0 may have moved
        engines = {new.engine_id for new in started.values()}
        new_ranks = [p.rank for p in world.placements if p.engine_id in engines]
    _replay_setup(provisioner, config, world, new_ranks, running.setup_cells, deadline)
    return _regroup(provisioner, config, world, survivors, running.private_dir, began, deadline)


def shrink(running: RunningWorld, config: WorldConfig, lost: Mapping[int, Death]) -> Comeback:
    """Go on without the ranks in `lost` (their processes or hosts are gone): the survivors form a
    group of their own number, renumbered host by host in their order, and every one goes to the
    newest snapshot all of them hold; tracked loaders deal the rest of the epoch over them.

    Raises DDPError with what went wrong (no survivor); the world is then left as it was."""
    began = time.perf_counter()
    deadline = began + config.start_timeout
    world = running.layout
    gone = set(lost)
    survivors = [info for rank, info in sorted(running.ranks.items()) if rank not in gone]
    if not survivors:
        raise DDPError("no rank survived")
    running.provisioner.end_lost(running.ranks[rank] for rank in gone if lost[rank].cause == "lost")
    # a GPU survivor keeps its GPU and LOCAL_RANK: its tensors are there
    _renumber(world, [p for p in world.placements if p.rank not in gone], [])
    # rank 0 may be another process, on another host: the routes to it are planned again
    forming.plan_routes(running.provisioner, world, deadline)
    return _regroup(running.provisioner, config, world, survivors, running.private_dir, began, deadline)


def resize(running: RunningWorld, config: WorldConfig, size: int) -> Comeback:
    """Grow or shrink a running world to `size` ranks: the ranks that stay keep everything; new
    ranks get the setup cells replayed and the tracked state from rank 0; the ranks past `size`
    end. Every rank goes to a snapshot taken now, so tracked loaders deal the rest of their
    epoch over the new ranks."""
    began = time.perf_counter()
    deadline = began + config.start_timeout
    provisioner, world, ranks, client = running.provisioner, running.layout, running.ranks, running.client
    old = len(world.placements)
    everyone = client[running.engines()]
    everyone.apply_async(rank_calls.take_snapshot, "the resize").get(timeout=_remaining(deadline))
    staying = [ranks[r] for r in sorted(ranks) if r < size]
    if size > old:
        added = list(range(old, size))
        started = _start_ranks(provisioner, added, deadline, staying)
        _renumber(world, world.placements, [started[slot] for slot in added])
        forming.plan_routes(provisioner, world, deadline)  # the new ranks may be on another host
        _replay_setup(provisioner, config, world, added, running.setup_cells, deadline)
    else:
        leaving = [ranks[r] for r in sorted(ranks) if r >= size]
        everyone.apply_async(rank_calls.release_group).get(timeout=_remaining(deadline))
        provisioner.remove(leaving)
        _renumber(world, world.placements[:size], [])
    return _regroup(provisioner, config, world, staying, running.private_dir, began, deadline)


def rollback(running: RunningWorld, config: WorldConfig) -> Comeback:
    """Every rank back to the newest snapshot all of them hold: after a training cell that failed
    or was interrupted, the ranks may have stopped at different steps. No process changes."""
    began = time.perf_counter()
    deadline = began + config.start_timeout
    ranks = running.ranks
    # a training cell cut short leaves DDP's reducers midway through a backward
    _fresh_reducers(running.client, ranks, sorted(ranks), deadline)
    resumed = _restore(running.client, ranks, sorted(ranks), deadline)
    return Comeback(dict(ranks), time.perf_counter() - began, resumed)


def _start_ranks(
    provisioner: Provisioner,
    slots: list[int],
    deadline: float,
    staying: list[RankInfo],
    replacing: Mapping[int, tuple[RankInfo, Death]] | None = None,
) -> dict[int, layout.EngineIdentity]:
    """New processes for `slots`, once they registered."""
    known = set(provisioner.client.ids)
    provisioner.add(slots, staying, replacing)
    return _wait_for_new_engines(provisioner, known, slots, deadline)


def _renumber(world: forming.WorldLayout, kept: list[layout.Placement], new: list[layout.EngineIdentity]) -> None:
    """Place the ranks again, host by host (GPU ranks keep their GPU: `layout.place_again`)."""
    world.placements = layout.place_again(kept, new)
    route = world.routes[0]
    world.routes = {p.rank: world.routes.get(p.rank, route) for p in world.placements}


def _regroup(
    provisioner: Provisioner,
    config: WorldConfig,
    world: forming.WorldLayout,
    survivors: list[RankInfo],
    stack_dir: str | None,
    began: float,
    deadline: float,
) -> Comeback:
    """The survivors leave their group, every rank joins a new one, DDP models are wrapped again
    and every rank loads the newest snapshot the survivors share (a tracked FSDP2 model sharded
    over another number of ranks is sharded again over the world first, on the rank side)."""
    client = provisioner.client
    if survivors:
        # survivors leave the group they were in (models from prepare_model move with them)
        client[[info.engine_id for info in survivors]].apply_async(rank_calls.release_group).get(
            timeout=_remaining(deadline)
        )
    new_ranks = forming.join_process_group(client, config, world, stack_dir, deadline)
    # the survivors' numbers in the new group (a shrink renumbers them): found by their engines
    rank_of_engine = {info.engine_id: rank for rank, info in new_ranks.items()}
    kept = [rank_of_engine[info.engine_id] for info in survivors]
    _fresh_reducers(client, new_ranks, kept, deadline)
    resumed = _restore(client, new_ranks, kept, deadline)
    return Comeback(new_ranks, time.perf_counter() - began, resumed)


def _fresh_reducers(client: Any, ranks: dict[int, RankInfo], kept: list[int], deadline: float) -> None:
    """Models every rank has (made by the setup cells) get fresh DDP reducers, in one order
    everywhere, their buckets laid out as the first of `kept` has them (the same on each: DDP
    syncs them). A new rank's reducer has not rebuilt its buckets yet, and a reducer whose
    backward was cut short (an interrupt, a released collective) is midway through one."""
    engines = client[[info.engine_id for info in ranks.values()]]
    held = engines.apply_async(rank_calls.wrapped_models).get(timeout=_remaining(deadline))
    common = sorted(set.intersection(*(set(models) for models in held)))
    by_rank = dict(zip(ranks, held))
    lead = by_rank[kept[0]] if kept else {}
    layouts = {name: lead.get(name) for name in common}
    engines.apply_async(rank_calls.rewrap_models, layouts).get(timeout=_remaining(deadline))


def _remaining(deadline: float) -> float:
    return max(1.0, deadline - time.perf_counter())


def _wait_for_new_engines(
    provisioner: Provisioner, known: set[int], slots: list[int], deadline: float
) -> dict[int, layout.EngineIdentity]:
    """slot -> who the process started for it is, once each registered."""
    client = provisioner.client
    while len(set(client.ids) - known) < len(slots):
        if time.perf_counter() > deadline:
            raise DDPError(
                f"the new process for {name_ranks(slots)} did not register within {_start_timeout(provisioner):g} s"
            )
        time.sleep(POLL_SECONDS)
    new_ids = sorted(set(client.ids) - known)
    described = client[new_ids].apply_async(rank_calls.describe)
    reports: list[Identity] = described.get(timeout=_remaining(deadline))
    found = {}
    for engine_id, report in zip(described.engine_id, reports):
        if report.slot in slots:
            found[report.slot] = layout.EngineIdentity(
                engine_id, report.host, report.pid, slot=report.slot, gpus=report.gpus
            )
    if sorted(found) != slots:
        raise DDPError(f"the new processes did not say they were {name_ranks(slots)}")
    provisioner.learn(found.values())
    return found


def _start_timeout(provisioner: Provisioner) -> float:
    return provisioner.config.start_timeout


def _replay_setup(
    provisioner: Provisioner,
    config: WorldConfig,
    world: forming.WorldLayout,
    ranks: list[int],
    setup_cells: list[str],
    deadline: float,
) -> None:
    """Each new rank becomes its rank in a group of its own and runs the setup cells, in order."""
    client = provisioner.client
    placements = [p for p in world.placements if p.rank in ranks]
    pending = [
        client[p.engine_id].apply_async(rank_calls.begin_replay, forming.rank_spec(config, world, p, 0, None))
        for p in placements
    ]
    for placement, result in zip(placements, pending):
        _wait(provisioner, placement, result, deadline, "while it got ready for the setup cells")
    for number, code in enumerate(setup_cells, start=1):
        for placement in placements:
            result = client[placement.engine_id].execute(code, silent=True, block=False)
            _wait(provisioner, placement, result, deadline, f"in setup cell {number} of {len(setup_cells)}")


def _wait(provisioner: Provisioner, placement: Any, result: Any, deadline: float, during: str) -> None:
    """Wait for one call on a new rank, watching that its process is alive."""
    info = RankInfo(placement.rank, placement.engine_id, placement.host, placement.pid, "", "", None)
    next_check = 0.0
    while not result.ready():
        now = time.perf_counter()
        if now > deadline:
            seconds = _start_timeout(provisioner)
            raise DDPError(f"the new rank {placement.rank} did not answer {during} within {seconds:g} s")
        if now > next_check:
            next_check = now + DEATH_CHECK_SECONDS
            gone = provisioner.dead_ranks([info])
            if gone:
                raise DDPError(f"the new rank {placement.rank} {gone[placement.rank]} {during}")
        time.sleep(POLL_SECONDS)
    try:
        result.get(timeout=1)
    except Exception as failure:  # noqa: BLE001  (any remote failure ends the comeback)
        raise DDPError(f"the new rank {placement.rank} failed {during}: {one_line(failure)}") from None


def _restore(client: Any, ranks: dict[int, RankInfo], survivors: list[int], deadline: float) -> str | None:
    """Every rank loads the newest snapshot all survivors hold, as the lowest of them sends it."""
    if not survivors:
        return None
    held = client[[ranks[r].engine_id for r in survivors]].apply_async(rank_calls.snapshot_numbers)
    numbers = [set(found) for found in held.get(timeout=_remaining(deadline))]
    if not any(numbers):
        return None  # nothing tracked
    common = set.intersection(*numbers)
    if not common:
        raise DDPError("the surviving ranks hold no snapshot in common (cells ran on some ranks only?)")
    source = survivors[0]
    engines = [ranks[r].engine_id for r in sorted(ranks)]
    where = client[engines].apply_async(rank_calls.restore_snapshot, max(common), source)
    return str(where.get(timeout=_remaining(deadline))[0])
