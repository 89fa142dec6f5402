"""DDPCluster: one world of ranks, driven from Python (the magics are a thin layer over it).

A facade over the parts that do the work (see docs/architecture.md):
a provisioner gets the processes (`provisioning`), `forming` turns them into ranks of one
process group, a `relay` carries each cell's messages while a `WorldSupervisor` watches the
ranks, and the cell's `CellOutcome` decides what the caller sees. The world's state lives
in a `WorldLifecycle`; its running parts in one `RunningWorld` (None while stopped).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from ..cell import busy as busy_ranks
from ..cell import debugging, large_output, xray
from ..cell.outcome import CellOutcome, Ending
from ..cell.profiling import ProfiledCell, ProfileSettings
from ..cell.relay import CellRelay, OutputSink
from ..cell.syntax import check_syntax
from ..errors import (
    DDPError,
    DDPUsageError,
    NotRunningError,
    RankError,
    RankFailure,
    StartError,
    WorldBrokenError,
    name_deaths,
    name_ranks,
    one_line,
)
from ..live import feed as live_feed
from ..live import stragglers, trackers
from ..live.profile_view import ProfileReport
from ..platform import devices, limits
from ..rank import calls as rank_calls
from ..wire.results import CellResult, Death, MemoryReading, RankInfo, RankStatus
from . import comeback, config, export, forming, provisioning
from . import sync as file_sync
from .config import WorldConfig
from .controller import QUERY_SECONDS
from .export import CellRecord
from .running import RunningWorld
from .state import WorldLifecycle, WorldState
from .supervision import RELEASE_SECONDS

LEAVE_GROUP_SECONDS = 3.0
PULL_SECONDS = 60.0
# how long a heal waits for ranks it released from a collective to end their cell
BUSY_SETTLE_SECONDS = 5.0


class DDPCluster:
    """A world of DDP ranks.

    >>> with DDPCluster(2) as world:                      # doctest: +SKIP
    ...     world.execute("print(rank, world_size)")
    [rank 0] 0 2
    [rank 1] 1 2

    Describe the world with a `WorldConfig` (`DDPCluster(WorldConfig.build(2, backend="gloo"))`),
    or pass the same options here (`DDPCluster(2, backend="gloo")`, see `WorldConfig.build`).
    Nothing starts until `start()` (or entering the `with` block); the options are checked
    first, so a bad request starts nothing.
    """

    def __init__(
        self,
        config: WorldConfig | int | None = None,
        /,
        *,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        **options: Any,
    ) -> None:
        if isinstance(config, WorldConfig):
            if options:
                raise TypeError("give a WorldConfig or world options, not both")
            self.config = config
        else:
            self.config = WorldConfig.build(config, **options) if config is not None else WorldConfig.build(**options)
        self._stdout = stdout
        self._stderr = stderr
        self._lifecycle = WorldLifecycle()
        self._world: RunningWorld | None = None  # its running parts, while it runs
        self.start_seconds: float | None = None
        self.last_heal_seconds: float | None = None
        self.last_failures: tuple[RankFailure, ...] = ()
        self.last_output: large_output.LargeOutput | None = None  # the last cell's output, every rank's
        # what the ranks logged with ddp_notebook.log / progress, one Feed per cell
        self.recorder = live_feed.Recorder()
        # every cell run in this world, for export_script (%ddp_export): code, ranks, outcome
        self.cell_history: list[CellRecord] = []
        self.restarts = 0  # lost ranks this world went on after, replaced or not (bounded by config.max_restarts)
        self.last_comeback_seconds: float | None = None
        self.last_rollback_seconds: float | None = None
        # what the last cell run with profile= found (%%ddp --profile)
        self.last_profile: ProfileReport | None = None
        # what the ranks' working folders elsewhere hold of the notebook's files (%ddp_sync)
        self._syncer: file_sync.Syncer | None = None
        # the experiment tracker the training cells' metrics also go to (track())
        self.tracking = trackers.Tracking()

    @classmethod
    def attach_to(
        cls,
        url_file: str | None = None,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        n_ranks: int | None = None,
        **options: Any,
    ) -> DDPCluster:
        """A world built from the engines of an ipyparallel cluster started elsewhere.

        Find it by its client connection file (`ipcontroller-client.json`), or by profile and
        cluster id (`ipcluster start --profile P --cluster-id C`). `n_ranks`: wait for that
        many engines (default: the ones registered now). `stop()` lets go of the engines and
        leaves them running: they belong to whoever started them.
        """
        target = config.AttachTarget(url_file=url_file, profile=profile, cluster_id=cluster_id)
        return cls(n_ranks, attach=target, **options)

    # ------------------------------------------------------------------ what it is

    @property
    def state(self) -> WorldState:
        return self._lifecycle.state

    @property
    def running(self) -> bool:
        return self._world is not None

    @property
    def broken(self) -> dict[int, Death]:
        """Ranks whose process died, with how; a world with dead ranks must be restarted."""
        return dict(self._lifecycle.dead)

    @property
    def needs_heal(self) -> bool:
        """A cell broke the process group; the next cell (or `heal()`) sets it up again."""
        return self.state is WorldState.NEEDS_HEALING

    @property
    def provisioner(self) -> provisioning.Provisioner | None:
        """What got this world's processes (None while stopped)."""
        return self._world.provisioner if self._world is not None else None

    @property
    def private_dir(self) -> str | None:
        """The running world's private directory (its key, the ranks' stack dumps; mode 0700)."""
        return self._world.private_dir if self._world is not None else None

    @property
    def setup_cells(self) -> list[str]:
        """The cells that set a rank up (run with setup=True, %%ddp --setup), replayed on a new rank."""
        return self._world.setup_cells if self._world is not None else []

    @property
    def world_size(self) -> int:
        return self._world.layout.world_size if self._world is not None else self.config.n_ranks or 0

    @property
    def backend(self) -> str:
        """nccl or gloo (for ranks started elsewhere: decided once they reported their GPUs)."""
        return self._world.layout.backend if self._world is not None else str(self.config.backend)

    @property
    def attached(self) -> bool:
        return self.config.launch.attach is not None

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        current = self._world.ranks if self._world is not None else {}
        return tuple(current[r] for r in sorted(current))

    @property
    def missing_features(self) -> list[str]:
        """What this kernel's and the ranks' releases lack, one line each (`world.capabilities`)."""
        from . import capabilities

        return capabilities.missing_features(self.ranks)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts the ranks run on, in rank order."""
        return tuple(dict.fromkeys(info.host for info in self.ranks))

    @property
    def metrics(self) -> live_feed.Metrics:
        """Every point the ranks logged (`ddp_notebook.log`) in the latest cell that logged any."""
        return self.recorder.metrics

    @property
    def pids(self) -> list[int]:
        """PIDs of the controller and rank processes of this world (none for an attached world)."""
        return self._world.provisioner.pids if self._world is not None else []

    @property
    def all_pids(self) -> list[int]:
        """`pids` and every process they started (all of it ends with `stop()`)."""
        from ..platform.processes import descendants

        pids = self.pids
        return pids + descendants(pids)

    def __repr__(self) -> str:
        return f"<DDPCluster {self.world_size} ranks, {self.backend}, {self.state}>"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> DDPCluster:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> DDPCluster:
        """Start the controller and the ranks, and join them into one process group."""
        return self._start(clear_namespaces=False)

    def restart(self) -> DDPCluster:
        """Stop this world (whatever state it is in) and start a full one with the same settings.

        The ranks are new processes: their Python state is gone. An attached world cannot
        start processes: its engines' namespaces are cleared instead, and a lost engine must
        be started again where the cluster runs.
        """
        warm = self._world.provisioner.keep_warm() if self._world is not None else None
        self.stop()
        return self._start(clear_namespaces=True, warm=warm)

    def _start(self, clear_namespaces: bool, warm: object = None) -> DDPCluster:
        if self.running:
            raise DDPUsageError("this world is already running; stop() it first")
        began = time.perf_counter()
        deadline = began + self.config.start_timeout
        self._lifecycle.starting()
        private_dir = tempfile.mkdtemp(prefix="ddp-notebook-")
        self.restarts = 0  # new processes: nothing was set up on them yet
        provisioner = provisioning.provisioner_for(self.config, private_dir, warm)
        try:
            client = provisioner.start()
            identities = forming.wait_for_engines(provisioner, deadline)
            if clear_namespaces and provisioner.clears_namespaces_on_restart:
                client.clear(targets=[i.engine_id for i in identities], block=True)
            layout = forming.place(self.config, identities)
            forming.plan_routes(provisioner, layout, deadline)
            ranks = forming.join_process_group(client, self.config, layout, private_dir, deadline)
            self._world = RunningWorld.open(provisioner, layout, ranks, private_dir)
            self._syncer = file_sync.Syncer(os.getcwd())
        except BaseException as failure:
            self._teardown(provisioner, private_dir)
            if isinstance(failure, (DDPError, KeyboardInterrupt)):
                raise
            raise StartError(f"could not start the world: {one_line(failure)}") from failure
        self.start_seconds = time.perf_counter() - began
        self._lifecycle.ready()
        return self

    def stop(self) -> bool:
        """Stop every rank and the controller. Returns False if nothing was running.

        An attached world lets go of its engines and leaves them running.
        """
        world = self._world
        if world is None:
            return False
        self._leave_process_group(world)
        world.supervisor.close()
        self.tracking.close()
        self._teardown(world.provisioner, world.private_dir)
        return True

    def activate(self) -> DDPCluster:
        """Make this world the one `%%ddp` and the other magics drive (as ipyparallel's `view.activate()`).

        Loads the magics into this IPython shell if needed; `%ddp_stop` then stops this world.
        """
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            raise DDPUsageError("activate() hands a world to the %ddp magics: call it in a notebook or IPython")
        shell.extension_manager.load_extension("ddp_notebook")  # harmless when loaded already
        shell.magics_manager.registry["DDPMagics"].adopt(self)
        return self

    def _leave_process_group(self, world: RunningWorld) -> None:
        # destroying the group before the processes go avoids gloo/nccl aborting on exit
        if world.controller.lost(now_please=True) is not None:
            return  # nobody to ask; the processes go anyway
        try:
            skip = set(world.controller.busy(self.ranks)) | set(self.broken)  # dead ranks cannot answer
            idle = [info.engine_id for info in self.ranks if info.rank not in skip]
            if idle:
                world.client[idle].apply_async(rank_calls.shutdown_world).get(timeout=LEAVE_GROUP_SECONDS)
        except Exception:  # noqa: BLE001  (the processes are ended next in any case)
            pass

    def _teardown(self, provisioner: provisioning.Provisioner, private_dir: str) -> None:
        self._world = None
        self._lifecycle.stopped()
        provisioner.stop()
        shutil.rmtree(private_dir, ignore_errors=True)

    # ------------------------------------------------------------------ running cells

    def execute(
        self,
        code: str,
        ranks: Iterable[int] | str | None = None,
        *,
        timeout: float | None = None,
        stream: bool = True,
        on_data: Callable[[int, dict[str, Any]], None] | None = None,
        setup: bool = False,
        tracker: str | trackers.TrackerSettings | None = None,
        params: Sequence[str] = (),
        profile: ProfileSettings | int | bool | None = None,
        show: Iterable[int] | str | None = None,
    ) -> CellResult:
        """Run `code` as a cell on `ranks` (default: all) and wait for it.

        Output streams back while the cell runs, each line tagged `[rank N] ` (written to
        this process's stdout/stderr); with `stream=False` it is collected in the result
        instead. Raises `RankError` if any rank raised (root cause first),
        `CellTimeoutError` past `timeout` seconds and `CellInterruptedError` on Ctrl-C /
        the notebook's stop button; in all three cases the ranks are left usable.
        `RankDiedError` says a rank's process died.

        `on_data(rank, data)` is called in this thread for each batch of plain data a rank
        publishes while the cell runs (metrics and progress, see `ddp_notebook.channel`).
        By default, progress is printed as text and the metrics are kept in `self.metrics`.

        `setup=True` (`%%ddp --setup`): the cell sets a rank up (imports, model, data,
        `ddp_notebook.track(...)`); it is replayed on a rank that replaces a dead one.

        `tracker` (`"mlflow"`, `"tensorboard:runs"`, `"wandb:project"`): this cell's metrics also go
        to that experiment tracker (default: the world's, see `track`); `params` names variables of
        rank 0 logged with them as hyperparameters once the cell ends.

        `profile` (`%%ddp --profile`): torch.profiler on every rank over the cell's optimizer steps,
        a number of steps to record or `ProfileSettings(...)`; the traces go to a folder and
        `self.last_profile` holds what they show (a timeline per rank, the straggler, ...).

        `show` (`%%ddp --show`): the ranks whose stdout is shown while the cell streams, or "all".
        By default every rank's, up to SHOW_ALL_UP_TO (16) ranks; in a larger world rank 0's, with
        every rank's stderr and the same line of several ranks shown once (`[ranks 0-511] ...`).
        Every rank's output is kept either way: `self.output(rank)`.
        """
        outcome = self.run(
            code,
            ranks,
            timeout=timeout,
            stream=stream,
            on_data=on_data,
            setup=setup,
            tracker=tracker,
            params=params,
            profile=profile,
            show=show,
        )
        result = outcome.raise_for_error()
        if stream and outcome.heal_note:
            print(outcome.heal_note.strip(), file=sys.stderr, flush=True)  # said by an error otherwise
        return result

    def run(
        self,
        code: str,
        ranks: Iterable[int] | str | None = None,
        *,
        timeout: float | None = None,
        stream: bool = True,
        on_data: Callable[[int, dict[str, Any]], None] | None = None,
        setup: bool = False,
        tracker: str | trackers.TrackerSettings | None = None,
        params: Sequence[str] = (),
        profile: ProfileSettings | int | bool | None = None,
        show: Iterable[int] | str | None = None,
    ) -> CellOutcome:
        """Like `execute`, but return how the cell ended instead of raising for it."""
        world = self._require_running()
        targets = self._select(ranks)
        routing = large_output.for_world(self.world_size, self._shown(show))
        if setup and len(targets) != self.world_size:
            raise DDPUsageError("a setup cell runs on every rank: leave out --ranks")
        if self.needs_heal:
            self.heal()
        if on_data is None:
            on_data = self.recorder.feed(self._text_view if stream else None, ranks=targets)
        check_syntax(code)
        # a tracker asked for that cannot work is said before the cell runs, not after
        chosen = trackers.TrackerSettings.parse(tracker) if isinstance(tracker, str) else tracker
        if chosen is not None:
            trackers.require(chosen.kind)
        timeout = self.config.cell_timeout if timeout is None else timeout
        if timeout is not None:
            config.check_seconds("cell timeout", timeout)
        began = time.perf_counter()
        went_on = self._go_on_if_lost(world, targets)
        if went_on is not None:
            return went_on
        self._sync_before_cell(world)
        if isinstance(on_data, live_feed.Feed):
            on_data.size_hint = len(targets)  # a large world's feed keeps what its aggregate view draws
            # before the cell is sent: its first points may arrive at once
            run_name = f"{trackers.notebook_name()} cell {len(self.cell_history) + 1}"
            self.tracking.attach(on_data, chosen, run_name, lambda: trackers.world_description(self))
        profiled = None
        if profile is not None:  # off: nothing is sent, nothing runs on the ranks
            self.last_profile = None
            profiled = ProfiledCell.start(profile, {r: world.client[world.ranks[r].engine_id] for r in targets})
        relay = CellRelay(world.client, targets)
        result = CellResult(ranks=targets)
        view = world.view(tuple(world.engines(targets)))
        if len(targets) != self.world_size:
            # queued ahead of the cell on the same ranks, so no round trip is waited for
            view.apply_async(rank_calls.skip_cell_snapshot)
        relay.attach(view.execute(code, silent=False, block=False))
        # the live view shows the ranks' memory and collective X-ray too; a caller's own on_data
        # gets rank data only
        feed = on_data if isinstance(on_data, live_feed.Feed) else None
        sink = OutputSink(
            self._stdout,
            self._stderr,
            None if stream else result,
            on_data,
            feed.memory if feed is not None else None,
            feed.collectives if feed is not None else None,
            routing,
        )
        self.last_output = routing
        ending = relay.wait(sink, timeout, world.supervisor)
        result.elapsed = time.perf_counter() - began
        result.values.update(relay.values())
        if profiled is not None:
            self.last_profile = profiled.finish((*relay.dead, *relay.unfinished()))
        failures = tuple(relay.failures())
        if failures:
            self.last_failures = failures  # for debug(): the cell to look into
        heal_note = came_back = busy_doing = ""
        unfinished = relay.unfinished()
        if unfinished and ending is not Ending.TIMEOUT:  # a timeout's report says where each rank is
            busy_doing = busy_ranks.describe(unfinished, world.supervisor.collectives(unfinished))
        if relay.dead:
            came_back, heal_note = self._replace_dead(world, dict(relay.dead), relay.unfinished())
        elif relay.released or relay.group_broken():
            self._lifecycle.group_broke()
            heal_note = self._heal_after_cell(relay.unfinished())
            if not failures and ending is Ending.DONE:  # nothing failed: the cell ended the group itself
                heal_note = f"\nthe cell ended the process group (torch.distributed.destroy_process_group()){heal_note}"
        outcome = CellOutcome(
            result=result,
            ending=ending,
            failures=failures,
            dead=dict(relay.dead),
            unfinished=relay.unfinished(),
            timeout=timeout,
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
        self._record_cell(code, targets, outcome.ok)
        if feed is not None and feed.tracker_run is not None:
            self._log_params(world, feed, tuple(params) or self.tracking.param_names)
        if setup and outcome.ok:
            self.setup_cells.append(code)
        if outcome.ok and len(targets) == self.world_size and relay.snapshot_owed():
            self._snapshot_everywhere(world)
        return outcome

    def track(
        self, tracker: str | trackers.TrackerSettings | None, *, ranks: str = "0", params: Sequence[str] = ()
    ) -> None:
        """Send the metrics of every training cell from now on to an experiment tracker: `"tensorboard"`
        (event files under ./runs, or `"tensorboard:DIR"`), `"mlflow"` (a SQLite store ./mlflow.db, or
        `"mlflow:URI"`) or `"wandb"` (offline, or `"wandb:PROJECT"`); None stops. `ranks`: "0" (rank
        0's metrics under their names) or "all" (every rank's, as NAME/rankN); `params`: names of
        rank 0's variables logged as hyperparameters after each training cell. `%ddp_start --tracker`."""
        settings = trackers.TrackerSettings.parse(tracker, ranks) if isinstance(tracker, str) else tracker
        self.tracking.configure(settings, params)

    def _log_params(self, world: RunningWorld, feed: live_feed.Feed, names: Sequence[str]) -> None:
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
        note = self.tracking.after_cell(feed, found, missing)
        if note:
            (self._stderr or sys.stderr).write(f"ddp_notebook: {note}\n")

    def _sync_before_cell(self, world: RunningWorld) -> None:
        """Ranks working in a sync folder (the notebook's folder does not exist on their host) get
        the notebook's changed modules before the cell, so that they run, and reload, the code on disk."""
        here = socket.gethostname()
        if self._syncer is None or all(info.host == here for info in world.ranks.values()):
            return  # local ranks work in the notebook's folder
        try:
            report = self._syncer.before_cell(world.client, world.engines())
        except DDPUsageError as refusal:
            report, note = None, str(refusal)
        except Exception as failure:  # noqa: BLE001  (the cell still runs; the ranks keep what they had)
            report, note = None, f"the notebook's files could not be synced before the cell: {one_line(failure)}"
        else:
            note = str(report) if report is not None and report.sent else ""
        if note:
            (self._stderr or sys.stderr).write(f"ddp_notebook: {note}\n")

    def autoreload(self, enabled: bool = True) -> None:
        """Before each cell, every rank reloads the user modules whose file changed (on by default,
        new ranks included); `autoreload(False)` stops it. `%ddp_autoreload on|off`."""
        world = self._require_running()
        self.config = world.provisioner.config = dataclasses.replace(self.config, autoreload=bool(enabled))
        world.client[world.engines()].apply_async(rank_calls.set_autoreload, bool(enabled)).get(timeout=QUERY_SECONDS)

    def sync(self, paths: Iterable[str] | str | None = None, *, max_mb: float | None = None) -> file_sync.SyncReport:
        """Send files under the notebook's folder (default: its Python modules and packages) to the
        ranks' working folders that do not hold the same bytes (other hosts without them), over the
        world's own channel; refused past `max_mb` (default file_sync.DEFAULT_LIMIT_MB). `%ddp_sync`."""
        world = self._require_running()
        syncer = self._syncer or file_sync.Syncer(os.getcwd())
        self._syncer = syncer
        if max_mb is not None:
            if not max_mb > 0:
                raise DDPUsageError(f"--max-mb must be a positive number of MB, got {max_mb:g}")
            syncer.limit_mb = float(max_mb)
        if paths is None:
            files = file_sync.default_files(syncer.folder)
        else:
            files = file_sync.chosen_files([paths] if isinstance(paths, str) else list(paths), syncer.folder)
        if not files:
            raise DDPUsageError(f"nothing to sync: no Python module or package in {syncer.folder}; name the files")
        return syncer.sync(world.client, world.engines(), files)

    def _lost_before_sending(self, world: RunningWorld, targets: tuple[int, ...]) -> dict[int, Death]:
        """Ranks of `targets` whose engine the controller no longer knows, with how they ended."""
        registered = set(world.client.ids)
        gone = tuple(rank for rank in targets if world.ranks[rank].engine_id not in registered)
        if not gone:
            return {}
        found = world.supervisor.find_dead(gone)
        return {rank: found.get(rank) or Death("lost", "was lost (the controller dropped it)") for rank in gone}

    def _go_on_if_lost(self, world: RunningWorld, targets: tuple[int, ...], doing: str = "") -> CellOutcome | None:
        """Before anything is sent to `targets` (a cell, a push, a pull): a rank the controller
        dropped since the last cell (a process stopped past the heartbeat while the world was idle,
        a host gone) is named, and the world goes on after it as after a loss in a cell, instead of
        ipyparallel's KeyError for its engine. Returns how that ended (None: every rank is there);
        `doing` (push, pull) is what to do again, nothing having been sent."""
        lost = self._lost_before_sending(world, targets)
        if not lost:
            return None
        came_back, why_not = self._replace_dead(world, lost, ())
        if came_back and doing:
            came_back += f"; nothing was sent: {doing} again"
        return CellOutcome(CellResult(ranks=targets), dead=lost, came_back=came_back, heal_note=why_not)

    def _snapshot_everywhere(self, world: RunningWorld) -> None:
        """The end-of-cell snapshot of a world that tracks a sharded model: it gathers the model's
        state, so every rank takes it at once, and only after a cell that succeeded on every rank
        (a rank's own post_run_cell hook cannot know that the others got there)."""
        try:
            world.client[world.engines()].apply_async(rank_calls.take_snapshot, "the end of a cell").get(
                timeout=self.config.timeout
            )
        except Exception as failure:  # noqa: BLE001  (the cell succeeded; the world keeps its last snapshot)
            self._lifecycle.group_broke()  # a rank stopped in the gather: the next cell heals the group
            (self._stderr or sys.stderr).write(f"ddp_notebook: the end-of-cell snapshot failed: {one_line(failure)}\n")

    def _replace_dead(
        self, world: RunningWorld, dead: dict[int, Death], unfinished: tuple[int, ...]
    ) -> tuple[str, str]:
        """Go on after a loss, as `config.on_loss` says: new processes for the lost ranks, or the
        survivors on their own (`comeback`), every rank at the last snapshot; past
        `config.max_restarts`, with `on_loss='stop'`, or where that fails, the world is broken.

        Returns (what the comeback did, why there was none)."""
        policy = self._loss_policy(world)
        if policy == "stop":
            self._lifecycle.ranks_died(dead)
            return "", "this world stops at a loss (on_loss='stop')"
        left = self.config.max_restarts - self.restarts
        if left < len(dead):
            self._lifecycle.ranks_died(dead)
            most = self.config.max_restarts
            return "", f"this world went on after {self.restarts} lost rank(s) already (max_restarts={most})"
        if policy == "replace" and not world.provisioner.starts_ranks:
            self._lifecycle.ranks_died(dead)
            launcher = self.config.launch.launcher
            return "", f"a world started with --launcher {launcher} cannot start ranks (--on-loss shrink goes on)"
        self.restarts += len(dead)
        running = tuple(rank for rank in unfinished if rank not in dead)
        if running:
            world.supervisor.interrupt(running)  # survivors still in the cell: the comeback waits for them
        size = self.world_size
        try:
            if policy == "replace":
                done = comeback.bring_back(world, self.config, dead)
            else:
                done = comeback.shrink(world, self.config, dead)
        except Exception as failure:  # noqa: BLE001  (any failure leaves the world broken, as a death did)
            self._lifecycle.ranks_died(dead)
            doing = "bringing it back" if policy == "replace" else "going on without it"
            return "", f"{doing} failed: {one_line(failure)}"
        world.regrouped(done.ranks)
        self.last_comeback_seconds = done.seconds
        ranks = name_ranks(dead)
        if policy == "shrink":
            # the config keeps the size asked for: restart() starts the full world again
            now = len(done.ranks)
            where = (
                f"every rank is at the snapshot taken at {done.resumed_from}; run the cell again to continue"
                if done.resumed_from
                else "nothing is tracked (ddp_notebook.track): the survivors keep what they had"
            )
            return (
                f"The world went on without {ranks} in {done.seconds:.1f} s: {now} rank(s) now (was {size}), "
                f"renumbered 0-{now - 1}, the process group formed again, variables kept: {where}",
                "",
            )
        where = (
            f"every rank is back at the snapshot taken at {done.resumed_from}; run the cell again to continue"
            if done.resumed_from
            else "nothing is tracked (ddp_notebook.track): the new rank has what the setup cells made"
        )
        return (
            f"{ranks[0].upper()}{ranks[1:]} came back in {done.seconds:.1f} s (a new process, "
            f"{len(world.setup_cells)} setup cell(s) "
            f"replayed, the process group formed again; other variables kept on the surviving ranks): {where}",
            "",
        )

    def _loss_policy(self, world: RunningWorld) -> str:
        """replace, shrink or stop: `on_loss`, with auto resolved for this world's provisioner."""
        if self.config.on_loss != "auto":
            return self.config.on_loss
        # ranks elsewhere go on with the survivors unless asked to wait for new processes there
        return "replace" if world.provisioner.starts_ranks_here else "shrink"

    # ------------------------------------------------------------------ export (cell history)

    def _record_cell(self, code: str, ranks: tuple[int, ...], ok: bool) -> None:
        number = len(self.cell_history) + 1
        self.cell_history.append(CellRecord(number, code, tuple(ranks), ok, self.world_size))

    def export_script(
        self, path: str | os.PathLike[str], cells: Iterable[int] | None = None, *, overwrite: bool = False
    ) -> str:
        """Write the cells run so far (default: every one that succeeded; or the numbers in
        `cells`) as one script for torchrun at `path`; returns its absolute path. `%ddp_export`."""
        return export.export_script(self.cell_history, path, cells, backend=self.backend, overwrite=overwrite)

    def _heal_after_cell(self, busy: tuple[int, ...]) -> str:
        if busy:  # what they do is said with the error (CellOutcome.busy_doing)
            return (
                f"\nthe next cell sets the process group up again once {name_ranks(busy)} end ({busy_ranks.WHAT_TO_DO})"
            )
        seconds = self.heal()
        return (
            f"\nthe process group was set up again in {seconds:.1f} s (variables kept; "
            "models from prepare_model were moved onto the new group)"
        )

    def heal(self) -> float:
        """Set the process group up again on every rank, keeping the ranks' Python state.

        Every rank leaves the old group; rank 0 opens a fresh rendezvous port; all join a new
        default group; models wrapped by `prepare_model` are moved onto it. Returns seconds.
        """
        world = self._require_running()
        began = time.perf_counter()
        busy = world.controller.busy(self.ranks)
        if busy:
            # a rank still waiting in a collective of the broken group (its peers left it): release
            # it through the X-ray too, and give it a moment to end its cell
            world.supervisor.release_blocked(tuple(busy))
            settle_by = time.monotonic() + BUSY_SETTLE_SECONDS
            while busy and time.monotonic() < settle_by:
                time.sleep(0.1)
                busy = world.controller.busy([info for info in self.ranks if info.rank in busy])
        if busy:
            raise DDPUsageError(busy_ranks.refusal(busy, world.supervisor.collectives(tuple(busy))))
        try:
            world.client[world.engines()].apply_async(rank_calls.release_group).get(timeout=RELEASE_SECONDS)
            deadline = time.perf_counter() + self.config.start_timeout
            ranks = forming.join_process_group(world.client, self.config, world.layout, world.private_dir, deadline)
            world.regrouped(ranks)
        except DDPError:
            raise  # the group stays broken: the next cell tries again
        except Exception as failure:  # noqa: BLE001  (any remote failure leaves the group broken)
            raise DDPError(f"could not set the process group up again: {one_line(failure)}; %ddp_restart") from None
        self._lifecycle.healed()
        self.last_heal_seconds = time.perf_counter() - began
        return self.last_heal_seconds

    def resize(self, n_ranks: int) -> float:
        """Grow or shrink the running world to `n_ranks` ranks (`%ddp_resize N`); returns seconds.

        The ranks that stay keep all their variables; new ranks get the setup cells
        (`setup=True`) replayed and the tracked state (`ddp_notebook.track`) from rank 0; ranks
        past `n_ranks` end. Models from `prepare_model` move to the new group, and loaders from
        `prepare_loader` deal the rest of the epoch's global order over the new ranks.
        """
        world = self._require_running()
        config.check_rank_count(n_ranks)
        if n_ranks == self.world_size:
            return 0.0
        if n_ranks > self.world_size:
            if not world.provisioner.starts_ranks:
                what = (
                    "an attached world"
                    if self.attached
                    else f"a world started with --launcher {self.config.launch.launcher}"
                )
                raise DDPUsageError(
                    f"{what} cannot add ranks; it can shrink (%ddp_resize N with N < {self.world_size})"
                )
            # GPU ranks started here: the new processes see the world's GPUs and free ones of this
            # machine (one line, the world untouched, when there are too few)
            world.provisioner.prepare_gpus(n_ranks, [p.gpu for p in world.layout.placements if p.gpu is not None])
        self._ready_for_regroup(world)
        try:
            done = comeback.resize(world, self.config, n_ranks)
        except DDPError as failure:
            raise DDPError(f"could not resize the world to {n_ranks} ranks: {failure}; %ddp_restart") from None
        except Exception as failure:  # noqa: BLE001  (any remote failure ends the resize)
            raise DDPError(
                f"could not resize the world to {n_ranks} ranks: {one_line(failure)}; %ddp_restart"
            ) from None
        world.regrouped(done.ranks)
        # a restart starts this size again, on the GPUs the ranks use now
        gpus = self.config.gpus
        if gpus:
            used = {p.gpu for p in world.layout.placements}
            gpus = tuple(gpu for gpu in world.provisioner.world_gpus if gpu in used)
        self.config = world.provisioner.config = dataclasses.replace(self.config, n_ranks=n_ranks, gpus=gpus)
        return done.seconds

    def _ready_for_regroup(self, world: RunningWorld) -> None:
        """Before every rank is moved at once (a resize, a rollback): the group whole, no rank busy."""
        if self.needs_heal:
            self.heal()
        busy = world.controller.busy(self.ranks)
        if busy:
            raise DDPUsageError(busy_ranks.refusal(busy, world.supervisor.collectives(tuple(busy))))

    def rollback(self) -> str | None:
        """Bring every rank back to the newest snapshot of the tracked state all of them hold
        (`%ddp_rollback`): after a training cell that failed or was interrupted, the ranks may
        have stopped at different steps. Returns where that snapshot was taken (None: nothing is
        tracked). Other variables stay as they are; the next training cell goes on from there.
        """
        world = self._require_running()
        healed = self.needs_heal
        self._ready_for_regroup(world)
        if not healed:
            # a cell cut short can leave a collective half-done on the group (DDP's backward queues
            # its all-reduces on gloo's threads): a fresh group, so the rollback's own collectives meet
            self.heal()
        try:
            done = comeback.rollback(world, self.config)
        except DDPError as failure:
            raise DDPError(f"could not roll back: {failure}") from None
        except Exception as failure:  # noqa: BLE001  (any remote failure ends the rollback)
            raise DDPError(f"could not roll back: {one_line(failure)}") from None
        self.last_rollback_seconds = done.seconds
        return done.resumed_from

    def where_stuck(self, ranks: Iterable[int] | str | None = None) -> str:
        """One line per rank saying where its main thread is (works while it is blocked)."""
        return self._require_running().supervisor.where_stuck(self._select(ranks))

    def collectives(self, ranks: Iterable[int] | str | None = None) -> dict[int, xray.RankCollectives]:
        """Collective X-ray of the ranks, on every host: the last collectives each one ran and the one it
        waits in (op, sequence number, shapes, cell line, seconds waited); answered while they are blocked."""
        return self._require_running(allow_broken=True).supervisor.collectives(self._select(ranks), full=True)

    def output(self, rank: int) -> str:
        """Everything `rank` printed in the last cell, shown or not (stderr lines marked `! `): the
        last 1 MiB of it, or of a world's 64 MiB its share. `%ddp_output RANK`."""
        (rank,) = self._select([rank])
        if self.last_output is None:
            raise DDPUsageError("no cell has run yet: %ddp_output shows a rank's output of the last one")
        return self.last_output.output(rank)

    def debug(self, rank: int | None = None) -> None:
        """pdb, in the notebook, on `rank`'s last failed cell (default: the root cause of the last
        RankError); each line is asked with input(). `%ddp_debug`."""
        world = self._require_running()
        if rank is None:
            if not self.last_failures:
                raise DDPUsageError("no cell has failed on a rank yet: %ddp_debug looks into the last one that did")
            rank = RankError(list(self.last_failures)).root_cause.rank
        (rank,) = self._select([rank])
        reach = world.supervisor.reach()
        assert reach is not None
        engine = world.client[world.ranks[rank].engine_id]
        debugging.post_mortem(engine, reach, rank)

    def straggler(self) -> stragglers.Straggler | None:
        """The rank clearly slower than its peers over their recent steps of models from prepare_model
        (`.rank`, `.phase`: data, compute or optimizer; `.describe()`), or None."""
        times = {rank: r.steps for rank, r in self.collectives().items() if r.steps is not None}
        return stragglers.find_straggler(times)

    def interrupt(self, ranks: Iterable[int] | str | None = None) -> None:
        """Send KeyboardInterrupt (SIGINT) to `ranks` (default: all). `%ddp_interrupt`."""
        self._require_running(allow_broken=True).supervisor.interrupt(self._select(ranks))

    def busy_ranks(self, ranks: Iterable[int] | str | None = None) -> tuple[int, ...]:
        """Those of `ranks` (default: all) still running a cell or a request of the world."""
        world = self._require_running(allow_broken=True)
        chosen = set(self._select(ranks))
        return tuple(sorted(world.controller.busy([info for info in self.ranks if info.rank in chosen])))

    def _text_view(self) -> live_feed.View:
        from ..live.widgets import TextView

        return TextView(self._stdout)

    # ------------------------------------------------------------------ data in and out

    def push(self, namespace: Mapping[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        """Copy `namespace`'s values into the user namespace of `ranks` (default: all)."""
        world = self._require_running()
        targets = self._select(ranks)
        for name, value in namespace.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise DDPUsageError(f"cannot push {name!r}: names must be valid Python identifiers")
            try:
                pickle.dumps(value)
            except Exception as failure:  # noqa: BLE001
                raise DDPUsageError(
                    f"cannot push '{name}': {type(value).__name__} cannot be pickled ({one_line(failure)}); "
                    "send what it is built from and build it on the ranks instead"
                ) from None
        if (went_on := self._go_on_if_lost(world, targets, "push")) is not None:
            went_on.raise_for_error()
        world.client[world.engines(targets)].push(dict(namespace), block=True)

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> dict[int, Any]:
        """`name`'s value on each of `ranks` (default: all), as {rank: value}."""
        world = self._require_running()
        targets = self._select(ranks)
        if (went_on := self._go_on_if_lost(world, targets, "pull")) is not None:
            went_on.raise_for_error()
        pending = {
            rank: world.client[world.ranks[rank].engine_id].apply_async(rank_calls.pull_names, [name])
            for rank in targets
        }
        values: dict[int, Any] = {}
        missing: list[int] = []
        for rank, result in pending.items():
            try:
                reply = result.get(timeout=PULL_SECONDS)
            except Exception as failure:  # noqa: BLE001
                raise DDPError(f"could not pull '{name}' from rank {rank}: {one_line(failure)}") from None
            if reply["missing"]:
                missing.append(rank)
            else:
                values[rank] = reply["found"][name]
        if missing:
            raise DDPUsageError(f"'{name}' is not defined on {name_ranks(missing)}")
        return values

    # ------------------------------------------------------------------ status

    def memory(self) -> MemoryReading | None:
        """The memory of the ranks on this host against the limit they share (their cgroup's, or
        the machine's): `reading.fraction`, `reading.rank_bytes`; None where no rank runs here."""
        return self._require_running(allow_broken=True).supervisor.memory.read(list(self.ranks))

    def status(self) -> list[RankStatus]:
        """State (idle/busy/gone), host, pid, device, memory (against its limit) of every rank."""
        world = self._require_running(allow_broken=True)
        try:
            queues = world.controller.settled_queue_status()
        except TimeoutError:
            raise DDPError(
                f"the controller did not answer within {QUERY_SECONDS:g} s: is its host reachable? %ddp_restart"
            ) from None
        gpu_memory = devices.gpu_memory_by_pid() if any(info.gpu for info in self.ranks) else {}
        # a rank's GPU is a CUDA_VISIBLE_DEVICES entry: an index (nvidia-smi's order) or a UUID
        gpu_totals = {key: g.memory_total_mb for g in limits.gpus() for key in (g.index, g.uuid)} if gpu_memory else {}
        reading = self.memory()
        limit_mb = reading.limit / 2**20 if reading is not None else None
        here = socket.gethostname()
        rows = []
        for info in self.ranks:
            entry = queues.get(info.engine_id)
            if entry is None or info.rank in self.broken:
                state = "gone"
            else:
                state = "busy" if entry.get("queue", 0) > 0 else "idle"
            rows.append(
                RankStatus(
                    rank=info.rank,
                    state=state,
                    host=info.host,
                    pid=info.pid,
                    device=info.device,
                    memory_mb=devices.resident_memory_mb(info.pid) if info.host == here else None,
                    gpu_memory_mb=gpu_memory.get(info.pid),
                    memory_limit_mb=limit_mb if info.host == here else None,
                    gpu_memory_total_mb=gpu_totals.get(info.gpu or "") if info.host == here else None,
                )
            )
        return rows

    # ------------------------------------------------------------------ helpers

    def _require_running(self, allow_broken: bool = False) -> RunningWorld:
        if self._world is None:
            raise NotRunningError("no DDP world is running: start one first (%ddp_start N, or DDPCluster(N).start())")
        if self.broken and not allow_broken:
            raise WorldBrokenError(
                f"the world is broken ({name_deaths(self.broken)}): "
                "%ddp_restart (or restart()) starts a full world again"
            )
        return self._world

    def _shown(self, show: Iterable[int] | str | None) -> tuple[int, ...] | None:
        return None if show is None else self._select(show)

    def _select(self, ranks: Iterable[int] | str | None) -> tuple[int, ...]:
        size = self.world_size
        if ranks is None:
            return tuple(range(size))
        if isinstance(ranks, str):
            return config.parse_ranks(ranks, size)
        chosen = tuple(sorted(set(ranks)))
        outside = [r for r in chosen if not (isinstance(r, int) and 0 <= r < size)]
        if outside:
            exist = "do not exist" if len(outside) > 1 else "does not exist"
            raise DDPUsageError(f"{name_ranks(outside)} {exist}: this world has ranks 0-{size - 1}")
        if not chosen:
            raise DDPUsageError("no ranks selected")
        return chosen
