"""Watching a running world on behalf of a cell: dead ranks, interrupts, stuck ranks, releases.

The relay asks these questions while it waits for a cell (`cell.relay.CellSupervisor`, which
this answers without the relay knowing a world); the answers come from the provisioner
(processes), the controller link and the ranks themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Any

from ..cell import debugging, xray
from ..live.grouping import grouped_waits
from ..live.xray_readings import RankCollectives
from ..platform import limits
from ..platform.limits import MEMORY_REARM_FRACTION, MEMORY_WARN_FRACTION
from ..rank import calls as rank_calls
from ..wire import stacks
from ..wire.results import Death, MemoryReading, RankInfo
from .controller import ControllerLink
from .provisioning import Provisioner

log = logging.getLogger("ddp_notebook")
# how long ranks get to let go of their process group (models move to a placeholder group first)
RELEASE_SECONDS = 30.0


class MemoryWatch:
    """The memory of a world's ranks on this host against the limit they share.

    The limit is the one their cgroup path or the machine reaches first (`limits`); the ranks
    of a local world inherit the kernel's cgroup. `check` warns once each time the use
    crosses MEMORY_WARN_FRACTION, naming the rank that grew most since it was first seen (or
    since the use fell below MEMORY_REARM_FRACTION after the last warning). A reading costs a
    few small /proc and cgroup files.
    """

    def __init__(self, platform: limits.Platform | None = None, warn_at: float = MEMORY_WARN_FRACTION) -> None:
        self.platform = platform or limits.Platform()
        self.warn_at = warn_at
        self._chains: dict[int, list[limits.Cgroup]] = {}  # by the PID they were read for
        self._baseline: dict[int, int] = {}  # rank -> resident bytes growth is counted from
        self._armed = True

    def read(self, infos: list[RankInfo]) -> MemoryReading | None:
        """The ranks' memory now; None where no rank runs here or nothing can be read."""
        here = socket.gethostname()
        local = [info for info in infos if info.host == here]
        if not local:
            return None
        pid = local[0].pid
        chain = self._chains.get(pid)
        if chain is None:
            # a local world's ranks run in the kernel's cgroup, unless moved: read theirs once
            chain = self.platform.cgroups("memory", pid) or self.platform.cgroups("memory")
            if chain:
                self._chains[pid] = chain
        limit = self.platform.memory_limit(pid, chain)
        if limit is None or not limit.limit:
            return None
        rank_bytes = {}
        for info in local:
            resident = self.platform.resident_bytes(info.pid)
            if resident is not None:
                rank_bytes[info.rank] = resident
        return MemoryReading(rank_bytes, limit.used, limit.limit, limit.describe())

    def check(self, infos: list[RankInfo]) -> MemoryReading | None:
        """A reading, with a warning on it when it crossed the warning level."""
        reading = self.read(infos)
        if reading is None:
            return None
        for rank, resident in reading.rank_bytes.items():
            self._baseline.setdefault(rank, resident)
        if reading.fraction < MEMORY_REARM_FRACTION:
            if not self._armed:  # the last warning is over: growth counts afresh from here
                self._armed = True
                self._baseline = dict(reading.rank_bytes)
            return reading
        if reading.fraction < self.warn_at or not self._armed:
            return reading
        self._armed = False
        return dataclasses.replace(reading, warning=self._warning(reading))

    def _warning(self, reading: MemoryReading) -> str:
        text = (
            f"warning: memory is {reading.fraction:.0%} full ({limits.format_bytes(reading.used)} "
            f"of {reading.limit_text})"
        )
        grown = {rank: now - self._baseline.get(rank, now) for rank, now in reading.rank_bytes.items()}
        if grown:
            rank = max(grown, key=lambda r: (grown[r], reading.rank_bytes[r]))
            size = limits.format_bytes(reading.rank_bytes[rank])
            if grown[rank] > 0:
                text += f"; rank {rank} grew most (+{limits.format_bytes(grown[rank])}, now {size})"
            else:
                text += f"; the largest rank is rank {rank} ({size})"
        return text + "; at 100% the out-of-memory killer ends the largest process"


def _remote_death(host: str, how: str) -> Death:
    """A rank on another host gone, as its watch connection showed it (`xray.ProcessWatch`)."""
    if how == xray.SILENT:
        return Death(
            "lost",
            f"on {host} was lost (its host stopped answering for {xray.WATCH_SILENT_SECONDS} s: the host or its "
            "network went down)",
        )
    return Death(
        "exited",
        f"on {host} ended: its connection to the notebook closed (the process exited or was killed; its host "
        "still answers)",
    )


