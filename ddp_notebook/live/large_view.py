"""The live view of a large world (more than AGGREGATE_ABOVE ranks), bounded whatever the rank count.

A bar and a curve per rank stop being readable (and cost the browser a message per rank per
redraw) long before 1,024 ranks. This view draws the same cell as aggregates (`live.aggregate`):
- progress: one bar per loop level at the median rank, min / median / max and the slowest ranks named;
- each metric: the median over the ranks with a band (10th to 90th percentile) and the outlier
  ranks (robust z-score on their latest value) drawn as their own curves;
- a heat map of seconds per step, ranks (in bands of consecutive ranks, each cell the band's worst)
  by time, so a rank that slows down shows where and when;
- the state of the ranks counted ("1,020 running, 3 done, 1 failed: rank 17"), the slowest by
  step rate, each metric's outliers, the straggler by phase;
- the collective X-ray grouped by where the ranks wait.
What reaches the browser per redraw is a few hundred points per metric and one bounded heat map,
so the bytes a second stay bounded as ranks grow (`benchmarks/run.py scale`).
"""

from __future__ import annotations

import html
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

from ..errors import RUNS_SHOWN, count_ranks, rank_ranges
from .aggregate import band, outlier_ranks, summarize_progress, wants_aggregate
from .feed import Feed, View
from .grouping import grouped_waits
from .widgets import (
    STATE_COLORS,
    LiveView,
    TextView,
    _array,
    _show_panel,
    axes_layout,
    format_rate,
    where_rank_is,
    widget_frontend,
)

# the curves and the heat map cost most to redraw: at most this often in a large world
LARGE_CURVE_SECONDS = 1.0
HEAT_SECONDS = 2.0
# points per curve (median, band, outliers) while the cell runs and at its end
BAND_POINTS = 200
# outlier ranks drawn per metric, and named in the table
OUTLIERS = 3
HEAT_HOVER = "ranks %{text}, %{x:.1f} s: %{z:.3g} s/step<extra></extra>"
# the heat map's size: time bins by bands of ranks
HEAT_COLUMNS = 40
HEAT_ROWS = 32
HEAT_TICKS = 12  # rank labels on the heat map's axis, at most
SLOWEST = 3
# a metric's traces: the band's lower and upper edges, the median, then the outlier ranks
_BAND_LOW, _BAND_HIGH, _MEDIAN = 0, 1, 2
_TRACES_PER_METRIC = 3 + OUTLIERS


def make_view(stream: TextIO | None = None, ranks: int = 0) -> View:
    """The live view of a cell on `ranks` ranks: where widgets can be shown, this large world's view
    above AGGREGATE_ABOVE ranks and `LiveView` up to it; else the text fallback (`TextView`)."""
    if not widget_frontend():
        return TextView(stream)
    return LargeWorldView() if wants_aggregate(ranks) else LiveView()


