"""How a cell ended, as a value, and the one mapping from it to the error a caller sees.

`DDPCluster.run` returns a `CellOutcome`; `DDPCluster.execute` and `%%ddp` both call
`raise_for_error()` on it, so a cell that failed reads the same from Python and from a
notebook.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ..errors import (
    CellInterruptedError,
    CellTimeoutError,
    DDPError,
    RankDiedError,
    RankError,
    RankFailure,
    name_ranks,
)
from ..wire.channel import CellEnd
from ..wire.results import CellResult, Death
from .xray import CollectiveMismatchError, Mismatch


class Ending(str, Enum):
    """Why the wait for a cell ended."""

    DONE = "done"  # every rank replied (some may have raised)
    TIMEOUT = "timeout"  # past the cell's time limit: the ranks were interrupted
    INTERRUPTED = "interrupted"  # Ctrl-C / the notebook's stop button


@dataclass(frozen=True)
class CellOutcome:
    """Everything about how one cell ended on its ranks."""

    result: CellResult
    ending: Ending = Ending.DONE
    failures: tuple[RankFailure, ...] = ()
    dead: Mapping[int, Death] = field(default_factory=dict)  # rank -> how its process ended
    unfinished: tuple[int, ...] = ()  # ranks still running when the wait ended
    timeout: float | None = None
    stuck_report: str = ""  # where each rank was when the time limit struck
    heal_note: str = ""  # what became of the process group, when the cell broke it
    came_back: str = ""  # how the world replaced its dead ranks (comeback), when it did
    mismatch: Mismatch | None = None  # ranks blocked in collectives that could never match
    # rank -> the collective it was blocked in when released (its failure is that release)
    released_from: Mapping[int, str] = field(default_factory=dict)
    # what the unfinished ranks were doing when the wait ended, from their X-ray (cell/busy.py)
    busy_doing: str = ""

    @property
    def ok(self) -> bool:
        return self.ending is Ending.DONE and not self.failures and not self.dead

    @property
    def view_state(self) -> CellEnd | None:
        """How the live view marks the ranks that never said how they ended: None after a clean run."""
        if self.ending is not Ending.DONE:
            return "stopped"
        return None if self.ok else "failed"

    def error(self) -> DDPError | None:
        """The exception this outcome means for the caller (None when the cell succeeded)."""
        if self.ending is Ending.INTERRUPTED:
            busy = f"; still running: {self.busy_doing or name_ranks(self.unfinished)}" if self.unfinished else ""
            ranks = name_ranks(self.result.ranks)
            return CellInterruptedError(f"cell interrupted on {ranks}{busy}{self.heal_note}")
        if self.ending is Ending.TIMEOUT:
            assert self.timeout is not None
            return CellTimeoutError(self.timeout, self.unfinished, self.stuck_report + self.heal_note)
        if self.mismatch is not None and self.failures and not self.dead:
            return CollectiveMismatchError(self.mismatch, self.failures, self.heal_note)
        if self.dead:
            return RankDiedError(
                dict(self.dead), list(self.failures), self.came_back, self.heal_note.strip(), self.released_from
            )
        if self.failures:
            return RankError(
                list(self.failures),
                busy_ranks=self.unfinished,
                note=self.heal_note.strip(),
                released_from=self.released_from,
                busy_doing=self.busy_doing,
            )
        return None

    def raise_for_error(self) -> CellResult:
        """The cell's result, or the error its ending means."""
        error = self.error()
        if error is not None:
            raise error
        return self.result
