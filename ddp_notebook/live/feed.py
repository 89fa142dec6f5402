"""The notebook's side of the live view: one cell's rank messages turned into what a view draws.

A `Feed` turns one cell's messages (`wire.channel.RankMessage`) into `Metrics` (every point)
and the state of each progress bar and rank, and asks its view (`live.widgets`) to redraw at
most every REDRAW_SECONDS. A `Recorder` makes one feed per cell and keeps the latest.

Standard library only: the notebook kernel never imports torch.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.channel import MESSAGE_VERSION, BarMessage, BarRun, CellEnd, RankMessage, RunState, messages_in
from .aggregate import StepHeat, wants_aggregate
from .stragglers import StepTimes, Straggler, find_straggler

if TYPE_CHECKING:
    from ..wire.results import MemoryReading
    from .xray_readings import RankCollectives

# the notebook redraws a view at most this often (~10 Hz)
REDRAW_SECONDS = 0.1
# the X-ray of a running cell is shown once a rank has waited this long in one collective
XRAY_SHOW_SECONDS = 3.0


class Metrics:
    """Every point the ranks logged, by metric name and rank.

    `series(name, rank)` gives (steps, values); `to_dict()` a table as a dict of lists
    (rank, name, step, value); `to_pandas()` the same as a DataFrame.
    """

    def __init__(self) -> None:
        self._series: dict[tuple[str, int], tuple[list[float], list[float]]] = {}

    def add(self, rank: int, name: str, steps: Iterable[float], values: Iterable[float]) -> None:
        key = (name, rank)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = ([], [])
        series[0].extend(steps)
        series[1].extend(values)

    @property
    def names(self) -> list[str]:
        """Metric names in the order they first arrived."""
        return list(dict.fromkeys(name for name, _ in self._series))

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for _, rank in self._series})

    def series(self, name: str, rank: int) -> tuple[list[float], list[float]]:
        """(steps, values) of `name` on `rank` (empty lists if it logged none)."""
        steps, values = self._series.get((name, rank), ([], []))
        return list(steps), list(values)

    def view(self, name: str, rank: int) -> tuple[Sequence[float], Sequence[float]]:
        """Like `series`, without copying: for readers that only look (the live view)."""
        return self._series.get((name, rank), ((), ()))

    def keys(self) -> list[tuple[str, int]]:
        """(name, rank) of every series, in arrival order."""
        return list(self._series)

    def last(self, name: str, rank: int) -> float | None:
        series = self._series.get((name, rank))
        return series[1][-1] if series and series[1] else None

    def __len__(self) -> int:
        """The number of points."""
        return sum(len(steps) for steps, _ in self._series.values())

    def __bool__(self) -> bool:
        return bool(self._series)

    def to_dict(self) -> dict[str, list[Any]]:
        """One row per point: {'rank': [...], 'name': [...], 'step': [...], 'value': [...]}."""
        table: dict[str, list[Any]] = {"rank": [], "name": [], "step": [], "value": []}
        for (name, rank), (steps, values) in self._series.items():
            table["rank"].extend([rank] * len(steps))
            table["name"].extend([name] * len(steps))
            table["step"].extend(steps)
            table["value"].extend(values)
        return table

    def to_pandas(self) -> Any:
        """The points as a pandas DataFrame (columns rank, name, step, value)."""
        try:
            import pandas
        except ImportError:
            raise ImportError("to_pandas() needs pandas (pip install pandas); to_dict() does not") from None
        return pandas.DataFrame(self.to_dict())

    def __repr__(self) -> str:
        if not self._series:
            return "<Metrics: nothing logged>"
        parts = []
        for name in self.names:
            counts = {rank: len(self._series[(name, rank)][0]) for rank in self.ranks if (name, rank) in self._series}
            spread = ", ".join(f"rank {rank}: {count}" for rank, count in counts.items())
            parts.append(f"{name} ({spread})")
        return f"<Metrics: {len(self)} points; {'; '.join(parts)}>"


@dataclass
class BarState:
    """The notebook's picture of one rank's progress bar at one nesting level."""

    rank: int
    level: int
    id: int
    desc: str
    n: int = 0
    total: int | None = None
    elapsed: float = 0.0
    state: BarRun = "running"
    rate: float | None = None  # iterations per second, smoothed like tqdm's

    def update(self, message: BarMessage) -> None:
        if message["id"] != self.id:  # a new loop at this level (the next epoch's batches)
            self.id, self.n, self.elapsed, self.rate = message["id"], 0, 0.0, None
        self.rate = _smoothed_rate(
            self.rate, message["n"] - self.n, message["elapsed"] - self.elapsed, message["n"], message["elapsed"]
        )
        if message["state"] != "running" and message["elapsed"] > 0:
            self.rate = message["n"] / message["elapsed"]  # a finished bar shows its average
        self.desc = message["desc"]
        self.n = message["n"]
        self.total = message["total"]
        self.elapsed = message["elapsed"]
        self.state = message["state"]

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return 1.0 if self.total == 0 else None
        return min(1.0, self.n / self.total)

    @property
    def eta(self) -> float | None:
        if self.total is None or not self.rate or self.state != "running":
            return None
        return max(0.0, (self.total - self.n) / self.rate)


@dataclass
class RankRow:
    """One rank's row of the status table: how far it got in the cell, as its messages say."""

    rank: int
    state: RunState = "running"
    steps: int = 0  # log() calls in this cell
    count: int = 0  # of those, the calls without step=: where an appended cell's steps start
    t: float = 0.0  # seconds since the rank's first message of the cell
    rate: float | None = None  # steps per second
    seq: int = -1
    lost: int = 0  # messages that never arrived (should stay 0)
    last: dict[str, float] = field(default_factory=dict)


