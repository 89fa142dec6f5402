"""CellRelay.wait against a fake supervisor and fake message futures: when the wait releases which
ranks, and how it ends. No processes (the integration tests run the same paths on real ranks)."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ddp_notebook.cell.outcome import Ending
from ddp_notebook.cell.output import LineAssembler
from ddp_notebook.cell.relay import DEATH_GRACE_SECONDS, CellRelay, OutputSink, PublishedData
from ddp_notebook.live.xray_readings import RankCollectives
from ddp_notebook.wire.results import GROUP_BROKEN_KEY, SNAPSHOT_OWED_KEY, CellResult, Death, MemoryReading
from tests.support import stop_button


@dataclass
class FakeOutput:
    metadata: dict[str, Any] = field(default_factory=lambda: {"status": None})


@dataclass
class FakeFuture:
    """One rank's message future: done once the rank replied."""

    finished: bool = False
    output: FakeOutput = field(default_factory=FakeOutput)

    def done(self) -> bool:
        return self.finished

    def result(self) -> dict[str, Any]:
        return {"content": {"status": self.output.metadata["status"]}}


class FakeCell:
    """The AsyncResult of a cell on `size` ranks (what ipp_adapter.message_futures reads)."""

    def __init__(self, size: int) -> None:
        self._children = [FakeFuture() for _ in range(size)]

    def ready(self) -> bool:
        return all(child.finished for child in self._children)


class Ranks:
    """The ranks' side: each may reply (ok or raising); the relay's queue hears it."""

    def __init__(self, relay: CellRelay, cell: FakeCell) -> None:
        self.relay, self.cell = relay, cell

    def reply(self, rank: int, error: str | None = None) -> None:
        child = self.cell._children[rank]
        child.finished = True
        if error is not None:
            child.output.metadata.update(status="error", error=_Remote("RuntimeError", error))
        else:
            child.output.metadata["status"] = "ok"
        self.relay._went_idle(rank)
        if self.cell.ready():
            self.relay._all_replied()


@dataclass
class _Remote:
    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)


class FakeSupervisor:
    """Records what the relay asks; shutting a rank's connections makes it fail out of its collective."""

    def __init__(self, ranks: Ranks, dead: dict[int, Death] | None = None) -> None:
        self.ranks = ranks
        self.dead = dead or {}
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def interrupt(self, ranks: tuple[int, ...]) -> None:
        self.calls.append(("interrupt", ranks))

    def find_dead(self, ranks: tuple[int, ...]) -> dict[int, Death]:
        return dict(self.dead)

    def where_stuck(self, ranks: tuple[int, ...]) -> str:
        return ""

    def release(self, ranks: tuple[int, ...]) -> None:
        self.calls.append(("release", ranks))

    def check_memory(self, ranks: tuple[int, ...]) -> MemoryReading | None:
        return None

    def collectives(self, ranks: tuple[int, ...]) -> dict[int, RankCollectives]:
        return {}

    def release_blocked(self, ranks: tuple[int, ...]) -> None:
        self.calls.append(("release_blocked", ranks))
        for rank in ranks:
            if rank not in self.dead:  # a dead rank's process answers nothing
                self.ranks.reply(rank, "Connection closed by peer")

    def debug(self, rank: int) -> None:
        raise AssertionError("no rank waits in pdb here")


class StuckElsewhere(FakeSupervisor):
    """Its running ranks are in no collective: shutting their connections does not end them."""

    def release_blocked(self, ranks: tuple[int, ...]) -> None:
        self.calls.append(("release_blocked", ranks))


class _InlineLoop:
    """The client's IO loop, as the relay uses it (ipp_adapter.on_io_thread): runs callbacks at once."""

    def add_callback(self, callback: Any) -> None:
        callback()


def _relay(size: int) -> tuple[CellRelay, FakeCell, Ranks]:
    relay = CellRelay(client=SimpleNamespace(_io_loop=_InlineLoop()), ranks=tuple(range(size)))
    cell = FakeCell(size)
    # what attach() sets; its callbacks are ipyparallel's, not tested here
    relay._async_result, relay._futures = cell, list(cell._children)
    return relay, cell, Ranks(relay, cell)


def _sink() -> OutputSink:
    return OutputSink(io.StringIO(), io.StringIO(), CellResult(ranks=()))


def test_a_raise_at_4_ranks_releases_the_finished_rank_and_every_rank_still_running() -> None:
    relay, _, ranks = _relay(4)
    supervisor = FakeSupervisor(ranks)
    ranks.reply(0, "fails on purpose")  # the others wait for it in a collective
    ending = relay.wait(_sink(), timeout=30, supervisor=supervisor)
    assert ending is Ending.DONE and relay.released
    assert supervisor.calls == [("release", (0,)), ("release_blocked", (1, 2, 3))]
    assert [f.rank for f in relay.failures()] == [0, 1, 2, 3] and relay.unfinished() == ()


