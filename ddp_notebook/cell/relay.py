"""One cell in flight: its messages, carried from ipyparallel's IO thread to the waiting thread.

`CellRelay` registers on ipyparallel's message futures, turns stdout/stderr chunks into whole
`[rank N]` lines (via `OutputSink`), relays display and data messages, and decides when the
cell is over: all ranks replied, a timeout or interrupt ran out its grace, or a rank died.
It also notices when finished ranks must let go of the process group to release peers.
"""

from __future__ import annotations

import datetime
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from ..errors import RankFailure, one_line
from ..live.xray_readings import RankCollectives
from ..platform.processes import DEATH_CHECK_SECONDS
from ..wire.results import GROUP_BROKEN_KEY, SNAPSHOT_OWED_KEY, CellResult, Death, MemoryReading, raised_at
from .ipp_adapter import message_futures, on_io_thread, unwrap_exception
from .large_output import LargeOutput
from .outcome import Ending
from .output import LineAssembler, rank_prefix, tag_lines
from .xray import Mismatch, MismatchWatch

# after an interrupt or timeout, how long the ranks get to stop before we give up waiting
INTERRUPT_GRACE_SECONDS = 5.0
# after every rank replied, how long to wait for the tail of its output: a healthy rank's idle status
# always comes, after all of it, but its IOPub thread can lag its reply by seconds on a loaded machine
OUTPUT_DRAIN_SECONDS = 10.0
# a rank whose engine aborted the request instead of running it (ipyparallel's abort)
SKIPPED = "the rank's engine aborted the cell instead of running it: nothing of it ran there; run it again"
# how often a running cell reads its ranks' memory against their limit (a few small files)
MEMORY_CHECK_SECONDS = 1.0
# after a rank died, how long its peers get to fail (a closed socket releases gloo in ~1 s)
DEATH_GRACE_SECONDS = 3.0
# after a rank failed (or the ranks were interrupted), how long the others may keep running
# before the finished ranks let go of the process group and the running ones shut their side
RELEASE_AFTER_SECONDS = 0.5
# once a cell ran this long, how often the ranks' collectives are read to catch a mismatch
COLLECTIVES_CHECK_SECONDS = 0.25
# ... for worlds up to this many ranks; a reading asks every rank, so a larger world's are spaced
# out in proportion (1,024 ranks: one every 8 s), to keep the kernel's share of a core bounded
COLLECTIVES_CHECK_RANKS = 32
# after ranks in mismatched collectives were released, how long they get to fail and reply (they
# fail at once; the margin is for a loaded machine, and the wait ends when they have replied)
MISMATCH_GRACE_SECONDS = 10.0
# past a grace, ranks whose X-ray says they left the cell's code (their reply is on its way: a loaded
# machine, a large world) are waited for this much longer, a little at a time, so that the report has
# their failures instead of calling them still running
REPLY_GRACE_SECONDS, REPLY_STEP_SECONDS = 5.0, 0.5
# how often an unfinished text progress line (plain tqdm) is drawn again while a cell runs
PROGRESS_DRAW_SECONDS = 0.5

# the keys of what our own rank code publishes (not the user's data)
_OWN_KEYS = (SNAPSHOT_OWED_KEY, GROUP_BROKEN_KEY)


# What the IO thread hands the waiting thread through the relay's queue: one value per message.


@dataclass(frozen=True)
class StreamText:
    """A chunk of a rank's stdout or stderr (not whole lines: `LineAssembler` makes those)."""

    rank: int
    stream: str
    text: str


@dataclass(frozen=True)
class Display:
    """A rank's rich output (display_data), or an update of one it showed by its id."""

    rank: int
    content: dict[str, Any]
    update: bool = False


@dataclass(frozen=True)
class ClearOutput:
    """A rank cleared its output: its next display replaces its last one."""

    rank: int


