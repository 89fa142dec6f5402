"""A rank's side of the live view: `log()` and `progress()`, batched and published.

`log()` and `progress()` only append to a buffer; from the rank's main thread, at most every
FLUSH_SECONDS, the buffer goes out as ONE plain-data message (`wire.channel.RankMessage`)
through ipyparallel's `publish_data` (a signed `data_message` on IOPub, no transport of our
own). A `post_run_cell` hook sends the tail when the cell ends, before the rank reports idle,
so the notebook gets every point while `DDPCluster.execute` still waits for the cell.

Standard library only at import: ranks import this without widgets, and without torch.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..wire.channel import (
    FLUSH_SECONDS,
    MESSAGE_VERSION,
    BarMessage,
    BarRun,
    RankMessage,
    RunState,
    flush_seconds,
    message_key,
)
from .state import RANK


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
        self.state: BarRun = "running"

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

    def flush(self, now: float | None = None, state: RunState = "running") -> None:
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
            self._publish({message_key(message["seq"]): message})

    def end_cell(self, state: RunState) -> None:
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


def rank_channel() -> Channel:
    """This rank's channel; on first use, hooks it to the engine's cell boundaries."""
    channel = RANK.channel
    if channel is None:
        channel = RANK.channel = _connect()
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

    channel = Channel(publish=_journaled(publish_data), step_times=CLOCK.summary)

    def paced() -> None:
        # read at each cell: a resize changes the world's size
        channel.flush_seconds = flush_seconds(int(os.environ.get("WORLD_SIZE") or 1))

    paced()

    def ended(result: Any) -> None:
        error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        if error is None:
            channel.end_cell("done")
        else:
            channel.end_cell("stopped" if isinstance(error, KeyboardInterrupt) else "failed")

    shell.events.register("pre_run_cell", lambda *_: (paced(), channel.begin_cell()))
    shell.events.register("post_run_cell", ended)
    return channel


def _journaled(publish: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """`publish`, each message also kept in a detached world's journal (`cell_journal`)."""
    journal = RANK.journal
    if journal is None:
        return publish

    def publish_and_keep(data: dict[str, Any]) -> None:
        for message in data.values():
            journal.data(message)
        publish(data)

    return publish_and_keep


def in_rank(shell: Any) -> bool:
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False
    from ipyparallel.engine.kernel import IPythonParallelKernel

    return isinstance(kernel, IPythonParallelKernel)


def tell_notebook(key: str) -> None:
    """Publish `{key: True}` to the notebook listening to this rank, read there after the cell
    (`wire.results`' keys); nothing where no notebook listens (a script under torchrun)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if in_rank(get_ipython()):
        from ipyparallel.datapub import publish_data

        if RANK.journal is not None:
            RANK.journal.told(key)
        publish_data({key: True})


def log(step: float | None = None, **metrics: Any) -> None:
    """Record numbers for the notebook's live plot: `ddp_notebook.log(loss=loss.item())`.

    Each call is one step of this rank: points are plotted against the number of earlier
    `log()` calls in the cell, unless `step=` gives the x value. Costs about a microsecond;
    the points leave the rank in batches, at most every 0.1 s and when the cell ends.
    """
    channel = RANK.channel or rank_channel()
    channel.log(step, metrics)


def progress(iterable: Iterable[Any], desc: str | None = None, total: int | None = None) -> Progress:
    """Iterate over `iterable` with a live progress bar per rank in the notebook.

    `total` defaults to `len(iterable)` where there is one. Loops may nest: each level
    gets its own bar.
    """
    return Progress(RANK.channel or rank_channel(), iterable, desc, total)