class LargeWorldView(LiveView):
    """`LiveView`'s layout, drawn as aggregates: one bar per level, bands, a heat map, grouped tables."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(live_budget=BAND_POINTS, curve_seconds=LARGE_CURVE_SECONDS, clock=clock)
        from . import plotly_adapter

        widgets = self._widgets
        # made now, like the curves' figure: plotly.js must be in the page before an update reaches it
        self.heat_figure = plotly_adapter.figure_widget(
            layout={
                "height": 260,
                "margin": {"l": 70, "r": 20, "t": 30, "b": 40},
                "template": "plotly_white",
                "title": {"text": "seconds per step (each band of ranks: its slowest)", "font": {"size": 12}},
                "xaxis": {"title": {"text": "seconds into the cell"}},
                "yaxis": {"title": {"text": "ranks"}, "autorange": "reversed"},
            }
        )
        self.heat = widgets.VBox()  # empty until a rank logged a step
        self.heat.add_class("ddp-heat")
        self.widget.children = (self.header, self.xray, self.bars, self.plot, self.heat, self.status, self.steps)
        self.widget.add_class("ddp-large")
        self._levels: dict[int, tuple[Any, Any]] = {}
        self._metric_traces: dict[str, int] = {}  # metric -> index of its first trace
        self._heat_drawn = -math.inf
        self._heat_shape: tuple[Any, ...] = ()

    def draw(self, feed: Feed, final: bool) -> None:
        super().draw(feed, final)
        now = self._clock()
        if feed.heat is not None and (final or now - self._heat_drawn >= HEAT_SECONDS):
            self._heat_drawn = now
            self._draw_heat(feed)

    # ------------------------------------------------------------ progress

    def _draw_bars(self, feed: Feed) -> None:
        widgets = self._widgets
        added = False
        for level in sorted({level for _, level in feed.bars}):
            summary = summarize_progress(feed.bars, level, slowest=SLOWEST)
            if summary is None:
                continue
            row = self._levels.get(level)
            if row is None:
                bar = widgets.IntProgress(min=0, max=1, value=0, layout=widgets.Layout(width="35%"))
                row = self._levels[level] = (bar, widgets.HTML())
                added = True
            bar, text = row
            total = summary.total
            bar.max = max(total or 1, 1)
            bar.value = min(int(summary.median), bar.max) if total else bar.max
            state = "success" if summary.finished == summary.ranks else ""
            if bar.bar_style != state:
                bar.bar_style = state
            value = f"<code>{html.escape(summary.describe())}</code>"
            if text.value != value:
                text.value = value
        if added:
            rows = [widgets.HBox(list(self._levels[level])) for level in sorted(self._levels)]
            for row in rows:
                row.add_class("ddp-bar")
            self.bars.children = tuple(rows)

    # ------------------------------------------------------------ curves

    def _draw_curves(self, feed: Feed, final: bool) -> None:
        metrics = feed.metrics
        names = metrics.names
        if not names:
            return
        if names != self._names:
            self._names = names
            self._lay_out(names)
        ranks = metrics.ranks
        curves = {name: self._curves(metrics, name, ranks) for name in names}
        with self.figure.batch_update():
            for name, drawn in curves.items():
                first = self._metric_traces.get(name)
                if first is None:
                    continue  # added below, with its points
                traces = self.figure.data[first : first + 3 + OUTLIERS]
                for offset, (trace, (xs, ys, label)) in enumerate(zip(traces, drawn)):
                    if offset < 3 or label is not None:  # the band and the median; a slot's outlier
                        trace.x, trace.y = xs, ys
                        if label is not None and (trace.name != label or not trace.visible):
                            trace.name, trace.visible = label, True
                    elif trace.visible:  # a slot with no outlier now
                        trace.x, trace.y, trace.visible = [], [], False
        for axis, name in enumerate(names):
            if name not in self._metric_traces:
                self._add_metric(name, axis, curves[name])
        if not self.plot.children:
            # shown once it holds its first curves: the page draws it once, instead of again for each
            # message that would otherwise follow it there
            self.plot.children = (self.figure,)

    def _curves(self, metrics: Any, name: str, ranks: Any) -> list[tuple[Any, Any, str | None]]:
        """`name`'s curves as drawn: the band's two edges and the median (label None), then each
        outlier slot, (x, y, "rank N") or empty with None."""
        series = band(metrics, name, ranks, budget=BAND_POINTS)
        xs = _array(series.steps)
        drawn: list[tuple[Any, Any, str | None]] = [
            (xs, _array(series.low), None),
            (xs, _array(series.high), None),
            (xs, _array(series.median), None),
        ]
        outliers = outlier_ranks(metrics, name, limit=OUTLIERS)
        for slot in range(OUTLIERS):
            if slot < len(outliers):
                steps, values = metrics.view(name, outliers[slot].rank)
                stride = max(1, math.ceil(len(steps) / BAND_POINTS))
                drawn.append(
                    (_array(list(steps[::stride])), _array(list(values[::stride])), f"rank {outliers[slot].rank}")
                )
            else:
                drawn.append(([], [], None))
        return drawn

    def _add_metric(self, name: str, axis: int, drawn: list[tuple[Any, Any, str | None]]) -> None:
        """`name`'s traces with their first points, in one message to the page (one redraw)."""
        import plotly.graph_objects as go

        self._metric_traces[name] = len(self.figure.data)
        suffix = "" if axis == 0 else str(axis + 1)
        where = {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}
        escaped = html.escape(name)
        shown = axis == 0  # one legend for all metrics
        band_line = {"width": 0, "color": "rgba(31,119,180,0.25)"}
        (low_x, low_y, _), (high_x, high_y, _), (median_x, median_y, _), *outliers = drawn
        traces = [
            go.Scatter(x=low_x, y=low_y, name="10th percentile", line=band_line, showlegend=False, **where),
            go.Scatter(
                x=high_x,
                y=high_y,
                name="10th-90th percentile",
                line=band_line,
                fill="tonexty",
                fillcolor="rgba(31,119,180,0.2)",
                showlegend=shown,
                legendgroup="band",
                **where,
            ),
            go.Scatter(
                x=median_x,
                y=median_y,
                name="median",
                line={"color": STATE_COLORS["running"], "width": 2},
                showlegend=shown,
                legendgroup="median",
                hovertemplate=f"{escaped} median: %{{y:.4g}}<extra></extra>",
                **where,
            ),
        ]
        for xs, ys, label in outliers:
            traces.append(
                go.Scatter(
                    x=xs,
                    y=ys,
                    name=label,
                    visible=label is not None,
                    line={"color": STATE_COLORS["failed"], "width": 1},
                    hovertemplate=f"{escaped}: %{{y:.4g}}<extra>%{{fullData.name}}</extra>",
                    **where,
                )
            )
        self.figure.add_traces(traces)

    def _lay_out(self, names: Any) -> None:
        layout = axes_layout(names)
        for key in [key for key in layout if key.startswith(("xaxis", "yaxis")) and key not in self._axes]:
            self._axes.add(key)
            self.figure.layout[key] = layout.pop(key)
        self.figure.update_layout(hovermode="x unified", **layout)

    def _smoothing_changed(self, _: Any) -> None:
        pass  # the median is drawn as it is: no smoothing slider in a large world's view

    # ------------------------------------------------------------ heat map

    def _draw_heat(self, feed: Feed) -> None:
        assert feed.heat is not None
        matrix = feed.heat.matrix(columns=HEAT_COLUMNS, rows=HEAT_ROWS, ranks=sorted(feed.ranks))
        if not matrix.labels or len(matrix.edges) < 2:
            return
        centers = [(low + high) / 2 for low, high in zip(matrix.edges, matrix.edges[1:])]
        # JSON rows with gaps as null (a 2-D binary array does not reach plotly.js as a heat map), in
        # 4 significant digits: 32 x 40 cells are a few KB
        z = [[None if value is None else float(f"{value:.4g}") for value in row] for row in matrix.values]
        # rows by number, named by their ranks on the axis: labels such as "0-1" would be read as dates
        rows = list(range(len(matrix.labels)))
        shape = (tuple(matrix.labels), len(centers))
        # the hover's rank labels and the axis' ticks, sent when they change
        labels = {} if shape == self._heat_shape else {"text": [[label] * len(centers) for label in matrix.labels]}
        every = max(1, math.ceil(len(rows) / HEAT_TICKS))
        ticks = {"tickvals": rows[::every], "ticktext": matrix.labels[::every]}
        self._heat_shape = shape
        x = [round(c, 2) for c in centers]
        if not self.heat_figure.data:  # the first drawing: the map with its cells, in one message
            self.heat_figure.layout.yaxis.update(ticks)
            self.heat_figure.add_heatmap(
                z=z,
                x=x,
                y=rows,
                colorscale="YlOrRd",
                colorbar={"title": {"text": "s/step"}},
                hoverongaps=False,
                hovertemplate=HEAT_HOVER,
                **labels,
            )
            self.heat.children = (self.heat_figure,)  # shown with its cells: drawn once
            return
        trace = self.heat_figure.data[0]
        with self.heat_figure.batch_update():
            trace.x, trace.y, trace.z = x, rows, z
            if labels:
                trace.text = labels["text"]
                self.heat_figure.layout.yaxis.update(ticks)

    # ------------------------------------------------------------ tables

    def _draw_panels(self, feed: Feed, final: bool) -> None:
        self.status.value = large_status(feed)
        straggler = feed.straggler
        _show_panel(self.steps, html.escape(straggler.headline()) if straggler is not None else "")
        _show_panel(self.xray, "" if final else grouped_xray(feed))


