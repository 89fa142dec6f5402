"""A large world's output as the notebook shows it: readable whatever the rank count.

Up to SHOW_ALL_UP_TO ranks every line of every rank is shown, tagged. Above, a `print` in a
training loop would bring a line per rank per step (1,024 lines for one `print` at 1,024 ranks),
so by default:
- stdout is shown for rank 0 only (`%%ddp --show RANKS` picks others, or `all`);
- stderr (warnings, errors) is shown for every rank, and the same line from several ranks close
  together (FOLD_SECONDS) is shown once, with its ranks: `[ranks 0-1023] UserWarning: ...`; the
  same line again later in the cell (a rank that came late, a warning in a loop) is counted, and
  the cell's last line names its ranks, as Python's warnings show a warning once;
- every line of every rank is kept (the last KEEP_BYTES_TOTAL / ranks bytes of each), so one
  rank's whole output stays a call away: `world.output(rank)`, `%ddp_output RANK`.

Pure bookkeeping: the relay hands lines in and writes what comes out.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from ..errors import GROUP_ABOVE, RUNS_SHOWN, count_ranks, rank_ranges
from .output import rank_prefix

# worlds up to this many ranks show every line of every rank (and their reports a line per rank)
SHOW_ALL_UP_TO = GROUP_ABOVE
# the same stderr line from several ranks is shown once: it waits until every rank said it, or no
# other rank said it for FOLD_SECONDS (a warning every rank prints reaches the notebook within a
# few of ipykernel's 0.2 s output flushes, spread as the ranks started the cell), and at most
# FOLD_MAX_SECONDS (ranks starved of CPU spread it over seconds)
FOLD_SECONDS = 0.3
FOLD_MAX_SECONDS = 5.0
# a line said again after it was shown is named at the end by its first words
QUOTED_CHARS = 32
# how many shown lines are remembered for that (the oldest forgotten first: a bound on the kernel's
# memory when every line differs)
REMEMBERED_LINES = 4096
# what the kernel keeps of one cell's output, all ranks together (each rank gets its share)
KEEP_BYTES_TOTAL = 64 * 2**20
KEEP_BYTES_MAX = 1 * 2**20


def default_shown(world_size: int) -> frozenset[int] | None:
    """Whose stdout a cell shows when not told: everyone's (None) in a small world, rank 0's above."""
    return None if world_size <= SHOW_ALL_UP_TO else frozenset({0})


def for_world(world_size: int, show: Iterable[int] | None = None) -> LargeOutput:
    """The routing of a cell's output in a world of `world_size` ranks: every line shown as it comes
    up to SHOW_ALL_UP_TO ranks; above, stdout of `show` (default: rank 0's) and stderr folded
    across ranks."""
    shown = frozenset(show) if show is not None else default_shown(world_size)
    return LargeOutput(world_size, shown, fold=world_size > SHOW_ALL_UP_TO)


class KeptOutput:
    """One rank's output of one cell, the last `limit` bytes of it (whole lines)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: deque[str] = deque()
        self.size = 0
        self.dropped = 0  # earliest lines let go to stay under the limit

    def add(self, stream: str, lines: Iterable[str]) -> None:
        mark = "! " if stream == "stderr" else ""
        for line in lines:
            text = mark + line
            self.lines.append(text)
            self.size += len(text) + 1
            while self.size > self.limit and len(self.lines) > 1:
                self.size -= len(self.lines.popleft()) + 1
                self.dropped += 1

    def text(self) -> str:
        head = f"... ({self.dropped:,} earlier lines not kept)\n" if self.dropped else ""
        return head + "".join(line + "\n" for line in self.lines)


class LargeOutput:
    """Routes a cell's lines: which are shown now, which are folded, which are only kept.

    `take(rank, stream, lines)` returns the (stream, text) to write at once; `due()` the folded
    stderr whose window closed; `finish()` the rest and a note of what was not shown.
    `shown`: the ranks whose stdout is shown (None: every rank's); `fold`: whether stderr lines are
    folded across ranks (above SHOW_ALL_UP_TO ranks) or shown as they come, as a small world's are.
    """

    def __init__(
        self,
        world_size: int,
        shown: frozenset[int] | None,
        clock: Callable[[], float] = time.monotonic,
        fold_seconds: float = FOLD_SECONDS,
        fold: bool = True,
    ) -> None:
        self.shown = shown
        self.fold = fold
        self._world_size = world_size
        self._clock = clock
        self._fold_seconds = fold_seconds
        self._limit = max(4096, min(KEEP_BYTES_MAX, KEEP_BYTES_TOTAL // max(1, world_size)))
        self.kept: dict[int, KeptOutput] = {}
        # stderr lines waiting to be folded: text -> (when the first came, when the last came, its ranks)
        self._folding: dict[str, tuple[float, float, list[int]]] = {}
        # stderr lines already shown, and who said them again since: text -> [times, ranks]
        self._again: dict[str, tuple[list[int], set[int]]] = {}
        self.hidden_lines = 0
        self.hidden_ranks: set[int] = set()

    def take(self, rank: int, stream: str, lines: list[str]) -> list[tuple[str, str]]:
        if not lines:
            return []
        kept = self.kept.get(rank)
        if kept is None:
            kept = self.kept[rank] = KeptOutput(self._limit)
        kept.add(stream, lines)
        if stream == "stderr" and self.fold:
            now = self._clock()
            for line in lines:
                again = self._again.get(line)
                if again is not None:
                    again[0][0] += 1
                    again[1].add(rank)
                    continue
                first, _, ranks = self._folding.get(line, (now, now, []))
                ranks.append(rank)
                self._folding[line] = (first, now, ranks)
            return self.due(now)
        if self.shown is None or rank in self.shown or stream == "stderr":
            prefix = rank_prefix(rank)
            return [(stream, "".join(f"{prefix}{line}\n" for line in lines))]
        self.hidden_lines += len(lines)
        self.hidden_ranks.add(rank)
        return []

    def due(self, now: float | None = None) -> list[tuple[str, str]]:
        """The folded stderr lines every rank said, or no rank added to for FOLD_SECONDS (or waiting
        FOLD_MAX_SECONDS), in the order they first came."""
        if not self._folding:
            return []
        now = self._clock() if now is None else now
        ready = [
            line
            for line, (first, last, ranks) in self._folding.items()
            if now - last >= self._fold_seconds
            or now - first >= FOLD_MAX_SECONDS
            or (len(ranks) >= self._world_size and len(set(ranks)) == self._world_size)
        ]
        return self._emit(ready)

    def finish(self) -> list[tuple[str, str]]:
        """Everything still folding, a line for each shown line said again, then one line on what
        was kept and not shown."""
        out = self._emit(list(self._folding))
        repeats = "".join(
            self._said_again(line, times[0], ranks) for line, (times, ranks) in self._again.items() if ranks
        )
        if repeats:
            out.append(("stderr", repeats))
        if self.hidden_lines:
            out.append(("stdout", self.note() + "\n"))
        return out

    def note(self) -> str:
        ranks = sorted(self.hidden_ranks)
        return (
            f"({self.hidden_lines:,} lines of {count_ranks(len(ranks))} not shown ({rank_ranges(ranks, RUNS_SHOWN)}): "
            f"%ddp_output RANK or world.output(rank) shows one rank's; %%ddp --show RANKS shows them live)"
        )

    def output(self, rank: int) -> str:
        kept = self.kept.get(rank)
        return kept.text() if kept is not None else ""

    @staticmethod
    def _said_again(line: str, times: int, ranks: set[int]) -> str:
        quoted = line
        if len(line) > QUOTED_CHARS:  # cut at a word where there is one
            head = line[:QUOTED_CHARS]
            quoted = (head.rsplit(" ", 1)[0] if " " in head.strip() else head).rstrip() + "…"
        more = "once more" if times == 1 else f"{times:,} more times"
        return (
            f'(the line "{quoted}" came {more}, after it was shown, from {count_ranks(len(ranks))} '
            f"({rank_ranges(ranks, RUNS_SHOWN)}): %ddp_output RANK shows each)\n"
        )

    def _emit(self, lines: list[str]) -> list[tuple[str, str]]:
        if not lines:
            return []
        text = []
        for line in lines:
            _, _, ranks = self._folding.pop(line)
            self._again[line] = ([0], set())
            if len(self._again) > REMEMBERED_LINES:
                del self._again[next(iter(self._again))]
            distinct = sorted(set(ranks))
            if len(distinct) == 1:
                text.append(f"{rank_prefix(distinct[0])}{line}\n")
            else:
                text.append(f"[ranks {rank_ranges(distinct, RUNS_SHOWN)}] {line}\n")
        return [("stderr", "".join(text))]
