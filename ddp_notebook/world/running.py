"""RunningWorld: everything a started world holds, as one value.

`DDPCluster` has one while its world runs and None once it is stopped, so no part of a running
world (its processes, the controller link, the supervisor, the rank map...) can be missing while
another is there. `comeback` and `heal` work on it and leave it with the new rank map.
Notebook side (no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..cell import ipp_adapter
from ..wire.results import RankInfo
from . import forming
from .controller import ControllerLink
from .provisioning import Provisioner
from .supervision import WorldSupervisor


@dataclasses.dataclass
class RunningWorld:
    """One world's running parts, from the moment its process group formed until it stops.

    Made by `open`, which connects the parts: the value itself starts nothing.
    """

    provisioner: Provisioner  # owns every process of the world (the only one that signals them)
    layout: forming.WorldLayout  # where each rank runs, the backend, the routes to rank 0
    ranks: dict[int, RankInfo]  # rank -> who it is now (changes when the world heals or a rank comes back)
    private_dir: str  # files only this user may read: the world's key, the ranks' stack dumps
    controller: ControllerLink  # questions to the world's controller, each with a time limit
    supervisor: WorldSupervisor  # what a cell's relay asks about the world while it waits
    # the cells that set a rank up (%%ddp --setup), replayed on a rank that replaces a dead one
    setup_cells: list[str] = dataclasses.field(default_factory=list)
    # whether a cell an earlier kernel left running is known not to run any more (`earlier_cell`): only
    # a detached world attached again can have one (its provisioner says so as it opens)
    earlier_cell_checked: bool = True
    _views: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict, init=False)

    @classmethod
    def open(
        cls, provisioner: Provisioner, layout: forming.WorldLayout, ranks: dict[int, RankInfo], private_dir: str
    ) -> RunningWorld:
        """The running parts of a world whose process group just formed: its controller link, and a
        supervisor watching its ranks (on other hosts, a watch connection to each from now on)."""
        ipp_adapter.parse_reply_dates_quickly()  # once per kernel: a tenth of a large world's round trip
        controller = ControllerLink(provisioner.client, provisioner.controller_pid)
        world: RunningWorld
        # the supervisor reads the rank map as it is when asked: it changes as the world heals
        supervisor = WorldSupervisor(provisioner, controller, lambda: world.ranks, private_dir)
        world = cls(provisioner, layout, ranks, private_dir, controller, supervisor)
        supervisor.watch_ranks()
        provisioner.opened(world)
        return world

    @property
    def client(self) -> Any:
        """The ipyparallel Client connected to the world's controller."""
        return self.provisioner.client

    def engines(self, ranks: list[int] | tuple[int, ...] | None = None) -> list[int]:
        """The engine ids of `ranks` (default: every rank), in rank order."""
        chosen = sorted(self.ranks) if ranks is None else ranks
        return [self.ranks[rank].engine_id for rank in chosen]

    def view(self, engine_ids: tuple[int, ...]) -> Any:
        """A DirectView on these engines, made once (one costs ~0.2 ms; a notebook reuses a few)."""
        view = self._views.get(engine_ids)
        if view is None:
            view = self._views[engine_ids] = self.client.direct_view(list(engine_ids))
        return view

    def regrouped(self, ranks: dict[int, RankInfo]) -> None:
        """The world formed its group again (a heal, a comeback, a resize): `ranks` is its rank map now."""
        self.ranks = ranks
        self._views.clear()  # engine ids may have changed
        self.supervisor.watch_ranks()  # new processes elsewhere: watched from now on
        self.provisioner.opened(self)  # a detached world's entry says who its ranks are now
