"""CellRequest: one cell to run, as a value checked once before anything is sent.

`DDPCluster.execute` and `DDPCluster.run` take a cell's code with options, or a `CellRequest`
built by `CellRequest.build` (`DDPCluster.cell_request` builds one against a running world): a bad
option gets the same one line either way, and nothing reaches a rank. Notebook side (no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cell.profiling import ProfileSettings
from ..cell.syntax import check_syntax
from ..errors import DDPUsageError
from ..live import trackers
from .config import check_seconds, select_ranks


@dataclass(frozen=True)
class CellRequest:
    """A cell's code and how to run it, checked against a world of `world_size` ranks."""

    code: str
    ranks: tuple[int, ...]  # the ranks the cell runs on, sorted
    world_size: int  # the size of the world it was checked against
    timeout: float | None = None  # seconds; None: no limit
    stream: bool = True
    on_data: Callable[[int, dict[str, Any]], None] | None = None
    setup: bool = False
    tracker: trackers.TrackerSettings | None = None  # None: the world's (DDPCluster.track)
    params: tuple[str, ...] = ()
    profile: ProfileSettings | None = None  # None: no profiler
    show: tuple[int, ...] | None = None  # None: the default for the world's size

    @classmethod
    def build(
        cls,
        code: str,
        ranks: Iterable[int] | str | None = None,
        *,
        world_size: int,
        default_timeout: float | None,
        timeout: float | None = None,
        stream: bool = True,
        on_data: Callable[[int, dict[str, Any]], None] | None = None,
        setup: bool = False,
        tracker: str | trackers.TrackerSettings | None = None,
        params: Sequence[str] = (),
        profile: ProfileSettings | int | bool | None = None,
        show: Iterable[int] | str | None = None,
    ) -> CellRequest:
        """Check a cell and its options; raises `DDPUsageError` (or `CellSyntaxError`) with one line.

        `code` runs as a cell on `ranks` (default: all; "0,2", "1-3", "all" or numbers) of a world of
        `world_size` ranks; `default_timeout` is the world's cell limit (`WorldConfig.cell_timeout`).

        `timeout`: seconds the cell may run before its ranks are interrupted (default: the world's).

        `stream=False`: the output is collected in the result instead of written to this process's
        stdout/stderr as it comes.

        `on_data(rank, data)` is called in the caller's thread for each batch of plain data a rank
        publishes while the cell runs (metrics and progress, see `ddp_notebook.log` and
        `ddp_notebook.progress`). By default, progress is printed as text and the metrics are kept
        in the world's `metrics`.

        `setup=True` (`%%ddp --setup`): the cell sets a rank up (imports, model, data,
        `ddp_notebook.track(...)`); it is replayed on a rank that replaces a dead one. It runs on
        every rank.

        `tracker` (`"mlflow"`, `"tensorboard:runs"`, `"wandb:project"`): this cell's metrics also go
        to that experiment tracker (default: the world's, see `DDPCluster.track`); `params` names
        variables of rank 0 logged with them as hyperparameters once the cell ends.

        `profile` (`%%ddp --profile`): torch.profiler on every rank over the cell's optimizer steps,
        a number of steps to record or `ProfileSettings(...)`; the traces go to a folder and the
        world's `last_profile` holds what they show (a timeline per rank, the straggler, ...).

        `show` (`%%ddp --show`): the ranks whose stdout is shown while the cell streams, or "all".
        By default every rank's, up to SHOW_ALL_UP_TO (16) ranks; in a larger world rank 0's, with
        every rank's stderr and the same line of several ranks shown once (`[ranks 0-511] ...`).
        Every rank's output is kept either way: `DDPCluster.output(rank)`.
        """
        chosen = select_ranks(ranks, world_size)
        shown = None if show is None else select_ranks(show, world_size)
        if setup and len(chosen) != world_size:
            raise DDPUsageError("a setup cell runs on every rank: leave out --ranks")
        check_syntax(code)
        # a tracker asked for that cannot work is said before the cell runs, not after
        settings = trackers.TrackerSettings.parse(tracker) if isinstance(tracker, str) else tracker
        if settings is not None:
            trackers.require(settings.kind)
        limit = default_timeout if timeout is None else timeout
        if limit is not None:
            check_seconds("cell timeout", limit)
        profiled = None if profile is None else ProfileSettings.coerce(profile)
        return cls(
            code=code,
            ranks=chosen,
            world_size=world_size,
            timeout=limit,
            stream=stream,
            on_data=on_data,
            setup=setup,
            tracker=settings,
            params=tuple(params),
            profile=profiled,
            show=shown,
        )

    @property
    def everywhere(self) -> bool:
        """The cell runs on every rank of its world."""
        return len(self.ranks) == self.world_size
