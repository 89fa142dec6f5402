"""Live progress and metrics on a real 2-rank world: what ranks log reaches the notebook side,
while the cell runs, completely; scripts get text; the magics keep the metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from ddp_notebook import DDPCluster, Metrics, RankError
from ddp_notebook.live.feed import XRAY_SHOW_SECONDS, Feed
from ddp_notebook.live.widgets import steps_table, xray_table
from ddp_notebook.wire.channel import FLUSH_SECONDS
from tests.support.worlds import magics_driving

pytestmark = pytest.mark.integration

TRAIN = """
import time
for epoch in ddp_notebook.progress(range(3), desc="epoch"):
    for batch in ddp_notebook.progress(range(STEPS // 3), desc="batch"):
        time.sleep(PAUSE)
        ddp_notebook.log(loss=rank * 1000 + epoch * (STEPS // 3) + batch)
    ddp_notebook.log(step=epoch, accuracy=0.5 + epoch / 10)
"""


class Arrivals:
    """An on_data consumer that notes when each message reached the notebook side."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.times: dict[int, list[float]] = {}

    def __call__(self, rank: int, data: dict[str, Any]) -> None:
        self.times.setdefault(rank, []).append(time.monotonic())
        self.feed(rank, data)


def test_every_point_arrives_while_the_cell_runs_at_a_bounded_rate(world: DDPCluster) -> None:
    steps, pause = 150, 0.01
    world.push({"STEPS": steps, "PAUSE": pause})
    arrivals = Arrivals(Feed(None, ranks=(0, 1)))
    began = time.monotonic()
    world.execute(TRAIN, on_data=arrivals)
    ended = time.monotonic()
    feed = arrivals.feed
    for rank in (0, 1):
        times = arrivals.times[rank]
        # live: the first update came long before the end, and they kept coming
        assert times[0] - began < 0.5 * (ended - began)
        assert len(times) >= 5
        # bounded: at most one message per flush interval (plus the first and the tail)
        assert len(times) <= (times[-1] - times[0]) / FLUSH_SECONDS + 3
        assert feed.ranks[rank].lost == 0
        # complete: every point, in order, the tail included
        assert feed.metrics.series("loss", rank) == (list(range(steps)), [float(rank * 1000 + s) for s in range(steps)])
        assert feed.metrics.series("accuracy", rank) == ([0, 1, 2], [0.5, 0.6, 0.7])
        assert feed.ranks[rank].state == "done"
        for level, total in ((0, 3), (1, steps // 3)):
            bar = feed.bars[(rank, level)]
            assert (bar.n, bar.total, bar.state) == (total, total, "done")
    assert feed.finished  # every rank said it ended, before execute() returned


def test_a_script_gets_text_progress_and_the_metrics(world: DDPCluster, capsys: pytest.CaptureFixture[str]) -> None:
    world.push({"STEPS": 30, "PAUSE": 0.0})
    world.execute(TRAIN)
    out = capsys.readouterr().out
    assert "[progress " in out
    assert "[progress] finished after" in out
    assert "[progress] rank 0: done, 33 steps" in out and "[progress] rank 1: done" in out
    metrics = world.metrics
    assert isinstance(metrics, Metrics) and len(metrics) == 2 * 33
    table = metrics.to_dict()
    assert set(table) == {"rank", "name", "step", "value"} and len(table["value"]) == 66

    world.execute("x = 1")  # a cell that logs nothing keeps the record
    assert world.metrics is metrics
    assert capsys.readouterr().out == ""
    world.execute(TRAIN, stream=False)  # quiet: no text, metrics still kept
    assert capsys.readouterr().out == ""
    assert world.metrics is not metrics and len(world.metrics) == 66


def test_only_the_ranks_that_run_the_cell_report(world: DDPCluster) -> None:
    world.push({"STEPS": 9, "PAUSE": 0.0})
    feed = Feed(None, ranks=(1,))
    world.execute(TRAIN, ranks=[1], on_data=feed)
    assert feed.finished and sorted(feed.ranks) == [1]
    assert feed.metrics.ranks == [1]
    assert feed.bars[(1, 1)].n == 3


def test_a_failing_rank_is_reported_failed(world: DDPCluster) -> None:
    cell = """
for step in ddp_notebook.progress(range(10), desc="work"):
    ddp_notebook.log(value=step)
    if rank == 1 and step == 4:
        raise ValueError("rank 1 gives up")
"""
    feed = Feed(None, ranks=(0, 1))
    with pytest.raises(RankError, match="rank 1 gives up"):
        world.execute(cell, on_data=feed)
    assert feed.ranks[0].state == "done" and feed.ranks[1].state == "failed"
    assert (feed.bars[(1, 0)].n, feed.bars[(1, 0)].state) == (4, "closed")
    assert feed.metrics.series("value", 1)[1] == [0.0, 1.0, 2.0, 3.0, 4.0]


class DrawnPanels:
    """A view that keeps, for each draw, whether it was the final one, the straggler and both panels."""

    def __init__(self) -> None:
        self.draws: list[tuple[bool, Any, str, str]] = []

    def show(self) -> None:
        pass

    def draw(self, feed: Feed, final: bool) -> None:
        self.draws.append((final, feed.straggler, steps_table(feed), xray_table(feed)))


SLOW_RANK_1 = """
import time
torch.manual_seed(0)
net = ddp_notebook.prepare_model(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in ddp_notebook.progress(range(40), desc="steps"):
    opt.zero_grad()
    net(torch.randn(8, 16)).sum().backward()
    if rank == 1:
        time.sleep(0.05)
    opt.step()
"""


def test_the_straggler_is_named_with_its_phase_while_the_cell_runs(world: DDPCluster) -> None:
    view = DrawnPanels()
    feed = Feed(lambda: view, ranks=(0, 1))
    world.execute(SLOW_RANK_1, on_data=feed, timeout=120)
    live = [(straggler, table) for final, straggler, table, _ in view.draws if not final and straggler is not None]
    assert live, "no straggler named while the cell ran"
    straggler, table = live[-1]
    assert (straggler.rank, straggler.phase) == (1, "compute") and "rank 1 is the straggler" in table
    final, straggler, table, _ = view.draws[-1]
    assert final and straggler is not None and (straggler.rank, straggler.phase) == (1, "compute")
    assert straggler.busy - straggler.peers_busy > 0.04  # about the 50 ms it sleeps
    assert feed.step_times[0].comm > 0.03  # rank 0 waits for it in the gradient all-reduce
    assert feed.step_times[1].steps >= 20


def test_a_long_wait_in_a_collective_shows_the_xray_and_clears_when_it_ends(world: DDPCluster) -> None:
    view = DrawnPanels()
    feed = Feed(lambda: view, ranks=(0, 1))
    # nothing logged: the X-ray alone makes the view
    world.execute("import time\nif rank == 0:\n    time.sleep(5)\ndist.all_reduce(torch.ones(4))", on_data=feed)
    shown = [xray for final, _, _, xray in view.draws if not final and xray]
    assert shown, "the X-ray was never shown"
    assert "<td>1</td><td>all_reduce #" in shown[-1] and " [4]</td><td>4</td>" in shown[-1]
    assert "<td>0</td><td>in no collective</td><td>3</td>" in shown[-1]  # rank 0 still sleeps on line 3
    waited = float(shown[0].split("</td><td>")[-1].split(" s<")[0])
    assert XRAY_SHOW_SECONDS <= waited < 5
    final, _, _, xray = view.draws[-1]
    assert final and xray == "" and feed.finished


# ---------------------------------------------------------------- the magics


@pytest.fixture
def shell(world: DDPCluster) -> Iterator[Any]:
    """An IPython shell (no kernel: the text fallback) whose magics drive the shared world."""
    with magics_driving(world) as ip:
        yield ip


def test_magics_show_text_and_keep_metrics(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    shell.user_ns.pop("metrics", None)
    result = shell.run_cell(
        "%%ddp\nSTEPS, PAUSE = 30, 0.0\n" + TRAIN,
        store_history=False,
    )
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert "[progress] finished after" in out
    assert shell.run_cell("metrics = %ddp_metrics", store_history=False).success
    metrics = shell.user_ns["metrics"]
    assert metrics.series("loss", 0)[0] == list(range(30))

    assert shell.run_cell("%%ddp --append\n" + TRAIN, store_history=False).success
    appended = shell.run_line_magic("ddp_metrics", "")
    assert appended is metrics
    assert metrics.series("loss", 1)[0] == list(range(60))  # the new steps follow the old ones

    assert shell.run_cell("%%ddp --ranks 0\ny = 2", store_history=False).success
    assert shell.run_line_magic("ddp_metrics", "") is metrics
    assert shell.run_cell("%%ddp\n" + TRAIN, store_history=False).success
    assert shell.run_line_magic("ddp_metrics", "") is not metrics  # a new cell, a new record
    failed = shell.run_cell("%ddp_metrics loss", store_history=False)
    assert "takes no arguments" in str(failed.error_in_exec)
