"""Rank -> notebook messages: metrics and progress, batched on the rank, consumed in the notebook.

Rank side: `log()` and `progress()` only append to a buffer; from the rank's main thread,
at most every FLUSH_SECONDS, the buffer goes out as ONE plain-data message through
ipyparallel's `publish_data` (a signed `data_message` on IOPub, no transport of our own).
A `post_run_cell` hook sends the tail when the cell ends, before the rank reports idle, so
the notebook gets every point while `DDPCluster.execute` still waits for the cell.

Notebook side: a `Feed` turns one cell's messages into `Metrics` (every point) and the
state of each progress bar and rank, and asks its view (`ddp_notebook.widgets`) to redraw
at most every REDRAW_SECONDS. A `Recorder` makes one feed per cell and keeps the latest.

Standard library only: ranks import this without widgets, the notebook without torch.
"""

from __future__ import annotations

import math
import time
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from .stragglers import StepTimes, Straggler, find_straggler

if TYPE_CHECKING:
    from .results import MemoryReading
    from .xray import RankCollectives

# the rank publishes at most this often (and once more when the cell ends)
FLUSH_SECONDS = 0.1
# the notebook redraws a view at most this often (~10 Hz)
REDRAW_SECONDS = 0.1
# the key of our messages in a published dict; other keys belong to the user
MESSAGE_KEY = "ddp_notebook"
# a new optional field keeps the version (readers ignore what they do not know, and take a missing
# one as absent); a field whose meaning changes, or a new required one, needs the next version
MESSAGE_VERSION = 1
# the X-ray of a running cell is shown once a rank has waited this long in one collective
XRAY_SHOW_SECONDS = 3.0


# ---------------------------------------------------------------- message shapes


class BarMessage(TypedDict):
    """One progress bar as it stood at the flush."""

    id: int  # per rank and cell, in the order the bars were opened
    level: int  # nesting depth: 0 is the outermost loop
    desc: str
    n: int  # iterations finished
    total: int | None  # None while the length is unknown
    elapsed: float  # seconds since the bar opened (rank clock), frozen when it closed
    state: str  # running | done (exhausted) | closed (left early)


class StepsMessage(TypedDict):
    """The rank's recent training steps (`timing.StepClock.summary`): mean seconds per phase."""

    steps: int  # steps timed since the model was prepared
    window: int  # the recent steps the means are over
    total: float
    data: float
    compute: float
    comm: float
    optimizer: float


class _OptionalFields(TypedDict, total=False):
    # only when the rank timed steps in this cell (models from prepare_model), and they changed
    steps: StepsMessage


class RankMessage(_OptionalFields):
    """Everything a rank buffered since its last flush."""

    v: int
    seq: int  # 0, 1, 2... per rank and cell: a gap means a lost message
    t: float  # seconds since the cell started (rank clock)
    count: int  # log() calls without step= so far in this cell: the rank's step count
    calls: int  # all log() calls so far in this cell
    # metric name -> [steps, values] of the points logged since the last flush, as arrays
    # ('q' or 'd' steps, 'd' values): ipyparallel pickles them whole, not item by item
    metrics: dict[str, list[Sequence[float]]]
    explicit: list[str]  # names logged with step=...: those steps are kept as given
    bars: list[BarMessage]  # the bars that changed since the last flush
    state: str  # running, or how the cell ended: done | failed | stopped


# ---------------------------------------------------------------- rank side


class _Bar:
    __slots__ = ("desc", "ended", "id", "level", "n", "started", "state", "total")

    def __init__(self, bar_id: int, level: int, desc: str, total: int | None, started: float) -> None:
        self.id = bar_id
        self.level = level
        self.desc = desc
        self.total = total
        self.n = 0
        self.started = started
        self.ended: float | None = None
        self.state = "running"

    def message(self, now: float) -> BarMessage:
        end = self.ended if self.ended is not None else now
        return {
            "id": self.id,
            "level": self.level,
            "desc": self.desc,
            "n": self.n,
            "total": self.total,
            "elapsed": end - self.started,
            "state": self.state,
        }


