"""One cell's run on a world, from the request to how it ended (`DDPCluster.run`).

Before the cell is sent: a rank lost while the world was idle is gone on after, the notebook's
files are synced where the ranks work elsewhere, the live feed gets its tracker run, the profiler
starts. Then a `CellRelay` carries the cell's messages to an `OutputSink` while the supervisor
watches the ranks, and what the relay saw becomes a `CellOutcome`: a lost rank is gone on after
(the loss policy, `comeback.recover`), a broken group set up again, the cell recorded for `%ddp_export`, a
setup cell kept for new ranks, a sharded model's snapshot taken on every rank.
Notebook side (no torch).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from ..cell import busy as busy_ranks
from ..cell import ipp_adapter, large_output
from ..cell.outcome import CellOutcome, Ending
from ..cell.profiling import ProfiledCell
from ..cell.relay import CellRelay, OutputSink
from ..errors import DDPUsageError, name_ranks, one_line
from ..live import feed as live_feed
from ..live import trackers
from ..rank import calls as rank_calls
from ..wire.results import CellResult, Death
from . import comeback, report
from . import sync as file_sync
from .cell_request import CellRequest
from .export import CellRecord
from .running import RunningWorld
from .state import WorldLifecycle

if TYPE_CHECKING:
    from .cluster import DDPCluster  # the facade calls in; this module never imports it

PULL_SECONDS = 60.0  # how long rank 0 may take to send the hyperparameters a tracker logs


@dataclass(frozen=True)
class RunContext:
    """What a cell's run writes to and changes of its world besides the world's public record."""

    stdout: TextIO | None  # None: sys.stdout, as the cell writes
    stderr: TextIO | None
    lifecycle: WorldLifecycle  # the world's state: a broken group, dead ranks
    syncer: file_sync.Syncer | None  # the notebook's files, for ranks working elsewhere

    def note(self, text: str) -> None:
        """A line about the world (not a rank's), written where the ranks' errors go."""
        (self.stderr or sys.stderr).write(f"ddp_notebook: {text}\n")


def run(cluster: DDPCluster, world: RunningWorld, request: CellRequest, context: RunContext) -> CellOutcome:
    """Run `request` on `world` (its group whole) and say how it ended; raises only for what stops
    the cell before it is sent (a profiler that did not start, ...)."""
    targets = request.ranks
    routing = large_output.for_world(request.world_size, request.show)
    on_data = request.on_data
    if on_data is None:
        on_data = cluster.recorder.feed(text_view(context.stdout) if request.stream else None, ranks=targets)
    began = time.perf_counter()
    went_on = go_on_if_lost(cluster, world, targets, context.lifecycle)
    if went_on is not None:
        return went_on
    sync_before_cell(world, context)
    if isinstance(on_data, live_feed.Feed):
        on_data.size_hint = len(targets)  # a large world's feed keeps what its aggregate view draws
        if request.tracker is not None or cluster.tracking.settings is not None:
            # before the cell is sent: its first points may arrive at once
            run_name = f"{trackers.notebook_name()} cell {len(cluster.cell_history) + 1}"
            cluster.tracking.attach(on_data, request.tracker, run_name, lambda: trackers.world_description(cluster))
    profiled = None
    if request.profile is not None:  # off: nothing is sent, nothing runs on the ranks
        cluster.last_profile = None
        profiled = ProfiledCell.start(request.profile, {r: world.client[world.ranks[r].engine_id] for r in targets})
    relay = CellRelay(world.client, targets)
    result = CellResult(ranks=targets)
    view = world.view(tuple(world.engines(targets)))
    if not request.everywhere:
        # queued ahead of the cell on the same ranks, so no round trip is waited for
        view.apply_async(rank_calls.skip_cell_snapshot)
    relay.attach(ipp_adapter.execute_watched(view, request.code, relay.watch))
    # the live view shows the ranks' memory and collective X-ray too; a caller's own on_data
    # gets rank data only
    feed = on_data if isinstance(on_data, live_feed.Feed) else None
    sink = OutputSink(
        context.stdout,
        context.stderr,
        None if request.stream else result,
        on_data,
        feed.memory if feed is not None else None,
        feed.collectives if feed is not None else None,
        routing,
    )
    cluster.last_output = routing
    ending = relay.wait(sink, request.timeout, world.supervisor)
    result.elapsed = time.perf_counter() - began
    result.values.update(relay.values())
    if profiled is not None:
        cluster.last_profile = profiled.finish((*relay.dead, *relay.unfinished()))
    failures = tuple(relay.failures())
    if failures:
        cluster.last_failures = failures  # for debug(): the cell to look into
    heal_note = came_back = busy_doing = ""
    unfinished = relay.unfinished()
    if unfinished and ending is not Ending.TIMEOUT:  # a timeout's report says where each rank is
        busy_doing = busy_ranks.describe(unfinished, world.supervisor.collectives(unfinished))
    if relay.dead:
        came_back, heal_note = go_on_after_loss(cluster, world, dict(relay.dead), relay.unfinished(), context.lifecycle)
    elif relay.released or relay.group_broken():
        context.lifecycle.group_broke()
        heal_note = _heal_after_cell(cluster, relay.unfinished())
        if not failures and ending is Ending.DONE:  # nothing failed: the cell ended the group itself
            heal_note = f"\nthe cell ended the process group (torch.distributed.destroy_process_group()){heal_note}"
    outcome = CellOutcome(
        result=result,
        ending=ending,
        failures=failures,
        dead=dict(relay.dead),
        unfinished=relay.unfinished(),
        timeout=request.timeout,
        stuck_report=relay.stuck_report,
        heal_note=heal_note,
        came_back=came_back,
        mismatch=relay.mismatch,
        released_from=dict(relay.released_from),
        busy_doing=busy_doing,
    )
    if feed is not None and not feed.finished:
        # its final drawing, where no rank's message ended it (a view shown only for the X-ray,
        # ranks that never said how they ended)
        feed.finish(outcome.view_state)
    number = len(cluster.cell_history) + 1
    cluster.cell_history.append(CellRecord(number, request.code, targets, outcome.ok, cluster.world_size))
    if feed is not None and feed.tracker_run is not None:
        log_params(cluster, world, feed, request.params or cluster.tracking.param_names, context)
    if request.setup and outcome.ok:
        cluster.setup_cells.append(request.code)
    if outcome.ok and request.everywhere and relay.snapshot_owed():
        snapshot_everywhere(cluster, world, context)
    return outcome


def go_on_if_lost(
    cluster: DDPCluster, world: RunningWorld, targets: tuple[int, ...], lifecycle: WorldLifecycle, doing: str = ""
) -> CellOutcome | None:
    """Before anything is sent to `targets` (a cell, a push, a pull): a rank the controller
    dropped since the last cell is named, and the world goes on after it as after a loss in a
    cell, instead of ipyparallel's KeyError for its engine. Returns how that ended (None: every
    rank is there); `doing` (push, pull) is what to do again, nothing having been sent."""
    lost = comeback.lost_before_sending(world, targets)
    if not lost:
        return None
    what_now = f"nothing was sent: {doing} again" if doing else ""
    return go_on_after_lost(cluster, world, targets, lost, lifecycle, what_now)


def go_on_after_lost(
    cluster: DDPCluster,
    world: RunningWorld,
    targets: tuple[int, ...],
    lost: dict[int, Death],
    lifecycle: WorldLifecycle,
    what_now: str = "",
) -> CellOutcome:
    """The world goes on after `lost`, ranks of `targets` lost before or while something was sent
    to them (a push, a pull); `what_now` ends what the comeback says (do it again)."""
    came_back, why_not = go_on_after_loss(cluster, world, lost, (), lifecycle)
    if came_back and what_now:
        came_back += f"; {what_now}"
    return CellOutcome(CellResult(ranks=targets), dead=lost, came_back=came_back, heal_note=why_not)


def go_on_after_loss(
    cluster: DDPCluster,
    world: RunningWorld,
    dead: dict[int, Death],
    unfinished: tuple[int, ...],
    lifecycle: WorldLifecycle,
) -> tuple[str, str]:
    """The loss policy (`comeback.recover`) applied to the world, its count of restarts and its
    state kept; returns (what the comeback did, why there was none), as a report says them."""
    recovery = comeback.recover(world, cluster.config, dead, unfinished, cluster.restarts)
    cluster.restarts = recovery.restarts
    if recovery.comeback is None:
        lifecycle.ranks_died(dead)
    else:
        cluster.last_comeback_seconds = recovery.comeback.seconds
    return report.describe_recovery(recovery)


def _heal_after_cell(cluster: DDPCluster, busy: tuple[int, ...]) -> str:
    """The group broke in the cell: set up again now, or by the next cell once `busy` end."""
    if busy:  # what they do is said with the error (CellOutcome.busy_doing)
        return f"\nthe next cell sets the process group up again once {name_ranks(busy)} end ({busy_ranks.WHAT_TO_DO})"
    seconds = cluster.heal()
    return (
        f"\nthe process group was set up again in {seconds:.1f} s (variables kept; "
        "models from prepare_model were moved onto the new group)"
    )


def text_view(stdout: TextIO | None) -> Callable[[], live_feed.View]:
    """The text view's maker: made only once a rank logs or shows progress."""

    def make() -> live_feed.View:
        from ..live.widgets import TextView

        return TextView(stdout)

    return make


