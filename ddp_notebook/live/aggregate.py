"""The live view of a large world: what every rank did, summed up in a size that does not grow with it.

Above AGGREGATE_ABOVE ranks one bar and one curve per rank stop being readable (and cost bytes
per redraw that grow with the world), so the live view draws instead:

- `summarize_progress`: one line for a level of progress bars (median, extremes, the slowest ranks);
- `band`: one curve per metric, the median across ranks with its 10-90 % band and its extremes,
  at most `budget` points whatever the number of ranks and steps;
- `outlier_ranks`: the ranks whose latest value stands out (a robust z-score);
- `StepHeat`: seconds per step, ranks x time, in bounded memory, banded to at most `rows` rows.

Plain data in, plain data out; drawing is the widgets' business. Standard library only: the
notebook kernel never imports torch or numpy for this.
"""

from __future__ import annotations

import math
import statistics
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from ..errors import count_ranks, rank_ranges

if TYPE_CHECKING:
    from .feed import BarState, Metrics

# worlds with more ranks than this draw the aggregate instead of one bar and one curve per rank
AGGREGATE_ABOVE = 16
# band(): the median and the 10-90 % band of one point come from at most about this many values (those at
# the bucket's latest QUANTILE_VALUES // ranks steps): exact in all but crowded buckets, and the sorts stay bounded
QUANTILE_VALUES = 1024
# StepHeat: time buckets kept per rank, and the first bucket's width in seconds (it doubles as the cell runs on)
HEAT_SLOTS = 128
HEAT_FIRST_WIDTH = 0.125


def wants_aggregate(world_size: int) -> bool:
    """Whether a world of `world_size` ranks is drawn as an aggregate (more than AGGREGATE_ABOVE ranks)."""
    return world_size > AGGREGATE_ABOVE


# ---------------------------------------------------------------- progress bars


@dataclass(frozen=True)
class RankProgress:
    """Where one rank's bar stands: its count and its rate (items per second, None before it has one)."""

    rank: int
    n: int
    rate: float | None

    def describe(self) -> str:
        """'rank 17 (98, 3.1 it/s)'."""
        rate = f", {self.rate:.1f} it/s" if self.rate is not None else ""
        return f"rank {self.rank} ({self.n}{rate})"


@dataclass(frozen=True)
class ProgressSummary:
    """The bars of one nesting level across the ranks, in a size that does not grow with them.

    Ranks are ordered by how far they got: first by loop (a bar's id counts the loops a rank
    opened, the same on every rank of an SPMD cell), then by count, then by rate. `minimum` and
    `maximum` are the counts of `laggard` and `fastest`; `median` is the median count (of the
    lower middle rank when the two middle ranks are on different loops). `earlier` and `later`
    count the ranks on another loop than the median rank's (an epoch behind or ahead).
    """

    level: int
    ranks: int
    desc: str  # the most common description
    minimum: int
    median: float
    maximum: int
    total: int | None  # the most common total (None where no bar knows its length)
    finished: int  # bars no longer running (done or closed)
    laggard: RankProgress
    fastest: RankProgress
    slowest: tuple[RankProgress, ...]  # the ranks furthest behind, the furthest first
    earlier: int = 0
    later: int = 0

    def describe(self) -> str:
        """'64 ranks: 120 / 400 (median), min 98 (rank 17), max 131 (rank 2); slowest: rank 17 (98, 3.1 it/s), ...'."""
        total = f" / {self.total:,}" if self.total is not None else ""
        line = (
            f"{count_ranks(self.ranks)}: {_count(self.median)}{total} (median), "
            f"min {self.minimum:,} (rank {self.laggard.rank}), max {self.maximum:,} (rank {self.fastest.rank})"
        )
        if self.finished:
            line += f", {self.finished:,} finished"
        if self.earlier or self.later:
            apart = [f"{count_ranks(self.earlier)} on an earlier loop"] if self.earlier else []
            apart += [f"{count_ranks(self.later)} on a later loop"] if self.later else []
            line += "; " + ", ".join(apart)
        if self.slowest:
            line += "; slowest: " + ", ".join(progress.describe() for progress in self.slowest)
        return line


