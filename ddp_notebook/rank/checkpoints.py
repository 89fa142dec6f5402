"""Checkpoints of `%%ddp` cells: written once (by rank 0, atomically) and read on every rank,
in the same format torch.save gives a plain model, so a checkpoint opens outside ddp_notebook.

Runs on ranks (torch + standard library); the package root loads these names lazily.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from .helpers import is_sharded
from .membership import context


def save_checkpoint(obj: Any, path: str | os.PathLike[str], *, optimizer: Any = None) -> str | None:
    """Save `obj` with torch.save on rank 0 only; returns the path there, None elsewhere.

    A model (DDP-wrapped or not) is saved as its plain state_dict, loadable without DDP; with
    `optimizer=`, the file holds {"model": ..., "optimizer": optimizer.state_dict()}.
    The file is written to a temporary name and renamed, so a reader never sees half a file.
    Other ranks do not wait: call `ddp_notebook.barrier()` after it if they read the file.

    A model sharded with FSDP2 is saved with torch.distributed.checkpoint instead: `path` is a
    directory, every rank writes its own shard of the model and of the optimizer's state (call
    it on every rank), and every rank gets the path back. `load_checkpoint` reads it on any
    number of ranks, or in one process.
    """
    if is_sharded(obj):
        from .sharding import save_sharded

        return save_sharded(obj, path, optimizer)
    if context().rank != 0:
        return None
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if optimizer is not None:
        obj = {"model": obj, "optimizer": optimizer.state_dict()}
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pt")
    os.close(handle)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike[str], *, optimizer: Any = None) -> torch.nn.Module:
    """Load a checkpoint written by `save_checkpoint` into `model` (on every rank, or in one process).

    A directory is a torch.distributed.checkpoint written by sharded models: a sharded model
    reads its own slices whatever the number of ranks that wrote it; a plain model (DDP-wrapped
    or not, in a world or in a process without one) reads all of it. A file is a torch.save'd
    state_dict. With `optimizer=`, its state is loaded too (the checkpoint must hold it).
    Returns `model`.
    """
    target = os.fspath(path)
    plain = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if os.path.isdir(target):
        from .sharding import load_sharded

        load_sharded(plain, target, optimizer)
        return model
    state = torch.load(target, map_location="cpu", weights_only=True)
    both = isinstance(state, dict) and set(state) == {"model", "optimizer"} and isinstance(state["model"], dict)
    if optimizer is not None:
        if not both:
            raise ValueError(f"{target} holds no optimizer state (saved without optimizer=): load the model alone")
        optimizer.load_state_dict(state["optimizer"])
    plain.load_state_dict(state["model"] if both else state)
    return model