@dataclass(frozen=True)
class PublishedData:
    """What a rank published with ipyparallel's publish_data (the live view's messages, ours)."""

    rank: int
    payload: dict[str, Any]


@dataclass(frozen=True)
class WentIdle:
    """These ranks are idle: every message of theirs came before this."""

    ranks: tuple[int, ...]


Relayed = StreamText | Display | ClearOutput | PublishedData | WentIdle


class CellSupervisor(Protocol):
    """What the relay asks of the world while it waits for a cell."""

    def interrupt(self, ranks: tuple[int, ...]) -> None:
        """Send SIGINT to `ranks`."""

    def find_dead(self, ranks: tuple[int, ...]) -> dict[int, Death]:
        """Ranks among `ranks` whose process is gone, with how each one ended."""

    def where_stuck(self, ranks: tuple[int, ...]) -> str:
        """One line per rank saying where it is."""

    def release(self, ranks: tuple[int, ...]) -> None:
        """Make `ranks` let go of the process group, so peers blocked in it with them fail."""

    def check_memory(self, ranks: tuple[int, ...]) -> MemoryReading | None:
        """The memory of `ranks` against their limit; with a warning when it crossed the warning level."""

    def collectives(self, ranks: tuple[int, ...]) -> dict[int, RankCollectives]:
        """What `ranks` say about the collectives they ran and wait in."""

    def release_blocked(self, ranks: tuple[int, ...]) -> None:
        """Make `ranks` fail out of the collective they are blocked in."""

    def debug(self, rank: int) -> None:
        """Drive `rank`'s waiting pdb session until the user continues or quits."""


@dataclass
class _WaitClock:
    """The deadlines of one wait for a cell (monotonic seconds)."""

    began: float
    timeout: float | None
    ending: Ending = Ending.DONE
    replied_at: float | None = None
    stop_at: float | None = None  # set once we interrupted the ranks or one died
    release_at: float | None = None  # set once some ranks finished badly while others run
    replies_until: float | None = None  # the latest a grace is extended for replies on their way
    next_death_check: float = 0.0
    next_memory_check: float = 0.0
    next_collectives_check: float = 0.0
    next_progress_draw: float = 0.0

    def __post_init__(self) -> None:
        self.next_death_check = self.began + DEATH_CHECK_SECONDS
        self.next_memory_check = self.began + MEMORY_CHECK_SECONDS
        self.next_collectives_check = self.began + COLLECTIVES_CHECK_SECONDS


