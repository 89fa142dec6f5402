"""The job magics: `%ddp_export` writes the cells run so far as a torchrun script (and submits it
as a batch job), `%ddp_jobs` follows and cancels those jobs."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import DDPUsageError
from ..world import export
from .arguments import SUBMIT_OPTIONS, check_scheduler, parse_line, renamed, submit_args, usage_errors
from .core import DDPMagics


@magics_class
class JobsMagics(Magics):
    """`%ddp_export` and `%ddp_jobs`, on the world `DDPMagics` holds."""

    def __init__(self, shell: Any, worlds: DDPMagics) -> None:
        super().__init__(shell)
        self.worlds = worlds

    @magic_arguments()
    @argument("path", nargs="?", default=None, help="the script to write, e.g. train.py")
    @argument("--cells", default=None, help="cells to export: 1,3-5 (default: every cell that succeeded)")
    @argument("--list", action="store_true", help="list the cells this world ran, numbered")
    @argument("--force", action="store_true", help="overwrite an existing file")
    @submit_args
    @line_magic
    @usage_errors
    def ddp_export(self, line: str) -> None:
        """Write the %%ddp cells run so far as one script for torchrun (failed cells left out);
        `--submit slurm` also writes an sbatch script beside it and submits it (%ddp_jobs follows it)."""
        args = parse_line(self.ddp_export, line)
        if args.submit is None and any(getattr(args, name) is not None for name in SUBMIT_OPTIONS):
            raise DDPUsageError("--nodes, --time and the like are for a batch job: add --submit slurm")
        if args.submit is not None:
            check_scheduler(args.submit)
            if args.path is None or args.list:
                raise DDPUsageError("--submit needs the script to write: %ddp_export train.py --submit slurm")
        world = self.worlds.world
        if world is None:
            raise DDPUsageError("no DDP world: start one with %ddp_start N and run %%ddp cells first")
        if args.list or args.path is None:
            print(export.listing(world.cell_history))
            return
        cells = export.parse_selection(args.cells)
        if args.submit is None:
            target = world.export_script(args.path, cells, overwrite=args.force)
            print(f"wrote {target}; run it with: torchrun --nproc-per-node {world.world_size} {args.path}")
            return
        from ..world import jobs

        job = jobs.submit_job(
            world,
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
        "--follow-timeout",
        type=float,
        default=None,
        help="with --follow: stop following after this many seconds (default: 600; the job goes on)",
    )
    @renamed("--timeout", "--follow-timeout")
    @argument("--all", action="store_true", help="with --log: every rank's lines")
    @argument("--cancel", default=None, metavar="ID", help="cancel job ID (scancel)")
    @line_magic
    @usage_errors
    def ddp_jobs(self, line: str = "") -> None:
        """The batch jobs submitted from this notebook (%ddp_export PATH --submit slurm) and their state;
        `--log ID [--follow]` shows a job's log, `--cancel ID` cancels it."""
        from ..world import jobs

        args = parse_line(self.ddp_jobs, line)
        if args.log is not None and args.cancel is not None:
            raise DDPUsageError("give --log ID or --cancel ID, not both")
        if args.log is None and (args.follow or args.all or args.follow_timeout is not None):
            raise DDPUsageError("--follow, --all and --follow-timeout go with --log ID")
        if args.follow_timeout is not None and args.follow_timeout <= 0:
            raise DDPUsageError(f"--follow-timeout must be a number of seconds > 0, got {args.follow_timeout:g}")
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
                timeout=args.follow_timeout or jobs.DEFAULT_FOLLOW_SECONDS,
                everything=args.all,
            )
        except KeyboardInterrupt:
            print(f"stopped following job {args.log}; it goes on (%ddp_jobs --cancel {args.log} stops it)")
            return
        print(status.describe())
