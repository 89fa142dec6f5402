"""Runs on ranks: a torchrun script's own set-up calls, answered by the world it runs in.

Every torchrun script begins with `torch.distributed.init_process_group(...)`, and torch raises
"trying to initialize the default process group twice!" where a group exists: a rank of a world has
had one since it joined. Once a rank joins, its `init_process_group` gives the world's group to a
request the group satisfies (the world's backend, size and rank; `init_method`, `store` and
`MASTER_*` are the world's already), says so once in one line on rank 0, and refuses any other
request in one line naming what the world is. A `torch.multiprocessing.spawn` launch is refused in one
line too: in a world every rank already runs the cell, and it would start more processes on each.
`destroy_process_group()` ends the group as torch does (the world forms its group again after the
cell), but the ended group is kept referenced until then: see `keep_destroyed_groups`.

Public functions of torch are replaced (no internals); `torch_init_process_group` is torch's own, for
the world's joins.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as torch_mp

from .state import RANK, RankContext

_ORIGINAL = "__ddp_notebook_original__"  # where an answered function keeps torch's own


class WorldGroupMismatch(ValueError):
    """A script asked for a process group that the world's group is not (another backend, size or rank)."""


class SpawnInWorld(RuntimeError):
    """A script tried to start its own worker processes inside a world."""


def torch_init_process_group() -> Callable[..., Any]:
    """torch's own `init_process_group`, whether or not the world answers the script's calls."""
    return getattr(dist.init_process_group, _ORIGINAL, dist.init_process_group)  # type: ignore[no-any-return]


def answer_script_calls() -> None:
    """From now on, this process's `init_process_group` and `mp.spawn` are answered by its world (idempotent)."""
    if hasattr(dist.init_process_group, _ORIGINAL):
        return
    original_init = dist.init_process_group
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        context = RANK.membership.context
        if context is None or not dist.is_initialized():
            # not in a world, or a cell ended the world's group itself: torch's own call
            return original_init(*args, **kwargs)  # type: ignore[no-any-return]
        request = signature.bind(*args, **kwargs).arguments
        problem = mismatch(request, context)
        if problem is not None:
            raise WorldGroupMismatch(problem)
        if context.rank == 0 and not RANK.membership.told_own_init:
            print(f"ddp_notebook: {describe_call(request)} uses the world's process group ({group_summary(context)})")
        RANK.membership.told_own_init = True
        return None

    setattr(init_process_group, _ORIGINAL, original_init)
    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group  # the same function, where some code finds it
    destroy = keep_destroyed_groups(dist.destroy_process_group)
    dist.destroy_process_group = destroy
    dist.distributed_c10d.destroy_process_group = destroy
    for name in ("spawn", "start_processes"):
        launcher = getattr(torch_mp, name, None)
        if launcher is not None and not hasattr(launcher, _ORIGINAL):
            setattr(torch_mp, name, _refusing_spawn(launcher))


def keep_destroyed_groups(original_destroy: Callable[..., Any]) -> Callable[..., Any]:
    """torch's `destroy_process_group`, keeping a reference to the group it ends until the world
    lets go of its own after the cell (`group.release_group`).

    A gloo group joins its worker threads in its destructor without releasing the GIL, and a worker
    that ran one of backward's all-reduces needs the GIL to free that work (its thread-local state
    holds backward's contextvars context on torch 2.13). A script's DDP model freed right after its
    `destroy_process_group()` (its `main()` returning) drops the group's last reference on the main
    thread: where the worker had not yet freed the work, the rank hung there forever (seen at 4 CPU
    ranks on 2 cores). Kept here, the group is freed after the cell, its workers long idle.
    """

    @functools.wraps(original_destroy)
    def destroy_process_group(group: Any = None) -> None:
        ending = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        if ending is not None:
            RANK.membership.destroyed_groups.append(ending)
        return original_destroy(group)  # type: ignore[no-any-return]

    setattr(destroy_process_group, _ORIGINAL, original_destroy)
    return destroy_process_group


def mismatch(request: dict[str, Any], context: RankContext) -> str | None:
    """Why the world's group cannot stand in for `init_process_group(**request)`, or None where it can."""
    world = group_summary(context)
    backend = request.get("backend")
    if backend is not None and str(backend) and not backend_matches(str(backend), context.backend):
        on_gpus = "--backend nccl on GPU ranks" if context.backend != "nccl" else "--backend gloo"
        return (
            f"{describe_call(request)}: this world's process group is {world}; ask for backend="
            f"{context.backend!r} (or none), or start a world with {on_gpus} (%ddp_start --restart ...)"
        )
    world_size = request.get("world_size", -1)
    if world_size is not None and int(world_size) > 0 and int(world_size) != context.world_size:
        return (
            f"{describe_call(request)}: this world has {context.world_size} ranks; start one of "
            f"{int(world_size)} (%ddp_resize {int(world_size)}), or leave world_size to the environment"
        )
    rank = request.get("rank", -1)
    if rank is not None and int(rank) >= 0 and int(rank) != context.rank:
        return (
            f"{describe_call(request)}: this process is rank {context.rank} of the world (RANK in its "
            "environment); take the rank from there, as under torchrun"
        )
    return None


def backend_matches(requested: str, world_backend: str) -> bool:
    """Whether a requested backend ("gloo", "NCCL", "cpu:gloo,cuda:nccl") names the world's."""
    names = {part.rpartition(":")[2].strip().lower() for part in requested.split(",")}
    return world_backend.lower() in names


def describe_call(request: dict[str, Any]) -> str:
    shown = ", ".join(f"{name}={request[name]!r}" for name in ("backend", "world_size", "rank") if name in request)
    return f"init_process_group({shown})"


def group_summary(context: RankContext) -> str:
    where = "GPU" if context.device.type == "cuda" else "CPU"
    return f"{context.backend}, {context.world_size} {where} ranks"


def _refusing_spawn(launcher: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(launcher)
    def refuse(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        context = RANK.membership.context
        if context is None:
            return launcher(fn, *args, **kwargs)
        name = getattr(fn, "__name__", "fn")
        raise SpawnInWorld(
            f"torch.multiprocessing.{launcher.__name__} would start more processes on each of this world's "
            f"{context.world_size} ranks: every rank already runs this cell; call {name}(rank, ...) directly "
            f"instead (rank {context.rank} here; its init_process_group gets the world's group)"
        )

    setattr(refuse, _ORIGINAL, launcher)
    return refuse