def large_status(feed: Feed) -> str:
    """The ranks' states counted, the slowest by step rate, each metric's outliers: a few lines."""
    states = Counter(state.state for state in feed.ranks.values())
    counted = ", ".join(
        f'<span style="color:{STATE_COLORS.get(name, "inherit")}">{count:,} {name}</span>'
        for name, count in sorted(states.items(), key=lambda item: -item[1])
    )
    failed = sorted(rank for rank, state in feed.ranks.items() if state.state == "failed")
    if failed:
        counted += f" (failed: {rank_ranges(failed, RUNS_SHOWN)})"
    lines = [f"<b>{count_ranks(len(feed.ranks))}</b>: {counted}"]
    timed = [state for state in feed.ranks.values() if state.rate is not None and state.state == "running"]
    if timed:
        slowest = sorted(timed, key=lambda state: (state.rate, state.rank))[:SLOWEST]
        rates = sorted(state.rate or 0.0 for state in timed)
        median = rates[len(rates) // 2]
        named = ", ".join(f"rank {state.rank} ({format_rate(state.rate, 'step')})" for state in slowest)
        lines.append(f"slowest: {named}; median {format_rate(median, 'step')}")
    for name in feed.metrics.names:
        outliers = outlier_ranks(feed.metrics, name, limit=OUTLIERS)
        if outliers:
            lines.append("outliers: " + "; ".join(html.escape(outlier.describe()) for outlier in outliers))
    return '<div class="ddp-status" style="font-family:monospace;font-size:12px">' + "<br>".join(lines) + "</div>"


def grouped_xray(feed: Feed) -> str:
    """The collective X-ray grouped by where the ranks are: `ranks 0-1022 (1,023 ranks): waits in
    all_reduce #412 (cell line 7) for 4.9-5.1 s`; '' while no rank waited long in one."""
    waiting = feed.waiting
    if not waiting:
        return ""
    places = [
        (rank, where_rank_is(reading).rsplit(" for ", 1)[0], reading.waited)
        if reading.current is not None
        else (rank, where_rank_is(reading), None)
        for rank, reading in waiting.items()
    ]
    lines = [html.escape(line) for line in grouped_waits(places)]
    return "<div><b>waiting in a collective</b> (collective X-ray)</div>" + "<br>".join(
        f'<code style="color:{STATE_COLORS["failed"]}">{line}</code>' for line in lines
    )
