"""The world magics: `%ddp_start`, `%ddp_attach`, `%ddp_stop`, `%ddp_status`, ...: each parses its
line once and makes one API call on the shell's world.

`DDPMagics` holds the notebook's one world: the one `%ddp_start` / `%ddp_attach` started, or one
built in Python and handed over with `world.activate()`. The cell magics and the job magics drive
the world it holds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..cell import xray
from ..errors import DDPUsageError, InsecureNetworkWarning, name_ranks
from ..live.feed import Metrics, Recorder
from ..world import capabilities, config, spare
from ..world.cluster import DDPCluster
from ..world.config import WorldConfig
from ..world.report import format_start_summary, format_status
from .arguments import (
    TRACKER_OPTIONS,
    build_options,
    check_backend,
    launcher_args,
    names,
    no_arguments,
    parse_line,
    ranks_args,
    start_args,
    tracker_args,
    usage_errors,
    world_args,
)


def start_config(line: str) -> tuple[WorldConfig, bool]:
    """What `%ddp_start LINE` starts, checked (nothing is started), and whether it asked for --restart."""
    return _start_config(parse_line(DDPMagics.ddp_start, line))


def _start_config(args: Any) -> tuple[WorldConfig, bool]:
    n_ranks = config.parse_rank_count(args.n) if args.n is not None else None
    check_backend(args.backend)
    options = build_options(args, "n", "restart", *TRACKER_OPTIONS)
    return WorldConfig.build(n_ranks, **options), bool(args.restart)


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


def preload_widgets(browser: bool = False) -> None:
    from ..live.widgets import preload

    preload(browser)


@magics_class
class DDPMagics(Magics):
    """Holds the notebook's one world; every magic talks to it through DDPCluster."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.world: DDPCluster | None = None
        self.owns_world = False  # started by %ddp_start / %ddp_attach, not handed over by activate()
        # one record of logged metrics for the notebook: it outlives %ddp_stop and restarts
        self.recorder = Recorder()

    def running_world(self) -> DDPCluster:
        if self.world is None or not self.world.running:
            raise DDPUsageError("no DDP world is running: start one with %ddp_start N (e.g. %ddp_start 2)")
        return self.world

    # ---------------------------------------------------------------- starting and handing over

    @magic_arguments()
    @world_args
    @start_args
    @launcher_args
    @tracker_args
    @line_magic
    @usage_errors
    def ddp_start(self, line: str) -> None:
        """Start a world of DDP ranks: `%ddp_start 2` (CPU: gloo ranks; GPUs: one rank per GPU).

        `--launcher mpi|slurm|ssh|...` starts the ranks through ipyparallel's launcher of that
        name, with the settings of `--ipp-profile` and the options given here.
        """
        args = parse_line(self.ddp_start, line)
        settings, restart = _start_config(args)
        world = DDPCluster(settings)
        if args.tracker is not None:
            world.track(args.tracker, ranks=args.tracker_ranks or "0", params=names(args.params))  # checked first
        elif args.tracker_ranks is not None or args.params is not None:
            raise DDPUsageError("--tracker-ranks and --params go with --tracker KIND (tensorboard, mlflow or wandb)")
        self._start(world, restart)

    @magic_arguments()
    @argument(
        "url_file", nargs="?", default=None, help="the cluster's client connection file (ipcontroller-client.json)"
    )
    @argument("--cluster-id", default=None, help="the cluster's id (ipcluster start --cluster-id ...)")
    @argument("-n", default=None, help="ranks: wait for this many engines (default: those registered now)")
    @argument("--world", default=None, help="a detached world's id (%%ddp_worlds lists them)")
    @argument(
        "--take-over",
        action="store_true",
        help="a detached world another live kernel is attached to: take it from that kernel",
    )
    @world_args
    @line_magic
    @usage_errors
    def ddp_attach(self, line: str) -> None:
        """Attach again to a detached world, or build a world from the engines of an ipyparallel cluster.

        `%ddp_attach`: this notebook's newest detached world (`%ddp_start N --detach`), else the only
        one of yours; `%ddp_attach --world ID` names one. `%ddp_stop` then ends it. While another live
        kernel is attached to it the attach is refused; `%ddp_attach --take-over` takes it from that kernel.
        `%ddp_attach --ipp-profile mpi`, `%ddp_attach --cluster-id 1712345678-abcd`, or
        `%ddp_attach path/to/ipcontroller-client.json`: an ipcluster's engines, which `%ddp_stop`
        leaves running.
        """
        args = parse_line(self.ddp_attach, line)
        if args.world is not None or not (args.url_file or args.ipp_profile or args.cluster_id or args.n):
            self._start(DDPCluster.attach_detached(args.world, take_over=args.take_over), args.restart)
            return
        if args.take_over:
            raise DDPUsageError("--take-over is for a detached world (%ddp_attach --take-over [--world ID])")
        n_ranks = config.parse_rank_count(args.n) if args.n is not None else None
        check_backend(args.backend)
        options = build_options(args, "url_file", "ipp_profile", "cluster_id", "n", "restart", "world", "take_over")
        world = DDPCluster.attach_to(
            args.url_file, ipp_profile=args.ipp_profile, cluster_id=args.cluster_id, n_ranks=n_ranks, **options
        )
        self._start(world, args.restart)

    def _start(self, world: DDPCluster, restart: bool) -> None:
        current = self.world
        if current is not None and current.running:
            current.let_go_if_taken()  # a detached world another kernel took is not this kernel's to keep
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
        preload_widgets(browser=True)

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
        preload_widgets(browser=True)
        self.world, self.owns_world = world, False

    # ---------------------------------------------------------------- the running world

    @line_magic
    @usage_errors
    @no_arguments
    def ddp_stop(self) -> None:
        """Stop every rank and the controller (harmless when nothing runs).

        An attached world lets go of its engines and leaves them running; a detached world ends,
        from whichever kernel is attached to it.
        """
        world, self.world = self.world, None
        spare.discard_spare()  # nothing of ours outlives %ddp_stop, a template no world took included
        size = world.world_size if world is not None else 0
        if world is None or not world.stop():
            print("no DDP world is running; nothing to stop")
            return
        if world.config.detach:
            print(f"ended the detached world of {size} ranks (its processes and files)")
        elif world.attached:
            print(f"left the world of {size} ranks; its engines keep running in their cluster")
        else:
            print(f"stopped the world of {size} ranks")

    @line_magic
    @usage_errors
    @no_arguments
    def ddp_restart(self) -> None:
        """Stop the world (healthy or broken) and start a full one with the same settings.

        The ranks are new processes: run the cells that build your model and data again.
        """
        if self.world is None:
            raise DDPUsageError("no DDP world to restart: start one with %ddp_start N (e.g. %ddp_start 2)")
        _start_and_summarize(self.world, self.world.restart)

    @line_magic
    @usage_errors
    def ddp_resize(self, line: str = "") -> None:
        """Grow or shrink the running world to N ranks: `%ddp_resize 3`.

        The ranks that stay keep their variables; new ranks run the `%%ddp --setup` cells and
        get the tracked state from rank 0.
        """
        if not line.strip():
            raise DDPUsageError("%ddp_resize needs the number of ranks, e.g. %ddp_resize 3")
        n_ranks = config.parse_rank_count(line.strip())
        seconds = self.running_world().resize(n_ranks)
        print(f"the world has {n_ranks} ranks now (resized in {seconds:.1f} s)")

    @magic_arguments()
    @argument("folder", help="the folder track(persist=...) wrote the snapshots to, e.g. ckpt/")
    @line_magic
    @usage_errors
    def ddp_resume(self, line: str = "") -> None:
        """Go on from the newest whole snapshot on disk after every rank was lost (the machine rebooted,
        the kernel gone): `%ddp_start`, the setup cells, then `%ddp_resume ckpt/`."""
        done = self.running_world().resume(parse_line(self.ddp_resume, line).folder)
        for note in done.skipped:
            print(note)
        print(f"every rank goes on from {done.said} ({done.seconds:.1f} s); run the training cell again")

    @line_magic
    @usage_errors
    @no_arguments
    def ddp_rollback(self) -> None:
        """Bring every rank back to the newest snapshot of the tracked state they all hold:
        `%ddp_rollback`, after a training cell that failed or was interrupted midway."""
        world = self.running_world()
        where = world.rollback()
        if where is None:
            print("nothing is tracked (ddp_notebook.track): there is no snapshot to go back to")
        else:
            seconds = world.last_rollback_seconds or 0.0
            print(f"every rank is back at the snapshot taken at {where} ({seconds:.1f} s); run the training cell again")

    @magic_arguments()
    @argument("state", nargs="?", default=None, help="on or off (default: say which)")
    @line_magic
    @usage_errors
    def ddp_autoreload(self, line: str = "") -> None:
        """Before each %%ddp cell every rank reloads the user modules whose file changed: on by
        default; `%ddp_autoreload off` stops it, `%ddp_autoreload on` brings it back."""
        args = parse_line(self.ddp_autoreload, line)
        world = self.running_world()
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
    @usage_errors
    def ddp_sync(self, line: str = "") -> None:
        """Send the notebook's Python files (or the files and folders named) to ranks on hosts that
        do not have them: only what differs, over the world's own channel."""
        args = parse_line(self.ddp_sync, line)
        print(self.running_world().sync(args.paths or None, max_mb=args.max_mb))

    @line_magic
    @usage_errors
    @no_arguments
    def ddp_metrics(self) -> Metrics:
        """What the ranks logged with ddp_notebook.log in the latest cell that logged: `m = %ddp_metrics`.

        `m.to_dict()` gives a table as a dict of lists, `m.to_pandas()` a DataFrame,
        `m.series("loss", 0)` one rank's (steps, values).
        """
        return self.recorder.metrics

    @line_magic
    @usage_errors
    def ddp_output(self, line: str = "") -> None:
        """Print everything one rank printed in the last cell, shown or not: `%ddp_output 17`."""
        text = line.strip()
        if not text.isdigit():
            raise DDPUsageError(f"%ddp_output takes one rank, e.g. %ddp_output 3; got '{text}'")
        print(self.running_world().output(int(text)), end="")

    @magic_arguments()
    @ranks_args
    @line_magic
    @usage_errors
    def ddp_interrupt(self, line: str = "") -> None:
        """Send KeyboardInterrupt to the ranks still running an earlier cell (a failure elsewhere left
        them computing): `%ddp_interrupt`, `%ddp_interrupt --ranks 1-3`. The next cell then runs."""
        args = parse_line(self.ddp_interrupt, line)
        world = self.running_world()
        busy = world.busy_ranks(args.ranks)
        if not busy:
            print("no rank is running a cell: nothing to interrupt")
            return
        world.interrupt(busy)
        print(f"sent KeyboardInterrupt to {name_ranks(busy)}")

    @line_magic
    @usage_errors
    @no_arguments
    def ddp_status(self) -> None:
        """Show each rank's state (idle/busy), host, pid, device and memory against its limit."""
        world = self.running_world()
        print(format_status(world, world.status(), world.memory()))
        readings = world.collectives()
        if readings:
            source = capabilities.collectives_source(world.ranks)
            print(f"inside the ranks (collectives: {source}; steps: prepare_model / prepare_loader):")
            print(xray.describe_world(readings))

    @line_magic
    @usage_errors
    def ddp_debug(self, line: str = "") -> None:
        """pdb on the last failed cell of a rank: %ddp_debug (the root cause of the last error) or %ddp_debug RANK."""
        text = line.strip()
        if text and not text.isdigit():
            raise DDPUsageError(f"%ddp_debug takes a rank number or nothing, got '{text}'")
        self.running_world().debug(int(text) if text else None)