def _smoothed_rate(rate: float | None, dn: float, dt: float, n: float, elapsed: float) -> float | None:
    """Items per second: the average until there is one, then an exponential average like tqdm's."""
    if n <= 0 or elapsed <= 0:
        return None
    if rate is None or dt <= 0 or dn < 0:
        return n / elapsed if rate is None else rate
    return 0.3 * (dn / dt) + 0.7 * rate


class View(Protocol):
    """What a Feed draws on: the widgets or the text fallback (ddp_notebook.widgets)."""

    def show(self) -> None: ...

    def draw(self, feed: Feed, final: bool) -> None: ...


class Feed:
    """Consumes one cell's messages (`feed(rank, data)`, as `DDPCluster.execute(on_data=)`).

    Keeps every point in `metrics`, tracks bars and rank states, and redraws the view made
    by `make_view` (on the first message) at most every REDRAW_SECONDS. Following `previous`
    continues its metrics and view, with this cell's default steps after the earlier ones.
    """

    def __init__(
        self,
        make_view: Callable[[], View | None] | None = None,
        *,
        ranks: Iterable[int] | None = None,
        previous: Feed | None = None,
        on_first: Callable[[Feed], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        redraw_seconds: float = REDRAW_SECONDS,
    ) -> None:
        self._make_view = make_view
        self._on_first = on_first
        self._clock = clock
        self._redraw_seconds = redraw_seconds
        self.expected = tuple(ranks) if ranks is not None else None
        self.previous = previous
        self.metrics = previous.metrics if previous is not None else Metrics()
        self.view: View | None = None
        self.bars: dict[tuple[int, int], BarState] = {}
        self.ranks: dict[int, RankRow] = {}
        self.received = 0  # our messages so far
        self.started = clock()
        self.elapsed = 0.0
        self.finished = False
        self.outcome: CellEnd | None = None
        self.memory_reading: MemoryReading | None = None  # the ranks' memory, read about once a second
        self.step_times: dict[int, StepTimes] = {}  # each rank's latest recent-steps means (prepare_model)
        self._straggler: Straggler | None = None
        self._straggler_found = True
        # how many ranks the cell runs on, where `ranks` was not given (the world says, before the cell)
        self.size_hint = 0
        # a large world's seconds per step, rank by rank over time (its live view's heat map)
        self.heat: StepHeat | None = None
        # the latest collective X-ray of the running cell (the relay reads it 4 times a second)
        self.collective_readings: dict[int, RankCollectives] = {}
        self._last_draw = -math.inf
        self._shown = False  # the view was made and shown
        # default steps of an appended cell continue after the earlier cells' steps
        self._step_base: dict[int, int] = dict(previous.step_base_after()) if previous is not None else {}
        # every point as it arrives, to an experiment tracker (`live.trackers`); set by the world
        self.on_points: Callable[[int, str, list[float], list[float]], None] | None = None
        self.tracker_run: Any = None  # the tracker run this cell's points went to (an appended cell continues it)

    @property
    def straggler(self) -> Straggler | None:
        """The rank clearly slower than the others per step (from step_times), if one is."""
        if not self._straggler_found:
            self._straggler = find_straggler(self.step_times)
            self._straggler_found = True
        return self._straggler

    @property
    def rank_count(self) -> int:
        """How many ranks the cell runs on, as far as this feed knows."""
        return max(len(self.expected or ()), self.size_hint, len(self.ranks))

    def step_base_after(self) -> dict[int, int]:
        """Where the default steps of a cell appended after this one start, per rank."""
        bases = dict(self._step_base)
        for rank, state in self.ranks.items():
            bases[rank] = self._step_base.get(rank, 0) + state.count
        return bases

    def __call__(self, rank: int, data: dict[str, Any]) -> None:
        for message in messages_in(data):
            if message.get("v") != MESSAGE_VERSION:
                continue  # another version's
            state = self.ranks.get(rank)
            if state is not None and isinstance(message.get("seq"), int) and message["seq"] <= state.seq:
                continue  # had already (a merged catch-up holds earlier messages too)
            self._take(rank, message)  # type: ignore[arg-type]

    def _take(self, rank: int, message: RankMessage) -> None:
        if self.received == 0:
            if self.heat is None and wants_aggregate(self.rank_count):
                self.heat = self.previous.heat if self.previous is not None and self.previous.heat else StepHeat()
            if self._on_first is not None:
                self._on_first(self)
            self._show()
        self.received += 1
        self._apply(rank, message)
        now = self._clock()
        self.elapsed = now - self.started
        if self._all_ended():
            self.finish()
        elif now - self._last_draw >= self._redraw_seconds:
            self._draw(final=False, now=now)

    def memory(self, reading: MemoryReading) -> None:
        """The ranks' memory against their limit (the running cell reads it about once a second);
        the status table shows it at its next redraw."""
        self.memory_reading = reading

    @property
    def waiting(self) -> dict[int, RankCollectives]:
        """The X-ray to show: every rank's reading once one has waited XRAY_SHOW_SECONDS in a
        collective (the others say where they are: often what the waiting ones wait for); else {}."""
        readings = self.collective_readings
        if any(r.current is not None and r.waited >= XRAY_SHOW_SECONDS for r in readings.values()):
            return readings
        return {}

    def collectives(self, readings: dict[int, RankCollectives]) -> None:
        """The running cell's latest collective X-ray. Ranks blocked in a collective send nothing,
        so this redraws the view itself while the X-ray is shown (making it if no rank sent
        anything yet: a cell that only hangs gets a view too), and once more when it clears."""
        if self.finished:
            return
        was_shown = bool(self.waiting)
        # a rank that did not answer this reading (a busy machine) keeps its last one in the view
        self.collective_readings = {**self.collective_readings, **readings}
        shown = bool(self.waiting)
        if not (shown or was_shown):
            return
        self._show()
        now = self._clock()
        self.elapsed = now - self.started
        if shown != was_shown or now - self._last_draw >= self._redraw_seconds:
            self._draw(final=False, now=now)

    def _show(self) -> None:
        if self._shown:
            return
        self._shown = True
        try:
            if self.previous is not None and self.previous.view is not None:
                self.view = self.previous.view
            elif self._make_view is not None:
                self.view = self._make_view()
            if self.view is not None:
                self.view.show()
        except Exception as failure:  # noqa: BLE001
            self._drop_view(failure)

    def _apply(self, rank: int, message: RankMessage) -> None:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankRow(rank)
        # a detached rank's journal merges its oldest messages into one (`wire.journal`): "first" is the
        # oldest it holds, none of them lost
        first = message.get("first", message["seq"])
        if first > state.seq + 1:
            state.lost += first - state.seq - 1
        state.seq = message["seq"]
        state.rate = _smoothed_rate(
            state.rate, message["calls"] - state.steps, message["t"] - state.t, message["calls"], message["t"]
        )
        if message["state"] != "running" and message["t"] > 0:
            state.rate = message["calls"] / message["t"]  # an ended rank shows its average
        state.t, state.steps, state.count = message["t"], message["calls"], message["count"]
        state.state = message["state"]
        base = self._step_base.get(rank, 0)
        explicit = set(message["explicit"])
        for name, (steps, values) in message["metrics"].items():
            if base and name not in explicit:
                steps = [step + base for step in steps]
            self.metrics.add(rank, name, steps, values)
            if self.on_points is not None:
                self.on_points(rank, name, steps, values)
            if values:
                state.last[name] = values[-1]
        steps = StepTimes.parse(message.get("steps"))
        if steps is not None:
            self.step_times[rank] = steps
            self._straggler_found = False  # looked for when drawn: once per redraw, not per message
        if self.heat is not None:
            self.heat.add(rank, state.t, state.steps)
        for bar in message["bars"]:
            key = (rank, bar["level"])
            current = self.bars.get(key)
            if current is None:
                current = self.bars[key] = BarState(rank, bar["level"], bar["id"], bar["desc"])
            if bar["id"] >= current.id:  # never let an older bar's late update win
                current.update(bar)

    def _all_ended(self) -> bool:
        if self.expected is None:
            return False
        return all(rank in self.ranks and self.ranks[rank].state != "running" for rank in self.expected)

    def _draw(self, final: bool, now: float | None = None) -> None:
        self._last_draw = self._clock() if now is None else now
        if self.view is not None:
            try:
                self.view.draw(self, final)
            except Exception as failure:  # noqa: BLE001
                self._drop_view(failure)

    def _drop_view(self, failure: Exception) -> None:
        # a broken view must not break the cell it watches: the ranks run on, the data is kept
        self.view = None
        warnings.warn(
            f"ddp_notebook: the live view failed ({type(failure).__name__}: {failure}); "
            "the metrics are still kept (%ddp_metrics)",
            RuntimeWarning,
            stacklevel=2,
        )

    def finish(self, outcome: CellEnd | None = None) -> None:
        """The cell is over: ranks that never said how they ended get `outcome`; final redraw.

        `outcome` is None after a clean run, else 'failed' or 'stopped'. Harmless to repeat.
        """
        self.collective_readings = {}  # the cell is over: nobody waits in it any more
        if not self._shown:
            self.finished = True
            return
        if outcome is not None:
            for state in self.ranks.values():
                if state.state == "running":
                    state.state = outcome
        if self.finished and outcome in (None, self.outcome):
            return
        self.finished = True
        self.outcome = outcome
        self.elapsed = self._clock() - self.started
        self._draw(final=True)


class Recorder:
    """A world's record of what its ranks logged: one Feed per cell, the latest kept."""

    def __init__(self) -> None:
        self.latest: Feed | None = None

    @property
    def metrics(self) -> Metrics:
        """Every point of the latest cell that logged anything (and the cells appended to it)."""
        return self.latest.metrics if self.latest is not None else Metrics()

    def feed(
        self,
        make_view: Callable[[], View | None] | None = None,
        *,
        ranks: Iterable[int] | None = None,
        append: bool = False,
    ) -> Feed:
        """A consumer for one cell; with `append`, it continues the latest cell's metrics and view."""
        previous = self.latest if append else None
        return Feed(make_view, ranks=ranks, previous=previous, on_first=self._adopt)

    def _adopt(self, feed: Feed) -> None:
        # only a cell that logged replaces the record: a later cell that only saves a
        # checkpoint leaves the training metrics where they are
        self.latest = feed
