"""The notebook-side live view of a cell's progress and metrics.

`LiveView` (in a kernel with a widget frontend): one progress bar per rank per loop level,
one plotly FigureWidget with a curve per metric per rank, a status table, each rank's time per
training step split by phase with the straggler named, and the collective X-ray while a rank
waits in a collective. `TextView` (a plain script, terminal IPython): a concise progress line
every few seconds, one line when ranks wait in a collective, and a summary per rank at the end.
Both draw what a `feed.Feed` holds; the Feed decides when.

ipywidgets and plotly are imported only when a LiveView is made.
"""

from __future__ import annotations

import html
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ..errors import GROUP_ABOVE, count_ranks, name_ranks, rank_ranges
from ..platform.limits import MEMORY_WARN_FRACTION, format_bytes
from ..wire.channel import RunState
from .aggregate import outlier_ranks, summarize_progress, wants_aggregate
from .durations import milliseconds
from .feed import BarState, Feed, RankRow
from .grouping import grouped_lines
from .stragglers import PHASES

# while the cell runs, a curve longer than this is drawn with every k-th point (and its
# last one), so each redraw stays small; the final drawing has every point
LIVE_POINTS = 2000
# the curves, the costliest part to redraw, at most this often (the bars at the Feed's pace)
CURVE_SECONDS = 0.25
TEXT_INTERVAL_SECONDS = 2.0
STATE_COLORS: dict[RunState, str] = {"running": "#1f77b4", "done": "#2ca02c", "failed": "#d62728", "stopped": "#ff7f0e"}


