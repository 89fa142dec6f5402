"""The live view of a large world: aggregates drawn through real widgets (a recording comm), the
bytes it sends bounded whatever the rank count, and the text view's grouped lines."""

from __future__ import annotations

import io
import random
from typing import Any

from ddp_notebook.live.feed import Feed
from ddp_notebook.live.large_view import BAND_POINTS, HEAT_ROWS, LargeWorldView, grouped_xray, make_view
from ddp_notebook.live.widgets import TextView
from ddp_notebook.rank.channel import Channel
from tests.support.comms import RecordingComm
from tests.support.readings import waiting_in
from tests.support.widgets import Clock, bytes_sent, models_named

SLOW_RANK = 37
DIVERGED_RANK = 50


def stream(feed: Feed, clock: Clock, ranks: int, seconds: float, hz: float = 10.0) -> None:
    """Every rank logs a loss at `hz` for `seconds` of the clock, through its real channel, paced as
    a world of `ranks` paces it (wire.channel.flush_seconds); one rank is 3x slower, one diverges."""
    from ddp_notebook.wire.channel import flush_seconds

    channels = {
        rank: Channel(
            publish=lambda payload, rank=rank: feed(rank, payload), clock=clock, flush_seconds=flush_seconds(ranks)
        )
        for rank in range(ranks)
    }
    steps = dict.fromkeys(channels, 0)
    bars = {rank: channel.open_bar("batch", 1000) for rank, channel in channels.items()}
    noise = random.Random(0)
    ticks = int(seconds * hz)
    for tick in range(ticks):
        for rank, channel in channels.items():
            if rank == SLOW_RANK and tick % 3:
                continue
            step = steps[rank]
            loss = 1.0 / (1 + step) + noise.uniform(0, 0.01)
            if rank == DIVERGED_RANK and step > ticks // 2:
                loss = 50.0
            channel.log(None, {"loss": loss})
            channel.step_bar(bars[rank])
            steps[rank] += 1
        clock.advance(1 / hz)


def test_a_large_world_draws_aggregates_and_sends_bounded_bytes(comms: list[RecordingComm]) -> None:
    LargeWorldView()  # the first view of a kernel brings plotly.js (5 MB, once): not a cell's cost
    sent_per_second = {}
    for ranks in (64, 256):
        before = bytes_sent(comms)
        clock = Clock()
        view = LargeWorldView(clock=clock)
        feed = Feed(lambda view=view: view, clock=clock)
        feed.size_hint = ranks
        stream(feed, clock, ranks, seconds=20)
        streamed = bytes_sent(comms) - before
        sent_per_second[ranks] = streamed / 20
        feed.finish()
    # the same bound whatever the rank count (the goal: <= 50 KB/s to the browser)
    assert sent_per_second[64] < 50_000 and sent_per_second[256] < 50_000, sent_per_second
    assert sent_per_second[256] < 1.5 * sent_per_second[64], sent_per_second

    # what the last view shows: one bar for 256 ranks, naming the slow rank
    bars = models_named(comms, "HTMLModel")
    texts = [state.get("value", "") for state in bars]
    progress = [text for text in texts if "256 ranks:" in text and "slowest" in text]
    assert progress and f"rank {SLOW_RANK}" in progress[-1], progress[-1:]
    status = [text for text in texts if "ddp-status" in text][-1]
    assert "256 ranks" in status and f"rank {SLOW_RANK}" in status
    assert f"rank {DIVERGED_RANK}: loss 50" in status


def test_the_large_view_draws_median_band_outliers_and_a_heat_map() -> None:
    import ipywidgets  # noqa: F401  (the view's widgets exist without a frontend)

    clock = Clock()
    view = LargeWorldView(clock=clock)
    feed = Feed(lambda: view, clock=clock)
    feed.size_hint = 64
    stream(feed, clock, 64, seconds=30)
    feed.finish()
    data = view.figure.data
    names = [trace.name for trace in data]
    assert names[:3] == ["10th percentile", "10th-90th percentile", "median"]
    assert f"rank {DIVERGED_RANK}" in names  # the diverged rank is drawn as its own curve
    median = data[2]
    assert 0 < len(median.x) <= BAND_POINTS
    assert median.y[-1] < 0.05  # the median ignores the one rank at 50
    assert max(data[1].y) < 50  # so does the band's 90th percentile
    heat = view.heat_figure.data[0]
    assert len(heat.y) <= HEAT_ROWS
    # the slow rank's band holds the largest seconds per step
    slowest_row = max(range(len(heat.z)), key=lambda row: max(v for v in heat.z[row] if v == v))
    low, _, high = heat.text[slowest_row][0].partition("-")  # rows are numbered, their ranks in the text
    assert int(low) <= SLOW_RANK <= int(high or low)


