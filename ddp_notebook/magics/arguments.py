"""What the magics take, declared once: option groups shared by the magics that take them (as
ipyparallel's `client/magics.py` shares `exec_args` and `output_args`), `%ddp_start`'s options
mirroring `WorldConfig.build` (a test holds them to it), a line read as a shell splits it, and the
options' old spellings.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ..errors import DDPUsageError
from ..live import trackers
from ..world import config, launchers

F = TypeVar("F", bound=Callable[..., Any])


def options(*arguments: Callable[[F], F]) -> Callable[[F], F]:
    """A group of options given to a magic in one decorator, in the order listed."""

    def add(method: F) -> F:
        for decorator in reversed(arguments):
            method = decorator(method)
        return method

    return add


def renamed(old: str, new: str) -> Callable[[F], F]:
    """`old` still works on this magic, read as `new` with a note (see `parse_line`)."""

    def mark(method: F) -> F:
        method.renamed_options = {**getattr(method, "renamed_options", {}), old: new}  # type: ignore[attr-defined]
        return method

    return mark


# ---------------------------------------------------------------- the groups

# which ranks a line acts on: %%ddp, %ddp_interrupt
ranks_args = options(argument("--ranks", default=None, help="which ranks: 0, 0,2, 1-3 or all (default: all)"))

# where the training cells' metrics also go: %ddp_start (every cell from then on) and %%ddp (this cell)
tracker_args = options(
    argument("--tracker", default=None, help="metrics also to tensorboard[:DIR], mlflow[:URI], wandb[:PROJECT]"),
    argument(
        "--tracker-ranks",
        default=None,
        choices=trackers.RANK_CHOICES,
        help="0: rank 0's metrics (default); all: every rank's as NAME/rankN",
    ),
    argument("--params", default=None, help="rank 0's variables logged as hyperparameters, e.g. lr,batch_size"),
)
TRACKER_OPTIONS = ("tracker", "tracker_ranks", "params")  # the notebook's side, not the world's config

# a slurm job's place and length: %ddp_start --launcher slurm (the ranks' job), %ddp_export --submit slurm
slurm_args = options(
    argument("--partition", default=None, help="slurm: partition"),
    argument("--account", default=None, help="slurm: account"),
    argument("--time", default=None, help="slurm: the job's time limit, e.g. 2:00:00"),
)

# what a world is and how long it may take: %ddp_start and %ddp_attach
world_args = options(
    argument("--backend", default="auto", help="auto (nccl where every rank has a GPU, gloo otherwise), nccl or gloo"),
    argument(
        "--ipp-profile",
        default=None,
        help="ipyparallel profile: the launcher's ipcluster_config.py, or the attached cluster's (default: 'default')",
    ),
    renamed("--profile", "--ipp-profile"),
    argument(
        "--collective-timeout",
        type=float,
        default=config.DEFAULT_COLLECTIVE_TIMEOUT,
        help="seconds a collective may wait before it fails (default: %(default)s)",
    ),
    renamed("--timeout", "--collective-timeout"),
    argument("--cell-timeout", type=float, default=None, help="default time limit of each %%%%ddp cell, seconds"),
    argument(
        "--start-timeout",
        type=float,
        default=config.DEFAULT_START_TIMEOUT,
        help="seconds to wait for the ranks to come up (default: %(default)s)",
    ),
    argument("--restart", action="store_true", help="end the running world first (stop it, or leave it if attached)"),
)

# how ranks started elsewhere are started: %ddp_start --launcher ...
launcher_args = options(
    argument(
        "--launcher",
        default="local",
        help=f"how ranks are started: {', '.join(launchers.names())} (ipyparallel's launchers; default: local)",
    ),
    argument("--hosts", default=None, help="ssh: hosts and ranks per host, e.g. node1:2,node2:2"),
    argument("--ssh-args", default=None, help='ssh: extra ssh arguments, e.g. "-F ~/.ssh/cluster_config"'),
    slurm_args,
    argument("--mpi-args", default=None, help='mpi: extra mpiexec arguments, e.g. "--hostfile hosts"'),
    argument("--python", default=None, help="Python the ranks run with (default: this kernel's)"),
    argument(
        "--config",
        action="append",
        default=[],
        metavar="Class.trait=value",
        help="any ipyparallel launcher setting, e.g. SlurmEngineSetLauncher.qos=high (repeatable)",
    ),
)

# %ddp_start's own options; with world_args and launcher_args, each is a keyword of WorldConfig.build
# (spelled as KEYWORDS says where the names differ)
start_args = options(
    argument("n", nargs="?", default=None, help="number of ranks (default: one per visible GPU; CPU: up to 4)"),
    argument("--gpus", default=None, help="GPUs to use, one per rank, e.g. 0,1"),
    argument("--ip", default=None, help="address the controller listens on (default: loopback for local ranks)"),
    argument("--curve", action="store_true", help="encrypt ipyparallel's traffic (always on beyond loopback)"),
    argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="start each rank as a fresh interpreter instead of forking it from a warm template",
    ),
    argument(
        "--force",
        action="store_true",
        help="start the ranks even if they do not fit this machine's cores or memory (refused otherwise)",
    ),
    argument(
        "--max-restarts",
        type=int,
        default=config.DEFAULT_MAX_RESTARTS,
        help="lost ranks the world goes on after by itself, back at the last snapshot (default: %(default)s; 0: never)",
    ),
    argument(
        "--on-loss",
        default="auto",
        choices=config.ON_LOSS_CHOICES,
        help="when ranks are lost: replace them (local ranks; ssh: on its host or a spare slot of --hosts; "
        "slurm: a job of one task), shrink to the survivors, or stop; auto (default): replace local ranks, "
        "shrink elsewhere",
    ),
    argument(
        "--check-collectives",
        action="store_true",
        help="strict mode: the ranks compare op and shapes before each collective (ddp_notebook.check_collectives)",
    ),
    argument(
        "--detach",
        action="store_true",
        help="the world outlives this kernel (killed or restarted): %%ddp_attach from a new kernel finds it",
    ),
    argument(
        "--idle-limit",
        type=float,
        default=config.DEFAULT_IDLE_LIMIT,
        help="--detach: seconds with no cell running and no kernel attached before the world ends itself "
        "(default: %(default)g, an hour)",
    ),
)
# the magics' options spelled differently from WorldConfig.build's keywords
KEYWORDS = {"time": "time_limit", "config": "settings"}

# a batch job of the exported script: %ddp_export --submit slurm
submit_args = options(
    argument("--submit", default=None, metavar="slurm", help="also write PATH's sbatch script and submit it to slurm"),
    argument("--nodes", type=int, default=None, help="--submit: nodes (default: the world's hosts)"),
    argument(
        "--nproc-per-node", type=int, default=None, help="--submit: ranks per node (default: the cells' ranks / nodes)"
    ),
    argument("--gpus-per-node", type=int, default=None, help="--submit: GPUs per node, one rank each (nccl)"),
    slurm_args,
)
SUBMIT_OPTIONS = ("nodes", "nproc_per_node", "gpus_per_node", "time", "partition", "account")


# ---------------------------------------------------------------- reading a line


def build_options(args: Any, *leave_out: str) -> dict[str, Any]:
    """The parsed options as `WorldConfig.build` keywords (every option of the magic is one)."""
    return {KEYWORDS.get(name, name): value for name, value in vars(args).items() if name not in leave_out}


def check_backend(backend: str) -> None:
    if backend not in config.BACKEND_CHOICES:
        raise DDPUsageError(f"--backend must be one of {', '.join(config.BACKEND_CHOICES)}, got '{backend}'")


def check_scheduler(scheduler: str) -> None:
    from ..world import jobs

    if scheduler not in jobs.SCHEDULERS:
        raise DDPUsageError(f"--submit takes {' or '.join(jobs.SCHEDULERS)}, got '{scheduler}'")


def names(text: str | None) -> tuple[str, ...]:
    """--params 'lr,batch_size' -> ('lr', 'batch_size'), each a Python name."""
    found = tuple(name.strip() for name in (text or "").split(",") if name.strip())
    bad = [name for name in found if not name.isidentifier()]
    if bad:
        raise DDPUsageError(f"--params takes names of variables, like lr,batch_size; got '{','.join(bad)}'")
    return found


_noted: set[str] = set()  # the old spellings (old + new) already noted in this kernel


def parse_line(magic: Callable[..., Any], line: str) -> Any:
    """A magic's line parsed as a shell would split it: quotes group and are removed, so
    `--ssh-args "-i KEY -o X=no"` and `--ssh-args="-i KEY -o X=no"` both give `-i KEY -o X=no`.
    (IPython's own splitting keeps the quotes, and ssh then got one argument.) An option's old
    spelling is read as its new one, with a note the first time."""
    parser = magic.parser  # type: ignore[attr-defined]
    if not line.strip():
        # the usual `%%ddp` line: its defaults, parsed once per magic (argparse and shlex took a
        # twentieth of a millisecond of each trivial cell), a fresh copy each time
        defaults = _empty_lines.get(parser)
        if defaults is None:
            defaults = _empty_lines[parser] = parser.parse_args([])
        return argparse.Namespace(**vars(defaults))
    try:
        words = shlex.split(line)
    except ValueError as problem:  # an unbalanced quote
        raise DDPUsageError(f"cannot read this line ({problem}): close every quote you open") from None
    return parser.parse_args([_respelled(magic, word) for word in words])


_empty_lines: dict[Any, argparse.Namespace] = {}  # a magic's parser -> what an empty line gives


def _respelled(magic: Callable[..., Any], word: str) -> str:
    old, equals, value = word.partition("=")
    new = getattr(magic, "renamed_options", {}).get(old)
    if new is None:
        return word
    if old + new not in _noted:
        _noted.add(old + new)
        print(f"note: {old} is spelled {new} now (the old spelling still works)", file=sys.stderr, flush=True)
    return f"{new}{equals}{value}"


def usage_errors(method: F) -> F:
    """Turn user mistakes into IPython UsageErrors: one line, no traceback."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except DDPUsageError as mistake:
            raise UsageError(str(mistake)) from None

    return wrapper  # type: ignore[return-value]


def no_arguments(method: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
    """A magic that takes nothing after its name: anything there is refused, in one wording."""

    @functools.wraps(method)
    def wrapper(self: Any, line: str = "") -> Any:
        if line.strip():
            raise DDPUsageError(f"%{method.__name__} takes no arguments, got '{line.strip()}'")
        return method(self)

    return wrapper
