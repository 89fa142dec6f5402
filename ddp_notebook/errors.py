"""The DDPError family, and how its messages name ranks.

`UsageError`-style mistakes (bad arguments, no world running) derive from `DDPUsageError`
so the magics can turn them into IPython `UsageError`s: one line, no traceback. A message names
ranks through `name_ranks` ("rank 3", "ranks 1-15", "ranks 0-511, 513-1023"), and a failure report
gives the ranks that failed the same way one line, at 3 ranks as at 1,000.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .wire.results import Death

# up to this many ranks a view (the live view, the X-ray, %ddp_status) has a line per rank; above,
# ranks that say the same share one (failure reports group at every size)
GROUP_ABOVE = 16
# a list of ranks in a message names at most this many runs ("0-3, 5, 7-9": 3 runs)
RUNS_SHOWN = 8


def rank_ranges(ranks: Iterable[int], limit: int | None = RUNS_SHOWN) -> str:
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


def name_ranks(ranks: Iterable[int], limit: int | None = RUNS_SHOWN) -> str:
    """Ranks for a message, as runs: "rank 3", "ranks 1-15", "ranks 0, 2, 4, ... (509 more)"; "" for none."""
    chosen = set(ranks)
    if not chosen:
        return ""
    return f"rank{'s' if len(chosen) > 1 else ''} {rank_ranges(chosen, limit)}"


def name_counted(ranks: Iterable[int]) -> str:
    """`name_ranks`, with the count where the runs do not make it plain at a glance: "ranks 1-15",
    "ranks 0, 2", "ranks 0-511, 513-1023 (1,023 ranks)"."""
    chosen = sorted(set(ranks))
    named = name_ranks(chosen)
    runs = 1 + sum(1 for a, b in itertools.pairwise(chosen) if b != a + 1)
    return f"{named} ({count_ranks(len(chosen))})" if runs > 1 and len(chosen) > GROUP_ABOVE else named


def group_ranks(described: Iterable[tuple[int, str]]) -> dict[str, list[int]]:
    """(rank, what it says) pairs as {what: its ranks}, in the order of each group's lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, what in sorted(described):
        groups.setdefault(what, []).append(rank)
    return groups


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
    # seconds since the epoch the rank raised (where it could not say: reported) the error
    failed_at: float | None = None

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
        busy_doing: str = "",
    ) -> None:
        if not failures:
            raise ValueError("RankError needs at least one failure")
        self.failures = sorted(failures, key=_failure_order)
        self.busy_ranks = busy_ranks
        # what the busy ranks were doing when the cell ended, grouped ("ranks 1-3 running cell line 3, ...")
        self.busy_doing = busy_doing
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
            lines.append(f"still running when the cell ended: {self.busy_doing or name_ranks(self.busy_ranks)}")
        if root.ename == "SystemExit":
            lines.append("(sys.exit() ends the cell, not the rank: the world keeps running; %ddp_stop ends it)")
        if self.note:
            lines.append(self.note)
        return lines


def failure_lines(
    failures: list[RankFailure], released_from: Mapping[int, str], verb: str = "also failed"
) -> list[str]:
    """One line per kind of failure, its ranks as runs, at every world size: the ranks released from
    the same collective share one ("ranks 1-15 also failed: RuntimeError: Connection closed by peer
    [127.0.0.1]:40000 (released from all_reduce #1 at cell line 5)"), whatever each raised then; the
    others share one where their errors are the same, numbers aside (gloo names each peer's port)."""
    groups: dict[str, list[RankFailure]] = {}
    for failure in failures:
        where = released_from.get(failure.rank)
        key = f"released from {where}" if where else re.sub(r"\d+", "#", short_summary(failure.summary))
        groups.setdefault(key, []).append(failure)
    lines = []
    for key, members in sorted(groups.items(), key=lambda item: min(f.rank for f in item[1])):
        first = min(members, key=lambda f: f.rank)
        if first.rank in released_from:
            said = f" ({key})"
        else:  # the same error, numbers aside: the first one's text, said to be one of several
            said = " (numbers vary)" if len({f.summary for f in members}) > 1 else ""
        lines.append(f"{name_counted(f.rank for f in members)} {verb}: {short_summary(first.summary)}{said}")
    return lines


