"""Watching a running world on behalf of a cell: dead ranks, interrupts, stuck ranks, releases.

The relay asks these questions while it waits for a cell (`relay.CellSupervisor`); the
answers come from the provisioner (processes), the controller link and the ranks themselves.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Any

from . import rank_calls, stacks
from .controller import ControllerLink
from .provisioning import Provisioner
from .results import RankInfo

log = logging.getLogger("ddp_notebook")
RELEASE_SECONDS = 10.0


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

    def _infos(self, ranks: tuple[int, ...]) -> list[RankInfo]:
        current = self._ranks()
        return [current[r] for r in ranks if r in current]

    def interrupt(self, ranks: tuple[int, ...]) -> None:
        self.provisioner.signal(self._infos(ranks), signal.SIGINT)

    def find_dead(self, ranks: tuple[int, ...]) -> dict[int, str]:
        lost = self.controller.lost()
        if lost is not None:
            return {rank: f"cannot be reached: {lost}" for rank in ranks}
        return self.provisioner.dead_ranks(self._infos(ranks))

    def where_stuck(self, ranks: tuple[int, ...]) -> str:
        """One line per rank on this host saying where its main thread is (works while it is blocked)."""
        here = socket.gethostname()
        infos = {info.rank: info for info in self._infos(ranks) if info.host == here}
        if not infos or self.stack_dir is None:
            return ""
        dumps = stacks.request_stacks({r: info.pid for r, info in infos.items()}, self.stack_dir)
        lines = []
        for rank, info in infos.items():
            frames = stacks.main_thread_frames(dumps.get(rank, ""), info.main_thread or 0)
            lines.append(f"rank {rank}: {stacks.describe_stuck_rank(frames)}")
        return "\n".join(lines)

    def release(self, ranks: tuple[int, ...]) -> None:
        """Make `ranks` let go of the process group, so peers blocked in it with them fail."""
        engine_ids = [info.engine_id for info in self._infos(ranks)]
        client: Any = self.provisioner.client
        try:
            client[engine_ids].apply_async(rank_calls.release_group).get(timeout=RELEASE_SECONDS)
        except Exception:
            log.debug("releasing the process group on ranks %s failed", ranks, exc_info=True)
