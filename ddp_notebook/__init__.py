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
    from .cell.outcome import CellOutcome, Ending
    from .cell.xray import CollectiveMismatchError
    from .errors import (
        CellInterruptedError,
        CellStillRunning,
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
    from .live.feed import Metrics
    from .rank.channel import log, progress
    from .rank.checkpoints import load_checkpoint, save_checkpoint
    from .rank.debugger import breakpoint
    from .rank.elastic import snapshot, track
    from .rank.helpers import barrier, is_main, prepare_loader, prepare_model, shard_model
    from .rank.strict import check_collectives
    from .wire.results import CellResult, RankInfo, RankStatus
    from .world.cell_request import CellRequest
    from .world.cluster import DDPCluster
    from .world.config import WorldConfig
    from .world.resume import Resumed
    from .world.state import WorldState

# Every public name is loaded on first use, from the module that holds it: a rank process that
# imports `ddp_notebook.rank` loads no kernel-side module, and the kernel never imports torch.
_HOMES = {
    "DDPCluster": "world.cluster",
    "WorldConfig": "world.config",
    "CellRequest": "world.cell_request",
    "Resumed": "world.resume",
    "CellOutcome": "cell.outcome",
    "Ending": "cell.outcome",
    "CellResult": "wire.results",
    "RankInfo": "wire.results",
    "RankStatus": "wire.results",
    "WorldState": "world.state",
    "CollectiveMismatchError": "cell.xray",
    "breakpoint": "rank.debugger",
    "check_collectives": "rank.strict",
    "ProfileSettings": "cell.profiling",
    # live progress and metrics (standard library only, no torch)
    "Metrics": "live.feed",
    "log": "rank.channel",
    "progress": "rank.channel",
    # the training state a world keeps alive when a rank dies (rank side, imports torch)
    "snapshot": "rank.elastic",
    "track": "rank.elastic",
    # the helpers of %%ddp cells (rank side, import torch)
    **dict.fromkeys(("barrier", "is_main", "prepare_loader", "prepare_model", "shard_model"), "rank.helpers"),
    **dict.fromkeys(("load_checkpoint", "save_checkpoint"), "rank.checkpoints"),
    **dict.fromkeys(
        (
            "CellInterruptedError",
            "CellStillRunning",
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
    "CellRequest",
    "CellResult",
    "CellStillRunning",
    "CellTimeoutError",
    "CollectiveMismatchError",
    "DDPCluster",
    "DDPError",
    "DDPUsageError",
    "Ending",
    "InsecureNetworkWarning",
    "Metrics",
    "NotRunningError",
    "ProfileSettings",
    "RankDiedError",
    "RankError",
    "RankInfo",
    "RankStatus",
    "Resumed",
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
    from .world.spare import start_spare

    return start_spare(wait)


def discard_warm_up() -> None:
    """End the template `warm_up()` started, if no world took it (harmless otherwise)."""
    from .world.spare import discard_spare

    discard_spare()


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext ddp_notebook`: register the ddp magics (loading twice is harmless)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext ddp_notebook`: stop the running world and remove the magics."""
    from .magics import unload

    unload(ipython)