def test_a_death_releases_the_survivors_at_once() -> None:
    relay, _, ranks = _relay(4)
    killed = Death("signal", "was killed by SIGKILL", -9)
    supervisor = FakeSupervisor(ranks, dead={2: killed})
    ranks.cell._children[2].finished = True  # ipyparallel's engine error for the dead rank
    ending = relay.wait(_sink(), timeout=30, supervisor=supervisor)
    assert ending is Ending.DONE and relay.dead == {2: killed}
    assert supervisor.calls[0] == ("release_blocked", (0, 1, 3))


def test_survivors_that_went_idle_before_a_death_was_found_end_the_cell_at_once() -> None:
    """Their idles woke no one (the wake-up waits for the last rank, the dead one): finding the
    death tells the waiting thread about them, so the cell does not wait out the death grace."""
    relay, _, ranks = _relay(3)
    ranks.reply(0, "Connection closed by peer")
    ranks.reply(1, "Connection closed by peer")
    supervisor = FakeSupervisor(ranks, dead={2: Death("signal", "was killed by SIGKILL", -9)})
    began = time.monotonic()
    ending = relay.wait(_sink(), timeout=30, supervisor=supervisor)
    assert ending is Ending.DONE and set(relay.dead) == {2}
    assert time.monotonic() - began < DEATH_GRACE_SECONDS / 2


def _replied_ok(cell: FakeCell) -> None:
    """Every rank's reply is in, each a success; what the IO thread saw is the test's to say."""
    for child in cell._children:
        child.finished = True
        child.output.metadata["status"] = "ok"


def _queued(relay: CellRelay) -> list[str]:
    items = []
    while not relay._queue.empty():
        items.append(type(relay._queue.get_nowait()).__name__)
    return items


def test_the_waiting_thread_is_woken_once_when_every_rank_replied_and_went_idle() -> None:
    """Idles before the replies (as iopub often outruns the replies) or after: nothing is queued
    until both are in, then one item (the replies the waiting thread reads itself), so a trivial
    cell wakes the waiting thread once."""
    for idles_first in (True, False):
        relay, cell, _ = _relay(2)
        _replied_ok(cell)
        if idles_first:
            relay._went_idle(0)
            relay._went_idle(1)
        if idles_first:
            assert _queued(relay) == []
        relay._all_replied()
        if not idles_first:
            assert _queued(relay) == []
            relay._went_idle(0)
            assert _queued(relay) == []
            relay._went_idle(1)
        assert _queued(relay) == ["WentIdle"]


def test_a_cell_whose_idle_never_comes_ends_once_its_output_had_time_to_drain(monkeypatch: Any) -> None:
    """The waiting thread sees the replies itself: a rank's lost idle costs the drain time, not a hang."""
    from ddp_notebook.cell import relay as relay_module

    monkeypatch.setattr(relay_module, "OUTPUT_DRAIN_SECONDS", 0.3)
    relay, cell, _ = _relay(2)
    _replied_ok(cell)
    relay._went_idle(0)
    relay._all_replied()  # rank 1's idle never comes
    began = time.monotonic()
    ending = relay.wait(_sink(), timeout=30, supervisor=FakeSupervisor(Ranks(relay, cell)))
    assert ending is Ending.DONE and relay.failures() == []
    assert 0.3 <= time.monotonic() - began < 5


class StopsOnInterrupt(FakeSupervisor):
    """An interrupt makes every rank leave the cell raising KeyboardInterrupt, as real ranks do."""

    def interrupt(self, ranks: tuple[int, ...]) -> None:
        super().interrupt(ranks)
        for rank in ranks:
            self.ranks.reply(rank, "KeyboardInterrupt")


def test_an_interrupt_the_main_thread_sees_between_statements_stops_the_cell_and_never_escapes() -> None:
    """`_thread.interrupt_main` (a Windows kernel's stop button; no signal interrupts the queue's
    wait) is raised at the next jump of the wait's loop: inside its try, at every turn."""
    for delay in (0.05, 0.12, 0.2):
        relay, _, ranks = _relay(2)
        supervisor = StopsOnInterrupt(ranks)
        began = time.monotonic()
        with stop_button.pressed_after(delay):
            ending = relay.wait(_sink(), timeout=30, supervisor=supervisor)
        assert ending is Ending.INTERRUPTED and supervisor.calls[0] == ("interrupt", (0, 1))
        assert time.monotonic() - began < 5


def test_a_failed_cell_that_leaves_a_rank_running_ends_as_a_failure_not_an_interrupt() -> None:
    relay, _, ranks = _relay(3)
    supervisor = StuckElsewhere(ranks)
    ranks.reply(1, "fails on purpose")
    ranks.reply(0, "Connection closed by peer")
    ending = relay.wait(_sink(), timeout=30, supervisor=supervisor)  # rank 2 computes on, in no collective
    assert ending is Ending.DONE
    assert relay.unfinished() == (2,)
    assert ("release_blocked", (2,)) in supervisor.calls