class Channel:
    """A rank's buffer of metrics and bars; `publish(dict)` sends one batch.

    Not thread-safe: call it from the thread that runs the cell (the rank's main thread).
    """

    def __init__(
        self,
        publish: Callable[[dict[str, Any]], None] | None,
        clock: Callable[[], float] = time.monotonic,
        flush_seconds: float = FLUSH_SECONDS,
        step_times: Callable[[], Any] | None = None,
    ) -> None:
        self._publish = publish
        self._clock = clock
        # the rank's step timing (`timing.CLOCK.summary`, O(1)): its means ride along in each batch
        self._step_times = step_times
        self.flush_seconds = flush_seconds  # the least time between two batches
        self.begin_cell()

    def begin_cell(self) -> None:
        """Start a new cell: steps count from 0, messages from seq 0."""
        self.count = 0
        self.calls = 0
        self.next_flush = 0.0  # the first log() or progress step of a cell flushes at once
        self._seq = 0
        self._started = self._clock()
        # arrays, not lists: one batch pickles as a few byte strings, whatever its length
        self._pending: dict[str, tuple[array[Any], array[float]]] = {}
        self._explicit: set[str] = set()
        self._open: list[_Bar] = []
        self._dirty: dict[int, _Bar] = {}
        self._bar_ids = 0
        self._active = False  # sent (or has) anything this cell
        # steps timed before this cell are an earlier cell's: only steps after this count are sent
        self._steps_sent = self._timed_steps()

    def _timed_steps(self) -> int:
        summary = self._step_times() if self._step_times is not None else None
        return int(summary["steps"]) if summary else 0

    # log() is the hot path: a few appends and one clock read, nothing else
    def log(self, step: float | None, metrics: dict[str, Any]) -> None:
        counted = step is None
        if counted:
            step = self.count
        else:
            self._explicit.update(metrics)
        pending = self._pending
        for name, value in metrics.items():
            series = pending.get(name)
            if series is None:
                series = pending[name] = (array("q" if isinstance(step, int) else "d"), array("d"))
            try:
                series[1].append(value)  # the value first: a refused one leaves no step behind
            except Exception:  # noqa: BLE001  (whatever float() refuses, said plainly)
                raise _not_a_number(name, value) from None
            try:
                series[0].append(step)
            except TypeError:  # a fractional step after whole ones: this series' steps become floats
                series = pending[name] = (array("d", series[0]), series[1])
                series[0].append(step)
        self.calls += 1
        self.count += counted
        now = self._clock()
        if now >= self.next_flush:
            self.flush(now)

    def open_bar(self, desc: str, total: int | None) -> _Bar:
        bar = _Bar(self._bar_ids, len(self._open), desc, total, self._clock())
        self._bar_ids += 1
        self._open.append(bar)
        self._dirty[bar.id] = bar
        now = self._clock()
        if now >= self.next_flush:  # a long first step still shows its bar at 0
            self.flush(now)
        return bar

    def close_bar(self, bar: _Bar, exhausted: bool, flush: bool = True) -> None:
        if bar.ended is not None:  # closed already, when its cell ended
            return
        bar.ended = self._clock()
        if exhausted:
            bar.state = "done"
            if bar.total is None or bar.n > bar.total:
                bar.total = bar.n  # an iterable without len: its length is now known
        else:
            bar.state = "closed"
        if bar in self._open:
            self._open.remove(bar)
        self._dirty[bar.id] = bar
        now = self._clock()
        if flush and now >= self.next_flush:
            self.flush(now)

    def step_bar(self, bar: _Bar) -> None:
        bar.n += 1
        self._dirty[bar.id] = bar
        now = self._clock()
        if now >= self.next_flush:
            self.flush(now)

    def flush(self, now: float | None = None, state: str = "running") -> None:
        """Publish what is buffered (if anything, or if the cell's end must be told)."""
        now = self._clock() if now is None else now
        self.next_flush = now + self.flush_seconds
        final = state != "running"
        if not (self._pending or self._dirty or (final and self._active)):
            return
        self._active = True
        message: RankMessage = {
            "v": MESSAGE_VERSION,
            "seq": self._seq,
            "t": now - self._started,
            "count": self.count,
            "calls": self.calls,
            "metrics": {name: [steps, values] for name, (steps, values) in self._pending.items()},
            "explicit": sorted(self._explicit),
            "bars": [bar.message(now) for bar in self._dirty.values()],
            "state": state,
        }
        if self._step_times is not None:
            steps = self._step_times()
            if steps and steps["steps"] > self._steps_sent:
                message["steps"] = steps
                self._steps_sent = steps["steps"]
        self._seq += 1
        self._pending = {}
        self._dirty = {}
        if self._publish is not None:
            self._publish({MESSAGE_KEY: message})

    def end_cell(self, state: str) -> None:
        """The cell ended (done, failed or stopped): send the tail and the final state."""
        for bar in reversed(self._open):  # bars of loops the cell left by an exception
            self.close_bar(bar, exhausted=False, flush=False)
        self.flush(state=state)
        self._active = False


def _not_a_number(name: str, value: Any) -> TypeError:
    return TypeError(
        f"ddp_notebook.log({name}=...) needs a number, got {type(value).__name__}; "
        "log loss.item() rather than the tensor"
    )


