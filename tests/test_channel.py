"""Unit tests of the rank -> notebook channel: buffering, throttling, message shapes, the Feed."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from ddp_notebook.live.feed import XRAY_SHOW_SECONDS, Feed, Metrics, Recorder
from ddp_notebook.rank.channel import Channel, Progress
from ddp_notebook.wire.channel import FLUSH_SECONDS, KEPT_MESSAGES, MESSAGE_KEY, RankMessage, messages_in
from tests.support.readings import StepsSoFar, waiting_in


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def messages(sent: list[dict[str, Any]]) -> list[RankMessage]:
    """Each published dict holds one message, under a key of our own."""
    found = [messages_in(payload) for payload in sent]
    assert all(len(one) == 1 and len(payload) == 1 for one, payload in zip(found, sent, strict=True)), sent
    return [one[0] for one in found]  # type: ignore[misc]


def plain(message: RankMessage) -> dict[str, list[list[float]]]:
    """A message's metrics as lists (they travel as arrays)."""
    return {name: [list(steps), list(values)] for name, (steps, values) in message["metrics"].items()}


def all_points(sent: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    steps: list[float] = []
    values: list[float] = []
    for message in messages(sent):
        if name in message["metrics"]:
            steps.extend(message["metrics"][name][0])
            values.extend(message["metrics"][name][1])
    return steps, values


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sent() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def channel(clock: Clock, sent: list[dict[str, Any]]) -> Channel:
    return Channel(publish=sent.append, clock=clock)


# ---------------------------------------------------------------- rank side


def test_log_every_millisecond_flushes_about_ten_times_a_second_and_keeps_every_point(
    channel: Channel, clock: Clock, sent: list[dict[str, Any]]
) -> None:
    for step in range(1000):  # one second of steps
        channel.log(None, {"loss": 1.0 / (step + 1)})
        clock.advance(0.001)
    channel.end_cell("done")
    flushes = messages(sent)
    assert 10 <= len(flushes) <= 12  # the first call flushes at once, then every 0.1 s, then the tail
    assert [m["seq"] for m in flushes] == list(range(len(flushes)))
    assert [m["state"] for m in flushes] == ["running"] * (len(flushes) - 1) + ["done"]
    steps, values = all_points(sent, "loss")
    assert steps == list(range(1000))
    assert values == [1.0 / (step + 1) for step in range(1000)]
    assert flushes[-1]["count"] == 1000


def test_a_flush_waits_for_the_interval(channel: Channel, clock: Clock, sent: list[dict[str, Any]]) -> None:
    channel.log(None, {"loss": 1.0})
    assert len(sent) == 1  # the first point of a cell goes out at once
    clock.advance(FLUSH_SECONDS * 0.6)
    channel.log(None, {"loss": 2.0})
    assert len(sent) == 1
    clock.advance(FLUSH_SECONDS * 0.6)
    channel.log(None, {"loss": 3.0})
    assert len(sent) == 2
    assert plain(messages(sent)[1]) == {"loss": [[1, 2], [2.0, 3.0]]}


def test_explicit_steps_are_kept_and_do_not_advance_the_step_count(
    channel: Channel, sent: list[dict[str, Any]]
) -> None:
    for epoch in range(3):
        for _ in range(2):
            channel.log(None, {"loss": 0.5})
        channel.log(epoch * 10, {"accuracy": 0.9})
    channel.end_cell("done")
    assert all_points(sent, "loss")[0] == [0, 1, 2, 3, 4, 5]
    assert all_points(sent, "accuracy")[0] == [0, 10, 20]
    last = messages(sent)[-1]
    assert (last["count"], last["calls"]) == (6, 9)
    assert last["explicit"] == ["accuracy"]


def test_numbers_of_any_kind_become_floats_and_others_are_refused(channel: Channel, sent: list[dict[str, Any]]) -> None:
    class Scalar:  # what a one-element tensor offers
        def __float__(self) -> float:
            return 0.25

    channel.log(None, {"a": 1, "b": True, "c": Scalar()})
    assert plain(messages(sent)[0]) == {"a": [[0], [1.0]], "b": [[0], [1.0]], "c": [[0], [0.25]]}

    class Vector:  # what a tensor of several elements does
        def __float__(self) -> float:
            raise RuntimeError("a Tensor with 2 elements cannot be converted to Scalar")

    for refused, kind in (("high", "str"), (Vector(), "Vector")):
        with pytest.raises(TypeError, match=rf"log\(loss=...\) needs a number, got {kind}"):
            channel.log(None, {"loss": refused})
    channel.log(None, {"loss": 1.0})
    channel.end_cell("done")
    assert all_points(sent, "loss") == ([1], [1.0])  # refused values left no steps behind


def test_fractional_steps_after_whole_ones(channel: Channel, sent: list[dict[str, Any]]) -> None:
    channel.log(1, {"epoch_loss": 0.5})
    channel.log(1.5, {"epoch_loss": 0.25})
    channel.end_cell("done")
    assert all_points(sent, "epoch_loss") == ([1, 1.5], [0.5, 0.25])


def test_a_cell_that_logs_nothing_sends_nothing(channel: Channel, sent: list[dict[str, Any]]) -> None:
    channel.begin_cell()
    channel.end_cell("done")
    assert sent == []


def test_the_end_of_a_cell_is_told_even_with_nothing_left_to_send(channel: Channel, sent: list[dict[str, Any]]) -> None:
    channel.log(None, {"loss": 1.0})
    channel.end_cell("failed")
    assert [m["state"] for m in messages(sent)] == ["running", "failed"]
    assert messages(sent)[1]["metrics"] == {}


def test_each_cell_counts_steps_and_messages_from_zero(
    channel: Channel, clock: Clock, sent: list[dict[str, Any]]
) -> None:
    channel.log(None, {"loss": 1.0})
    channel.end_cell("done")
    channel.begin_cell()
    clock.advance(1)
    channel.log(None, {"loss": 2.0})
    channel.end_cell("done")
    second = messages(sent)[2:]
    assert [m["seq"] for m in second] == [0, 1]
    assert plain(second[0]) == {"loss": [[0], [2.0]]}
    assert second[0]["t"] == 1.0  # seconds since the cell began


def test_progress_counts_iterations_and_knows_its_total(
    channel: Channel, clock: Clock, sent: list[dict[str, Any]]
) -> None:
    seen = []
    bar = Progress(channel, range(5), "epoch", None)
    assert len(bar) == 5
    for item in bar:
        seen.append(item)
        clock.advance(0.5)  # every step flushes
    channel.end_cell("done")
    assert seen == [0, 1, 2, 3, 4]
    states = [(b["n"], b["total"], b["state"]) for m in messages(sent) for b in m["bars"]]
    assert states[0] == (0, 5, "running")
    assert states[-1] == (5, 5, "done")
    assert [n for n, _, _ in states] == sorted(n for n, _, _ in states)
    assert messages(sent)[-1]["bars"][0]["elapsed"] == pytest.approx(2.5)


def test_progress_over_an_iterable_without_length_learns_it_at_the_end(
    channel: Channel, sent: list[dict[str, Any]]
) -> None:
    bar = Progress(channel, (x for x in range(7)), "stream", None)
    with pytest.raises(TypeError, match="no length"):
        len(bar)
    assert list(bar) == list(range(7))
    channel.end_cell("done")
    final = messages(sent)[-1]["bars"][0]
    assert (final["n"], final["total"], final["state"]) == (7, 7, "done")


def test_total_overrides_the_length(channel: Channel, sent: list[dict[str, Any]]) -> None:
    assert list(itertools.islice(Progress(channel, itertools.count(), "", 3), 3)) == [0, 1, 2]
    channel.end_cell("done")
    final = messages(sent)[-1]["bars"][0]
    assert final["total"] == 3
    assert final["state"] == "closed"  # islice stopped asking: the bar did not run out


def test_nested_bars_have_levels_and_inner_bars_are_new_each_time(
    channel: Channel, clock: Clock, sent: list[dict[str, Any]]
) -> None:
    for _ in Progress(channel, range(2), "epoch", None):
        for _ in Progress(channel, range(3), "batch", None):
            clock.advance(0.2)
    channel.end_cell("done")
    bars = {(b["id"], b["level"], b["desc"]): b for m in messages(sent) for b in m["bars"]}
    assert sorted(bars) == [(0, 0, "epoch"), (1, 1, "batch"), (2, 1, "batch")]
    assert all(b["state"] == "done" and b["n"] == b["total"] for b in bars.values())


def test_leaving_a_loop_early_closes_its_bar(channel: Channel, sent: list[dict[str, Any]]) -> None:
    for item in Progress(channel, range(10), "epoch", None):
        if item == 3:
            break
    channel.end_cell("done")
    final = messages(sent)[-1]["bars"][0]
    assert (final["n"], final["state"]) == (3, "closed")


def test_a_failing_cell_closes_its_open_bars_once(channel: Channel, sent: list[dict[str, Any]]) -> None:
    loop = iter(Progress(channel, range(10), "epoch", None))
    next(loop)
    channel.end_cell("failed")
    del loop  # the generator closes after its cell ended: no second report
    last = messages(sent)[-1]
    assert last["state"] == "failed"
    assert [(b["n"], b["state"]) for b in last["bars"]] == [(0, "closed")]
    channel.begin_cell()
    channel.end_cell("done")
    assert messages(sent)[-1] is last


def test_outside_a_rank_nothing_is_sent() -> None:
    channel = Channel(publish=None)
    channel.log(None, {"loss": 1.0})
    assert list(Progress(channel, range(3), "x", None)) == [0, 1, 2]
    channel.end_cell("done")


# ---------------------------------------------------------------- notebook side


class CountingView:
    def __init__(self) -> None:
        self.shown = 0
        self.draws: list[bool] = []

    def show(self) -> None:
        self.shown += 1

    def draw(self, feed: Feed, final: bool) -> None:
        self.draws.append(final)


def rank_messages(clock: Clock, steps: int, rank_seconds: float = 0.001) -> list[dict[str, Any]]:
    """What one rank sends for a cell that logs `steps` losses inside two nested loops."""
    sent: list[dict[str, Any]] = []
    channel = Channel(publish=sent.append, clock=clock)
    for epoch in Progress(channel, range(2), "epoch", None):
        for step in Progress(channel, range(steps // 2), "batch", None):
            channel.log(None, {"loss": float(step)})
            clock.advance(rank_seconds)
        channel.log(epoch, {"accuracy": 0.5 + epoch / 10})
    channel.end_cell("done")
    return sent


def test_feed_keeps_every_point_and_the_bars_and_ranks_state(clock: Clock) -> None:
    view = CountingView()
    feed = Feed(lambda: view, ranks=[0, 1], clock=clock)
    for rank in (0, 1):
        for payload in rank_messages(clock, 400):
            feed(rank, payload)
    assert view.shown == 1
    assert view.draws[-1] is True
    assert feed.finished and feed.outcome is None
    assert len(feed.metrics) == 2 * (400 + 2)
    steps, values = feed.metrics.series("loss", 1)
    assert steps == list(range(400))
    assert values == [float(s) for s in range(200)] * 2
    assert feed.metrics.series("accuracy", 0) == ([0, 1], [0.5, 0.6])
    for rank in (0, 1):
        assert feed.ranks[rank].state == "done"
        assert feed.ranks[rank].steps == 402
        assert feed.ranks[rank].lost == 0
        assert feed.ranks[rank].last == {"loss": 199.0, "accuracy": 0.6}
        epoch, batch = feed.bars[(rank, 0)], feed.bars[(rank, 1)]
        assert (epoch.n, epoch.total, epoch.state, epoch.fraction) == (2, 2, "done", 1.0)
        assert (batch.id, batch.n, batch.total, batch.state) == (2, 200, 200, "done")


def test_feed_redraws_at_most_ten_times_a_second(clock: Clock) -> None:
    view = CountingView()
    feed = Feed(lambda: view, clock=clock)
    sent = rank_messages(clock, 2000, rank_seconds=0.0)  # made instantly: the clock moves below
    for payload in sent:
        feed(0, payload)
        clock.advance(0.01)  # messages arrive 100 per second
    feed.finish()
    duration = 0.01 * len(sent)
    assert len(view.draws) <= duration / 0.1 + 2
    assert view.draws.count(True) == 1


def test_feed_ignores_data_that_is_not_ours(clock: Clock) -> None:
    view = CountingView()
    feed = Feed(lambda: view, clock=clock)
    feed(0, {"something": 1})
    feed(0, {MESSAGE_KEY: {"v": 999}})
    assert view.shown == 0 and feed.received == 0
    feed.finish("failed")
    assert view.draws == []


def test_a_lost_message_is_counted(clock: Clock) -> None:
    feed = Feed(None, clock=clock)
    sent = rank_messages(clock, 200, rank_seconds=0.05)
    del sent[2]
    for payload in sent:
        feed(0, payload)
    assert feed.ranks[0].lost == 1


def test_finish_marks_ranks_that_never_ended(clock: Clock) -> None:
    feed = Feed(None, ranks=[0, 1], clock=clock)
    channel = Channel(publish=lambda payload: feed(0, payload), clock=clock)
    channel.log(None, {"loss": 1.0})
    other = Channel(publish=lambda payload: feed(1, payload), clock=clock)
    other.log(None, {"loss": 1.0})
    other.end_cell("failed")
    assert not feed.finished
    feed.finish("failed")
    assert feed.ranks[0].state == "failed"  # it never said: the cell failed around it
    assert feed.outcome == "failed"


def test_an_appended_cell_continues_the_steps_and_the_view(clock: Clock) -> None:
    recorder = Recorder()
    view = CountingView()
    first = recorder.feed(lambda: view)
    for payload in rank_messages(clock, 10):
        first(0, payload)
    first.finish()
    second = recorder.feed(lambda: CountingView(), append=True)
    for payload in rank_messages(clock, 10):
        second(0, payload)
    second.finish()
    assert second.view is view and view.shown == 2
    assert recorder.metrics is first.metrics
    steps, _ = recorder.metrics.series("loss", 0)
    assert steps == list(range(20))
    assert recorder.metrics.series("accuracy", 0)[0] == [0, 1, 0, 1]  # given steps stay as given


def test_a_cell_that_logs_nothing_leaves_the_latest_metrics(clock: Clock) -> None:
    recorder = Recorder()
    assert not recorder.metrics
    first = recorder.feed(None)
    for payload in rank_messages(clock, 10):
        first(0, payload)
    quiet = recorder.feed(None)
    quiet.finish()
    assert recorder.latest is first
    fresh = recorder.feed(None)
    fresh(0, rank_messages(clock, 4)[0])
    assert recorder.latest is fresh and recorder.metrics is not first.metrics


# ---------------------------------------------------------------- step times and the X-ray


def test_step_times_ride_along_only_when_the_rank_timed_new_steps_in_this_cell(
    clock: Clock, sent: list[dict[str, Any]]
) -> None:
    timed = StepsSoFar()
    timed.steps = 7  # an earlier cell's steps
    channel = Channel(publish=sent.append, clock=clock, step_times=timed)
    channel.log(None, {"loss": 1.0})
    assert "steps" not in messages(sent)[-1]  # this cell timed none yet
    timed.steps = 9
    clock.advance(FLUSH_SECONDS)
    channel.log(None, {"loss": 1.0})
    assert messages(sent)[-1]["steps"]["steps"] == 9
    clock.advance(FLUSH_SECONDS)
    channel.log(None, {"loss": 1.0})
    assert "steps" not in messages(sent)[-1]  # unchanged: not sent again
    timed.steps = 12
    channel.end_cell("done")
    assert messages(sent)[-1]["steps"]["steps"] == 12 and messages(sent)[-1]["state"] == "done"


def test_feed_keeps_each_ranks_latest_step_times_and_names_the_straggler(clock: Clock) -> None:
    feed = Feed(None, ranks=[0, 1, 2], clock=clock)
    timings = {0: StepsSoFar(comm=0.05), 1: StepsSoFar(compute=0.054), 2: StepsSoFar(comm=0.05)}
    channels = {
        rank: Channel(publish=lambda payload, rank=rank: feed(rank, payload), clock=clock, step_times=timed)
        for rank, timed in timings.items()
    }
    for channel in channels.values():
        channel.log(None, {"loss": 1.0})
    assert feed.step_times == {} and feed.straggler is None
    for rank, channel in channels.items():
        timings[rank].steps = 20
        clock.advance(FLUSH_SECONDS)
        channel.log(None, {"loss": 1.0})
    assert sorted(feed.step_times) == [0, 1, 2] and feed.step_times[1].compute == 0.054
    assert feed.straggler is not None and (feed.straggler.rank, feed.straggler.phase) == (1, "compute")
    assert feed.straggler.headline() == "rank 1 is the straggler: 9.3x, compute (+50.0 ms per step)"


def test_the_xray_is_shown_past_the_threshold_even_before_any_message_and_cleared_after(clock: Clock) -> None:
    recorder = Recorder()
    view = CountingView()
    feed = recorder.feed(lambda: view, ranks=[0, 1])
    feed.collectives({0: waiting_in(0, None), 1: waiting_in(1, XRAY_SHOW_SECONDS - 0.5)})
    assert feed.waiting == {} and view.shown == 0  # a short wait is every step's: nothing shown
    clock.advance(0.5)
    feed.collectives({0: waiting_in(0, None, line=5), 1: waiting_in(1, XRAY_SHOW_SECONDS)})
    assert sorted(feed.waiting) == [0, 1] and feed.waiting[0].cell_line == 5
    assert view.shown == 1 and view.draws == [False]  # no rank sent anything: the X-ray makes the view
    assert recorder.latest is None  # a cell that logged nothing leaves the record alone
    clock.advance(0.01)
    feed.collectives({0: waiting_in(0, None), 1: waiting_in(1, XRAY_SHOW_SECONDS + 0.01)})
    assert view.draws == [False]  # redrawn at the Feed's pace
    clock.advance(0.2)
    feed.collectives({0: waiting_in(0, 0.1, seq=4), 1: waiting_in(1, 0.1, seq=4)})
    assert feed.waiting == {} and view.draws == [False, False]  # they moved on: drawn once more, without it
    feed.collectives({0: waiting_in(0, XRAY_SHOW_SECONDS, seq=5), 1: waiting_in(1, None)})
    feed.finish()
    assert feed.waiting == {} and view.draws[-1] is True  # the end: nobody waits in the cell any more


def test_metrics_as_a_table() -> None:
    metrics = Metrics()
    metrics.add(0, "loss", [0, 1], [0.5, 0.25])
    metrics.add(1, "loss", [0], [0.75])
    metrics.add(0, "lr", [0], [0.1])
    assert metrics.to_dict() == {
        "rank": [0, 0, 1, 0],
        "name": ["loss", "loss", "loss", "lr"],
        "step": [0, 1, 0, 0],
        "value": [0.5, 0.25, 0.75, 0.1],
    }
    assert metrics.names == ["loss", "lr"] and metrics.ranks == [0, 1] and len(metrics) == 4
    assert metrics.last("loss", 0) == 0.25 and metrics.last("loss", 5) is None
    assert repr(metrics) == "<Metrics: 4 points; loss (rank 0: 2, rank 1: 1); lr (rank 0: 1)>"
    steps, _ = metrics.series("loss", 0)
    steps.append(99)  # a copy: the store is not changed through it
    assert metrics.series("loss", 0) == ([0, 1], [0.5, 0.25])


def test_metrics_to_pandas() -> None:
    metrics = Metrics()
    metrics.add(0, "loss", [0, 1], [0.5, 0.25])
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="to_dict"):
            metrics.to_pandas()
    else:
        frame = metrics.to_pandas()
        assert list(frame.columns) == ["rank", "name", "step", "value"] and len(frame) == 2


def test_the_relay_listens_to_each_rank_before_its_request_is_sent(clock: Clock) -> None:
    """`CellRelay.watch` registers on a rank's message future (handed over before the send): its
    published data reach the live view, its idle status ends the rank's part."""
    from types import SimpleNamespace

    from ddp_notebook.cell.relay import CellRelay, PublishedData
    from ddp_notebook.wire.channel import MESSAGE_KEY

    done: list[Any] = []
    future = SimpleNamespace(iopub_callbacks=[], output=SimpleNamespace(add_done_callback=done.append))
    relay = CellRelay(client=None, ranks=(3, 5))
    relay.watch(1, future)
    assert len(future.iopub_callbacks) == 1 and len(done) == 1
    sent: list[dict[str, Any]] = []
    Channel(publish=sent.append, clock=clock).log(None, {"loss": 1.0})
    from ipyparallel.serialize import serialize_object

    message = {"header": {"msg_type": "data_message"}, "content": {}, "buffers": serialize_object(sent[0])}
    future.iopub_callbacks[0](message)
    item = relay._queue.get_nowait()
    assert isinstance(item, PublishedData) and item.rank == 5 and any(MESSAGE_KEY in key for key in item.payload)
    feed = Feed(None, clock=clock)
    feed(item.rank, item.payload)
    assert feed.metrics.series("loss", 5) == ([0], [1.0])
    other = SimpleNamespace(iopub_callbacks=[], output=SimpleNamespace(add_done_callback=done.append))
    relay.watch(0, other)
    done[0](None)
    assert relay._queue.empty(), "the waiting thread is woken once every rank went idle"
    done[1](None)
    assert relay._queue.empty(), "... and replied"
    relay._all_replied()
    assert set(relay._queue.get_nowait().ranks) == {3, 5} and relay._queue.empty()


def test_a_failing_view_is_dropped_and_the_data_kept(clock: Clock) -> None:
    class BrokenView(CountingView):
        def draw(self, feed: Feed, final: bool) -> None:
            raise ValueError("cannot draw")

    feed = Feed(BrokenView, clock=clock)
    with pytest.warns(RuntimeWarning, match="live view failed.*cannot draw"):
        for payload in rank_messages(clock, 10):
            feed(0, payload)
    assert feed.view is None and len(feed.metrics) == 12
    feed.finish()


def test_the_notebook_side_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ddp_notebook\n"
        "from ddp_notebook import log, progress, Metrics\nfrom ddp_notebook.live import widgets\n"
        "ddp_notebook.log(loss=1.0)\n"
        "assert list(ddp_notebook.progress(range(2))) == [0, 1]\n"
        "widgets.LiveView()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_only_an_ipyparallel_rank_publishes() -> None:
    from types import SimpleNamespace

    from ddp_notebook.rank.channel import in_rank

    assert not in_rank(None)  # a script
    assert not in_rank(SimpleNamespace())  # terminal IPython
    assert not in_rank(SimpleNamespace(kernel=object()))  # the notebook's own kernel


def test_one_run_state_type_on_both_sides() -> None:
    """A rank's cell states are one type (wire.channel.RunState): what a rank sends when its cell
    ends, how the notebook ends the ranks that never said, and what the live view can color."""
    from typing import get_args

    from ddp_notebook.cell.outcome import CellOutcome, Ending
    from ddp_notebook.live.widgets import STATE_COLORS
    from ddp_notebook.wire.channel import CellEnd, RunState
    from ddp_notebook.wire.results import CellResult

    assert set(get_args(CellEnd)) < set(get_args(RunState))
    assert set(STATE_COLORS) == set(get_args(RunState))
    ended = {CellOutcome(CellResult(ranks=(0,)), ending=ending).view_state for ending in Ending}
    assert ended == {None, "stopped"} and ended - {None} <= set(get_args(CellEnd))
    sent: list[dict[str, Any]] = []
    channel = Channel(publish=sent.append)
    for state in get_args(RunState)[1:]:  # each way a rank's cell ends, one cell each
        channel.begin_cell()
        channel.log(None, {"loss": 1.0})
        channel.end_cell(state)
    states = [message["state"] for message in messages(sent)]
    assert states == ["running", "done", "running", "failed", "running", "stopped"]


def test_messages_ipyparallel_merged_before_the_notebook_listened_are_all_taken() -> None:
    """Under load a rank's first messages can reach the notebook before its callback is registered;
    ipyparallel keeps them merged into one dict (each update replacing same keys): a message has a
    key of its own among KEPT_MESSAGES, so the merge keeps them all and the feed takes each once."""
    clock = Clock()
    sent: list[dict[str, Any]] = []
    channel = Channel(publish=sent.append, clock=clock)
    channel.begin_cell()
    for step in range(3):
        channel.log(step, {"loss": float(step)})  # the first at once, then each after the interval
        clock.advance(FLUSH_SECONDS)
    merged: dict[str, Any] = {}
    for payload in sent:
        merged.update(payload)  # as ipyparallel's metadata['data'] does
    assert len(messages_in(merged)) == len(sent) == 3 < KEPT_MESSAGES
    feed = Feed(ranks=[0])
    feed(0, merged)
    feed(0, sent[-1])  # the same message again, delivered by the callback: taken once
    assert feed.metrics.series("loss", 0) == ([0, 1, 2], [0.0, 1.0, 2.0])
    assert feed.ranks[0].lost == 0
