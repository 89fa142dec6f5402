"""A cell that a detached world's ranks ran while no kernel was attached, followed from a kernel
that attached again (`DDPCluster.wait`, `%ddp_wait`): its output since it began, its live view with
the curves so far, and how it ended, as `%%ddp` would have shown them.

Each rank of a detached world keeps its newest cell (`rank.cell_journal`, bounded as
`wire.journal` says; `earlier_cell` finds it); this module reads it over each rank's X-ray line,
which a rank answers from a thread of its own while its cell runs, a page at a time from the entry
it read last, and shows it through a cell's output sink and live view. Notebook side (no torch).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..cell import large_output, xray
from ..cell.outcome import CellOutcome, Ending
from ..cell.output import LineAssembler
from ..cell.relay import (
    DEATH_GRACE_SECONDS,
    ClearOutput,
    Display,
    OutputSink,
    PublishedData,
    RankDisplays,
    Relayed,
    StreamText,
    show,
)
from ..errors import CellStillRunning, DDPUsageError, RankFailure, name_ranks
from ..live import feed as live_feed
from ..platform.processes import DEATH_CHECK_SECONDS
from ..wire import journal as wire
from ..wire.channel import message_key
from ..wire.results import GROUP_BROKEN_KEY, CellResult, Death
from . import cell_run
from .earlier_cell import EarlierCell, earlier_cell
from .running import RunningWorld

if TYPE_CHECKING:
    from .cluster import DDPCluster

# how long a rank may take to answer one page of its journal (it answers from a thread of its own;
# a page of a few MB is JSON-encoded while the rank's cell holds the GIL)
PAGE_SECONDS = 5.0


def follow(
    cluster: DDPCluster,
    world: RunningWorld,
    context: cell_run.RunContext,
    on_data: Any,
    timeout: float | None,
) -> CellOutcome:
    """Show the earlier kernel's cell from its start (what its ranks kept) and follow it until it ends:
    how it ended, as `DDPCluster.run` says it. Raises `CellStillRunning` past `timeout` seconds."""
    earlier = earlier_cell(world)
    if earlier is None:
        raise DDPUsageError(
            "no cell of an earlier kernel to follow: %ddp_wait follows the cell a detached world's ranks ran "
            "while no kernel was attached (%ddp_start N --detach, then %ddp_attach from a new kernel)"
        )
    if on_data is None:
        on_data = cluster.recorder.feed(cell_run.text_view(context.stdout), ranks=earlier.ranks)
    # a rank that kept no record of the cell (it did not answer) may be one the cell lost
    silent = tuple(rank for rank in sorted(world.ranks) if rank not in earlier.journals)
    follower = _Follower(world, earlier, context, on_data, world.supervisor.find_dead(silent) if silent else {})
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not follower.over():
            if deadline is not None and time.monotonic() > deadline:
                raise CellStillRunning(
                    f"the cell still runs on {name_ranks(follower.running())} after {timeout:g} s: it goes on "
                    "(%ddp_wait follows it again, %ddp_interrupt stops it)"
                )
            time.sleep(wire.POLL_SECONDS)
            follower.read()
    finally:
        follower.sink.flush()
    world.earlier_cell_checked = True
    outcome = follower.outcome(cluster)
    if isinstance(on_data, live_feed.Feed) and not on_data.finished:
        on_data.finish(outcome.view_state)
    return outcome


class _Follower:
    """One follow of an earlier cell: what was read of each rank's journal, and where it was shown."""

    def __init__(
        self,
        world: RunningWorld,
        earlier: EarlierCell,
        context: cell_run.RunContext,
        on_data: Any,
        dead: dict[int, Death],
    ) -> None:
        self.world = world
        self.context = context
        self.ranks = tuple(sorted({*earlier.ranks, *dead}))
        self.cells = dict(earlier.journals)
        self.ids = {rank: cell["id"] for rank, cell in earlier.journals.items()}
        self.read_from = dict.fromkeys(earlier.ranks, 0)
        self.sink = OutputSink(
            context.stdout,
            context.stderr,
            None,
            on_data,
            large=large_output.for_world(len(world.ranks)),
        )
        self.lines = LineAssembler()
        self.displays = RankDisplays()
        self.dead = dict(dead)
        self.dead_since = time.monotonic() if dead else None
        self.next_death_check = 0.0
        reach = world.supervisor.reach()
        assert reach is not None  # earlier_cell read the journals through it
        self.reach = reach
        self.read()

    def running(self) -> tuple[int, ...]:
        return tuple(r for r in self.ranks if r not in self.dead and self.cells[r]["status"] == "running")

    def read(self) -> None:
        """The ranks' new entries shown in the order they were sent (the whole backlog when the
        follow begins, a page of each rank at a time)."""
        pending = [rank for rank in self.ranks if rank not in self.dead]
        while pending:
            entries: list[tuple[float, int, str, Any]] = []
            for rank in list(pending):
                answer = xray.ask(self.reach, rank, wire.journal_request(self.read_from[rank]), PAGE_SECONDS)
                cell = answer.get("cell") if answer else None
                if cell is None or cell["id"] != self.ids[rank]:
                    pending.remove(rank)  # no answer (a death check names it), or the rank began another cell
                    continue
                self._note_dropped(rank, cell)
                self.cells[rank] = cell
                for number, kind, payload, when in answer["entries"]:
                    self.read_from[rank] = number + 1
                    entries.append((when, rank, kind, payload))
                if not answer["entries"] or self.read_from[rank] >= cell["next"]:
                    pending.remove(rank)
            for _when, rank, kind, payload in sorted(entries, key=lambda entry: entry[:2]):
                self._show(rank, kind, payload)
        self.sink.flush()
        self._check_deaths()

    def _note_dropped(self, rank: int, cell: wire.JournalCell) -> None:
        if self.read_from[rank] == 0 and cell["dropped_bytes"]:
            self.context.note(
                f"rank {rank}'s first {cell['dropped_bytes']:,} bytes of output were not kept (a detached "
                f"world's rank keeps at most {wire.TEXT_LIMIT_BYTES >> 20} MiB of a cell's output: the newest)"
            )

    def _show(self, rank: int, kind: str, payload: Any) -> None:
        """A journal entry shown as the live cell's relay shows the message it records."""
        if kind == "stream":
            item: Relayed = StreamText(rank, payload["name"], payload["text"])
        elif kind in ("display", "update"):
            item = Display(rank, payload, kind == "update")
        elif kind == "clear":
            item = ClearOutput(rank)
        elif kind == "data":
            item = PublishedData(rank, {message_key(payload["seq"]): payload})
        else:
            return
        show(item, self.sink, self.lines, self.displays)

    def _check_deaths(self) -> None:
        now = time.monotonic()
        if now < self.next_death_check:
            return
        self.next_death_check = now + DEATH_CHECK_SECONDS
        running = self.running()
        if running:
            found = self.world.supervisor.find_dead(running)
            if found and self.dead_since is None:
                self.dead_since = now
            self.dead.update(found)

    def over(self) -> bool:
        """Every rank ended the cell (or died), or its peers had their grace after a death."""
        running = self.running()
        if not running:
            return True
        return self.dead_since is not None and time.monotonic() > self.dead_since + DEATH_GRACE_SECONDS

    def outcome(self, cluster: DDPCluster) -> CellOutcome:
        """How the cell ended, and what the world does after it (a loss gone on after, a broken group healed
        by the next cell)."""
        for rank, stream, line in self.lines.flush_all():
            self.sink.write(rank, stream, [line])
        self.sink.flush()
        failures = sorted(
            (
                RankFailure(rank, error["ename"], error["evalue"], tuple(error["traceback"]), _failed_at(cell))
                for rank, cell in self.cells.items()
                if (error := cell["error"]) is not None and rank not in self.dead
            ),
            key=lambda failure: failure.failed_at or 0.0,
        )
        unfinished = self.running()
        came_back = heal_note = ""
        lifecycle = self.context.lifecycle
        if self.dead:
            came_back, heal_note = cell_run.go_on_after_loss(cluster, self.world, self.dead, unfinished, lifecycle)
        elif any(GROUP_BROKEN_KEY in cell["told"] for cell in self.cells.values()):
            lifecycle.group_broke()
            heal_note = "\nthe next cell sets the process group up again (variables kept)"
        return CellOutcome(
            result=CellResult(ranks=self.ranks),
            ending=Ending.DONE,
            failures=tuple(failures),
            dead=dict(self.dead),
            unfinished=unfinished,
            heal_note=heal_note,
            came_back=came_back,
        )


def _failed_at(cell: wire.JournalCell) -> float | None:
    """When a rank's failed cell raised, as its journal says; where it does not, when the cell ended."""
    error = cell["error"]
    return (error.get("raised") if error is not None else None) or cell["ended"]