class SlowToReply(StuckElsewhere):
    """Its released ranks leave the cell's code at once but their replies come late (a loaded machine):
    the X-ray says they are out of the cell; `replied_after` seconds after the release, they reply."""

    def __init__(self, ranks: Ranks, replied_after: float) -> None:
        super().__init__(ranks)
        self.replied_after = replied_after
        self.released_at: float | None = None

    def release_blocked(self, ranks: tuple[int, ...]) -> None:
        super().release_blocked(ranks)
        self.released_at = time.monotonic()

    def collectives(self, ranks: tuple[int, ...]) -> dict[int, RankCollectives]:
        if self.released_at is not None and time.monotonic() - self.released_at > self.replied_after:
            for rank in ranks:
                self.ranks.reply(rank, "Connection closed by peer")
        return {rank: RankCollectives(rank, (), None, False, 0) for rank in ranks}


def test_ranks_whose_replies_are_on_their_way_are_waited_for() -> None:
    relay, _, ranks = _relay(3)
    supervisor = SlowToReply(ranks, replied_after=DEATH_GRACE_SECONDS + 1.0)
    ranks.reply(0, "fails on purpose")
    ending = relay.wait(_sink(), timeout=30, supervisor=supervisor)
    assert ending is Ending.DONE and relay.unfinished() == ()
    assert [f.rank for f in relay.failures()] == [0, 1, 2]  # in the report, not "still running"


def test_a_rank_still_in_the_cells_code_is_not_waited_for_past_the_grace() -> None:
    relay, _, ranks = _relay(3)
    supervisor = StuckElsewhere(ranks)  # its X-ray answers nothing: no reply is known to be on its way
    ranks.reply(0, "fails on purpose")
    began = time.monotonic()
    relay.wait(_sink(), timeout=30, supervisor=supervisor)
    assert relay.unfinished() == (1, 2) and time.monotonic() - began < DEATH_GRACE_SECONDS + 2


def test_every_rank_replying_in_time_releases_nothing() -> None:
    relay, _, ranks = _relay(3)
    supervisor = FakeSupervisor(ranks)
    for rank in range(3):
        ranks.reply(rank)
    assert relay.wait(_sink(), timeout=30, supervisor=supervisor) is Ending.DONE
    assert supervisor.calls == [] and not relay.released and relay.failures() == []


def test_a_rank_whose_engine_aborted_the_cell_is_a_failure_not_a_silent_success() -> None:
    """ipyparallel hands an aborted request's reply over as a TaskAborted: that rank ran nothing."""
    from ipyparallel.error import TaskAborted

    relay, cell, ranks = _relay(2)
    ranks.reply(0)
    ranks.reply(1)
    cell._children[1].result = lambda: TaskAborted("m1")  # type: ignore[method-assign]
    assert relay.wait(_sink(), timeout=30, supervisor=FakeSupervisor(ranks)) is Ending.DONE
    [failure] = relay.failures()
    assert failure.rank == 1 and failure.ename == "TaskAborted" and "nothing of it ran there" in failure.evalue


class CountingStream(io.StringIO):
    """A stream that counts its flushes (a kernel's flush waits on its IO thread)."""

    flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def test_the_sink_flushes_only_the_streams_it_wrote_to() -> None:
    out, err = CountingStream(), CountingStream()
    sink = OutputSink(out, err, None)
    sink.flush()  # a cell with no output: nothing to flush
    assert (out.flushes, err.flushes) == (0, 0)
    sink.write(1, "stdout", ["step 1"])
    sink.flush()
    sink.flush()
    assert (out.flushes, err.flushes) == (1, 0)
    assert out.getvalue() == "[rank 1] step 1\n"
    sink.live(0, "stderr", "50%")
    sink.flush()
    assert (out.flushes, err.flushes) == (1, 1)


def test_a_group_is_broken_when_a_rank_says_so_and_ours_keys_stay_out_of_the_users_data() -> None:
    relay, cell, ranks = _relay(3)
    ranks.reply(0, error="ValueError: bad batch")
    assert not relay.group_broken()  # failed, but its group is fine: no heal
    cell._children[1].output.metadata["data"] = {GROUP_BROKEN_KEY: True}  # as the rank's hook publishes it
    ranks.reply(1, error="RuntimeError: Connection closed by peer")
    assert relay.group_broken()
    sink = _sink()
    seen: list[tuple[int, dict[str, Any]]] = []
    sink.data = lambda rank, payload: seen.append((rank, payload))  # type: ignore[method-assign]
    relay._queue.put(PublishedData(1, {GROUP_BROKEN_KEY: True, SNAPSHOT_OWED_KEY: True, "loss": 0.5}))
    relay._queue.put(PublishedData(2, {GROUP_BROKEN_KEY: True}))
    while not relay._queue.empty():
        relay._handle(relay._queue.get(), sink, LineAssembler())
    assert seen == [(1, {"loss": 0.5})]