class Progress:
    """What `progress(iterable)` returns: iterates like the iterable, counting each step."""

    def __init__(self, channel: Channel, iterable: Iterable[Any], desc: str | None, total: int | None) -> None:
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        self._channel = channel
        self.iterable = iterable
        self.desc = desc or ""
        self.total = total

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar's iterable has no length")
        return self.total

    def __iter__(self) -> Iterator[Any]:
        channel = self._channel
        bar = channel.open_bar(self.desc, self.total)
        exhausted = False
        try:
            for item in self.iterable:
                yield item
                channel.step_bar(bar)
            exhausted = True
        finally:
            channel.close_bar(bar, exhausted)


# The rank's one channel and whether its cell hooks are registered: process state, not config.
_rank_state: dict[str, Any] = {"channel": None}


def rank_channel() -> Channel:
    """This rank's channel; on first use, hooks it to the engine's cell boundaries."""
    channel = _rank_state["channel"]
    if channel is None:
        channel = _rank_state["channel"] = _connect()
    return channel


def _connect() -> Channel:
    try:
        from IPython import get_ipython
    except ImportError:
        return Channel(publish=None)
    shell = get_ipython()
    if not in_rank(shell):
        # not an ipyparallel rank (the notebook itself, a script under torchrun): send nothing
        return Channel(publish=None)
    from ipyparallel.datapub import publish_data

    from .timing import CLOCK

    channel = Channel(publish=publish_data, step_times=CLOCK.summary)

    def ended(result: Any) -> None:
        error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        if error is None:
            channel.end_cell("done")
        else:
            channel.end_cell("stopped" if isinstance(error, KeyboardInterrupt) else "failed")

    shell.events.register("pre_run_cell", lambda *_: channel.begin_cell())
    shell.events.register("post_run_cell", ended)
    return channel


def in_rank(shell: Any) -> bool:
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False
    from ipyparallel.engine.kernel import IPythonParallelKernel

    return isinstance(kernel, IPythonParallelKernel)


def log(step: float | None = None, **metrics: Any) -> None:
    """Record numbers for the notebook's live plot: `ddp_notebook.log(loss=loss.item())`.

    Each call is one step of this rank: points are plotted against the number of earlier
    `log()` calls in the cell, unless `step=` gives the x value. Costs about a microsecond;
    the points leave the rank in batches, at most every 0.1 s and when the cell ends.
    """
    channel = _rank_state["channel"] or rank_channel()
    channel.log(step, metrics)


def progress(iterable: Iterable[Any], desc: str | None = None, total: int | None = None) -> Progress:
    """Iterate over `iterable` with a live progress bar per rank in the notebook.

    `total` defaults to `len(iterable)` where there is one. Loops may nest: each level
    gets its own bar.
    """
    return Progress(_rank_state["channel"] or rank_channel(), iterable, desc, total)


# ---------------------------------------------------------------- notebook side


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
    state: str = "running"
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
class RankState:
    """One row of the status table."""

    rank: int
    state: str = "running"
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
        self.ranks: dict[int, RankState] = {}
        self.received = 0  # our messages so far
        self.started = clock()
        self.elapsed = 0.0
        self.finished = False
        self.outcome: str | None = None
        self.memory_reading: MemoryReading | None = None  # the ranks' memory, read about once a second
        self.step_times: dict[int, StepTimes] = {}  # each rank's latest recent-steps means (prepare_model)
        self.straggler: Straggler | None = None  # named from step_times when one rank is clearly slower
        # the latest collective X-ray of the running cell (the relay reads it 4 times a second)
        self.collective_readings: dict[int, RankCollectives] = {}
        self._last_draw = -math.inf
        self._shown = False  # the view was made and shown
        # default steps of an appended cell continue after the earlier cells' steps
        self._step_base: dict[int, int] = dict(previous.step_base_after()) if previous is not None else {}

    def step_base_after(self) -> dict[int, int]:
        """Where the default steps of a cell appended after this one start, per rank."""
        bases = dict(self._step_base)
        for rank, state in self.ranks.items():
            bases[rank] = self._step_base.get(rank, 0) + state.count
        return bases

    def __call__(self, rank: int, data: dict[str, Any]) -> None:
        message = data.get(MESSAGE_KEY) if isinstance(data, dict) else None
        if not isinstance(message, dict) or message.get("v") != MESSAGE_VERSION:
            return  # someone else's publish_data
        if self.received == 0:
            if self._on_first is not None:
                self._on_first(self)
            self._show()
        self.received += 1
        self._apply(rank, message)  # type: ignore[arg-type]
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
        self.collective_readings = dict(readings)
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
            state = self.ranks[rank] = RankState(rank)
        if message["seq"] > state.seq + 1:
            state.lost += message["seq"] - state.seq - 1
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
            if values:
                state.last[name] = values[-1]
        steps = StepTimes.parse(message.get("steps"))
        if steps is not None:
            self.step_times[rank] = steps
            self.straggler = find_straggler(self.step_times)
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

    def finish(self, outcome: str | None = None) -> None:
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
