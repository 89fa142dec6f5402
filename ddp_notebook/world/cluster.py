"""DDPCluster: one world of ranks, driven from Python (the magics are a thin layer over it).

A facade over the parts that do the work (see docs/architecture.md):
a provisioner gets the processes (`provisioning`), `forming` turns them into ranks of one
process group, a `CellRequest` is a cell checked once, `cell_run` runs it (a `relay` carries its
messages while a `WorldSupervisor` watches the ranks, its `CellOutcome` decides what the caller
sees, `comeback.recover` goes on after a loss), `regroup` heals, resizes and rolls back,
`transfer` pushes, pulls and syncs, `status` reads the ranks, `following` shows a cell an earlier
kernel left running. The world's state: a `WorldLifecycle`; its running parts: a `RunningWorld`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from ..cell import debugging, large_output, xray
from ..cell.outcome import CellOutcome
from ..errors import (
    DDPUsageError,
    NotRunningError,
    RankError,
    RankFailure,
    StartError,
    WorldBrokenError,
    failing_as,
    name_deaths,
)
from ..live import feed as live_feed
from ..live import stragglers, trackers
from ..live.profile_view import ProfileReport
from ..rank import calls as rank_calls
from ..wire.results import CellResult, Death, MemoryReading, RankInfo, RankStatus
from . import cell_run, config, earlier_cell, export, following, forming, ownership, provisioning, regroup, transfer
from . import sync as file_sync
from .cell_request import CellRequest
from .config import WorldConfig
from .controller import QUERY_SECONDS
from .export import CellRecord
from .resume import Resumed, resume_from
from .running import RunningWorld
from .state import WorldLifecycle, WorldState
from .status import rank_status


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
        self.recorder = live_feed.Recorder()  # what the ranks logged (log / progress), one Feed per cell
        self.cell_history: list[CellRecord] = []  # every cell run here, for export_script (%ddp_export)
        self.restarts = 0  # lost ranks this world went on after, replaced or not (bounded by config.max_restarts)
        self.last_comeback_seconds: float | None = None
        self.last_rollback_seconds: float | None = None
        self.last_profile: ProfileReport | None = None  # what the last cell run with profile= found
        self._syncer: file_sync.Syncer | None = None  # what the ranks' folders elsewhere hold of the notebook's
        # the experiment tracker the training cells' metrics also go to (track())
        self.tracking = trackers.Tracking()

    @classmethod
    def attach_to(
        cls,
        url_file: str | None = None,
        *,
        ipp_profile: str | None = None,
        cluster_id: str | None = None,
        n_ranks: int | None = None,
        profile: str | None = None,
        **options: Any,
    ) -> DDPCluster:
        """A world of the engines of an ipyparallel cluster started elsewhere, found by its client
        connection file or by its ipyparallel profile and cluster id (`ipcluster start --profile P
        --cluster-id C`; `profile=`, the old name of `ipp_profile=`, warns); `n_ranks`: wait for that
        many (default: those registered now). `stop()` leaves them running."""
        ipp_profile = config.renamed_keyword("profile", profile, "ipp_profile", ipp_profile)
        target = config.AttachTarget(url_file=url_file, profile=ipp_profile, cluster_id=cluster_id)
        return cls(n_ranks, attach=target, **options)

    @classmethod
    def attach_detached(cls, world: str | None = None, *, take_over: bool = False, **options: Any) -> DDPCluster:
        """A world of the detached world `world` (an id `%ddp_worlds` lists; default: this notebook's
        newest, else the user's only one), every rank's variables kept; `stop()` ends it. `%ddp_attach`.
        Refused while another live kernel is attached to it, unless `take_over` (that kernel's next
        call then lets go of it: `%ddp_attach --take-over`)."""
        from . import detached

        return cls(detached.attach_config(detached.choose(world), take_over=take_over, **options))

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
        self.restarts = 0  # new processes: nothing was set up on them yet
        provisioner = provisioning.provisioner_for(self.config, tempfile.mkdtemp(prefix="ddp-notebook-"), warm)
        private_dir = provisioner.private_dir  # (a detached world attached again has its own)
        try:
            with failing_as("start the world", error=StartError, keep_ddp_errors=True, chained=True):
                provisioner.start()
                layout, ranks = forming.form(provisioner, private_dir, deadline, clear_namespaces)
                self._world = RunningWorld.open(provisioner, layout, ranks, private_dir)
                self._syncer = file_sync.Syncer(os.getcwd())
        except BaseException:  # KeyboardInterrupt too: nothing of the world is left running
            self._teardown(provisioner)
            raise
        self.start_seconds = time.perf_counter() - began
        self._lifecycle.ready()
        return self

    def stop(self) -> bool:
        """Stop every rank and the controller. Returns False if nothing was running.

        An attached world lets go of its engines and leaves them running. A detached world another
        kernel took since is let go of, not ended, and `DDPUsageError` says who took it.
        """
        world = self._world
        if world is None:
            return False
        if self.config.detach:
            ownership.refuse_if_taken(world, self._let_go)
        regroup.leave_process_group(world, self.broken)  # before the processes go: gloo/nccl abort otherwise
        world.supervisor.close()
        self.tracking.close()
        self._teardown(world.provisioner)
        return True

    def activate(self) -> DDPCluster:
        """Make this world the one `%%ddp` and the other magics drive (as ipyparallel's `view.activate()`);
        loads the magics into this IPython shell if needed. `%ddp_stop` then stops this world."""
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            raise DDPUsageError("activate() hands a world to the %ddp magics: call it in a notebook or IPython")
        shell.extension_manager.load_extension("ddp_notebook")  # harmless when loaded already
        shell.magics_manager.registry["DDPMagics"].adopt(self)
        return self

    def let_go_if_taken(self) -> str | None:
        """A detached world another kernel took since this one attached: let go of it (it runs on,
        there) and say who took it; None while it is this kernel's (or not detached)."""
        world = self._world
        if world is None or not self.config.detach:
            return None
        try:
            ownership.refuse_if_taken(world, self._let_go)
        except DDPUsageError as taken:
            return str(taken)
        return None

    def _let_go(self) -> None:
        """Another kernel took this detached world: this one lets go of it, ending nothing."""
        world, self._world = self._world, None
        if world is None:
            return
        world.supervisor.close()
        self.tracking.close()
        self._lifecycle.stopped()
        world.provisioner.let_go()

    def _teardown(self, provisioner: provisioning.Provisioner) -> None:
        self._world = None
        self._lifecycle.stopped()
        provisioner.stop()
        provisioner.remove_private_dir()

    # ------------------------------------------------------------------ running cells

    def execute(
        self, code_or_request: str | CellRequest, ranks: Iterable[int] | str | None = None, **options: Any
    ) -> CellResult:
        """Run a cell's code on `ranks` (default: all) and wait for it; the options (`timeout`,
        `stream`, `on_data`, `setup`, `tracker`, `params`, `profile`, `show`) are
        `CellRequest.build`'s, or give a ready `CellRequest` (`cell_request`) alone.

        Output streams back while the cell runs, each line tagged `[rank N] ` (written to
        this process's stdout/stderr); with `stream=False` it is collected in the result
        instead. Raises `RankError` if any rank raised (root cause first),
        `CellTimeoutError` past `timeout` seconds and `CellInterruptedError` on Ctrl-C /
        the notebook's stop button; in all three cases the ranks are left usable.
        `RankDiedError` says a rank's process died.
        """
        self._require_running()
        request = self._request(code_or_request, ranks, options)
        outcome = self.run(request)
        result = outcome.raise_for_error()
        if request.stream and outcome.heal_note:
            print(outcome.heal_note.strip(), file=sys.stderr, flush=True)  # said by an error otherwise
        return result

    def run(
        self, code_or_request: str | CellRequest, ranks: Iterable[int] | str | None = None, **options: Any
    ) -> CellOutcome:
        """Like `execute`, but return how the cell ended instead of raising for it."""
        world = self._require_running()
        request = self._request(code_or_request, ranks, options)
        earlier_cell.refuse_while_running(world)  # behind a cell an earlier kernel left running
        if self.needs_heal:
            self.heal()
        return cell_run.run(self, world, request, self._run_context())

    def wait(self, timeout: float | None = None, *, on_data: Any = None) -> CellResult:
        """Show the cell an earlier kernel left running on this detached world from its start, as its ranks kept
        it, and follow it to its end (`%ddp_wait`); raises as `execute` does, `CellStillRunning` past `timeout`."""
        return following.follow(self, self._require_running(), self._run_context(), on_data, timeout).raise_for_error()

    def cell_request(self, code: str, ranks: Iterable[int] | str | None = None, **options: Any) -> CellRequest:
        """`code` with `execute`'s options, checked against this world (`CellRequest.build`)."""
        return CellRequest.build(
            code, ranks, world_size=self.world_size, default_timeout=self.config.cell_timeout, **options
        )

    def _request(
        self, code_or_request: str | CellRequest, ranks: Iterable[int] | str | None, options: dict[str, Any]
    ) -> CellRequest:
        if isinstance(code_or_request, str):
            return self.cell_request(code_or_request, ranks, **options)
        if ranks is not None or options:
            raise TypeError("give a CellRequest or a cell's code with options, not both")
        if code_or_request.world_size != self.world_size:
            raise DDPUsageError(
                f"this cell request was checked against a world of {code_or_request.world_size} ranks; "
                f"this world has {self.world_size}: build it again (cell_request)"
            )
        return code_or_request

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
        self._syncer = self._syncer or file_sync.Syncer(os.getcwd())
        return transfer.sync(world, self._syncer, paths, max_mb)

    # ------------------------------------------------------------------ export (cell history)

    def export_script(
        self, path: str | os.PathLike[str], cells: Iterable[int] | None = None, *, overwrite: bool = False
    ) -> str:
        """Write the cells run so far (default: every one that succeeded; or the numbers in
        `cells`) as one script for torchrun at `path`; returns its absolute path. `%ddp_export`."""
        return export.export_script(self.cell_history, path, cells, backend=self.backend, overwrite=overwrite)

    # ------------------------------------------------------------------ every rank at once, and the ranks' state

    def heal(self) -> float:
        """Set the process group up again on every rank, keeping the ranks' Python state.

        Every rank leaves the old group; rank 0 opens a fresh rendezvous port; all join a new
        default group; models wrapped by `prepare_model` are moved onto it. Returns seconds.
        """
        seconds = regroup.heal(self._require_running(), self.config)
        self._lifecycle.healed()
        self.last_heal_seconds = seconds
        return seconds

    def resize(self, n_ranks: int) -> float:
        """Grow or shrink the running world to `n_ranks` ranks (`%ddp_resize N`); returns seconds.

        The ranks that stay keep all their variables; new ranks get the setup cells
        (`setup=True`) replayed and the tracked state (`ddp_notebook.track`) from rank 0; ranks
        past `n_ranks` end. Models from `prepare_model` move to the new group, and loaders from
        `prepare_loader` deal the rest of the epoch's global order over the new ranks.
        """
        return regroup.resize(self, self._require_running(), n_ranks)

    def rollback(self) -> str | None:
        """Bring every rank back to the newest snapshot of the tracked state all of them hold
        (`%ddp_rollback`): after a training cell that failed or was interrupted, the ranks may
        have stopped at different steps. Returns where that snapshot was taken (None: nothing is
        tracked). Other variables stay as they are; the next training cell goes on from there.
        """
        return regroup.rollback(self, self._require_running())

    def resume(self, folder: str) -> Resumed:
        """Every rank goes on from the newest whole snapshot `track(persist=folder)` wrote (`%ddp_resume`),
        once the setup cells ran: after every rank of the world that wrote it was lost. Says which."""
        return resume_from(self._require_running(), folder, self.config.start_timeout)

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
        debugging.post_mortem(world.client[world.ranks[rank].engine_id], world.supervisor.reach(), rank)

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

    # ------------------------------------------------------------------ data in and out

    def push(self, namespace: Mapping[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        """Copy `namespace`'s values into the user namespace of `ranks` (default: all)."""
        transfer.push(self, self._require_running(), self._lifecycle, namespace, ranks)

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> dict[int, Any]:
        """`name`'s value on each of `ranks` (default: all), as {rank: value}."""
        return transfer.pull(self, self._require_running(), self._lifecycle, name, ranks)

    # ------------------------------------------------------------------ status

    def memory(self) -> MemoryReading | None:
        """The memory of the ranks on this host against the limit they share (their cgroup's, or
        the machine's): `reading.fraction`, `reading.rank_bytes`; None where no rank runs here."""
        return self._require_running(allow_broken=True).supervisor.memory.read(list(self.ranks))

    def status(self) -> list[RankStatus]:
        """State (idle/busy/gone), host, pid, device, memory (against its limit) of every rank."""
        return rank_status(self._require_running(allow_broken=True), self.broken)

    # ------------------------------------------------------------------ helpers

    def _require_running(self, allow_broken: bool = False) -> RunningWorld:
        if self._world is None:
            raise NotRunningError("no DDP world is running: start one first (%ddp_start N, or DDPCluster(N).start())")
        if self.config.detach:  # one kernel at a time: another may have taken it since
            ownership.refuse_if_taken(self._world, self._let_go)
        if self.broken and not allow_broken:
            raise WorldBrokenError(
                f"the world is broken ({name_deaths(self.broken)}): "
                "%ddp_restart (or restart()) starts a full world again"
            )
        return self._world

    def _run_context(self) -> cell_run.RunContext:
        return cell_run.RunContext(self._stdout, self._stderr, self._lifecycle, self._syncer)

    def _select(self, ranks: Iterable[int] | str | None) -> tuple[int, ...]:
        return config.select_ranks(ranks, self.world_size)