def summarize_progress(
    bars: Mapping[tuple[int, int], BarState], level: int = 0, slowest: int = 3
) -> ProgressSummary | None:
    """The bars at `level` (`Feed.bars`, keyed (rank, level)) summed up; None when there is none.

    The `slowest` ranks are named furthest behind first (lowest count; ties: lower rate, then
    lower rank; a bar without a rate yet counts as slowest).
    """
    chosen = [bar for (_, bar_level), bar in sorted(bars.items()) if bar_level == level]
    if not chosen:
        return None
    order = sorted(chosen, key=_behind_first)
    count = len(order)
    low, high = order[(count - 1) // 2], order[count // 2]
    # within one loop this is statistics.median of the counts; across loops the lower middle rank's count
    median = (low.n + high.n) / 2 if low.id == high.id else float(low.n)
    totals = Counter(bar.total for bar in chosen if bar.total is not None)
    # the most common total; a tie goes to the larger (the loop's length rather than a cut-short one)
    total = max(totals, key=lambda value: (totals[value], value)) if totals else None
    fastest = max(chosen, key=lambda bar: (bar.id, bar.n, _rate_key(bar), -bar.rank))
    return ProgressSummary(
        level=level,
        ranks=count,
        desc=Counter(bar.desc for bar in chosen).most_common(1)[0][0],
        minimum=order[0].n,
        median=median,
        maximum=fastest.n,
        total=total,
        finished=sum(bar.state != "running" for bar in chosen),
        laggard=_progress(order[0]),
        fastest=_progress(fastest),
        slowest=tuple(_progress(bar) for bar in order[: max(0, slowest)]),
        earlier=sum(bar.id < low.id for bar in chosen),
        later=sum(bar.id > low.id for bar in chosen),
    )


def _rate_key(bar: BarState) -> float:
    return bar.rate if bar.rate is not None else -math.inf


def _behind_first(bar: BarState) -> tuple[int, int, float, int]:
    return bar.id, bar.n, _rate_key(bar), bar.rank


def _progress(bar: BarState) -> RankProgress:
    return RankProgress(bar.rank, bar.n, bar.rate)


def _count(value: float) -> str:
    return f"{int(value):,}" if value == int(value) else f"{value:,.1f}"


# ---------------------------------------------------------------- a metric's band across ranks


@dataclass
class BandSeries:
    """One metric across ranks, one point per bucket of consecutive steps (at most `budget` points).

    `steps[i]` is the last step of bucket i; `minimum` and `maximum` are over every value the
    ranks logged in the bucket, `counts[i]` is how many there are. `median`, `low` and `high`
    (the 10th and 90th percentiles, interpolated as statistics.quantiles(method='inclusive'))
    are over the values at the bucket's latest `depth` distinct steps, `depth` being
    QUANTILE_VALUES // ranks (at least 1), so over the whole bucket while it has no more
    steps than that (every bucket, up to depth x budget distinct steps). NaN values are left
    out (outlier_ranks names the ranks that log them).
    """

    steps: list[float] = field(default_factory=list)
    median: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    minimum: list[float] = field(default_factory=list)
    maximum: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)


# band(): at most this many groups of ranks with the same steps are read column by column; the rest by slices
_GROUPS = 8
_MISSING = object()  # zip_longest's filler where a rank behind has no value yet


