"""The notebook-side views, checked through what their widgets send (a recording comm)."""

from __future__ import annotations

import io
import math

import pytest

from ddp_notebook.live.feed import Feed
from ddp_notebook.live.large_view import make_view
from ddp_notebook.live.widgets import (
    LiveView,
    Smoother,
    TextView,
    format_rate,
    format_seconds,
    live_points,
    progress_line,
    steps_table,
    summary_lines,
    xray_table,
)
from ddp_notebook.rank.channel import Channel, Progress
from tests.support.comms import RecordingComm
from tests.support.readings import StepsSoFar, waiting_in
from tests.support.widgets import Clock, bytes_sent, frontend_state, models_named, train


@pytest.mark.core
def test_a_cell_after_the_first_sends_kilobytes_not_plotly_js_again(
    comms: list[RecordingComm], monkeypatch: pytest.MonkeyPatch
) -> None:
    """plotly.js (about 5 MB) reaches the browser with the first cell's live view only: a later
    cell's view, curves and all, sends under 100 KB."""
    from ddp_notebook.live import plotly_adapter

    monkeypatch.setattr(plotly_adapter, "_holder", None)  # a fresh kernel: no view shown before
    clock, sent = Clock(), []
    for _ in range(3):
        before = bytes_sent(comms)
        view = LiveView()
        feed = Feed(lambda view=view: view, ranks=[0, 1], clock=clock)
        for rank in (0, 1):
            train(feed, clock, rank)
        assert feed.finished and len(view.figure.data) == 4
        sent.append(bytes_sent(comms) - before)
    assert sent[0] > 4_000_000, sent  # plotly.js, once
    assert max(sent[1:]) < 100_000, sent