# gloo's errors open with its source file and end with advice; the middle says what happened
_GLOO_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\] ")
_GLOO_ADVICE = ". This is typically caused by"


def short_summary(summary: str) -> str:
    """An error's one line without gloo's source-file prefix and advice: "RuntimeError: Connection
    closed by peer [127.0.0.1]:40000" (its full text stays in the traceback %ddp_debug shows)."""
    summary = _GLOO_SOURCE.sub("", summary, count=1)
    cut = summary.find(_GLOO_ADVICE)
    return summary[:cut] if cut >= 0 else summary


def _failure_order(failure: RankFailure) -> tuple[float, int]:
    # ranks with no timestamp sort after those that have one; ties go to the lower rank
    failed_at = failure.failed_at if failure.failed_at is not None else float("inf")
    return (failed_at, failure.rank)


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
        died = name_deaths(dead)
        if came_back:
            super().__init__(f"{died}. {came_back}")
        else:
            lost = f"{note}; its state is lost" if note else "Its state is lost"
            super().__init__(f"{died}. {lost}; %ddp_restart (or restart()) starts a full world again")

    def _render_traceback_(self) -> list[str]:
        return [str(self), *failure_lines(self.failures, self.released_from, "then failed")]


def name_deaths(dead: Mapping[int, Death]) -> str:
    """How ranks ended, the ranks that ended the same way together: "ranks 2-3 were killed by SIGKILL"."""
    parts = []
    for how, ranks in group_ranks((rank, str(death)) for rank, death in dead.items()).items():
        said = f"were {how[4:]}" if len(ranks) > 1 and how.startswith("was ") else how
        parts.append(f"{name_ranks(ranks)} {said}")
    return "; ".join(parts)


class CellTimeoutError(DDPError):
    """A cell ran past its time limit; the ranks were interrupted."""

    def __init__(self, timeout: float, busy_ranks: tuple[int, ...], detail: str = "") -> None:
        self.timeout = timeout
        self.busy_ranks = busy_ranks
        running = f"still running: {name_ranks(busy_ranks)}" if busy_ranks else "every rank was stopped"
        message = f"cell exceeded its {timeout:g} s limit; {running}"
        super().__init__(message + (f"\n{detail}" if detail else ""))

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


class CellStillRunning(DDPError):
    """`DDPCluster.wait` stopped following at its time limit: the cell goes on on the ranks."""

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


@contextmanager
def failing_as(
    doing: str,
    then: str = "",
    *,
    error: type[DDPError] = DDPError,
    keep_ddp_errors: bool = False,
    chained: bool = False,
) -> Iterator[None]:
    """Whatever fails inside, said as one `error`: "could not {doing}: {what failed}{then}" (a remote
    failure as the rank raised it, `one_line`). A DDPError keeps its own words after the prefix, or
    goes through as it is with `keep_ddp_errors`; KeyboardInterrupt always goes through. With
    `chained`, the failure stays the error's cause (its traceback is shown under the line)."""
    try:
        yield
    except DDPError as failure:
        if keep_ddp_errors:
            raise
        raise error(f"could not {doing}: {failure}{then}") from (failure if chained else None)
    except Exception as failure:  # noqa: BLE001  (any failure is said as one line)
        raise error(f"could not {doing}: {one_line(failure)}{then}") from (failure if chained else None)


class InsecureNetworkWarning(UserWarning):
    """The world's torch.distributed traffic crosses a network: gloo's and NCCL's is neither encrypted
    nor authenticated (the rendezvous store's values are signed on gloo, not encrypted)."""