class OutputSink:
    """Where a cell's output goes: tagged lines to stdout/stderr, or into the result."""

    def __init__(
        self,
        stdout: TextIO | None,
        stderr: TextIO | None,
        collect: CellResult | None,
        on_data: Callable[[int, dict[str, Any]], None] | None = None,
        on_memory: Callable[[MemoryReading], None] | None = None,
        on_collectives: Callable[[dict[int, RankCollectives]], None] | None = None,
        large: LargeOutput | None = None,
    ) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._collect = collect
        self._on_data = on_data
        self._on_memory = on_memory
        self._on_collectives = on_collectives
        # a large world's routing of lines: some shown, stderr folded across ranks, all kept
        self.large = large
        self._live: dict[str, str] = {}  # stream -> the progress line drawn last, not yet ended
        # streams written since the last flush: a kernel's flush waits on its IO thread (~0.2 ms),
        # so a cell with no output flushes nothing
        self._unflushed: set[str] = set()

    def _target(self, stream: str) -> TextIO:
        # looked up at write time: IPython swaps sys.stdout per cell
        return (self._stderr or sys.stderr) if stream == "stderr" else (self._stdout or sys.stdout)

    def memory(self, reading: MemoryReading) -> None:
        """A memory reading: to the live view; its warning, if any, to stderr at once (even
        when output is collected: it is about the machine, not the cell's output)."""
        if reading.warning:
            target = self._stderr or sys.stderr
            target.write(reading.warning + "\n")
            try:
                target.flush()
            except Exception:  # noqa: BLE001
                pass
        if self._on_memory is not None:
            self._on_memory(reading)

    def collectives(self, readings: dict[int, RankCollectives]) -> None:
        """The ranks' collective X-ray, read for the mismatch check: to the live view too."""
        if self._on_collectives is not None:
            self._on_collectives(readings)

    def data(self, rank: int, payload: dict[str, Any]) -> None:
        if self._on_data is not None:
            self._on_data(rank, payload)

    def write(self, rank: int, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        if self._collect is not None:
            store = self._collect.stderr if stream == "stderr" else self._collect.stdout
            store[rank] = store.get(rank, "") + "".join(line + "\n" for line in lines)
            return
        if self.large is not None:
            for target, text in self.large.take(rank, stream, lines):
                self._write(target, text)
            return
        self._write(stream, tag_lines(rank, lines))

    def tick(self) -> None:
        """Write what became due meanwhile (a large world's folded stderr)."""
        if self.large is not None and self._collect is None:
            written = self.large.due()
            for target, text in written:
                self._write(target, text)
            if written:
                self.flush()

    def finish(self) -> None:
        """The cell ended: what is left of a large world's output, and a line on what was not shown."""
        if self.large is not None and self._collect is None:
            for target, text in self.large.finish():
                self._write(target, text)
        self.flush()

    def _write(self, stream: str, text: str) -> None:
        drawn = self._live.pop(stream, None)
        if drawn is not None:  # these lines take the progress line's place ('\r'); it is drawn again below them
            first, newline, rest = text.partition("\n")
            text = "\r" + first.ljust(len(drawn)) + newline + rest
        self._target(stream).write(text)
        self._unflushed.add(stream)

    def live(self, rank: int, stream: str, drawing: str) -> None:
        """Show the current drawing of a rank's unfinished progress line, in place of the previous one.

        Written after '\\r' with no newline: the notebook (and a terminal) draw it over the last
        one, so a text progress bar moves while the cell runs instead of appearing only when done.
        """
        if self._collect is not None:
            return
        line = f"{rank_prefix(rank)}{drawing}"
        drawn = self._live.get(stream)
        if line == drawn:
            return
        self._target(stream).write("\r" + line.ljust(len(drawn or "")))
        self._live[stream] = line
        self._unflushed.add(stream)

    def flush(self) -> None:
        for stream in sorted(self._unflushed):
            try:
                self._target(stream).flush()
            except Exception:  # noqa: BLE001
                pass
        self._unflushed.clear()


def collectives_check_seconds(ranks: int) -> float:
    """How often a running cell's collective X-ray is read, for a cell on `ranks` ranks."""
    return COLLECTIVES_CHECK_SECONDS * max(1.0, ranks / COLLECTIVES_CHECK_RANKS)


class CellRelay:
    """Carries one cell's messages from ipyparallel's IO thread to the waiting thread.

    Registration happens on the IO thread itself, so each message is seen exactly once:
    either it was already folded into ipyparallel's metadata (caught up at registration)
    or it reaches our callback afterwards.
    """

    def __init__(self, client: Any, ranks: tuple[int, ...]) -> None:
        self._client = client
        self._ranks = ranks
        # C-implemented: a put on the IO thread and the waiting thread's wake-up take no Python lock
        self._queue: queue.SimpleQueue[Relayed] = queue.SimpleQueue()
        self._async_result: Any = None
        self._futures: list[Any] = []  # the cell's message future on each rank, in `ranks` order
        self._idle: set[int] = set()  # ranks gone idle, as the waiting thread was told
        self._idle_seen: set[int] = set()  # the same, on the IO thread (which alone touches it)
        self._replied_seen = False  # every rank replied, as the IO thread saw it
        self._done_lock = threading.Lock()  # ipyparallel may run a done callback on the caller's thread
        self.dead: dict[int, Death] = {}
        self.stuck_report = ""  # where the ranks were when the time limit struck
        self.released = False  # whether finished ranks let go of the process group
        self.released_from: dict[int, str] = {}  # rank -> the collective it was released from ("all_reduce #4 ...")
        self._released_in: dict[int, int] = {}  # rank -> that collective's sequence number
        self.mismatch: Mismatch | None = None  # ranks found in collectives that can never match
        self._mismatch_watch = MismatchWatch()
        self._displays = RankDisplays()

    def watch(self, index: int, future: Any) -> None:
        """Relay the messages of the rank at `index` of the cell's ranks: `future` is its request's
        message future, handed over before the request is sent (`ipp_adapter.execute_watched`), so
        every message of the reply reaches these callbacks."""
        rank = self._ranks[index]
        future.iopub_callbacks.append(lambda msg: self._on_iopub(rank, msg))
        # the output future resolves on the rank's 'idle' status, after all its output;
        # ipyparallel may drop the message future before that status reaches callbacks
        future.output.add_done_callback(lambda _: self._went_idle(rank))

    def attach(self, async_result: Any) -> None:
        """Wait for `async_result`, the cell sent with `watch` on each of its message futures."""
        self._async_result = async_result
        self._futures = list(message_futures(async_result))  # asked once: every later question reads these
        async_result.add_done_callback(lambda _: self._all_replied())

    def _all_replied(self) -> None:
        """On the IO thread: every rank replied. Told with the ranks' idles, once both are in."""
        with self._done_lock:
            self._replied_seen = True
            self._tell_if_done()

    def _went_idle(self, rank: int) -> None:
        """On the IO thread: `rank` is idle, all its output sent. The waiting thread is woken once,
        when every rank replied and went idle, whichever came last (a wake-up per rank, or one for
        the replies and one for the idles, each cost a trivial cell tens of microseconds of a core
        the IO thread needs), or at each idle while a rank is dead (the survivors' idles end the
        cell then). Queued after every message of theirs, as each rank's own idle would be. A
        rank whose idle never comes: the waiting thread sees the replies itself (`_step`)."""
        with self._done_lock:
            self._idle_seen.add(rank)
            if self.dead:
                self._queue.put(WentIdle(tuple(self._idle_seen)))
            else:
                self._tell_if_done()

    def _tell_if_done(self) -> None:
        if self._replied_seen and len(self._idle_seen) == len(self._ranks):
            self._queue.put(WentIdle(tuple(self._idle_seen)))  # the waiting thread reads the replies itself

    def _tell_idle_so_far(self) -> None:
        """A rank was found dead: the survivors that went idle before (their wake-up waited for
        the last rank, which never comes) are told to the waiting thread, queued on the IO thread
        behind what it already handled."""
        on_io_thread(self._client, lambda: self._queue.put(WentIdle(tuple(self._idle_seen))))

    def _on_iopub(self, rank: int, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        if kind == "stream":
            self._queue.put(StreamText(rank, content["name"], content["text"]))
        elif kind in ("display_data", "update_display_data"):
            self._queue.put(Display(rank, content, kind == "update_display_data"))
        elif kind == "clear_output":
            self._queue.put(ClearOutput(rank))
        elif kind == "data_message":
            # what a rank published with ipyparallel's publish_data: plain data, signed message
            from ipyparallel.serialize import deserialize_object

            payload, _ = deserialize_object(msg["buffers"])
            self._queue.put(PublishedData(rank, payload))

    def wait(self, sink: OutputSink, timeout: float | None, supervisor: CellSupervisor) -> Ending:
        """Relay output until every rank is done; say why the wait ended.

        Rank processes found dead are recorded in `self.dead`; the others then get a short
        grace period, in which peers blocked in a collective with the dead rank fail.
        When some ranks finished (a rank raised, or the interrupt reached them) while others
        still run, they may be blocked in a collective waiting for the finished ones, which
        SIGINT cannot break: after a second, the finished ranks let go of the process group
        (`supervisor.release`), so the blocked ones fail within a second too.
        """
        clock = _WaitClock(time.monotonic(), timeout)
        # a reading asks every rank: a large world's first comes later too (a short cell needs none)
        clock.next_collectives_check = clock.began + collectives_check_seconds(len(self._ranks))
        assembler = LineAssembler()
        while True:
            try:
                self._relay_until_done(clock, supervisor, sink, assembler)
                break
            except KeyboardInterrupt:
                if clock.ending is Ending.INTERRUPTED and clock.stop_at is not None:
                    break  # a second interrupt: stop waiting now
                clock.ending = Ending.INTERRUPTED
                self._stop_ranks(clock, supervisor, time.monotonic())
        for rank, stream, line in assembler.flush_all():
            sink.write(rank, stream, [line])
        sink.finish()
        if clock.ending is Ending.DONE and not self._async_result.ready() and not self.dead and not self._some_failed():
            clock.ending = Ending.INTERRUPTED
        if not self.dead and self.failures():
            # a rank lost on another host can reply (with ipyparallel's engine error) between two
            # death checks: one more, so it is named dead rather than healed around
            self.dead = supervisor.find_dead(self._ranks)
        return clock.ending

    def _relay_until_done(
        self, clock: _WaitClock, supervisor: CellSupervisor, sink: OutputSink, assembler: LineAssembler
    ) -> None:
        """The wait's loop, called inside `wait`'s try: its every turn, the jump back included, is
        inside it. An interrupt the main thread only sees between two statements (not a real
        signal: `_thread.interrupt_main`, as a Windows kernel and the tests stop a cell) is raised
        at such a jump once the queue's wait returned, and must land in that try, not past it."""
        while not self._step(clock, supervisor):
            self._watch_memory(clock, supervisor, sink)
            self._watch_collectives(clock, supervisor, sink)
            self._draw_progress_lines(clock, sink, assembler)
            sink.tick()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            self._handle_all(item, sink, assembler)

    def _step(self, clock: _WaitClock, supervisor: CellSupervisor) -> bool:
        """One turn of the wait's checks; True when the wait is over."""
        now = time.monotonic()
        if not self.released:
            self._maybe_release(clock, supervisor, now)
        if clock.replied_at is None and self._futures and not self.unfinished():
            clock.replied_at = now  # every rank replied (its idle may still be on its way)
        if clock.replied_at is not None and (
            self._idle >= set(self._ranks) or now - clock.replied_at > OUTPUT_DRAIN_SECONDS
        ):
            return True
        if clock.stop_at is not None and now > clock.stop_at:
            if not self._replies_on_their_way(clock, supervisor, now):
                return True
            clock.stop_at = now + REPLY_STEP_SECONDS
        if self.dead and self._survivors_done():
            return True
        if clock.timeout is not None and clock.stop_at is None and now - clock.began > clock.timeout:
            clock.ending = Ending.TIMEOUT
            self.stuck_report = supervisor.where_stuck(self.unfinished())  # before the interrupt moves them
            self._stop_ranks(clock, supervisor, now)
        if now > clock.next_death_check and not self.dead:
            clock.next_death_check = now + DEATH_CHECK_SECONDS
            self.dead = supervisor.find_dead(self._ranks)
            if self.dead:
                self._tell_idle_so_far()
                # only the dead rank's neighbours see its sockets close: the survivors still in a
                # collective shut theirs, so none waits for the collective timeout
                survivors = tuple(rank for rank in self.unfinished() if rank not in self.dead)
                if survivors:
                    self._note_where_released(supervisor, survivors)
                    supervisor.release_blocked(survivors)
                if clock.stop_at is None:
                    clock.stop_at = now + DEATH_GRACE_SECONDS
        return False

    def _replies_on_their_way(self, clock: _WaitClock, supervisor: CellSupervisor, now: float) -> bool:
        """Whether a rank not done yet has left the cell's code (its reply is being sent), or is still
        in the collective it was released from (its failure is on its way: a starved process takes
        seconds to see its connections shut), within REPLY_GRACE_SECONDS of the first grace's end."""
        if clock.replies_until is None:
            clock.replies_until = now + REPLY_GRACE_SECONDS
        running = tuple(rank for rank in self.unfinished() if rank not in self.dead)
        if not running or now > clock.replies_until:
            return False
        try:
            readings = supervisor.collectives(running)
        except Exception:  # noqa: BLE001  (no reading: the wait ends as it would have)
            return False
        return any(
            not reading.in_cell or (reading.current is not None and reading.current.seq == self._released_in.get(rank))
            for rank, reading in readings.items()
        )

    def _draw_progress_lines(self, clock: _WaitClock, sink: OutputSink, assembler: LineAssembler) -> None:
        """A few times a second, the lowest rank's unfinished progress line on each stream, drawn in place.

        One rank's bar (rank 0's where it has one), not one per rank: several bars cannot share
        the one line a stream can redraw. The others show their last drawing when they end.
        """
        now = time.monotonic()
        if now < clock.next_progress_draw:
            return
        clock.next_progress_draw = now + PROGRESS_DRAW_SECONDS
        for stream in ("stdout", "stderr"):
            for rank in sorted(self._ranks):
                drawing = assembler.drawing(rank, stream)
                if drawing is not None:
                    sink.live(rank, stream, drawing)
                    sink.flush()
                    break

    def _watch_memory(self, clock: _WaitClock, supervisor: CellSupervisor, sink: OutputSink) -> None:
        now = time.monotonic()
        if now < clock.next_memory_check or self.dead:
            return
        clock.next_memory_check = now + MEMORY_CHECK_SECONDS
        try:
            reading = supervisor.check_memory(self._ranks)
        except Exception:  # noqa: BLE001  (a reading that fails must not end the cell)
            return
        if reading is not None:
            sink.memory(reading)

    def _watch_collectives(self, clock: _WaitClock, supervisor: CellSupervisor, sink: OutputSink) -> None:
        """Catch ranks blocked in collectives that can never match, and release them; the
        readings go to the live view as well (where each rank waits, once one waited a while)."""
        now = time.monotonic()
        if now < clock.next_collectives_check or self.mismatch or self.dead or clock.stop_at is not None:
            return
        clock.next_collectives_check = now + collectives_check_seconds(len(self._ranks))
        running = self.unfinished()
        if not running:
            return
        try:
            readings = supervisor.collectives(self._ranks)
        except Exception:  # noqa: BLE001  (a reading that fails must not end the cell)
            return
        sink.collectives(readings)
        stopped = [rank for rank, reading in readings.items() if reading.debugger and rank in running]
        if stopped:
            supervisor.debug(stopped[0])  # asks the user for each line; the other ranks wait
            clock.next_collectives_check = time.monotonic()
            return
        if self._some_failed():
            return  # a failed rank is released by _maybe_release
        self.mismatch = self._mismatch_watch.check(readings, self._finished(), now)
        if self.mismatch is not None:
            # every rank shuts its side: a blocked rank sees its own shutdown late, its peer's at once
            supervisor.release_blocked(self._ranks)
            clock.stop_at = time.monotonic() + MISMATCH_GRACE_SECONDS

    def _maybe_release(self, clock: _WaitClock, supervisor: CellSupervisor, now: float) -> None:
        if clock.release_at is None and self._some_failed():
            clock.release_at = now + RELEASE_AFTER_SECONDS
        if clock.release_at is not None and now > clock.release_at:
            finished, running = self._finished(), self.unfinished()
            if running:
                # With more than 2 ranks gloo pairs ranks that never talk to the finished ones: a
                # rank blocked on a blocked peer is freed only by shutting its own connections.
                self.released = True
                self._note_where_released(supervisor, running)
                if finished:
                    supervisor.release(finished)
                supervisor.release_blocked(running)
                clock.stop_at = max(clock.stop_at or 0.0, time.monotonic() + DEATH_GRACE_SECONDS)

    def _note_where_released(self, supervisor: CellSupervisor, ranks: tuple[int, ...]) -> None:
        """Where each of `ranks` waits, before they are released: their failure is that release, and
        the report says so once for all the ranks released from the same collective."""
        try:
            readings = supervisor.collectives(ranks, full=True)
        except Exception:  # noqa: BLE001  (the report says less; the release goes on)
            return
        for rank, reading in readings.items():
            current = reading.current
            if current is not None:
                line = f" at cell line {reading.cell_line}" if reading.cell_line is not None else ""
                self.released_from[rank] = f"{current.op} #{current.seq}{line}"
                self._released_in[rank] = current.seq

    def _stop_ranks(self, clock: _WaitClock, supervisor: CellSupervisor, now: float) -> None:
        supervisor.interrupt(self._ranks)
        clock.stop_at = now + INTERRUPT_GRACE_SECONDS
        clock.release_at = now + RELEASE_AFTER_SECONDS

    def _handle_all(self, item: Relayed, sink: OutputSink, assembler: LineAssembler) -> None:
        # drain whatever else is queued before writing, so output goes out in batches
        while True:
            self._handle(item, sink, assembler)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        sink.flush()

    def _handle(self, item: Relayed, sink: OutputSink, assembler: LineAssembler) -> None:
        """Deal with one queued message."""
        match item:
            case WentIdle(ranks):
                self._idle.update(ranks)
            case _:
                show(item, sink, assembler, self._displays)

    def _survivors_done(self) -> bool:
        children = zip(self._ranks, self._futures)
        return all(future.done() and rank in self._idle for rank, future in children if rank not in self.dead)

    def _finished(self) -> tuple[int, ...]:
        children = zip(self._ranks, self._futures)
        return tuple(rank for rank, future in children if future.done() and rank not in self.dead)

    def _some_failed(self) -> bool:
        for future in self._futures:
            if future.done() and future.output.metadata.get("status") == "error":
                return True
        return False

    def unfinished(self) -> tuple[int, ...]:
        return tuple(rank for rank, future in zip(self._ranks, self._futures) if not future.done())

    def snapshot_owed(self) -> bool:
        """Whether every rank of the cell asked for a collective end-of-cell snapshot (it tracks a
        sharded model and its cell succeeded). Read from ipyparallel's merge of the published data:
        no message of its own."""
        futures = self._futures
        return bool(futures) and all(
            future.done() and (future.output.metadata.get("data") or {}).get(SNAPSHOT_OWED_KEY) for future in futures
        )

    def group_broken(self) -> bool:
        """Whether a rank's failure broke its process group, as the rank judged it (by the
        exception's type) and published; read like `snapshot_owed`."""
        return any(
            future.done() and (future.output.metadata.get("data") or {}).get(GROUP_BROKEN_KEY)
            for future in self._futures
        )

    def values(self) -> dict[int, dict[str, Any]]:
        values = {}
        for rank, future in zip(self._ranks, self._futures):
            executed = future.output.metadata.get("execute_result")
            if executed:
                values[rank] = executed.get("data", {})
        return values

    def failures(self) -> list[RankFailure]:
        from ipyparallel.error import TaskAborted

        found = []
        for rank, future in zip(self._ranks, self._futures):
            if not future.done():
                continue
            metadata = future.output.metadata
            error = metadata.get("error")
            if error is None:
                try:
                    reply = future.result()
                except Exception as failure:  # noqa: BLE001  (e.g. the rank's process died)
                    found.append(RankFailure(rank, type(failure).__name__, one_line(failure)))
                    continue
                if isinstance(reply, TaskAborted):  # skipped there, not run: never a silent success
                    found.append(RankFailure(rank, "TaskAborted", SKIPPED))
                    continue
                content = getattr(reply, "content", None) or (reply.get("content") if isinstance(reply, dict) else None)
                if not content or content.get("status") != "error":
                    continue
                error = unwrap_exception(self._client, content)
            raised = _raised_at(future)
            found.append(
                RankFailure(
                    rank=rank,
                    ename=getattr(error, "ename", type(error).__name__),
                    evalue=getattr(error, "evalue", str(error)),
                    traceback=tuple(_traceback_lines(error)),
                    failed_at=raised if raised is not None else _epoch_seconds(metadata.get("completed")),
                )
            )
        return found


def show(item: Relayed, sink: OutputSink, assembler: LineAssembler, displays: RankDisplays) -> None:
    """One rank's output message in the notebook: a live cell's (`CellRelay`), or one read back
    from a detached rank's journal (`world/following.py`)."""
    match item:
        case StreamText(rank, stream, text):
            sink.write(rank, stream, assembler.feed(rank, stream, text))
        case Display(rank, content, update):
            displays.show(rank, content, update)
        case ClearOutput(rank):
            displays.clear(rank)
        case PublishedData(rank, payload):
            if SNAPSHOT_OWED_KEY in payload or GROUP_BROKEN_KEY in payload:  # ours, read after the cell
                payload = {key: value for key, value in payload.items() if key not in _OWN_KEYS}
            if payload:
                sink.data(rank, payload)


def _traceback_lines(error: Any) -> list[str]:
    rendered = getattr(error, "render_traceback", None)
    if rendered is not None:
        try:
            return list(rendered())
        except Exception:  # noqa: BLE001
            pass
    return [str(error)]


def _raised_at(future: Any) -> float | None:
    """When a failed rank's cell raised, as its reply says (`ipp_process_adapter.stamp_errors_when_raised`;
    ipyparallel's metadata takes its error from the IOPub message, which does not say)."""
    try:
        reply = future.result()
    except Exception:  # noqa: BLE001  (no reply: the rank's process died)
        return None
    return raised_at(getattr(reply, "engine_info", None))


def _epoch_seconds(stamp: Any) -> float | None:
    """ipyparallel's timestamps arrive as datetimes or ISO strings."""
    if stamp is None:
        return None
    if isinstance(stamp, str):
        try:
            stamp = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            return None
    return stamp.timestamp() if isinstance(stamp, datetime.datetime) else None


class RankDisplays:
    """A cell's rich output from the ranks, shown in the notebook's cell.

    A rank's `clear_output` must not wipe the cell, which holds every rank's output: instead
    the display that follows it replaces that rank's previous one. This is how a live display
    redraws itself (rich's progress bars, as Lightning draws them, or `clear_output(wait=True)`
    then `display(...)` in a loop): one display per rank that updates in place, not a new one
    per redraw. A display a rank updates by its id (`display(..., display_id=True).update()`)
    keeps that id here.
    """

    def __init__(self) -> None:
        self._cleared: set[int] = set()
        self._live: dict[int, str] = {}  # rank -> the display id its redraws update

    def clear(self, rank: int) -> None:
        self._cleared.add(rank)

    def show(self, rank: int, content: dict[str, Any], update: bool = False) -> None:
        transient = content.get("transient") or None
        if not update and rank in self._cleared:
            self._cleared.discard(rank)
            if rank in self._live:
                update = True
            else:
                self._live[rank] = f"ddp-rank{rank}-{uuid.uuid4().hex}"
            transient = {"display_id": self._live[rank]}
        _publish(content, transient, update)


def _publish(content: dict[str, Any], transient: dict[str, Any] | None, update: bool) -> None:
    try:
        from IPython.display import publish_display_data
    except ImportError:
        return
    publish_display_data(
        data=content.get("data", {}), metadata=content.get("metadata", {}), transient=transient, update=update
    )