def test_views_are_chosen_by_the_ranks_of_the_cell(monkeypatch: Any) -> None:
    from ddp_notebook.live import large_view

    monkeypatch.setattr(large_view, "widget_frontend", lambda: True)
    assert type(make_view(ranks=16)).__name__ == "LiveView"
    assert type(make_view(ranks=17)).__name__ == "LargeWorldView"
    monkeypatch.setattr(large_view, "widget_frontend", lambda: False)
    assert isinstance(make_view(ranks=1024), TextView)


def test_the_xray_of_a_large_world_is_grouped_by_where_the_ranks_wait() -> None:
    feed = Feed(None)
    feed.collective_readings = {
        rank: waiting_in(rank, 5.0 + rank / 1000, seq=412, line=7) for rank in range(64) if rank != 9
    }
    feed.collective_readings[9] = waiting_in(9, None, line=3)
    text = grouped_xray(feed)
    assert "ranks 0-8, 10-63 (63 ranks): waits in all_reduce #412" in text
    assert "for 5.0-5.1 s" in text
    assert "rank 9: runs the cell (cell line 3), in no collective" in text


def test_the_text_view_of_a_large_world_groups_its_lines() -> None:
    clock = Clock()
    out = io.StringIO()
    view = TextView(out, clock=clock)
    feed = Feed(lambda: view, clock=clock)
    feed.size_hint = 64
    stream(feed, clock, 64, seconds=5)
    feed.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) < 20, lines
    assert any("64 ranks" in line for line in lines), lines


def test_each_figure_is_shown_once_it_holds_its_first_curves(comms: list[RecordingComm]) -> None:
    """The page draws a figure as it first appears, and again for every trace or update that reaches
    it after that. So a figure goes into its view (its box's children) only once it holds its traces
    with their first points, sent in one message: the small view's curves, the large view's band,
    median and outliers, and its heat map."""
    from ddp_notebook.live.large_view import OUTLIERS
    from ddp_notebook.live.widgets import LiveView

    def points(value: Any) -> int:
        return int(value["shape"][0]) if isinstance(value, dict) else len(value or [])

    for ranks in (2, 64):
        clock = Clock()
        view = LiveView() if ranks == 2 else LargeWorldView(clock=clock)
        feed = Feed(lambda view=view: view, clock=clock)
        feed.size_hint = ranks
        figures = [view.figure, *([view.heat_figure] if isinstance(view, LargeWorldView) else [])]
        boxes = [view.plot, *([view.heat] if isinstance(view, LargeWorldView) else [])]
        stream(feed, clock, ranks, seconds=5)
        feed.finish()
        for figure, box in zip(figures, boxes):
            sent = next(c for c in comms if c.comm_id == figure.comm.comm_id).sent
            shown_at = min(
                when
                for when, kind, data, _ in next(c for c in comms if c.comm_id == box.comm.comm_id).sent
                if kind == "comm_msg" and f"IPY_MODEL_{figure.model_id}" in data.get("state", {}).get("children", [])
            )
            added = [(when, data["state"]["_py2js_addTraces"]) for when, _, data, _ in sent if
                     data.get("state", {}).get("_py2js_addTraces")]  # fmt: skip
            assert len(added) == 1, f"{ranks} ranks: {len(added)} messages to add the traces of one metric"
            when, message = added[0]
            assert when < shown_at, f"{ranks} ranks: a figure shown before its traces"
            drawn = [points(trace.get("z") or trace.get("x")) for trace in message["trace_data"]]
            assert max(drawn) > 0, f"{ranks} ranks: a figure shown with no points: {drawn}"
        # one loss curve per rank; the band's two edges, the median and the outliers; the heat map
        assert [len(figure.data) for figure in figures] == ([2] if ranks == 2 else [3 + OUTLIERS, 1])
