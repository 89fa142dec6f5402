"""The cell an earlier kernel sent a detached world, as its ranks kept it (`rank.cell_journal`): what
`%ddp_attach` says the world is doing, and the `%%ddp` cell refused while that cell still runs.

Read over each rank's X-ray line, which a thread of the rank answers while its cell runs. The cell
is "earlier" when another kernel (another ipyparallel session) sent it; `following` shows it and
follows it to its end. Notebook side (no torch).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cell import xray
from ..errors import DDPUsageError, name_ranks
from ..wire import journal as wire
from .detached import ago

if TYPE_CHECKING:
    from .running import RunningWorld


@dataclass(frozen=True)
class EarlierCell:
    """The newest cell an earlier kernel sent the world, as its ranks kept it."""

    journals: Mapping[int, wire.JournalCell]  # rank -> its record of the cell

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.journals))

    @property
    def running(self) -> tuple[int, ...]:
        return tuple(rank for rank, cell in sorted(self.journals.items()) if cell["status"] == "running")

    @property
    def failed(self) -> tuple[int, ...]:
        return tuple(rank for rank, cell in sorted(self.journals.items()) if cell["status"] != "ok" and cell["ended"])

    @property
    def started(self) -> float:
        return min(cell["started"] for cell in self.journals.values())

    def describe(self, now: float | None = None) -> str:
        """One line for `%ddp_attach`: what the cell is doing, and how to see it."""
        now = time.time() if now is None else now
        first = _first_line(next(iter(self.journals.values()))["code"])
        began = f"a cell sent by an earlier kernel ({first!r}) began {ago(max(0.0, now - self.started))} ago"
        if self.running:
            return f"{began} and still runs on {name_ranks(self.running)}: %ddp_wait shows its output and follows it"
        ended = max(cell["ended"] or 0.0 for cell in self.journals.values())
        how = f"failed on {name_ranks(self.failed)}" if self.failed else "ended"
        return f"{began} and {how} {ago(max(0.0, now - ended))} ago: %ddp_wait shows its output and its end"


def earlier_cell(world: RunningWorld) -> EarlierCell | None:
    """The newest cell of the world's ranks that an earlier kernel sent (None: none, or the world's
    ranks keep no journal: a world that is not detached)."""
    ours = world.client.session.session
    reach = world.supervisor.reach()
    if reach is None:
        return None
    found: dict[int, wire.JournalCell] = {}
    for rank in sorted(world.ranks):
        answer = xray.ask(reach, rank, wire.journal_request(0, limit=0))
        cell = answer.get("cell") if answer else None
        if cell is not None and cell["session"] != ours:
            found[rank] = cell
    if not found:
        return None
    newest = max(found.values(), key=lambda cell: cell["started"])
    same = {
        rank: cell
        for rank, cell in found.items()
        if (cell["session"], cell["code"]) == (newest["session"], newest["code"])
    }
    return EarlierCell(same)


def refuse_while_running(world: RunningWorld) -> None:
    """Before a cell is sent to a detached world attached again: its ranks would queue it behind a cell
    an earlier kernel left running, and run it, silent, once that one ends. Said instead, once per
    such cell: after it ended, the world's ranks are read no more before a cell."""
    if world.earlier_cell_checked:
        return
    earlier = earlier_cell(world)
    if earlier is not None and earlier.running:
        raise DDPUsageError(
            f"a cell an earlier kernel sent still runs on {name_ranks(earlier.running)}: %ddp_wait follows it "
            "to its end (%ddp_interrupt stops it)"
        )
    world.earlier_cell_checked = True


def _first_line(code: str) -> str:
    line = next((line.strip() for line in code.splitlines() if line.strip()), "")
    return line if len(line) <= 40 else line[:37] + "..."