def band(
    metrics: Metrics,
    name: str,
    ranks: Sequence[int] | None = None,
    budget: int = 400,
    *,
    quantile_values: int = QUANTILE_VALUES,
) -> BandSeries:
    """`name` across `ranks` (default: every rank that logged anything): median, 10-90 % band, extremes.

    Every step any rank logged belongs to one bucket of consecutive distinct steps (one step per
    bucket while there are at most `budget`), so a rank behind simply has no values in the later
    buckets. The work is one pass over the values at C speed (zip, slices, min, max) plus one sort
    of at most about `quantile_values` values per point. Ranks whose steps are a prefix of one
    another's (the usual DDP cell: the same steps, some ranks a few behind) are read column by
    column, all at once; a rank with steps of its own is read by slices, one per bucket it has
    values in (1,024 ranks that share no step cost about three times as much).
    """
    if budget < 1:
        raise ValueError(f"band(budget={budget}): needs at least 1 point")
    chosen = metrics.ranks if ranks is None else sorted(set(ranks))
    series = [_clean(*metrics.view(name, rank)) for rank in chosen]
    series = [(steps, values) for steps, values in series if steps]
    if not series:
        return BandSeries()
    depth = max(1, quantile_values // len(series))

    # groups: the longest steps left and the ranks whose steps are a prefix of them (their values aligned)
    groups: list[tuple[Sequence[float], list[Sequence[float]]]] = []
    singles: list[tuple[Sequence[float], Sequence[float]]] = []
    rest = series
    while rest:
        canonical = max(rest, key=lambda pair: len(pair[0]))[0]
        if len(groups) == _GROUPS or not _ascending(canonical):
            singles += [_sorted(steps, values) for steps, values in rest]
            break
        inside = [_prefix(steps, canonical) for steps, _ in rest]
        groups.append((canonical, [values for (_, values), member in zip(rest, inside) if member]))
        rest = [pair for pair, member in zip(rest, inside) if not member]

    distinct: set[float] = set()
    for steps, _ in groups:
        distinct.update(steps)
    for steps, _ in singles:
        distinct.update(steps)
    ordered = sorted(distinct)
    points = min(budget, len(ordered))
    # bucket b holds the distinct steps ordered[b * n // points : (b + 1) * n // points]: never empty
    bounds = [(b + 1) * len(ordered) // points for b in range(points)]
    ends = [ordered[bound - 1] for bound in bounds]
    # the quantiles' sample: from the bucket's latest `depth` distinct steps on
    starts = [ordered[max(bound - depth, b * len(ordered) // points)] for b, bound in enumerate(bounds)]
    result = _Buckets(ends, starts)
    for steps, block in groups:
        result.add_block(steps, block)
    for steps, values in singles:
        result.add_slices(steps, values)
    return result.series()


class _Buckets:
    """band()'s running statistics: extremes and counts of all values, and the quantiles' sample."""

    def __init__(self, ends: list[float], starts: list[float]) -> None:
        self.ends = ends  # each bucket's last step
        self.starts = starts  # each bucket's first step in the quantiles' sample
        self.minimum = [math.inf] * len(ends)
        self.maximum = [-math.inf] * len(ends)
        self.counts = [0] * len(ends)
        self.sample: list[list[float]] = [[] for _ in ends]

    def add_block(self, steps: Sequence[float], block: list[Sequence[float]]) -> None:
        """Ranks whose steps are (a prefix of) ascending `steps`: one column per step, a bucket in a few C calls."""
        block = sorted(block, key=len, reverse=True)
        width = len(block)
        if len(block[-1]) == len(block[0]):
            columns: list[tuple[Any, ...]] = list(zip(*block))
        else:
            # the ranks longest first: a column's missing values are its end, cut off
            columns = list(zip_longest(*block, fillvalue=_MISSING))
            lengths = sorted(len(values) for values in block)
            for j in range(len(block[-1]), len(columns)):
                columns[j] = columns[j][: width - bisect_right(lengths, j)]
        lo = 0
        for b, end in enumerate(self.ends):
            hi = bisect_right(steps, end, lo, len(columns))
            if hi > lo:
                within = columns[lo:hi]
                self.minimum[b] = min(self.minimum[b], min(map(min, within)))
                self.maximum[b] = max(self.maximum[b], max(map(max, within)))
                self.counts[b] += sum(map(len, within)) if len(within[-1]) < width else (hi - lo) * width
                sample = self.sample[b]
                for column in columns[bisect_left(steps, self.starts[b], lo, hi) : hi]:
                    sample.extend(column)
            lo = hi
            if lo >= len(columns):
                break

    def add_slices(self, steps: Sequence[float], values: Sequence[float]) -> None:
        """One rank's ascending steps: one slice per bucket it has values in."""
        b = bisect_left(self.ends, steps[0])
        lo = 0
        while lo < len(steps):
            hi = bisect_right(steps, self.ends[b], lo)
            if hi > lo:
                within = values[lo:hi]
                self.minimum[b] = min(self.minimum[b], min(within))
                self.maximum[b] = max(self.maximum[b], max(within))
                self.counts[b] += hi - lo
                self.sample[b].extend(values[bisect_left(steps, self.starts[b], lo, hi) : hi])
            lo = hi
            b += 1

    def series(self) -> BandSeries:
        result = BandSeries(steps=list(self.ends), minimum=self.minimum, maximum=self.maximum, counts=self.counts)
        for sample in self.sample:
            sample.sort()
            result.median.append(_median_sorted(sample))
            result.low.append(_quantile_sorted(sample, 1))
            result.high.append(_quantile_sorted(sample, 9))
        return result


def _clean(steps: Sequence[float], values: Sequence[float]) -> tuple[Sequence[float], Sequence[float]]:
    """The series without its NaN values (a C-speed sum tells whether there is one to drop)."""
    if len(steps) != len(values):
        size = min(len(steps), len(values))
        steps, values = steps[:size], values[:size]
    total = sum(values)
    if total == total:
        return steps, values
    kept = [(step, value) for step, value in zip(steps, values) if value == value]
    return [step for step, _ in kept], [value for _, value in kept]


def _ascending(steps: Sequence[float]) -> bool:
    # sorted() of an already sorted list is one C pass: faster than comparing pairs in Python
    return sorted(steps) == list(steps)


def _prefix(steps: Sequence[float], canonical: Sequence[float]) -> bool:
    if len(steps) == len(canonical):
        return steps == canonical
    return steps == canonical[: len(steps)]


def _sorted(steps: Sequence[float], values: Sequence[float]) -> tuple[Sequence[float], Sequence[float]]:
    """The series ordered by step (a rank that logged explicit steps out of order); stable."""
    if _ascending(steps):
        return steps, values
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [steps[i] for i in order], [values[i] for i in order]


def _median_sorted(data: Sequence[float]) -> float:
    """statistics.median of sorted data, without sorting it again."""
    middle = len(data) // 2
    return data[middle] if len(data) % 2 else (data[middle - 1] + data[middle]) / 2


def _quantile_sorted(data: Sequence[float], i: int, n: int = 10) -> float:
    """The i/n quantile of sorted data, as statistics.quantiles(data, n=n, method='inclusive')[i - 1]."""
    j, delta = divmod(i * (len(data) - 1), n)
    if delta == 0:  # on a value: no interpolation (and no inf * 0)
        return data[j]
    return (data[j] * (n - delta) + data[j + 1] * delta) / n


# ---------------------------------------------------------------- outliers


@dataclass(frozen=True)
class Outlier:
    """A rank whose latest value of a metric stands out from the other ranks'."""

    rank: int
    name: str
    value: float
    median: float  # the median of the ranks' finite latest values
    score: float  # the modified z-score (NaN for a NaN value, ±inf for ±inf)

    def describe(self) -> str:
        """'rank 5: loss 3.2 vs median 0.41'."""
        return f"rank {self.rank}: {self.name} {self.value:.4g} vs median {self.median:.4g}"


def outlier_ranks(metrics: Metrics, name: str, limit: int = 5, threshold: float = 3.5) -> list[Outlier]:
    """The ranks whose latest `name` is a robust outlier, at most `limit`, the furthest first.

    The modified z-score of Iglewicz and Hoaglin, 0.6745 (x - median) / MAD, is an outlier above
    `threshold` in magnitude. Where more than half the ranks agree exactly (MAD 0), the mean
    absolute deviation scaled by 1.2533 stands in; where that is 0 too, any value off the median
    is one. NaN and infinite values always are, and come first (by rank).
    """
    latest = {rank: value for rank in metrics.ranks if (value := metrics.last(name, rank)) is not None}
    finite = {rank: value for rank, value in latest.items() if math.isfinite(value)}
    median = statistics.median(finite.values()) if finite else math.nan
    found = [
        Outlier(rank, name, value, median, value if math.isnan(value) else math.copysign(math.inf, value))
        for rank, value in sorted(latest.items())
        if rank not in finite
    ]
    if finite:
        deviations = [abs(value - median) for value in finite.values()]
        mad = statistics.median(deviations)
        mean_deviation = statistics.fmean(deviations)
        scored: list[Outlier] = []
        for rank, value in finite.items():
            if mad > 0:
                score = 0.6745 * (value - median) / mad
            elif mean_deviation > 0:
                score = (value - median) / (1.2533 * mean_deviation)
            else:
                score = math.copysign(math.inf, value - median) if value != median else 0.0
            if abs(score) > threshold:
                scored.append(Outlier(rank, name, value, median, score))
        found += sorted(scored, key=lambda outlier: (-abs(outlier.score), outlier.rank))
    return found[: max(0, limit)]


# ---------------------------------------------------------------- step time heat map


@dataclass
class HeatMatrix:
    """Seconds per step, one row per rank (or per band of consecutive ranks), one column per time bin.

    Column j covers [edges[j], edges[j + 1]) seconds of the ranks' clocks; the bins are equal and
    the last one ends at or just after the latest time seen. values[row][j] is None where no step
    completed. A band's cell is its worst (largest) rank's, `cell_ranks` says which; `worst[row]`
    is the band's slowest rank over the whole cell (its most seconds per step).
    """

    edges: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    values: list[list[float | None]] = field(default_factory=list)
    cell_ranks: list[list[int | None]] = field(default_factory=list)
    worst: list[int | None] = field(default_factory=list)


class StepHeat:
    """Each rank's seconds per step over time, fed message by message, in bounded memory.

    `add(rank, t, steps)` takes a message's rank, its clock (seconds since the rank's first
    message of the cell) and its cumulative steps (log() calls); the steps between two messages
    are spread evenly over the time between them. Time is kept in buckets of one width for all
    ranks, at most `slots` (HEAT_SLOTS) per rank: when a rank's clock passes the last one, the width
    doubles and neighbouring buckets merge. So the memory is at most 2 x `slots` numbers per rank
    (1,024 ranks: 262,144 doubles, 2 MiB) however long the cell runs, an add() is O(1) but
    for a merge (O(ranks x slots), once per doubling of the cell's length) or a message after a
    long silence (at most `slots` buckets), and matrix() is O(ranks x slots).
    """

    def __init__(self, slots: int = HEAT_SLOTS, first_width: float = HEAT_FIRST_WIDTH) -> None:
        if slots < 2 or first_width <= 0:
            raise ValueError(f"StepHeat(slots={slots}, first_width={first_width}): needs 2 slots and a width")
        self.slots = slots
        self.width = first_width  # seconds per bucket, the same for every rank
        self.span = 0.0  # the latest clock seen
        self._time: dict[int, array[float]] = {}  # seconds within each bucket
        self._done: dict[int, array[float]] = {}  # steps completed within each bucket
        self._last: dict[int, tuple[float, int]] = {}  # each rank's latest (t, steps)

    @property
    def ranks(self) -> list[int]:
        return sorted(self._last)

    def buckets(self, rank: int) -> int:
        """How many time buckets `rank` holds (at most `slots`)."""
        return len(self._time.get(rank, ()))

    def add(self, rank: int, t: float, steps: int) -> None:
        """One message of `rank`: its clock `t` and its cumulative step count. Ignored if it goes backwards."""
        previous_t, previous_steps = self._last.get(rank, (0.0, 0))
        if rank in self._last and (t < previous_t or steps < previous_steps):
            return  # an older message, or another cell's: the heat is one cell's
        if t < 0 or steps < 0 or not math.isfinite(t):
            return
        self._last[rank] = (t, steps)
        if rank not in self._time:
            self._time[rank], self._done[rank] = array("d"), array("d")
        while t >= self.slots * self.width:
            self._double()
        self.span = max(self.span, t)
        seconds, done = self._time[rank], self._done[rank]
        completed = steps - previous_steps
        if t <= previous_t:  # no time passed (a first message at t=0): the steps go to the bucket ending at t
            if completed:
                slot = min(max(0, math.ceil(t / self.width) - 1), self.slots - 1)
                _reach(seconds, done, slot)
                done[slot] += completed
            return
        per_second = completed / (t - previous_t)
        start, slot = previous_t, self._slot(previous_t)
        while start < t:
            end = min(t, (slot + 1) * self.width)
            if end <= start:  # rounding put start at the next bucket's edge
                slot += 1
                continue
            index = min(slot, self.slots - 1)
            _reach(seconds, done, index)
            seconds[index] += end - start
            done[index] += per_second * (end - start)
            start, slot = end, slot + 1

    def _slot(self, t: float) -> int:
        return min(int(t / self.width), self.slots - 1)

    def _double(self) -> None:
        """Twice the width: each pair of buckets becomes one, for every rank."""
        self.width *= 2
        for table in (self._time, self._done):
            for rank, old in table.items():
                merged = array("d", (old[i] + (old[i + 1] if i + 1 < len(old) else 0.0) for i in range(0, len(old), 2)))
                table[rank] = merged

    def matrix(self, columns: int = 60, rows: int = 64, ranks: Iterable[int] | None = None) -> HeatMatrix:
        """The heat map: at most `columns` time bins (whole buckets each) and `rows` rows.

        `ranks` adds rows for ranks never heard from (all None). With more ranks than `rows`,
        consecutive ranks share a row ('0-15'), each cell the worst of them, so a slow rank shows.
        """
        everyone = sorted(set(self._last) | set(ranks or ()))
        if not everyone or self.span <= 0 or columns < 1 or rows < 1:
            return HeatMatrix()
        used = max(1, min(self.slots, math.ceil(self.span / self.width)))  # the buckets (0, latest clock] covers
        per = math.ceil(used / columns)
        count = math.ceil(used / per)
        edges = [j * per * self.width for j in range(count + 1)]
        cells: dict[int, list[float | None]] = {}
        overall: dict[int, float | None] = {}
        for rank in everyone:
            seconds, done = self._time.get(rank, array("d")), self._done.get(rank, array("d"))
            row: list[float | None] = []
            for j in range(count):
                completed = sum(done[j * per : (j + 1) * per])
                row.append(sum(seconds[j * per : (j + 1) * per]) / completed if completed > 0 else None)
            cells[rank] = row
            completed = sum(done)
            overall[rank] = sum(seconds) / completed if completed > 0 else None
        groups = [everyone[k * len(everyone) // rows : (k + 1) * len(everyone) // rows] for k in range(rows)]
        result = HeatMatrix(edges=edges)
        for group in (group for group in groups if group):
            result.labels.append(rank_ranges(group))
            values: list[float | None] = []
            owners: list[int | None] = []
            for j in range(count):
                present = [(cells[rank][j], rank) for rank in group if cells[rank][j] is not None]
                # the largest seconds per step; a tie goes to the lower rank
                value, owner = max(present, key=lambda pair: (pair[0], -pair[1])) if present else (None, None)
                values.append(value)
                owners.append(owner)
            result.values.append(values)
            result.cell_ranks.append(owners)
            timed = [(value, rank) for rank in group if (value := overall[rank]) is not None]
            result.worst.append(max(timed, key=lambda pair: (pair[0], -pair[1]))[1] if timed else None)
        return result


def _reach(seconds: array[float], done: array[float], index: int) -> None:
    """Grow a rank's buckets to hold `index` (they only grow up to the slots)."""
    missing = index + 1 - len(seconds)
    if missing > 0:
        seconds.extend([0.0] * missing)
        done.extend([0.0] * missing)
