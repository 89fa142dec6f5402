"""The DDPError family, and how its messages name ranks.

`UsageError`-style mistakes (bad arguments, no world running) derive from `DDPUsageError`
so the magics can turn them into IPython `UsageError`s: one line, no traceback. Up to
GROUP_ABOVE ranks a message names each rank; in a larger world it writes them as runs
("0-511, 513-1023") and groups the ranks that say the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .wire.results import Death

# up to this many ranks a report has a line per rank; above, ranks that say the same share one
GROUP_ABOVE = 16
# a list of ranks in a report names at most this many runs ("0-3, 5, 7-9": 3 runs)
RUNS_SHOWN = 8


def rank_ranges(ranks: Iterable[int], limit: int | None = None) -> str:
    """Ranks as runs, sorted and without repeats: [0, 1, 2, 3, 5, 7, 8, 9] -> "0-3, 5, 7-9";
    past `limit` runs, the rest counted: "0, 2, 4, ... (509 more)"."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    shown = runs if limit is None or len(runs) <= limit else runs[:limit]
    text = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in shown)
    if len(shown) < len(runs):
        more = sum(last - first + 1 for first, last in runs[len(shown) :])
        text += f", ... ({more:,} more)"
    return text


def count_ranks(count: int) -> str:
    """ "1 rank", "1,023 ranks"."""
    return f"{count:,} rank{'' if count == 1 else 's'}"


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

    def __init__(
        self,
        failures: list[RankFailure],
        *,
        busy_ranks: tuple[int, ...] = (),
        note: str = "",
        released_from: Mapping[int, str] | None = None,
    ) -> None:
        if not failures:
            raise ValueError("RankError needs at least one failure")
        self.failures = sorted(failures, key=_failure_order)
        self.busy_ranks = busy_ranks
        self.note = note
        # rank -> the collective it was blocked in when the world released it ("all_reduce #4 at cell line 7")
        self.released_from = dict(released_from or {})
        root = self.failures[0]
        super().__init__(f"rank {root.rank} raised {root.summary}")

    @property
    def root_cause(self) -> RankFailure:
        return self.failures[0]

    def _render_traceback_(self) -> list[str]:
        root = self.root_cause
        lines = [f"rank {root.rank} failed first (root cause):"]
        lines.extend(root.traceback or (root.summary,))
        lines.extend(failure_lines(self.failures[1:], self.released_from))
        if self.busy_ranks:
            lines.append(f"ranks still running when the cell ended: {rank_list(self.busy_ranks)}")
        if root.ename == "SystemExit":
            lines.append("(sys.exit() ends the cell, not the rank: the world keeps running; %ddp_stop ends it)")
        if self.note:
            lines.append(self.note)
        return lines


def failure_lines(
    failures: list[RankFailure], released_from: Mapping[int, str], verb: str = "also failed"
) -> list[str]:
    """A line per failing rank (`rank 3 also failed: ...`); past GROUP_ABOVE of them, one per collective
    the ranks were released from ("1,023 ranks were released from all_reduce #412 at cell line 7: ...")
    and one per kind of error, numbers aside (gloo names each peer's port)."""
    if len(failures) <= GROUP_ABOVE:
        return [
            f"rank {f.rank} {verb}: {f.summary}"
            + (f" (released from {released_from[f.rank]})" if f.rank in released_from else "")
            for f in failures
        ]
    groups: dict[str, list[RankFailure]] = {}
    for failure in failures:
        where = released_from.get(failure.rank)
        key = f"released from {where}" if where else re.sub(r"\d+", "#", failure.summary)
        groups.setdefault(key, []).append(failure)
    lines = []
    for key, members in groups.items():
        ranks = rank_ranges((f.rank for f in members), RUNS_SHOWN)
        first = members[0]
        if first.rank in released_from:
            lines.append(f"{count_ranks(len(members))} were {key}: {ranks} ({first.summary})")
        elif len(members) == 1:
            lines.append(f"rank {first.rank} {verb}: {first.summary}")
        else:
            lines.append(f"{count_ranks(len(members))} {verb} ({ranks}): {first.summary}")
    return lines


def rank_list(ranks: tuple[int, ...]) -> str:
    """Ranks for a message: "0, 1, 3", or past GROUP_ABOVE of them as runs ("0-511, 513-1023")."""
    return ", ".join(map(str, ranks)) if len(ranks) <= GROUP_ABOVE else rank_ranges(ranks, RUNS_SHOWN)


def _failure_order(failure: RankFailure) -> tuple[float, int]:
    # ranks with no timestamp sort after those that have one; ties go to the lower rank
    completed = failure.completed if failure.completed is not None else float("inf")
    return (completed, failure.rank)


class WorldBrokenError(DDPUsageError):
    """A rank of this world died; the world must be restarted before it can run cells."""


class RankDiedError(DDPError):
    """A rank's process died while running a cell."""

    def __init__(
        self,
        dead: Mapping[int, Death],
        failures: list[RankFailure],
        came_back: str = "",
        note: str = "",
        released_from: Mapping[int, str] | None = None,
    ) -> None:
        self.dead = dict(dead)
        self.failures = [f for f in failures if f.rank not in dead]
        self.released_from = dict(released_from or {})
        # what happened after: the world replaced the rank ("" when it could not)
        self.came_back = came_back
        died = "; ".join(f"rank {rank} {how}" for rank, how in sorted(dead.items()))
        if came_back:
            super().__init__(f"{died}. {came_back}")
        else:
            lost = f"{note}; its state is lost" if note else "Its state is lost"
            super().__init__(f"{died}. {lost}; %ddp_restart (or restart()) starts a full world again")

    def _render_traceback_(self) -> list[str]:
        return [str(self), *failure_lines(self.failures, self.released_from, "then failed")]


class CellTimeoutError(DDPError):
    """A cell ran past its time limit; the ranks were interrupted."""

    def __init__(self, timeout: float, busy_ranks: tuple[int, ...], detail: str = "") -> None:
        self.timeout = timeout
        self.busy_ranks = busy_ranks
        ranks = rank_list(busy_ranks) or "none"
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