def log_params(
    cluster: DDPCluster, world: RunningWorld, feed: live_feed.Feed, names: Sequence[str], context: RunContext
) -> None:
    """The named hyperparameters from rank 0 into the cell's tracker run, then its points written."""
    found: dict[str, Any] = {}
    missing: list[str] = list(names)
    if names and 0 in world.ranks and world.ranks[0].engine_id in world.client.ids:
        try:
            reply = world.client[world.ranks[0].engine_id].apply_async(rank_calls.pull_names, list(names))
            answer = reply.get(timeout=PULL_SECONDS)
            found, missing = answer["found"], answer["missing"]
        except Exception:  # noqa: BLE001  (the training is done; the note says what was not logged)
            pass
    note = cluster.tracking.after_cell(feed, found, missing)
    if note:
        context.note(note)


def sync_before_cell(world: RunningWorld, context: RunContext) -> None:
    """Ranks working in a sync folder (the notebook's folder does not exist on their host) get
    the notebook's changed modules before the cell, so that they run, and reload, the code on disk."""
    syncer = context.syncer
    if syncer is None:
        return
    here = socket.gethostname()
    if all(info.host == here for info in world.ranks.values()):
        return  # local ranks work in the notebook's folder
    try:
        report = syncer.before_cell(world.client, world.engines())
    except DDPUsageError as refusal:
        report, note = None, str(refusal)
    except Exception as failure:  # noqa: BLE001  (the cell still runs; the ranks keep what they had)
        report, note = None, f"the notebook's files could not be synced before the cell: {one_line(failure)}"
    else:
        note = str(report) if report is not None and report.sent else ""
    if note:
        context.note(note)


def snapshot_everywhere(cluster: DDPCluster, world: RunningWorld, context: RunContext) -> None:
    """The end-of-cell snapshot of a world that tracks a sharded model: it gathers the model's
    state, so every rank takes it at once, and only after a cell that succeeded on every rank
    (a rank's own post_run_cell hook cannot know that the others got there)."""
    try:
        world.client[world.engines()].apply_async(rank_calls.take_snapshot, "the end of a cell").get(
            timeout=cluster.config.timeout
        )
    except Exception as failure:  # noqa: BLE001  (the cell succeeded; the world keeps its last snapshot)
        context.lifecycle.group_broke()  # a rank stopped in the gather: the next cell heals the group
        context.note(f"the end-of-cell snapshot failed: {one_line(failure)}")
