"""The DDPError family.

`UsageError`-style mistakes (bad arguments, no world running) derive from `DDPUsageError`
so the magics can turn them into IPython `UsageError`s: one line, no traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .wire.results import Death


class DDPError(Exception):
    """Base class of every error this package raises on purpose."""


class DDPUsageError(DDPError, ValueError):
    """The caller asked for something that cannot be done as asked (a user mistake)."""


class NotRunningError(DDPUsageError):
    """An operation needs a running world and there is none."""


class StartError(DDPError):
    """The world could not be started; nothing of it is left running."""


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank during a cell."""

    rank: int
    ename: str
    evalue: str
    traceback: tuple[str, ...] = ()
    completed: float | None = None  # seconds since the epoch the rank reported the error

    @property
    def summary(self) -> str:
        return f"{self.ename}: {self.evalue}" if self.evalue else self.ename


class RankError(DDPError):
    """One or more ranks raised while running a cell.

    `failures[0]` is the root cause: the rank that failed first. IPython renders this
    exception through `_render_traceback_`, so the notebook shows the remote traceback of
    the root cause and one line for each other failing rank, not this module's frames.
    """

    def __init__(self, failures: list[RankFailure], *, busy_ranks: tuple[int, ...] = (), note: str = "") -> None:
        if not failures:
            raise ValueError("RankError needs at least one failure")
        self.failures = sorted(failures, key=_failure_order)
        self.busy_ranks = busy_ranks
        self.note = note
        root = self.failures[0]
        super().__init__(f"rank {root.rank} raised {root.summary}")

    @property
    def root_cause(self) -> RankFailure:
        return self.failures[0]

    def _render_traceback_(self) -> list[str]:
        root = self.root_cause
        lines = [f"rank {root.rank} failed first (root cause):"]
        lines.extend(root.traceback or (root.summary,))
        for other in self.failures[1:]:
            lines.append(f"rank {other.rank} also failed: {other.summary}")
        if self.busy_ranks:
            ranks = ", ".join(str(r) for r in self.busy_ranks)
            lines.append(f"ranks still running when the cell ended: {ranks}")
        if root.ename == "SystemExit":
            lines.append("(sys.exit() ends the cell, not the rank: the world keeps running; %ddp_stop ends it)")
        if self.note:
            lines.append(self.note)
        return lines


def _failure_order(failure: RankFailure) -> tuple[float, int]:
    # ranks with no timestamp sort after those that have one; ties go to the lower rank
    completed = failure.completed if failure.completed is not None else float("inf")
    return (completed, failure.rank)


class WorldBrokenError(DDPUsageError):
    """A rank of this world died; the world must be restarted before it can run cells."""


class RankDiedError(DDPError):
    """A rank's process died while running a cell."""

    def __init__(
        self, dead: Mapping[int, Death], failures: list[RankFailure], came_back: str = "", note: str = ""
    ) -> None:
        self.dead = dict(dead)
        self.failures = [f for f in failures if f.rank not in dead]
        # what happened after: the world replaced the rank ("" when it could not)
        self.came_back = came_back
        died = "; ".join(f"rank {rank} {how}" for rank, how in sorted(dead.items()))
        if came_back:
            super().__init__(f"{died}. {came_back}")
        else:
            lost = f"{note}; its state is lost" if note else "Its state is lost"
            super().__init__(f"{died}. {lost}; %ddp_restart (or restart()) starts a full world again")

    def _render_traceback_(self) -> list[str]:
        lines = [str(self)]
        lines.extend(f"rank {f.rank} then failed: {f.summary}" for f in self.failures)
        return lines


class CellTimeoutError(DDPError):
    """A cell ran past its time limit; the ranks were interrupted."""

    def __init__(self, timeout: float, busy_ranks: tuple[int, ...], detail: str = "") -> None:
        self.timeout = timeout
        self.busy_ranks = busy_ranks
        ranks = ", ".join(str(r) for r in busy_ranks) or "none"
        message = f"cell exceeded its {timeout:g} s limit; ranks still running: {ranks}"
        super().__init__(message + (f"\n{detail}" if detail else ""))

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


class CellInterruptedError(DDPError):
    """The user interrupted a cell; the ranks were sent SIGINT."""

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def one_line(failure: BaseException) -> str:
    """A failure as one line; a rank's exception relayed by ipyparallel as the rank raised it."""
    ename, evalue = getattr(failure, "ename", None), getattr(failure, "evalue", None)
    if ename:
        return f"{ename}: {evalue}" if evalue else str(ename)
    text = str(failure).strip().splitlines()
    return text[-1] if text else type(failure).__name__


class InsecureNetworkWarning(UserWarning):
    """The world's torch.distributed traffic crosses a network: gloo's and NCCL's is neither encrypted
    nor authenticated (the rendezvous store's values are signed on gloo, not encrypted)."""
