"""Plain-text views of a world: the start summary, the status table, per-rank values, what the
world did after a loss."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..cell.output import tag_value
from ..errors import GROUP_ABOVE, RUNS_SHOWN, count_ranks, name_ranks, rank_ranges
from ..platform.limits import format_bytes
from ..wire.results import CellResult, MemoryReading, RankInfo, RankStatus
from .comeback import Recovered, Recovery
from .config import is_loopback
from .state import WorldState
from .users_server import find_users_server, on_jupyterhub

if TYPE_CHECKING:
    from .cluster import DDPCluster  # the reports read a world (only its type, to import no circle)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned text table with one space-padded column per header."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def format_start_summary(world: DDPCluster, warnings: Sequence[str] = ()) -> str:
    """The lines %ddp_start prints: what started, where, how fast, and what to watch out for."""
    ranks = world.ranks
    spread = len({r.host for r in ranks}) > 1
    rows = [
        (
            r.rank,
            *((r.local_rank,) if spread else ()),
            r.host,
            r.pid,
            r.device if r.device_name in ("cpu", r.device) else f"{r.device} ({r.device_name})",
            world.backend,
        )
        for r in ranks
    ]
    seconds = world.start_seconds or 0.0
    size = f"{world.world_size} rank{'s' if world.world_size != 1 else ''}"
    attach = world.config.launch.attach
    if attach is not None and attach.world is not None:
        heading = (
            f"DDP world ready: {size}, {world.backend}, attached again to {attach.describe()} in {seconds:.1f} s "
            "(every rank's variables kept; %ddp_stop ends it)"
        )
    elif attach is not None:
        heading = (
            f"DDP world ready: {size}, {world.backend}, attached to {attach.describe()} in {seconds:.1f} s "
            "(%ddp_stop leaves its engines running)"
        )
    else:
        heading = (
            f"DDP world ready: {size}, {world.backend}, {world.config.threads_per_rank} thread(s) per rank, "
            f"started in {seconds:.1f} s"
        )
    notes = []
    earlier = getattr(world.provisioner, "earlier_cell", None)
    if earlier is not None:
        notes.append(earlier.describe())
    if spread:
        notes.append(f"hosts: {describe_layout(ranks)}")
    if world.config.curve:
        notes.append("ipyparallel traffic is encrypted (CurveZMQ)")
    if world.config.detach and attach is None:
        server = find_users_server().ends_the_world() if on_jupyterhub() else ""
        notes.append(
            "detached: the world outlives this kernel (%ddp_attach in a new kernel attaches again); it ends "
            f"itself after {world.config.idle_limit:g} s with no cell running and no kernel attached, or with "
            f"%ddp_stop{server}"
        )
    if world.config.check_collectives:
        notes.append("strict mode: every collective of the default group is checked (op, shapes) before it runs")
    notes.extend(f"warning: {warning}" for warning in warnings)
    if not warnings and not is_loopback(world.config.master_addr):
        notes.append(
            f"listening on {world.config.master_addr}: torch.distributed's rendezvous and gloo/NCCL "
            "traffic are not encrypted; use this only on a network you trust"
        )
    headers = ("rank", *(("local rank",) if spread else ()), "host", "pid", "device", "backend")
    return "\n".join([heading, *notes, table(headers, rows)])


def describe_layout(ranks: Sequence[RankInfo]) -> str:
    """'node-a: ranks 0-1, node-b: ranks 2-3'."""
    by_host: dict[str, list[int]] = {}
    for info in ranks:
        by_host.setdefault(info.host, []).append(info.rank)
    return ", ".join(f"{host}: {name_ranks(numbers)}" for host, numbers in by_host.items())


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} MiB"


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def _gpu_mb(status: RankStatus) -> str:
    if status.gpu_memory_mb is None or not status.gpu_memory_total_mb:
        return _mb(status.gpu_memory_mb)
    return f"{_mb(status.gpu_memory_mb)} of {format_bytes(status.gpu_memory_total_mb * 2**20)}"


def format_memory(reading: MemoryReading) -> str:
    """'memory: 1.2 GiB in use of the cgroup memory limit of 1.5 GiB (80%), the ranks 540 MiB of it'."""
    ranks = sum(reading.rank_bytes.values())
    return (
        f"memory: {format_bytes(reading.used)} in use of {reading.limit_text} ({reading.fraction:.0%}), "
        f"the ranks here {format_bytes(ranks)} of it"
    )


def format_status(world: DDPCluster, rows: Sequence[RankStatus], memory: MemoryReading | None = None) -> str:
    """The %ddp_status table: each rank's state, where it runs, its memory and its share of the limit;
    past GROUP_ABOVE ranks, the ranks counted and only the rows worth a look."""
    lines = [f"world of {world.world_size} ranks ({world.backend}): {world_health(world, rows)}"]
    if memory is not None:
        lines.append(format_memory(memory))
    if len(rows) > GROUP_ABOVE:
        lines.extend(_summarised(rows))
        rows = _worth_a_look(rows)
    body = table(
        ("rank", "state", "host", "pid", "device", "memory", "of limit", "gpu memory"),
        [
            (s.rank, s.state, s.host, s.pid, s.device, _mb(s.memory_mb), _share(s.memory_fraction), _gpu_mb(s))
            for s in rows
        ],
    )
    return "\n".join([*lines, body])


def _summarised(rows: Sequence[RankStatus]) -> list[str]:
    """A large world's ranks in a few lines: their states and hosts counted, their memory spread."""
    states = Counter(s.state for s in rows)
    counted = ", ".join(f"{count:,} {state}" for state, count in states.most_common())
    unusual = [s.rank for s in rows if s.state != "idle"]
    if unusual and len(unusual) < len(rows):
        counted += f" (not idle: {rank_ranges(unusual)})"
    hosts = Counter(s.host for s in rows)
    where = ", ".join(f"{host} {count:,}" for host, count in hosts.most_common(RUNS_SHOWN))
    more = f", {len(hosts) - RUNS_SHOWN:,} more hosts" if len(hosts) > RUNS_SHOWN else ""
    lines = [
        f"{count_ranks(len(rows))}: {counted}; on {len(hosts):,} host{'s' if len(hosts) > 1 else ''} ({where}{more})"
    ]
    measured = sorted((s.memory_mb, s.rank) for s in rows if s.memory_mb is not None)
    if measured:
        (low, low_rank), (high, high_rank) = measured[0], measured[-1]
        median = measured[len(measured) // 2][0]
        lines.append(
            f"rank memory: median {_mb(median)}, min {_mb(low)} (rank {low_rank}), max {_mb(high)} (rank {high_rank})"
        )
    lines.append("the ranks worth a look (not idle, or holding the most memory):")
    return lines


def _worth_a_look(rows: Sequence[RankStatus], most: int = 3) -> list[RankStatus]:
    """Rows of the ranks that are not idle, and of the few holding the most memory, in rank order."""
    chosen = {s.rank for s in rows if s.state != "idle"}
    chosen |= {s.rank for s in sorted(rows, key=lambda s: -(s.memory_mb or 0.0))[:most]}
    picked = [s for s in rows if s.rank in chosen]
    return picked[: RUNS_SHOWN * 2]


def world_health(world: DDPCluster, rows: Sequence[RankStatus]) -> str:
    """The world's state, with what to do about it where something is wrong."""
    gone = [s.rank for s in rows if s.state == "gone"]
    if world.state is WorldState.BROKEN or gone:
        dead = sorted(set(world.broken) | set(gone))
        return f"broken ({name_ranks(dead)} gone): %ddp_restart"
    if world.state is WorldState.NEEDS_HEALING:
        return "needs healing (a cell broke the process group): the next cell sets it up again"
    return str(world.state)


def format_values(result: CellResult) -> str:
    """Each rank's last-expression value, like a kernel's Out[], tagged by rank."""
    values = ((rank, result.value_text(rank)) for rank in result.ranks)
    return "\n".join(tag_value(rank, text) for rank, text in values if text is not None)


def describe_recovery(recovery: Recovery) -> tuple[str, str]:
    """(what the comeback did, why there was none), as a cell's outcome says them after a loss."""
    how, done = recovery.how, recovery.comeback
    if how is Recovered.STOPS:
        return "", "this world stops at a loss (on_loss='stop')"
    if how is Recovered.NO_RESTARTS_LEFT:
        return "", (
            f"this world went on after {recovery.restarts} lost rank(s) already (max_restarts={recovery.max_restarts})"
        )
    if how is Recovered.CANNOT_START_RANKS:
        return "", f"a world started with --launcher {recovery.launcher} cannot start ranks (--on-loss shrink goes on)"
    if how is Recovered.FAILED or done is None:
        doing = "bringing it back" if recovery.policy == "replace" else "going on without it"
        return "", f"{doing} failed: {recovery.failure}"
    ranks = name_ranks(recovery.lost)
    if how is Recovered.SHRUNK:
        # the config keeps the size asked for: restart() starts the full world again
        now = len(done.ranks)
        where = (
            f"every rank is at the snapshot taken at {done.resumed_from}; run the cell again to continue"
            if done.resumed_from
            else "nothing is tracked (ddp_notebook.track): the survivors keep what they had"
        )
        return (
            f"The world went on without {ranks} in {done.seconds:.1f} s: {now} rank(s) now "
            f"(was {recovery.size_before}), renumbered 0-{now - 1}, the process group formed again, "
            f"variables kept: {where}",
            "",
        )
    where = (
        f"every rank is back at the snapshot taken at {done.resumed_from}; run the cell again to continue"
        if done.resumed_from
        else "nothing is tracked (ddp_notebook.track): the new rank has what the setup cells made"
    )
    return (
        f"{ranks[0].upper()}{ranks[1:]} came back in {done.seconds:.1f} s (a new process, "
        f"{recovery.setup_cells} setup cell(s) "
        f"replayed, the process group formed again; other variables kept on the surviving ranks): {where}",
        "",
    )
