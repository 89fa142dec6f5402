"""The `%ddp_*` magics and `%%ddp`: each parses its arguments and makes one API call.

They drive one world per shell: the one `%ddp_start` / `%ddp_attach` started, or one built in
Python and handed over with `world.activate()`.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .cell import xray
from .cell.output import tag_text
from .errors import DDPUsageError, InsecureNetworkWarning, name_ranks
from .live import trackers
from .live.feed import Feed, Metrics, Recorder
from .wire.results import CellResult
from .world import capabilities, config, export, launchers, spare
from .world.cluster import DDPCluster
from .world.config import WorldConfig
from .world.report import format_start_summary, format_status, format_values

F = TypeVar("F", bound=Callable[..., Any])
# magic options spelled differently from WorldConfig.build's keywords
_OPTION_KEYWORDS = {"time": "time_limit", "config": "settings"}


def _build_options(args: Any, *leave_out: str) -> dict[str, Any]:
    """The parsed options as `WorldConfig.build` keywords (every option of the magic is one)."""
    return {_OPTION_KEYWORDS.get(name, name): value for name, value in vars(args).items() if name not in leave_out}


def parse_line(magic: Callable[..., Any], line: str) -> Any:
    """A magic's line parsed as a shell would split it: quotes group and are removed, so
    `--ssh-args "-i KEY -o X=no"` and `--ssh-args="-i KEY -o X=no"` both give `-i KEY -o X=no`.
    (IPython's own splitting keeps the quotes, and ssh then got one argument.)"""
    try:
        words = shlex.split(line)
    except ValueError as problem:  # an unbalanced quote
        raise DDPUsageError(f"cannot read this line ({problem}): close every quote you open") from None
    return magic.parser.parse_args(words)  # type: ignore[attr-defined]  (a mistake: one UsageError line)


def start_config(line: str) -> tuple[WorldConfig, bool]:
    """What `%ddp_start LINE` starts, checked (nothing is started), and whether it asked for --restart."""
    args = parse_line(DDPMagics.ddp_start, line)
    n_ranks = config.parse_rank_count(args.n) if args.n is not None else None
    _check_backend(args.backend)
    options = _build_options(args, "n", "restart", *_TRACKER_OPTIONS)
    return WorldConfig.build(n_ranks, **options), bool(args.restart)


# %ddp_start's tracker options: the notebook's side, not the world's config
_TRACKER_OPTIONS = ("tracker", "tracker_ranks", "params")


def _names(text: str | None) -> tuple[str, ...]:
    """'lr,batch_size' -> ('lr', 'batch_size'), each a Python name."""
    names = tuple(name.strip() for name in (text or "").split(",") if name.strip())
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise DDPUsageError(f"--params takes names of variables, like lr,batch_size; got '{','.join(bad)}'")
    return names


def _options(*arguments: Callable[[F], F]) -> Callable[[F], F]:
    """A group of options declared once and given to every magic where it makes sense (as ipyparallel's
    magics share `exec_args` and `output_args`), so that an option reads the same wherever it is taken."""

    def add(method: F) -> F:
        for decorator in reversed(arguments):
            method = decorator(method)
        return method

    return add


# where a world's ranks run and how long they may take: %ddp_start and %ddp_attach
_world_options = _options(
    argument(
        "--timeout",
        type=float,
        default=config.DEFAULT_COLLECTIVE_TIMEOUT,
        help="seconds a collective may wait before it fails (default: %(default)s)",
    ),
    argument("--cell-timeout", type=float, default=None, help="default time limit of each %%%%ddp cell, seconds"),
    argument(
        "--start-timeout",
        type=float,
        default=config.DEFAULT_START_TIMEOUT,
        help="seconds to wait for the ranks to come up (default: %(default)s)",
    ),
)
# where the training cells' metrics also go: %ddp_start (every cell from then on) and %%ddp (this cell)
_tracker_options = _options(
    argument("--tracker", default=None, help="metrics also to tensorboard[:DIR], mlflow[:URI], wandb[:PROJECT]"),
    argument(
        "--tracker-ranks",
        default=None,
        choices=trackers.RANK_CHOICES,
        help="0: rank 0's metrics (default); all: every rank's as NAME/rankN",
    ),
    argument("--params", default=None, help="rank 0's variables logged as hyperparameters, e.g. lr,batch_size"),
)
# which ranks a line acts on: %%ddp, %ddp_interrupt
_ranks_option = _options(
    argument("--ranks", default=None, help="which ranks: 0, 0,2, 1-3 or all (default: all)"),
)


def _start_and_summarize(world: DDPCluster, start: Callable[[], object]) -> None:
    """Run `start` (start or restart `world`), then print its summary with the network warnings as lines of it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InsecureNetworkWarning)
        start()
    print(
        format_start_summary(world, [str(w.message) for w in caught if issubclass(w.category, InsecureNetworkWarning)])
    )
    for line in capabilities.not_yet_said(world.missing_features):
        print(f"off here: {line}")


def _check_backend(backend: str) -> None:
    if backend not in config.BACKEND_CHOICES:
        raise DDPUsageError(f"--backend must be one of {', '.join(config.BACKEND_CHOICES)}, got '{backend}'")


def _usage_errors(method: F) -> F:
    """Turn user mistakes into IPython UsageErrors: one line, no traceback."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except DDPUsageError as mistake:
            raise UsageError(str(mistake)) from None

    return wrapper  # type: ignore[return-value]


@magics_class
class DDPMagics(Magics):
    """Holds the notebook's one world; every magic talks to it through DDPCluster."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.world: DDPCluster | None = None
        self.owns_world = False  # started by %ddp_start / %ddp_attach, not handed over by activate()
        # one record of logged metrics for the notebook: it outlives %ddp_stop and restarts
        self.recorder = Recorder()

    # ---------------------------------------------------------------- %ddp_start

    @magic_arguments()
    @argument("n", nargs="?", default=None, help="number of ranks (default: one per visible GPU; CPU: up to 4)")
    @argument("--backend", default="auto", help="auto (nccl with GPUs, gloo without), nccl or gloo")
    @argument("--gpus", default=None, help="GPUs to use, one per rank, e.g. 0,1")
    @_world_options
    @argument("--ip", default=None, help="address the controller listens on (default: loopback for local ranks)")
    @argument("--curve", action="store_true", help="encrypt ipyparallel's traffic (always on beyond loopback)")
    @argument(
        "--launcher",
        default="local",
        help=f"how ranks are started: {', '.join(launchers.names())} (ipyparallel's launchers; default: local)",
    )
    @argument("--profile", default=None, help="ipyparallel profile whose ipcluster_config.py to use")
    @argument("--hosts", default=None, help="ssh: hosts and ranks per host, e.g. node1:2,node2:2")
    @argument("--ssh-args", default=None, help='ssh: extra ssh arguments, e.g. "-F ~/.ssh/cluster_config"')
    @argument("--partition", default=None, help="slurm: partition")
    @argument("--account", default=None, help="slurm: account")
    @argument("--time", default=None, help="slurm: time limit, e.g. 1:00:00")
    @argument("--mpi-args", default=None, help='mpi: extra mpiexec arguments, e.g. "--hostfile hosts"')
    @argument("--python", default=None, help="Python the ranks run with (default: this kernel's)")
    @argument(
        "--config",
        action="append",
        default=[],
        metavar="Class.trait=value",
        help="any ipyparallel launcher setting, e.g. SlurmEngineSetLauncher.qos=high (repeatable)",
    )
    @argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="start each rank as a fresh interpreter instead of forking it from a warm template",
    )
    @argument(
        "--force",
        action="store_true",
        help="start the ranks even if they do not fit this machine's cores or memory (refused otherwise)",
    )
    @argument(
        "--max-restarts",
        type=int,
        default=config.DEFAULT_MAX_RESTARTS,
        help="lost ranks the world goes on after by itself, back at the last snapshot (default: %(default)s; 0: never)",
    )
    @argument(
        "--on-loss",
        default="auto",
        choices=config.ON_LOSS_CHOICES,
        help="when ranks are lost: replace them (local ranks; ssh: on its host or a spare slot of --hosts; "
        "slurm: a job of one task), "
        "shrink to the survivors, or stop; auto (default): replace local ranks, shrink elsewhere",
    )
    @argument("--restart", action="store_true", help="stop a running world first and start this one")
    @argument(
        "--check-collectives",
        action="store_true",
        help="strict mode: the ranks compare op and shapes before each collective (ddp_notebook.check_collectives)",
    )
    @_tracker_options
    @line_magic
    @_usage_errors
    def ddp_start(self, line: str) -> None:
        """Start a world of DDP ranks: `%ddp_start 2` (CPU: gloo ranks; GPUs: one rank per GPU).

        `--launcher mpi|slurm|ssh|...` starts the ranks through ipyparallel's launcher of that
        name, with the settings of `--profile` and the options given here.
        """
        settings, restart = start_config(line)
        args = parse_line(self.ddp_start, line)
        world = DDPCluster(settings)
        if args.tracker is not None:
            world.track(args.tracker, ranks=args.tracker_ranks or "0", params=_names(args.params))  # checked first
        elif args.tracker_ranks is not None or args.params is not None:
            raise DDPUsageError("--tracker-ranks and --params go with --tracker KIND (tensorboard, mlflow or wandb)")
        self._start(world, restart)

    @magic_arguments()
    @argument(
        "url_file", nargs="?", default=None, help="the cluster's client connection file (ipcontroller-client.json)"
    )
    @argument("--profile", default=None, help="ipyparallel profile of the cluster (default: 'default')")
    @argument("--cluster-id", default=None, help="the cluster's id (ipcluster start --cluster-id ...)")
    @argument("-n", default=None, help="ranks: wait for this many engines (default: those registered now)")
    @argument("--backend", default="auto", help="auto (nccl where every rank has a GPU), nccl or gloo")
    @_world_options
    @argument("--restart", action="store_true", help="leave a running world first and attach to this one")
    @line_magic
    @_usage_errors
    def ddp_attach(self, line: str) -> None:
        """Build a world from the engines of an ipyparallel cluster started elsewhere.

        `%ddp_attach --profile mpi`, `%ddp_attach --cluster-id 1712345678-abcd`, or
        `%ddp_attach path/to/ipcontroller-client.json`. `%ddp_stop` lets go of the engines
        and leaves them running.
        """
        args = parse_line(self.ddp_attach, line)
        n_ranks = config.parse_rank_count(args.n) if args.n is not None else None
        _check_backend(args.backend)
        options = _build_options(args, "url_file", "profile", "cluster_id", "n", "restart")
        world = DDPCluster.attach_to(
            args.url_file, profile=args.profile, cluster_id=args.cluster_id, n_ranks=n_ranks, **options
        )
        self._start(world, args.restart)

    def _start(self, world: DDPCluster, restart: bool) -> None:
        current = self.world
        if current is not None and current.running:
            if not restart:
                if current.config == world.config:
                    print(
                        f"a world of {current.world_size} ranks is already running; nothing to do "
                        "(add --restart to start it afresh)"
                    )
                    return
                raise DDPUsageError(
                    f"a world of {current.world_size} ranks ({current.backend}) is running: "
                    f"%ddp_stop it first, or add --restart"
                )
            current.stop()
        world.recorder = self.recorder
        _start_and_summarize(world, world.start)
        self.world, self.owns_world = world, True
        _preload_widgets(browser=True)

    def adopt(self, world: DDPCluster) -> None:
        """Drive `world` (built in Python) from now on: `world.activate()`."""
        current = self.world
        if current is world:
            return
        if current is not None and current.running and self.owns_world:
            raise DDPUsageError(
                f"a world of {current.world_size} ranks started with %ddp_start is running: %ddp_stop it first"
            )
        world.recorder = self.recorder
        _preload_widgets(browser=True)
        self.world, self.owns_world = world, False

    # ---------------------------------------------------------------- %%ddp

    @magic_arguments()
    @_ranks_option
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
    @_tracker_options
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
    @_usage_errors
    def ddp(self, line: str, cell: str) -> None:
        """Run this cell on every rank (or on --ranks); rank state persists across cells.

        `ddp_notebook.progress(...)` and `ddp_notebook.log(...)` in the cell show up live under it.
        """
        args = parse_line(self.ddp, line)
        steps = _profile_steps(args)
        world = self._running_world()
        profile = _profile_settings(steps, args.profile_dir) if steps is not None else None
        ranks = len(config.parse_ranks(args.ranks, world.world_size)) if args.ranks else world.world_size
        feed = self.recorder.feed(lambda: _make_view(ranks), append=args.append)
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
                params=_names(args.params),
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

    @line_magic
    @_usage_errors
    def ddp_run(self, line: str) -> None:
        """Run a script on every rank as torchrun would: `%ddp_run train.py 4 2` (its `sys.argv`,
        `__name__ == "__main__"`, its own `init_process_group` given the world's group)."""
        from pathlib import Path

        from .world.scripts import script_cell

        self.ddp("", script_cell(line, Path.cwd()))

    # ---------------------------------------------------------------- %ddp_stop, %ddp_status

    @line_magic
    @_usage_errors
    def ddp_stop(self, line: str = "") -> None:
        """Stop every rank and the controller (harmless when nothing runs).

        An attached world lets go of its engines and leaves them running.
        """
        if line.strip():
            raise DDPUsageError(f"%ddp_stop takes no arguments, got '{line.strip()}'")
        world, self.world = self.world, None
        spare.discard_spare()  # nothing of ours outlives %ddp_stop, a template no world took included
        size = world.world_size if world is not None else 0
        if world is None or not world.stop():
            print("no DDP world is running; nothing to stop")
            return
        if world.attached:
            print(f"left the world of {size} ranks; its engines keep running in their cluster")
        else:
            print(f"stopped the world of {size} ranks")

    @line_magic
    @_usage_errors
    def ddp_restart(self, line: str = "") -> None:
        """Stop the world (healthy or broken) and start a full one with the same settings.

        The ranks are new processes: run the cells that build your model and data again.
        """
        if line.strip():
            raise DDPUsageError(f"%ddp_restart takes no arguments, got '{line.strip()}'")
        if self.world is None:
            raise DDPUsageError("no DDP world to restart: start one with %ddp_start N (e.g. %ddp_start 2)")
        _start_and_summarize(self.world, self.world.restart)

    @line_magic
    @_usage_errors
    def ddp_resize(self, line: str = "") -> None:
        """Grow or shrink the running world to N ranks: `%ddp_resize 3`.

        The ranks that stay keep their variables; new ranks run the `%%ddp --setup` cells and
        get the tracked state from rank 0.
        """
        if not line.strip():
            raise DDPUsageError("%ddp_resize needs the number of ranks, e.g. %ddp_resize 3")
        n_ranks = config.parse_rank_count(line.strip())
        seconds = self._running_world().resize(n_ranks)
        print(f"the world has {n_ranks} ranks now (resized in {seconds:.1f} s)")

    @line_magic
    @_usage_errors
    def ddp_rollback(self, line: str = "") -> None:
        """Bring every rank back to the newest snapshot of the tracked state they all hold:
        `%ddp_rollback`, after a training cell that failed or was interrupted midway."""
        if line.strip():
            raise DDPUsageError("%ddp_rollback takes no arguments")
        world = self._running_world()
        where = world.rollback()
        if where is None:
            print("nothing is tracked (ddp_notebook.track): there is no snapshot to go back to")
        else:
            seconds = world.last_rollback_seconds or 0.0
            print(f"every rank is back at the snapshot taken at {where} ({seconds:.1f} s); run the training cell again")

    @magic_arguments()
    @argument("state", nargs="?", default=None, help="on or off (default: say which)")
    @line_magic
    @_usage_errors
    def ddp_autoreload(self, line: str = "") -> None:
        """Before each %%ddp cell every rank reloads the user modules whose file changed: on by
        default; `%ddp_autoreload off` stops it, `%ddp_autoreload on` brings it back."""
        args = parse_line(self.ddp_autoreload, line)
        world = self._running_world()
        if args.state is None:
            state = "on" if world.config.autoreload else "off"
            print(f"autoreload is {state}: %ddp_autoreload on|off")
            return
        if args.state not in ("on", "off"):
            raise DDPUsageError(f"%ddp_autoreload takes on or off, got '{args.state}'")
        world.autoreload(args.state == "on")
        if args.state == "on":
            print("every rank reloads the modules you edit before each %%ddp cell")
        else:
            print("the ranks keep the modules they imported until %ddp_autoreload on")

    @magic_arguments()
    @argument("paths", nargs="*", help="files or folders in the notebook's folder (default: its modules and packages)")
    @argument("--max-mb", type=float, default=None, help="refuse to send more than this many MB (default 20)")
    @line_magic
    @_usage_errors
    def ddp_sync(self, line: str = "") -> None:
        """Send the notebook's Python files (or the files and folders named) to ranks on hosts that
        do not have them: only what differs, over the world's own channel."""
        args = parse_line(self.ddp_sync, line)
        print(self._running_world().sync(args.paths or None, max_mb=args.max_mb))

    @line_magic
    @_usage_errors
    def ddp_metrics(self, line: str = "") -> Metrics:
        """What the ranks logged with ddp_notebook.log in the latest cell that logged: `m = %ddp_metrics`.

        `m.to_dict()` gives a table as a dict of lists, `m.to_pandas()` a DataFrame,
        `m.series("loss", 0)` one rank's (steps, values).
        """
        if line.strip():
            raise DDPUsageError(f"%ddp_metrics takes no arguments, got '{line.strip()}'")
        return self.recorder.metrics

    @line_magic
    @_usage_errors
    def ddp_output(self, line: str = "") -> None:
        """Print everything one rank printed in the last cell, shown or not: `%ddp_output 17`."""
        text = line.strip()
        if not text.isdigit():
            raise DDPUsageError(f"%ddp_output takes one rank, e.g. %ddp_output 3; got '{text}'")
        world = self._running_world()
        print(world.output(int(text)), end="")

    @magic_arguments()
    @_ranks_option
    @line_magic
    @_usage_errors
    def ddp_interrupt(self, line: str = "") -> None:
        """Send KeyboardInterrupt to the ranks still running an earlier cell (a failure elsewhere left
        them computing): `%ddp_interrupt`, `%ddp_interrupt --ranks 1-3`. The next cell then runs."""
        args = parse_line(self.ddp_interrupt, line)
        world = self._running_world()
        busy = world.busy_ranks(args.ranks)
        if not busy:
            print("no rank is running a cell: nothing to interrupt")
            return
        world.interrupt(busy)
        print(f"sent KeyboardInterrupt to {name_ranks(busy)}")

    @line_magic
    @_usage_errors
    def ddp_status(self, line: str = "") -> None:
        """Show each rank's state (idle/busy), host, pid, device and memory against its limit."""
        if line.strip():
            raise DDPUsageError(f"%ddp_status takes no arguments, got '{line.strip()}'")
        world = self._running_world()
        print(format_status(world, world.status(), world.memory()))
        readings = world.collectives()
        if readings:
            source = capabilities.collectives_source(world.ranks)
            print(f"inside the ranks (collectives: {source}; steps: prepare_model / prepare_loader):")
            print(xray.describe_world(readings))

    @line_magic
    @_usage_errors
    def ddp_debug(self, line: str = "") -> None:
        """pdb on the last failed cell of a rank: %ddp_debug (the root cause of the last error) or %ddp_debug RANK."""
        text = line.strip()
        if text and not text.isdigit():
            raise DDPUsageError(f"%ddp_debug takes a rank number or nothing, got '{text}'")
        self._running_world().debug(int(text) if text else None)

    @magic_arguments()
    @argument("path", nargs="?", default=None, help="the script to write, e.g. train.py")
    @argument("--cells", default=None, help="cells to export: 1,3-5 (default: every cell that succeeded)")
    @argument("--list", action="store_true", help="list the cells this world ran, numbered")
    @argument("--force", action="store_true", help="overwrite an existing file")
    @argument("--submit", default=None, metavar="slurm", help="also write PATH's sbatch script and submit it to slurm")
    @argument("--nodes", type=int, default=None, help="--submit: nodes (default: the world's hosts)")
    @argument(
        "--nproc-per-node", type=int, default=None, help="--submit: ranks per node (default: the cells' ranks / nodes)"
    )
    @argument("--gpus-per-node", type=int, default=None, help="--submit: GPUs per node, one rank each (nccl)")
    @argument("--time", default=None, help="--submit: the job's time limit, e.g. 2:00:00")
    @argument("--partition", default=None, help="--submit: partition")
    @argument("--account", default=None, help="--submit: account")
    @line_magic
    @_usage_errors
    def ddp_export(self, line: str) -> None:
        """Write the %%ddp cells run so far as one script for torchrun (failed cells left out);
        `--submit slurm` also writes an sbatch script beside it and submits it (%ddp_jobs follows it)."""
        args = parse_line(self.ddp_export, line)
        submit_options = ("nodes", "nproc_per_node", "gpus_per_node", "time", "partition", "account")
        if args.submit is None and any(getattr(args, name) is not None for name in submit_options):
            raise DDPUsageError("--nodes, --time and the like are for a batch job: add --submit slurm")
        if args.submit is not None:
            from .world import jobs

            if args.submit not in jobs.SCHEDULERS:
                raise DDPUsageError(f"--submit takes {' or '.join(jobs.SCHEDULERS)}, got '{args.submit}'")
            if args.path is None or args.list:
                raise DDPUsageError("--submit needs the script to write: %ddp_export train.py --submit slurm")
        if self.world is None:
            raise DDPUsageError("no DDP world: start one with %ddp_start N and run %%ddp cells first")
        if args.list or args.path is None:
            print(export.listing(self.world.cell_history))
            return
        cells = export.parse_selection(args.cells)
        if args.submit is None:
            target = self.world.export_script(args.path, cells, overwrite=args.force)
            print(f"wrote {target}; run it with: torchrun --nproc-per-node {self.world.world_size} {args.path}")
            return
        job = jobs.submit_job(
            self.world,
            args.path,
            cells,
            scheduler=args.submit,
            nodes=args.nodes,
            nproc_per_node=args.nproc_per_node,
            gpus_per_node=args.gpus_per_node,
            time_limit=args.time,
            partition=args.partition,
            account=args.account,
            overwrite=args.force,
        )
        print(
            f"wrote {job.script} and {job.batch_script}; submitted job {job.job_id} "
            f"({job.nodes} node(s) x {job.nproc_per_node} rank(s), {job.backend}); log: {job.log}\n"
            f"follow it with: %ddp_jobs --log {job.job_id} --follow"
        )

    @magic_arguments()
    @argument("--log", default=None, metavar="ID", help="show job ID's log: rank 0's lines and every rank's errors")
    @argument("--follow", action="store_true", help="with --log: keep showing new lines until the job ends")
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="with --follow: stop following after this many seconds (default: 600; the job goes on)",
    )
    @argument("--all", action="store_true", help="with --log: every rank's lines")
    @argument("--cancel", default=None, metavar="ID", help="cancel job ID (scancel)")
    @line_magic
    @_usage_errors
    def ddp_jobs(self, line: str = "") -> None:
        """The batch jobs submitted from this notebook (%ddp_export PATH --submit slurm) and their state;
        `--log ID [--follow]` shows a job's log, `--cancel ID` cancels it."""
        from .world import jobs

        args = parse_line(self.ddp_jobs, line)
        if args.log is not None and args.cancel is not None:
            raise DDPUsageError("give --log ID or --cancel ID, not both")
        if args.log is None and (args.follow or args.all or args.timeout is not None):
            raise DDPUsageError("--follow, --all and --timeout go with --log ID")
        if args.timeout is not None and args.timeout <= 0:
            raise DDPUsageError(f"--timeout must be a number of seconds > 0, got {args.timeout:g}")
        if args.cancel is not None:
            print(f"{jobs.cancel_job(args.cancel).describe()}")
            return
        if args.log is None:
            print(jobs.listing(jobs.list_jobs()))
            return
        try:
            status = jobs.follow_log(
                args.log,
                follow=args.follow,
                timeout=args.timeout or jobs.DEFAULT_FOLLOW_SECONDS,
                everything=args.all,
            )
        except KeyboardInterrupt:
            print(f"stopped following job {args.log}; it goes on (%ddp_jobs --cancel {args.log} stops it)")
            return
        print(status.describe())

    def _running_world(self) -> DDPCluster:
        if self.world is None or not self.world.running:
            raise DDPUsageError("no DDP world is running: start one with %ddp_start N (e.g. %ddp_start 2)")
        return self.world


def _preload_widgets(browser: bool = False) -> None:
    from .live.widgets import preload

    preload(browser)


def _make_view(ranks: int) -> Any:
    from .live.large_view import make_view

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
    from .cell.profiling import DEFAULT_STEPS, parse_steps

    return DEFAULT_STEPS if args.profile == "default" else parse_steps(args.profile)


def _profile_settings(steps: int, folder: str | None) -> Any:
    """What to profile, its folder made and checked writable before the cell is sent."""
    from .cell.profiling import ProfileSettings, prepare_folder

    return ProfileSettings(steps=steps, folder=prepare_folder(folder))


def _show_profile(report: Any) -> None:
    from .live.profile_view import show

    show(report)


def _execute_live(world: DDPCluster, feed: Feed, cell: str, ranks: str | None, **kwargs: Any) -> CellResult:
    """Run the cell with `feed` drawing its live view; the view shows how the cell ended."""
    try:
        outcome = world.run(cell, ranks, on_data=feed, **kwargs)
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


def load(ipython: Any) -> None:
    """Register the magics once per shell."""
    if ipython.magics_manager.registry.get("DDPMagics") is None:
        ipython.register_magics(DDPMagics(ipython))
    # torch imported in the background while the user reads on: %ddp_start forks ranks from it
    spare.start_spare()
    _preload_widgets()  # once this cell has run, between cells


def unload(ipython: Any) -> None:
    """Stop the running world and remove the magics from the shell."""
    spare.discard_spare()
    magics = ipython.magics_manager.registry.pop("DDPMagics", None)
    if magics is None:
        return
    if magics.world is not None:
        magics.world.stop()
        magics.world = None
    for kind, names in magics.magics.items():
        table = ipython.magics_manager.magics[kind]
        for name in names:
            table.pop(name, None)