class WorldSupervisor:
    """Answers the relay's questions about one running world."""

    def __init__(
        self,
        provisioner: Provisioner,
        controller: ControllerLink,
        ranks: Callable[[], Mapping[int, RankInfo]],
        stack_dir: str | None,
    ) -> None:
        self.provisioner = provisioner
        self.controller = controller
        self._ranks = ranks  # the current rank map (it changes when the world heals)
        self.stack_dir = stack_dir
        self.memory = MemoryWatch()
        self.process_watch = xray.ProcessWatch()  # ranks elsewhere: their process's end, in a death check

    def _infos(self, ranks: tuple[int, ...]) -> list[RankInfo]:
        current = self._ranks()
        return [current[r] for r in ranks if r in current]

    def interrupt(self, ranks: tuple[int, ...]) -> None:
        self.provisioner.signal(self._infos(ranks), signal.SIGINT)

    def find_dead(self, ranks: tuple[int, ...]) -> dict[int, Death]:
        lost = self.controller.lost()
        if lost is not None:
            return {rank: Death("unreachable", f"cannot be reached: {lost}") for rank in ranks}
        infos = self._infos(ranks)
        # ranks elsewhere first: their watch connection tells a process's end from a silent host
        reach = self.reach()
        seen = self.process_watch.ended(reach, infos) if reach is not None and reach.remote else {}
        dead = {rank: _remote_death(next(i.host for i in infos if i.rank == rank), how) for rank, how in seen.items()}
        # a silent host is lost with every rank on it: their connections' keepalives each give up at
        # their own moment, and a rank left out would be kept as a survivor its controller then drops
        silent = {info.host for info in infos if seen.get(info.rank) == xray.SILENT}
        for info in self._ranks().values():
            if info.host in silent and info.rank not in dead:
                dead[info.rank] = _remote_death(info.host, xray.SILENT)
        dead.update(self.provisioner.dead_ranks([info for info in infos if info.rank not in dead]))
        return dead

    def watch_ranks(self) -> None:
        """Open the watch connections of ranks on other hosts not watched yet (the world formed)."""
        reach = self.reach()
        if reach is not None and reach.remote:
            self.process_watch.watch(reach, list(self._ranks().values()))

    def close(self) -> None:
        """Let go of what the supervisor holds open (the world ends)."""
        self.process_watch.close()

    def check_memory(self, ranks: tuple[int, ...]) -> MemoryReading | None:
        """The memory of `ranks` on this host against their limit, warning once per crossing."""
        return self.memory.check(self._infos(ranks))

    def reach(self) -> xray.Reach | None:
        """How to reach the ranks' X-ray threads (None before the world has its private directory)."""
        if self.stack_dir is None:
            return None
        return xray.Reach.of(self.stack_dir, self._ranks().values())

    def where_stuck(self, ranks: tuple[int, ...]) -> str:
        """One line per rank saying where its main thread is (works while it is blocked): for ranks
        on this host from faulthandler's dump (which works even while a rank holds the GIL), for
        ranks on other hosts from their X-ray thread."""
        reach = self.reach()
        if reach is None:
            return ""
        here = socket.gethostname()
        infos = {info.rank: info for info in self._infos(ranks)}
        local = {rank: info.pid for rank, info in infos.items() if info.host == here}
        dumps = stacks.request_stacks(local, reach.directory) if local else {}
        readings = xray.read_ranks(reach, infos)
        places: list[tuple[int, str, float | None]] = []
        for rank, info in infos.items():
            if rank in local:
                frames = stacks.main_thread_frames(dumps.get(rank, ""), info.main_thread or 0)
            else:
                frames = xray.main_thread_frames(reach, rank)
            reading = readings.get(rank)
            current = reading.current if reading is not None else None
            place = stacks.describe_stuck_rank(frames, current is not None)
            if reading is not None and current is not None:
                places.append((rank, f"{place}; {current.describe()}", reading.waited))
            else:
                places.append((rank, place, None))
        # the ranks in the same place share a line at every size, their waits as a range
        return "\n".join(grouped_waits(places))

    def collectives(self, ranks: tuple[int, ...], full: bool = False) -> dict[int, RankCollectives]:
        """The collective X-ray of `ranks` (answered while they are blocked); light unless `full`
        (see xray.read_ranks)."""
        reach = self.reach()
        return xray.read_ranks(reach, ranks, full) if reach is not None else {}

    def debug(self, rank: int) -> None:
        """Drive `rank`'s waiting pdb session from the notebook until the user continues or quits."""
        reach = self.reach()
        if reach is not None:
            debugging.drive(reach, rank)

    def release_blocked(self, ranks: tuple[int, ...]) -> None:
        """Make `ranks`, blocked in a collective, fail out of it (their processes live on)."""
        reach = self.reach()
        if reach is not None:
            xray.release(reach, ranks)

    def release(self, ranks: tuple[int, ...]) -> None:
        """Make `ranks` let go of the process group, so peers blocked in it with them fail."""
        engine_ids = [info.engine_id for info in self._infos(ranks)]
        client: Any = self.provisioner.client
        try:
            client[engine_ids].apply_async(rank_calls.release_group).get(timeout=RELEASE_SECONDS)
        except Exception:
            log.debug("releasing the process group on ranks %s failed", ranks, exc_info=True)