@pytest.mark.core
def test_live_view_reaches_the_frontend_complete(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView()
    feed = Feed(lambda: view, ranks=[0, 1], clock=clock)
    for rank in (0, 1):
        train(feed, clock, rank)
    assert feed.finished

    bars = models_named(comms, "IntProgressModel")
    assert len(bars) == 4  # 2 ranks x 2 levels
    assert all(bar["value"] == bar["max"] and bar["bar_style"] == "success" for bar in bars)
    assert sorted(bar["max"] for bar in bars) == [2, 2, 30, 30]

    traces = {(trace.meta, trace.name): len(trace.x) for trace in view.figure.data}
    assert traces == {
        ("loss", "rank 0"): 60,
        ("loss", "rank 1"): 60,
        ("accuracy", "rank 0"): 2,
        ("accuracy", "rank 1"): 2,
    }
    texts = " ".join(state.get("value", "") for state in models_named(comms, "HTMLModel"))
    assert "finished after" in texts and "124 points" in texts
    assert texts.count(">done<") == 2
    assert "30/30" in texts and "2/2" in texts


def test_finished_figure_is_kept_in_the_widget_state(comms: list[RecordingComm]) -> None:
    """What saves widget state (a saved notebook, nbclient, the docs site) gets every curve."""
    clock = Clock()
    view = LiveView()
    feed = Feed(lambda: view, ranks=[0, 1], clock=clock)
    figure_comm = None
    for rank in (0, 1):
        train(feed, clock, rank, batches=30)
        figure_comm = figure_comm or next(c for c in comms if c.comm_id == view.figure.comm.comm_id)
        if rank == 0:  # while a rank still runs, the state holds the figure as first shown
            assert frontend_state([figure_comm])[figure_comm.comm_id].get("_widget_data", []) == []
    assert feed.finished
    sent = frontend_state([figure_comm])[figure_comm.comm_id]["_widget_data"]
    assert [(trace["meta"], trace["name"]) for trace in sent] == [
        ("loss", "rank 0"),
        ("accuracy", "rank 0"),
        ("loss", "rank 1"),
        ("accuracy", "rank 1"),
    ]
    # arrays travel as binary buffers: their shapes say how many points each trace holds
    assert [list(trace["y"]["shape"]) for trace in sent] == [[60], [2], [60], [2]]


def test_figure_updates_travel_as_binary_and_new_axes_are_valid(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView()
    feed = Feed(lambda: view, clock=clock)
    train(feed, clock, 0)
    feed.finish()
    figure_comm = next(c for c in comms if c.comm_id == view.figure.comm.comm_id)
    updates = [data["state"] for _, kind, data, _ in figure_comm.sent if kind == "comm_msg" and "state" in data]
    restyles = [u for u in updates if u.get("_py2js_update") or u.get("_py2js_restyle")]
    assert restyles, "no trace data went to the frontend"
    assert any(buffers for _, _, _, buffers in figure_comm.sent), "arrays should travel as binary buffers"
    for update in updates:
        for key in ("_py2js_update", "_py2js_relayout"):
            layout = (update.get(key) or {}).get("layout_data") or (update.get(key) or {}).get("relayout_data") or {}
            # plotly.js refuses an update that sets an axis and one of its attributes at once
            parents = {k for k in layout if "." not in k}
            assert not any(k.split(".")[0] in parents for k in layout if "." in k), layout


def test_while_running_long_curves_are_thinned_and_the_end_has_every_point(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView(live_budget=50, clock=clock)
    feed = Feed(lambda: view, clock=clock)
    channel = Channel(publish=lambda payload: feed(0, payload), clock=clock)
    for step in range(1000):
        channel.log(None, {"loss": float(step)})
        clock.advance(0.005)
    live_x = list(view.figure.data[0].x)
    assert len(live_x) <= 52
    assert live_x[0] == 0 and live_x == sorted(live_x)
    channel.end_cell("done")
    feed.finish()
    assert list(view.figure.data[0].x) == list(range(1000))
    assert list(view.figure.data[0].y) == [float(step) for step in range(1000)]


def test_smoothing_redraws_with_a_moving_average(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView()
    feed = Feed(lambda: view, clock=clock)
    channel = Channel(publish=lambda payload: feed(0, payload), clock=clock)
    for step in range(100):
        channel.log(None, {"loss": float(step % 2)})
    channel.end_cell("done")
    feed.finish()
    view.smoothing.value = 0.9
    smoothed = list(view.figure.data[0].y)
    assert len(smoothed) == 100
    assert smoothed[0] == 0.0 and abs(smoothed[-1] - 0.5) < 0.1  # zig-zag averaged out
    view.smoothing.value = 0.0
    assert list(view.figure.data[0].y) == [float(step % 2) for step in range(100)]


def test_a_progress_only_cell_shows_no_plot(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView()
    feed = Feed(lambda: view, clock=clock)
    channel = Channel(publish=lambda payload: feed(0, payload), clock=clock)
    for _ in Progress(channel, range(3), "files", None):
        clock.advance(0.2)
    channel.end_cell("done")
    feed.finish()
    assert view.plot.children == ()
    assert len(view.bars.children) == 1


def test_a_failed_rank_is_shown_failed(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView()
    feed = Feed(lambda: view, ranks=[0, 1], clock=clock)
    channel = Channel(publish=lambda payload: feed(1, payload), clock=clock)
    loop = iter(Progress(channel, range(10), "epoch", None))
    next(loop)
    channel.end_cell("failed")
    feed.finish("failed")
    assert "failed" in view.status.value and "failed after" in view.header.value
    bar = models_named(comms, "IntProgressModel")[0]
    assert bar["bar_style"] == "warning" and bar["value"] == 0


# ---------------------------------------------------------------- pure helpers and the text view


def test_live_points_is_an_exact_stride_with_the_last_point() -> None:
    steps = list(range(1001))
    values = [s * 2.0 for s in steps]
    xs, ys = live_points(steps, values, 100)
    stride = math.ceil(1001 / 100)
    assert xs == [*steps[::stride], 1000] or xs == steps[::stride]
    assert xs[-1] == 1000 and ys == [x * 2.0 for x in xs]
    assert live_points(steps, values, 0) == (steps, values)
    assert live_points([1, 2], [3, 4], 100) == ([1, 2], [3, 4])


def test_smoother_is_debiased_and_incremental() -> None:
    smoother = Smoother(0.5)
    assert smoother.extend([2.0]) == [2.0]  # debiased: the first value is itself
    assert smoother.extend([2.0, 4.0])[-1] == pytest.approx((0.5 * 1.0 + 2.0) / 0.75)
    assert math.isnan(Smoother(0.5).extend([float("nan")])[0])


def test_formatting() -> None:
    assert format_seconds(7) == "00:07" and format_seconds(3723) == "1:02:03" and format_seconds(None) == "?"
    assert format_rate(12.345) == "12.35 it/s" and format_rate(0.5) == "2.00 s/it" and format_rate(None) == "? it/s"


def test_outside_a_kernel_the_view_is_text() -> None:
    assert isinstance(make_view(), TextView)


def test_text_view_is_concise_and_ends_with_a_line_per_rank() -> None:
    clock = Clock()
    out = io.StringIO()
    feed = Feed(lambda: TextView(out, interval=1.0, clock=clock), ranks=[0, 1], clock=clock)
    for rank in (0, 1):
        train(feed, clock, rank, epochs=3, batches=100)  # 6 s of rank time
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if line.startswith("[progress ")]
    assert 3 <= len(progress) <= 8  # at most one a second
    assert "epoch" in progress[1] and "batch" in progress[1] and "loss" in progress[1]
    assert lines[-3].startswith("[progress] finished after")
    assert lines[-2].startswith("[progress] rank 0: done, 303 steps")
    assert "accuracy 0.7" in lines[-1]


def test_progress_line_shows_the_slowest_rank_and_mean_values() -> None:
    clock = Clock()
    feed = Feed(None, clock=clock)
    fast = Channel(publish=lambda payload: feed(0, payload), clock=clock)
    slow = Channel(publish=lambda payload: feed(1, payload), clock=clock)
    fast_bar, slow_bar = fast.open_bar("batch", 10), slow.open_bar("batch", 10)
    for _ in range(6):
        fast.step_bar(fast_bar)
    for _ in range(2):
        slow.step_bar(slow_bar)
    fast.log(None, {"loss": 1.0})
    slow.log(None, {"loss": 3.0})
    clock.advance(1)
    fast.flush()
    slow.flush()
    line = progress_line(feed)
    assert "batch 2/10" in line and "loss 2 (mean of 2 ranks)" in line
    fast.end_cell("done")
    slow.end_cell("stopped")
    feed.finish("stopped")
    assert summary_lines(feed)[0].startswith("[progress] stopped after")
    assert summary_lines(feed)[2].startswith("[progress] rank 1: stopped")


def test_curves_redraw_at_most_four_times_a_second_and_bars_ten(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView(clock=clock)
    feed = Feed(lambda: view, clock=clock)
    channel = Channel(publish=lambda payload: feed(0, payload), clock=clock)
    bar = channel.open_bar("steps", 10_000)
    for step in range(5000):  # 5 s of steps
        channel.step_bar(bar)
        channel.log(None, {"loss": float(step)})
        clock.advance(0.001)
    figure = next(c for c in comms if c.comm_id == view.figure.comm.comm_id)
    curve_updates = [
        d for _, kind, d, _ in figure.sent if kind == "comm_msg" and d.get("state", {}).get("_py2js_update")
    ]
    progress = next(c for c in comms if c.comm_id == view._rows[(0, 0)].bar.comm.comm_id)
    bar_updates = [d for _, kind, d, _ in progress.sent if kind == "comm_msg" and "value" in d.get("state", {})]
    assert 15 <= len(curve_updates) <= 5 / 0.25 + 2
    assert 40 <= len(bar_updates) <= 5 / 0.1 + 2


def panels(comms: list[RecordingComm], view: LiveView) -> dict[str, tuple[str, str]]:
    """The X-ray and steps panels as the frontend holds them: (html, the layout's display)."""
    state = frontend_state(comms)
    found = {}
    for name, panel in (("xray", view.xray), ("steps", view.steps)):
        layout = state[panel.layout.comm.comm_id]
        found[name] = (state[panel.comm.comm_id].get("value", ""), layout.get("display") or "")
    return found


def test_live_view_shows_each_ranks_step_split_and_names_the_straggler(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView(clock=clock)
    feed = Feed(lambda: view, ranks=[0, 1], clock=clock)
    timings = {0: StepsSoFar(comm=0.05), 1: StepsSoFar(compute=0.054)}
    channels = {
        rank: Channel(publish=lambda payload, rank=rank: feed(rank, payload), clock=clock, step_times=timed)
        for rank, timed in timings.items()
    }
    for channel in channels.values():
        channel.log(None, {"loss": 1.0})
    assert panels(comms, view)["steps"] == ("", "none")  # no timed steps: hidden
    for rank, channel in channels.items():
        timings[rank].steps = 20
        clock.advance(0.2)
        channel.log(None, {"loss": 0.5})
    html, display = panels(comms, view)["steps"]
    assert display == ""
    assert "rank 1 is the straggler: 9.3x, compute (+50.0 ms per step)" in html
    # rank 1's compute (54 ms of its 56) is the highlighted cell; rank 0 waited 50 ms in comm
    assert '<td><b style="color:#d62728">54.0</b></td>' in html and "<td>50.0</td>" in html
    for channel in channels.values():
        channel.end_cell("done")
    assert feed.finished and "rank 1 is the straggler" in panels(comms, view)["steps"][0]  # kept at the end


def test_live_view_shows_the_xray_while_a_rank_waits_and_hides_it_after(comms: list[RecordingComm]) -> None:
    clock = Clock()
    view = LiveView(clock=clock)
    feed = Feed(lambda: view, ranks=[0, 1], clock=clock)
    feed.collectives({0: waiting_in(0, None, line=5), 1: waiting_in(1, 4.2, seq=7, line=2)})
    html, display = panels(comms, view)["xray"]
    assert display == "" and "waiting in a collective" in html
    assert "<td>1</td><td>all_reduce #7 [4]</td><td>2</td><td>4.2 s</td>" in html
    assert "<td>0</td><td>in no collective</td><td>5</td><td>-</td>" in html
    assert "ranks 0-1 · running" in view.header.value  # made by the X-ray, before any rank's message
    # a reading rank 0 did not answer (a loaded machine): its row stays, with what it said last
    clock.advance(1)
    feed.collectives({1: waiting_in(1, 5.2, seq=7, line=2)})
    html, _ = panels(comms, view)["xray"]
    assert "<td>1</td><td>all_reduce #7 [4]</td><td>2</td><td>5.2 s</td>" in html
    assert "<td>0</td><td>in no collective</td><td>5</td><td>-</td>" in html
    clock.advance(1)
    feed.collectives({0: waiting_in(0, 0.0, seq=8), 1: waiting_in(1, 0.0, seq=8)})
    assert panels(comms, view)["xray"] == ("", "none")
    feed.finish()
    assert xray_table(feed) == "" and steps_table(feed) == ""


def test_text_view_says_a_long_wait_once_and_the_straggler_at_the_end() -> None:
    clock = Clock()
    out = io.StringIO()
    feed = Feed(lambda: TextView(out, interval=2.0, clock=clock), ranks=[0, 1], clock=clock)
    for waited in (3.0, 3.3, 3.6, 3.9):  # the same wait, read four times
        feed.collectives({0: waiting_in(0, None, line=5), 1: waiting_in(1, waited, seq=7)})
        clock.advance(0.3)
    timings = {0: StepsSoFar(comm=0.05), 1: StepsSoFar(compute=0.054)}
    for rank, timed in timings.items():
        channel = Channel(publish=lambda payload, rank=rank: feed(rank, payload), clock=clock, step_times=timed)
        timed.steps = 20
        channel.log(None, {"loss": 1.0})
        channel.end_cell("done")
    lines = out.getvalue().splitlines()
    xray = [line for line in lines if line.startswith("[x-ray")]
    assert xray == [
        "[x-ray 00:00] rank 0 runs the cell (cell line 5), in no collective; "
        "rank 1 waits in all_reduce #7 [4] (cell line 2) for 3.0 s"
    ]
    assert lines[-3].startswith("[progress] rank 0 per step: 56.0 ms/step (data 1.0 ms, compute 4.0 ms, comm 50.0 ms")
    assert lines[-1] == "[progress] rank 1 is the straggler: 9.3x, compute (+50.0 ms per step)"
