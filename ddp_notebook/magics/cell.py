"""The cell magics: `%%ddp` runs a cell on the ranks, `%ddp_run` a script as torchrun would,
`%ddp_wait` follows a cell an earlier kernel left running on a detached world.

The one place a magic runs a cell on the world (`world.run`), with its live view fed as it runs.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..cell.output import tag_text
from ..errors import CellStillRunning, DDPUsageError
from ..live import trackers
from ..live.feed import Feed
from ..wire.results import CellResult
from ..world import config
from ..world.cluster import DDPCluster
from ..world.report import format_values
from .arguments import names, parse_line, ranks_args, tracker_args, usage_errors
from .core import DDPMagics


@magics_class
class CellMagics(Magics):
    """`%%ddp` and `%ddp_run`, on the world `DDPMagics` holds."""

    def __init__(self, shell: Any, worlds: DDPMagics) -> None:
        super().__init__(shell)
        self.worlds = worlds

    @magic_arguments()
    @ranks_args
    @argument("--timeout", type=float, default=None, help="time limit of this cell, seconds")
    @argument("--no-stream", action="store_true", help="print each rank's output when the cell ends")
    @argument(
        "--show",
        default=None,
        metavar="RANKS",
        help="ranks whose output is shown live: 0, 0,5, 0-3 or all (default: all up to 16 ranks, rank 0 above; "
        "every rank's stderr either way)",
    )
    @argument("--append", action="store_true", help="add this cell's progress and metrics to the previous live view")
    @argument(
        "--setup",
        action="store_true",
        help="this cell sets a rank up: it is replayed on a rank that replaces a dead one",
    )
    @tracker_args
    @argument(
        "--profile",
        nargs="?",
        const="default",
        default=None,
        metavar="STEPS",
        help="torch.profiler on every rank over STEPS optimizer steps (default 5, after 1 skipped and 1 warm-up): "
        "a timeline per rank, top ops, overlap, memory, the straggler",
    )
    @argument(
        "--profile-dir",
        default=None,
        metavar="DIR",
        help="folder for the profile's traces, one Chrome trace per rank (default: ddp_profiles/DATE-TIME)",
    )
    @cell_magic
    @usage_errors
    def ddp(self, line: str, cell: str) -> None:
        """Run this cell on every rank (or on --ranks); rank state persists across cells.

        `ddp_notebook.progress(...)` and `ddp_notebook.log(...)` in the cell show up live under it.
        """
        args = parse_line(self.ddp, line)
        steps = _profile_steps(args)
        world = self.worlds.running_world()
        profile = _profile_settings(steps, args.profile_dir) if steps is not None else None
        ranks = len(config.parse_ranks(args.ranks, world.world_size)) if args.ranks else world.world_size
        feed = self.worlds.recorder.feed(lambda: _make_view(ranks), append=args.append)
        before = world.last_profile
        try:
            result = _execute_live(
                world,
                feed,
                cell,
                args.ranks,
                timeout=args.timeout,
                stream=not args.no_stream,
                setup=args.setup,
                tracker=_cell_tracker(world, args.tracker, args.tracker_ranks),
                params=names(args.params),
                profile=profile,
                show=args.show,
            )
        finally:
            if profile is not None and world.last_profile not in (None, before):
                _show_profile(world.last_profile)
        if args.no_stream:
            _print_collected(result)
        text = format_values(result)
        if text:
            print(text)

    @magic_arguments()
    @argument(
        "--follow-timeout",
        type=float,
        default=None,
        help="stop following after this many seconds (the cell goes on; %%ddp_wait follows it again)",
    )
    @line_magic
    @usage_errors
    def ddp_wait(self, line: str = "") -> None:
        """Show the cell an earlier kernel left running on this detached world (after %ddp_attach): its
        output since it began and its live view with the curves so far, then follow it to its end."""
        args = parse_line(self.ddp_wait, line)
        if args.follow_timeout is not None:
            config.check_seconds("--follow-timeout", args.follow_timeout)
        world = self.worlds.world
        if world is None or not world.running:
            raise DDPUsageError(
                "no world is attached: %ddp_attach attaches this notebook's detached world again, then %ddp_wait "
                "follows the cell it runs"
            )
        feed = self.worlds.recorder.feed(lambda: _make_view(world.world_size))
        try:
            world.wait(args.follow_timeout, on_data=feed)
        except CellStillRunning as still:
            feed.finish()
            print(still)
        except KeyboardInterrupt:
            feed.finish()
            print(
                "stopped following: the cell goes on on the ranks (%ddp_wait follows it again, %ddp_interrupt stops it)"
            )

    @line_magic
    @usage_errors
    def ddp_run(self, line: str) -> None:
        """Run a script on every rank as torchrun would: `%ddp_run train.py 4 2` (its `sys.argv`,
        `__name__ == "__main__"`, its own `init_process_group` given the world's group)."""
        from pathlib import Path

        from ..world.scripts import script_cell

        self.ddp("", script_cell(line, Path.cwd()))


def _make_view(ranks: int) -> Any:
    from ..live.large_view import make_view

    return make_view(ranks=ranks)


def _cell_tracker(world: DDPCluster, tracker: str | None, ranks: str | None) -> trackers.TrackerSettings | None:
    """A %%ddp line's tracker: its --tracker with its --tracker-ranks, or the world's with other ranks."""
    if tracker is not None:
        return trackers.TrackerSettings.parse(tracker, ranks or "0")
    if ranks is None:
        return None
    current = world.tracking.settings
    if current is None:
        raise DDPUsageError("--tracker-ranks goes with a tracker: add --tracker KIND (or %ddp_start --tracker KIND)")
    return dataclasses.replace(current, ranks=ranks)


def _profile_steps(args: Any) -> int | None:
    """--profile [STEPS] checked: the steps to record, None without --profile."""
    if args.profile is None:
        if args.profile_dir is not None:
            raise DDPUsageError("--profile-dir goes with --profile: %%ddp --profile 5 --profile-dir DIR")
        return None
    from ..cell.profiling import DEFAULT_STEPS, parse_steps

    return DEFAULT_STEPS if args.profile == "default" else parse_steps(args.profile)


def _profile_settings(steps: int, folder: str | None) -> Any:
    """What to profile, its folder made and checked writable before the cell is sent."""
    from ..cell.profiling import ProfileSettings, prepare_folder

    return ProfileSettings(steps=steps, folder=prepare_folder(folder))


def _show_profile(report: Any) -> None:
    from ..live.profile_view import show

    show(report)


def _execute_live(world: DDPCluster, feed: Feed, cell: str, ranks: str | None, **options: Any) -> CellResult:
    """Run the cell, checked once as a CellRequest, with `feed` drawing its live view; the view shows
    how the cell ended (a request refused before it ran too)."""
    try:
        outcome = world.run(world.cell_request(cell, ranks, on_data=feed, **options))
    except KeyboardInterrupt:
        feed.finish("stopped")
        raise
    except BaseException:
        feed.finish("failed")
        raise
    feed.finish(outcome.view_state)
    result = outcome.raise_for_error()
    if outcome.heal_note:  # the cell ended the process group itself (a script's destroy_process_group())
        print(outcome.heal_note.strip(), file=sys.stderr, flush=True)
    return result


def _print_collected(result: CellResult) -> None:
    for rank in result.ranks:
        print(tag_text(rank, result.stdout.get(rank, "")), end="")
        sys.stderr.write(tag_text(rank, result.stderr.get(rank, "")))
