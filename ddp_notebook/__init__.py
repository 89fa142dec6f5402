"""Multi-GPU PyTorch DistributedDataParallel training, interactive, inside Jupyter.

In a notebook::

    %load_ext ddp_notebook
    %ddp_start 2

From Python::

    from ddp_notebook import DDPCluster
    with DDPCluster(2) as world:
        world.execute("print(rank, world_size)")

The helpers used inside `%%ddp` cells (`prepare_model`, `prepare_loader`, ...) import torch
and are loaded on first use, so the notebook kernel itself never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .channel import Metrics, log, progress
    from .cluster import DDPCluster
    from .config import WorldConfig
    from .debugger import breakpoint
    from .elastic import snapshot, track
    from .errors import (
        CellInterruptedError,
        CellTimeoutError,
        DDPError,
        DDPUsageError,
        InsecureNetworkWarning,
        NotRunningError,
        RankDiedError,
        RankError,
        StartError,
        WorldBrokenError,
    )
    from .outcome import CellOutcome, Ending
    from .rank import (
        barrier,
        is_main,
        load_checkpoint,
        prepare_loader,
        prepare_model,
        save_checkpoint,
        shard_model,
    )
    from .results import CellResult, RankInfo, RankStatus
    from .state import WorldState
    from .strict import check_collectives
    from .xray import CollectiveMismatchError

# Every public name is loaded on first use, from the module that holds it: a rank process that
# imports `ddp_notebook.rank` loads no kernel-side module, and the kernel never imports torch.
_HOMES = {
    "DDPCluster": "cluster",
    "WorldConfig": "config",
    "CellOutcome": "outcome",
    "Ending": "outcome",
    "CellResult": "results",
    "RankInfo": "results",
    "RankStatus": "results",
    "WorldState": "state",
    "CollectiveMismatchError": "xray",
    "breakpoint": "debugger",
    "check_collectives": "strict",
    # live progress and metrics (standard library only, no torch)
    "Metrics": "channel",
    "log": "channel",
    "progress": "channel",
    # the training state a world keeps alive when a rank dies (rank side, imports torch)
    "snapshot": "elastic",
    "track": "elastic",
    # the helpers of %%ddp cells (rank side, import torch)
    **dict.fromkeys(
        ("barrier", "is_main", "load_checkpoint", "prepare_loader", "prepare_model", "save_checkpoint", "shard_model"),
        "rank",
    ),
    **dict.fromkeys(
        (
            "CellInterruptedError",
            "CellTimeoutError",
            "DDPError",
            "DDPUsageError",
            "InsecureNetworkWarning",
            "NotRunningError",
            "RankDiedError",
            "RankError",
            "StartError",
            "WorldBrokenError",
        ),
        "errors",
    ),
}

__all__ = [
    "CellInterruptedError",
    "CellOutcome",
    "CellResult",
    "CellTimeoutError",
    "CollectiveMismatchError",
    "DDPCluster",
    "DDPError",
    "DDPUsageError",
    "Ending",
    "InsecureNetworkWarning",
    "Metrics",
    "NotRunningError",
    "RankDiedError",
    "RankError",
    "RankInfo",
    "RankStatus",
    "StartError",
    "WorldBrokenError",
    "WorldConfig",
    "WorldState",
    "__version__",
    "barrier",
    "breakpoint",
    "check_collectives",
    "discard_warm_up",
    "is_main",
    "load_checkpoint",
    "load_ipython_extension",
    "log",
    "prepare_loader",
    "prepare_model",
    "progress",
    "save_checkpoint",
    "shard_model",
    "snapshot",
    "track",
    "unload_ipython_extension",
    "warm_up",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ddp_notebook' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # cached: log() runs every step
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


def warm_up(wait: float = 0.0) -> bool:
    """Start a rank template now, so the next local world forks its processes from it (seconds faster).

    `%load_ext ddp_notebook` does this for you. The template imports torch in the background
    (no GPU is touched); it ends with the kernel, or with `discard_warm_up()` / `%ddp_stop`
    if no world took it. `wait`: seconds to wait until it is ready. False where ranks cannot be
    forked (not Linux), with DDP_NOTEBOOK_SPARE=0, or when it was not ready within `wait`.
    """
    from .spare import start_spare

    return start_spare(wait)


def discard_warm_up() -> None:
    """End the template `warm_up()` started, if no world took it (harmless otherwise)."""
    from .spare import discard_spare

    discard_spare()


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext ddp_notebook`: register the ddp magics (loading twice is harmless)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext ddp_notebook`: stop the running world and remove the magics."""
    from .magics import unload

    unload(ipython)