def widget_frontend() -> bool:
    """True inside a Jupyter kernel (widgets can be shown), False in a script or terminal IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def preload(browser: bool = False) -> None:
    """Import what the live view needs (ipywidgets, plotly's FigureWidget) as soon as the kernel
    is idle, where widgets will be shown; with `browser` (a world is there to train), also send
    the page plotly.js now, which the page evaluates as it arrives.

    The first import takes over a second (anywidget, and nbformat's schema checker through
    plotly's renderers): done between cells, the first live view of a cell appears at once
    instead of that late. It runs on the kernel's own thread, never beside a cell: an import on
    another thread races the user's imports of the same packages (a half-initialised module),
    and holds the GIL a starting world needs. The page takes most of a second to evaluate
    plotly.js on a slow CPU; done as the first live view arrived, it froze the page mid-cell. Its
    holder is sent at once (ipywidgets and anywidget import in tens of milliseconds where IPython
    runs): "between cells" comes too late where cells run back to back (Run All).
    """
    if not widget_frontend():
        return
    if browser:
        try:
            from . import plotly_adapter

            plotly_adapter.plotly_code()  # once per kernel
        except Exception:  # noqa: BLE001  (the live view reports it when it is made)
            pass
    if "plotly.graph_objs._figurewidget" in sys.modules:
        return
    from IPython import get_ipython

    loop = getattr(getattr(get_ipython(), "kernel", None), "io_loop", None)
    if loop is not None:
        loop.add_callback(_import_widgets)


def _import_widgets() -> None:
    try:
        import ipywidgets  # noqa: F401
        import plotly.graph_objects as go

        go.FigureWidget  # noqa: B018  (plotly imports it on first use)
    except Exception:  # noqa: BLE001  (the live view reports it when it is made)
        pass


# ---------------------------------------------------------------- formatting


def format_seconds(seconds: float | None) -> str:
    """tqdm's style: 00:07, 03:25, 1:02:03."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def format_rate(rate: float | None, unit: str = "it") -> str:
    if rate is None or not math.isfinite(rate):
        return f"? {unit}/s"
    if rate >= 1 or rate == 0:
        return f"{rate:.2f} {unit}/s" if rate < 100 else f"{rate:.0f} {unit}/s"
    return f"{1 / rate:.2f} s/{unit}"


def format_value(value: float | None) -> str:
    if value is None:
        return "-"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def bar_text(bar: BarState) -> str:
    """`37/100 [00:03<00:05, 12.30 it/s]`, like tqdm."""
    count = f"{bar.n}/{bar.total}" if bar.total is not None else f"{bar.n}"
    remaining = f"<{format_seconds(bar.eta)}" if bar.state == "running" and bar.total is not None else ""
    suffix = "" if bar.state in ("running", "done") else f", {bar.state}"
    return f"{count} [{format_seconds(bar.elapsed)}{remaining}, {format_rate(bar.rate)}{suffix}]"


# ---------------------------------------------------------------- text fallback


class TextView:
    """Concise text progress: a line at most every `interval` seconds, then one line per rank."""

    def __init__(
        self,
        stream: TextIO | None = None,
        interval: float = TEXT_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._interval = interval
        self._clock = clock
        self._last = -math.inf
        self._xray_said: tuple[Any, ...] = ()  # the waits the last X-ray line named

    def show(self) -> None:
        pass

    def draw(self, feed: Feed, final: bool) -> None:
        now = self._clock()
        lines = []
        waits = _waits(feed)
        if waits != self._xray_said and not final:
            # one line per new picture of who waits where, not one per redraw
            self._xray_said = waits
            if waits:
                lines.append(xray_line(feed))
        if final or now - self._last >= self._interval:
            self._last = now
            lines += summary_lines(feed) if final else [progress_line(feed)]
        if not lines:
            return
        out = self._stream or sys.stdout  # looked up now: IPython swaps sys.stdout per cell
        out.write("".join(line + "\n" for line in lines))
        out.flush()


def progress_line(feed: Feed) -> str:
    """The slowest rank's bar at each level, and each metric's mean over the ranks."""
    parts = []
    for level in sorted({level for _, level in feed.bars}):
        bars = [bar for (_, bar_level), bar in feed.bars.items() if bar_level == level]
        slowest = min(bars, key=lambda bar: (bar.fraction if bar.fraction is not None else 0.0, bar.n))
        name = f"{slowest.desc} " if slowest.desc else ""
        parts.append(f"{name}{bar_text(slowest)}")
    values = _mean_last_values(feed.ranks.values())
    if values:
        ranks = len(feed.ranks)
        mean = f" (mean of {ranks} ranks)" if ranks > 1 else ""
        parts.append(", ".join(f"{name} {format_value(value)}" for name, value in values.items()) + mean)
    return f"[progress {format_seconds(feed.elapsed)}] " + " | ".join(parts or ["started"])


def summary_lines(feed: Feed) -> list[str]:
    ended = {None: "finished", "failed": "failed", "stopped": "stopped"}.get(feed.outcome, "ended")
    lines = [f"[progress] {ended} after {feed.elapsed:.1f} s; {len(feed.metrics)} points logged"]
    if wants_aggregate(len(feed.ranks)):
        return lines + [f"[progress] {line}" for line in aggregate_lines(feed)]
    for rank in sorted(feed.ranks):
        state = feed.ranks[rank]
        values = ", ".join(f"{name} {format_value(value)}" for name, value in state.last.items())
        lines.append(
            f"[progress] rank {rank}: {state.state}, {state.steps} steps, {format_rate(state.rate, 'step')}"
            + (f", {values}" if values else "")
        )
    for rank in sorted(feed.step_times):
        lines.append(f"[progress] rank {rank} per step: {feed.step_times[rank].describe()}")
    if feed.straggler is not None:
        lines.append(f"[progress] {feed.straggler.headline()}")
    return lines


def aggregate_lines(feed: Feed) -> list[str]:
    """A large world's cell in a few lines: the ranks' states counted, each loop's progress, each
    metric's median and outliers, the straggler."""
    states = Counter(state.state for state in feed.ranks.values())
    counted = ", ".join(f"{count:,} {name}" for name, count in sorted(states.items(), key=lambda item: -item[1]))
    failed = [rank for rank, state in feed.ranks.items() if state.state == "failed"]
    lines = [f"{count_ranks(len(feed.ranks))}: {counted}" + (f" (failed: {rank_ranges(failed)})" if failed else "")]
    for level in sorted({level for _, level in feed.bars}):
        summary = summarize_progress(feed.bars, level)
        if summary is not None:
            lines.append(summary.describe())
    for name in feed.metrics.names:
        last = sorted(value for state in feed.ranks.values() if (value := state.last.get(name)) is not None)
        if not last:
            continue
        outliers = "; ".join(o.describe() for o in outlier_ranks(feed.metrics, name, limit=3))
        lines.append(
            f"{name}: median {format_value(last[len(last) // 2])}" + (f"; outliers: {outliers}" if outliers else "")
        )
    if feed.straggler is not None:
        lines.append(feed.straggler.headline())
    return lines


def _waits(feed: Feed) -> tuple[Any, ...]:
    """Who waits in which collective, in the X-ray shown (empty when none is)."""
    return tuple(
        (rank, reading.current.seq if reading.current is not None else None)
        for rank, reading in sorted(feed.waiting.items())
    )


def where_rank_is(reading: Any) -> str:
    """'waits in all_reduce #3 [4] (cell line 2) for 4.2 s', 'runs cell line 5, in no collective'."""
    line = f" (cell line {reading.cell_line})" if reading.cell_line is not None else ""
    current = reading.current
    if current is not None:
        return f"waits in {current.describe()}{line} for {reading.waited:.1f} s"
    if reading.in_cell:
        return f"runs the cell{line}, in no collective"
    return "finished the cell"


def xray_line(feed: Feed) -> str:
    """The X-ray on one line: `[x-ray 00:05] rank 0 waits in ...; rank 1 runs the cell ...`."""
    waiting = feed.waiting
    if len(waiting) > GROUP_ABOVE:  # grouped by where they are, the seconds each waited aside
        places = [(rank, where_rank_is(reading).rsplit(" for ", 1)[0]) for rank, reading in waiting.items()]
        return f"[x-ray {format_seconds(feed.elapsed)}] " + "; ".join(grouped_lines(places))
    parts = [f"rank {rank} {where_rank_is(reading)}" for rank, reading in sorted(waiting.items())]
    return f"[x-ray {format_seconds(feed.elapsed)}] " + "; ".join(parts)


def _mean_last_values(states: Any) -> dict[str, float]:
    collected: dict[str, list[float]] = {}
    for state in states:
        for name, value in state.last.items():
            collected.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in collected.items()}


# ---------------------------------------------------------------- widgets


def live_points(steps: Sequence[float], values: Sequence[float], budget: int) -> tuple[list[float], list[float]]:
    """Every k-th point (and always the last) so that at most about `budget` remain."""
    if budget <= 0 or len(steps) <= budget:
        return list(steps), list(values)
    stride = math.ceil(len(steps) / budget)
    xs, ys = list(steps[::stride]), list(values[::stride])
    if (len(steps) - 1) % stride:
        xs.append(steps[-1])
        ys.append(values[-1])
    return xs, ys


class Smoother:
    """TensorBoard's debiased exponential moving average, extended as points arrive."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.smoothed: list[float] = []
        self._mean = 0.0
        self._count = 0

    def extend(self, values: Sequence[float]) -> list[float]:
        weight = self.weight
        for value in values[len(self.smoothed) :]:
            if not math.isfinite(value):
                self.smoothed.append(value)
                continue
            self._count += 1
            self._mean = self._mean * weight + (1 - weight) * value
            self.smoothed.append(self._mean / (1 - weight**self._count))
        return self.smoothed


class _BarRow:
    def __init__(self, widgets: Any, rank: int) -> None:
        self.label = widgets.HTML()
        self.bar = widgets.IntProgress(min=0, max=1, value=0, layout=widgets.Layout(width="45%"))
        self.text = widgets.HTML()
        self.box = widgets.HBox([self.label, self.bar, self.text])
        self.box.add_class("ddp-bar")
        self.rank = rank
        self.shown: tuple[Any, ...] = ()

    def draw(self, bar: BarState) -> None:
        key = (bar.id, bar.n, bar.total, bar.state, bar.desc, round(bar.rate or 0, 3))
        if key == self.shown:
            return
        self.shown = key
        name = html.escape(f"rank {self.rank}" + (f" · {bar.desc}" if bar.desc else ""))
        self.label.value = f"<code>{name}</code>"
        if bar.total is None:  # unknown length: a full bar, like tqdm.notebook
            self.bar.max, self.bar.value = 1, 1
            self.bar.bar_style = "info"
        else:
            self.bar.max = max(bar.total, 1)
            self.bar.value = min(bar.n, self.bar.max) if bar.total else 1
            self.bar.bar_style = {"done": "success", "closed": "warning"}.get(bar.state, "")
        if bar.state == "done":
            self.box.add_class("ddp-bar-done")
        else:
            self.box.remove_class("ddp-bar-done")
        self.text.value = f"<code>{html.escape(bar_text(bar))}</code>"


class LiveView:
    """Bars, one FigureWidget for every rank's curves, and a status table, in one VBox."""

    def __init__(
        self,
        live_budget: int = LIVE_POINTS,
        curve_seconds: float = CURVE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import ipywidgets as widgets

        self._curve_seconds = curve_seconds
        self._clock = clock
        self._curves_drawn = -math.inf
        self._widgets = widgets
        self._live_budget = live_budget
        self.header = widgets.HTML()
        self.bars = widgets.VBox()
        # made with the view, though its curves come later: plotly.js must be loaded in the browser
        # before the first update reaches it (an update sent earlier is lost)
        from . import plotly_adapter

        # plotly.js itself reaches the browser once per kernel, not once per cell (5 MB each)
        self.figure = plotly_adapter.figure_widget(
            layout={
                "height": 300,
                "margin": {"l": 60, "r": 20, "t": 30, "b": 40},
                "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
                "hovermode": "x unified",
                "template": "plotly_white",
            }
        )
        self.smoothing = widgets.FloatSlider(
            value=0.0, min=0.0, max=0.99, step=0.01, description="smoothing", readout_format=".2f"
        )
        self.smoothing.observe(self._smoothing_changed, names="value")
        self.plot = widgets.VBox()  # empty until a metric arrives: a progress-only cell shows no axes
        self.status = widgets.HTML()
        # hidden while empty: most cells have neither timed steps nor a long wait in a collective
        self.xray = widgets.HTML(layout=widgets.Layout(display="none"))
        self.steps = widgets.HTML(layout=widgets.Layout(display="none"))
        self.xray.add_class("ddp-xray")
        self.steps.add_class("ddp-steps")
        self.widget = widgets.VBox([self.header, self.xray, self.bars, self.plot, self.status, self.steps])
        self.widget.add_class("ddp-live")
        self._rows: dict[tuple[int, int], _BarRow] = {}
        self._traces: dict[tuple[str, int], int] = {}
        self._drawn: dict[tuple[str, int], tuple[int, int, float]] = {}
        self._smoothers: dict[tuple[str, int], Smoother] = {}
        self._names: list[str] = []
        self._axes: set[str] = set()
        self._feed: Feed | None = None
        self._final = False

    def show(self) -> None:
        from IPython.display import display

        display(self.widget)

    def draw(self, feed: Feed, final: bool) -> None:
        self._feed, self._final = feed, final
        self._draw_header(feed, final)
        self._draw_bars(feed)
        now = self._clock()
        if final or now - self._curves_drawn >= self._curve_seconds:
            self._curves_drawn = now
            self._draw_curves(feed, final)
            if final:
                self._keep_figure()
        self._draw_panels(feed, final)

    def _draw_panels(self, feed: Feed, final: bool) -> None:
        """The tables under the curves: each rank's state, time per step and collective X-ray."""
        self.status.value = status_table(feed)
        _show_panel(self.steps, steps_table(feed))
        _show_panel(self.xray, "" if final else xray_table(feed))

    def _keep_figure(self) -> None:
        # curve updates reach plotly.js as messages, so the FigureWidget's synced state still
        # holds the figure it was shown with (no curves). Storing the finished figure there (as
        # plotly does when a figure is displayed; plotly.js ignores the change) lets what saves
        # widget state (a saved notebook, nbclient, the docs site) keep every curve.
        if self.plot.children:
            from . import plotly_adapter

            plotly_adapter.keep_current_figure(self.figure)

    def _draw_header(self, feed: Feed, final: bool) -> None:
        # a cell whose ranks sent nothing yet (shown for its X-ray): the ranks it runs on
        ranks = name_ranks(feed.ranks or feed.expected or ()) or "ranks"
        if not final:
            state = f"running · {feed.elapsed:.1f} s"
        else:
            state = {None: "finished", "failed": "failed", "stopped": "stopped"}.get(feed.outcome, "ended")
            state += f" after {feed.elapsed:.1f} s"
        lost = sum(rank.lost for rank in feed.ranks.values())
        warning = f" · <b>{lost} updates were lost</b>" if lost else ""
        self.header.value = (
            f"<b>ddp_notebook</b> · {ranks} · {state} · {len(feed.metrics)} points{memory_header(feed)}{warning}"
        )

    def _draw_bars(self, feed: Feed) -> None:
        added = False
        for key in sorted(feed.bars):
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _BarRow(self._widgets, key[0])
                added = True
            row.draw(feed.bars[key])
        if added:
            self.bars.children = tuple(self._rows[key].box for key in sorted(self._rows))

    def _draw_curves(self, feed: Feed, final: bool) -> None:
        metrics = feed.metrics
        keys = metrics.keys()
        if not keys:
            return
        weight = self.smoothing.value
        budget = 0 if final else self._live_budget
        names = metrics.names
        if names != self._names:
            self._names = names
            self._lay_out(names)
        changed: dict[tuple[str, int], tuple[Any, Any, str]] = {}
        for key in keys:
            name, rank = key
            steps, values = metrics.view(name, rank)
            shown = (len(steps), budget, weight)
            if self._drawn.get(key) == shown:
                continue
            self._drawn[key] = shown
            if weight > 0:
                smoother = self._smoothers.get(key)
                if smoother is None or smoother.weight != weight:
                    smoother = self._smoothers[key] = Smoother(weight)
                values = smoother.extend(values)
            xs, ys = live_points(steps, values, budget)
            changed[key] = (_array(xs), _array(ys), "lines+markers" if len(xs) <= 50 else "lines")
        with self.figure.batch_update():
            for key, (xs, ys, mode) in changed.items():
                index = self._traces.get(key)
                if index is None:
                    continue  # added below, with its points
                trace = self.figure.data[index]
                trace.x, trace.y = xs, ys
                if trace.mode != mode:  # every assignment is a message to the browser
                    trace.mode = mode
        self._add_traces({key: drawn for key, drawn in changed.items() if key not in self._traces}, names)
        if not self.plot.children:
            # shown once it holds its first curves: the page draws it once, instead of again for each
            # message that would otherwise follow it there
            self.plot.children = (self.figure, self.smoothing)

    def _lay_out(self, names: Sequence[str]) -> None:
        layout = axes_layout(names)
        # a new axis goes in on its own: plotly's batched update would send both `yaxis2`
        # and `yaxis2.domain`, which plotly.js rejects
        for key in [key for key in layout if key.startswith(("xaxis", "yaxis")) and key not in self._axes]:
            self._axes.add(key)
            self.figure.layout[key] = layout.pop(key)
        self.figure.update_layout(**layout)

    def _add_traces(self, curves: dict[tuple[str, int], tuple[Any, Any, str]], names: Sequence[str]) -> None:
        """A curve for each (metric, rank) of `curves` with its first points (x, y, mode), all in one
        message to the page (one redraw)."""
        if not curves:
            return
        import plotly.graph_objects as go

        ranks_drawn = {rank for _, rank in self._traces}
        traces = []
        for (name, rank), (xs, ys, mode) in curves.items():
            axis = names.index(name)
            suffix = "" if axis == 0 else str(axis + 1)
            traces.append(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode=mode,
                    name=f"rank {rank}",
                    meta=name,
                    legendgroup=f"rank {rank}",
                    legendrank=rank,
                    showlegend=rank not in ranks_drawn,
                    line={"color": _rank_color(rank)},
                    xaxis=f"x{suffix}",
                    yaxis=f"y{suffix}",
                    hovertemplate=f"{html.escape(name)}: %{{y:.4g}}<extra>rank {rank}</extra>",
                )
            )
            ranks_drawn.add(rank)
        first = len(self.figure.data)
        self.figure.add_traces(traces)
        for offset, key in enumerate(curves):
            self._traces[key] = first + offset

    def _smoothing_changed(self, _: Any) -> None:
        # redraw with the new weight (in a live cell, the next redraw picks it up)
        if self._feed is not None:
            self._draw_curves(self._feed, self._final)


def axes_layout(names: Sequence[str]) -> dict[str, Any]:
    """One subplot per metric, stacked (each with its own steps: some may be epochs)."""
    count = len(names)
    gap = 0.12 if count > 1 else 0.0
    height = (1.0 - gap * (count - 1)) / count
    layout: dict[str, Any] = {"height": 140 + 220 * count}
    for index, name in enumerate(names):
        suffix = "" if index == 0 else str(index + 1)
        top = 1.0 - index * (height + gap)
        layout[f"yaxis{suffix}"] = {
            "domain": [max(0.0, top - height), top],
            "title": {"text": name},
            "anchor": f"x{suffix}",
        }
        layout[f"xaxis{suffix}"] = {
            "anchor": f"y{suffix}",
            "title": {"text": "step" if index == count - 1 else ""},
        }
    return layout


def memory_header(feed: Feed) -> str:
    """' · memory 42% of this machine's 23.5 GiB', bold red from the warning level on."""
    reading = feed.memory_reading
    if reading is None:
        return ""
    text = html.escape(f"memory {reading.fraction:.0%} of {reading.limit_text}")
    if reading.fraction >= MEMORY_WARN_FRACTION:
        text = f'<b style="color:{STATE_COLORS["failed"]}">{text}</b>'
    return f" · {text}"


def rank_memory(feed: Feed, rank: int) -> str:
    """'270 MiB (18%)': a rank's resident memory and its share of the limit."""
    reading = feed.memory_reading
    resident = reading.rank_bytes.get(rank) if reading is not None else None
    if reading is None or resident is None:
        return "-"
    return f"{format_bytes(resident)} ({resident / reading.limit:.0%})"


def status_table(feed: Feed) -> str:
    names = feed.metrics.names
    memory = ["memory"] if feed.memory_reading is not None else []
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["rank", "state", "steps", "steps/s", "time", *memory, *names])
    rows = []
    for rank in sorted(feed.ranks):
        state: RankRow = feed.ranks[rank]
        color = STATE_COLORS.get(state.state, "inherit")
        cells = [
            f"{rank}",
            f'<span style="color:{color}">{html.escape(state.state)}</span>',
            f"{state.steps}",
            "-" if state.rate is None else f"{state.rate:.1f}",
            f"{state.t:.1f} s",
            *([rank_memory(feed, rank)] if memory else []),
            *(format_value(state.last.get(name)) for name in names),
        ]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return (
        '<table class="ddp-status" style="font-family:monospace;font-size:12px;border-spacing:12px 2px">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def steps_table(feed: Feed) -> str:
    """Each rank's mean time per training step, by phase, with the straggler named; '' if no rank
    timed steps (models from prepare_model)."""
    times = feed.step_times
    if not times:
        return ""
    straggler = feed.straggler
    head = "".join(f"<th>{h}</th>" for h in ["rank", "steps", "ms/step", *PHASES])
    rows = []
    for rank in sorted(times):
        t = times[rank]
        cells = [f"{rank}", f"{t.steps}", milliseconds(t.total, unit=False)]
        for phase in PHASES:
            cell = milliseconds(getattr(t, phase), unit=False)
            if straggler is not None and straggler.rank == rank and straggler.phase == phase:
                cell = f'<b style="color:{STATE_COLORS["failed"]}">{cell}</b>'
            cells.append(cell)
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    if straggler is not None:
        title = f'<b style="color:{STATE_COLORS["failed"]}">{html.escape(straggler.headline())}</b>'
    else:
        title = "time per step, ms (mean of recent steps)" + (": no straggler" if len(times) > 1 else "")
    return (
        f'<div class="ddp-steps-title">{title}</div>'
        '<table style="font-family:monospace;font-size:12px;border-spacing:12px 2px">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def xray_table(feed: Feed) -> str:
    """Where each rank is once one waited XRAY_SHOW_SECONDS in a collective; '' otherwise."""
    waiting = feed.waiting
    if not waiting:
        return ""
    rows = []
    for rank in sorted(waiting):
        reading = waiting[rank]
        current = reading.current
        waits = current is not None
        where = html.escape(current.describe() if waits else ("in no collective" if reading.in_cell else "finished"))
        line = "-" if reading.cell_line is None else f"{reading.cell_line}"
        waited = f"{reading.waited:.1f} s" if waits else "-"
        style = f' style="color:{STATE_COLORS["failed"]}"' if waits else ""
        rows.append(f"<tr{style}><td>{rank}</td><td>{where}</td><td>{line}</td><td>{waited}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("rank", "collective", "cell line", "waited"))
    return (
        "<div><b>waiting in a collective</b> (collective X-ray)</div>"
        '<table style="font-family:monospace;font-size:12px;border-spacing:12px 2px">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _show_panel(panel: Any, value: str) -> None:
    if panel.value == value:
        return  # each assignment is a message to the browser
    panel.value = value
    display = "" if value else "none"
    if panel.layout.display != display:
        panel.layout.display = display


def _rank_color(rank: int) -> str:
    from plotly.colors import qualitative

    palette = qualitative.Plotly
    return palette[rank % len(palette)]


def _array(values: list[float]) -> Any:
    # numpy arrays travel to the browser as binary buffers, lists as (slower) JSON
    try:
        import numpy
    except ImportError:
        return [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
    return numpy.asarray(values, dtype=float)
