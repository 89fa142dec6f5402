"""The helpers of `%%ddp` cells: which rank is the main one, a barrier, a model wrapped in DDP
(or sharded), a loader dealing each rank its share of the data and resuming mid-epoch.

Runs on ranks (torch + standard library); the package root loads these names lazily.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from . import timing
from .membership import context
from .state import RANK


def is_main() -> bool:
    """True on rank 0: the rank that prints summaries and writes files."""
    return context().rank == 0


def barrier() -> None:
    """Wait until every rank of the world reaches this point (bounded by the world's timeout)."""
    current = context()
    if current.backend == "nccl" and current.device.type == "cuda":
        dist.barrier(device_ids=[current.device.index])  # this rank's GPU, not the current default
    else:
        dist.barrier()


def prepare_model(model: torch.nn.Module, *, shard: bool = False, **ddp_kwargs: Any) -> torch.nn.Module:
    """Move `model` to this rank's device and wrap it in DistributedDataParallel (or shard it).

    `shard=True`: shard it with FSDP2 instead (`shard_model`). A model already sharded is
    returned as it is (DDP over FSDP would all-reduce what FSDP already reduces).

    On GPUs that device is `cuda:LOCAL_RANK` (the published `device`), and DDP gets
    `device_ids=[LOCAL_RANK]`. Wrapping broadcasts rank 0's parameters, so every rank starts
    from the same weights. Keyword arguments go to `DistributedDataParallel` (e.g.
    `find_unused_parameters=True`).
    """
    if shard or is_sharded(model):
        if ddp_kwargs:
            raise TypeError(f"DistributedDataParallel options {sorted(ddp_kwargs)} do not apply to a sharded model")
        return shard_model(model)
    current = context()
    model = model.to(current.device)
    if current.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [current.device.index])
    wrapper = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    RANK.prepared.wrappers.add(wrapper)  # kept weakly: moved onto a new group if the world heals
    timing.watch_model(wrapper)
    wrapper._ddp_notebook_kwargs = dict(ddp_kwargs)  # to wrap it again when a rank is replaced (elastic)
    return wrapper


def is_sharded(model: Any) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from .sharding import is_sharded

    return is_sharded(model)


def shard_model(
    model: torch.nn.Module, *, blocks: Any = None, mesh: Any = None, **fully_shard_kwargs: Any
) -> torch.nn.Module:
    """Shard `model` with FSDP2 (`fully_shard`) over the world, on this rank's device.

    Each block (the entries of the model's `ModuleList`s / `Sequential`s, e.g. a transformer's
    layers; or `blocks=[...]`) is sharded on its own, then the root: in forward, one block's
    parameters are gathered at a time. The mesh is one-dimensional over every rank (`mesh=` to
    give your own); other keyword arguments go to `fully_shard` (`mp_policy`,
    `reshard_after_forward`, ...). A model you sharded yourself is returned as it is. Save and
    load it with `save_checkpoint` / `load_checkpoint` (every rank writes its own shard).
    """
    from .sharding import shard_model as shard

    return shard(model, context().device, blocks=blocks, mesh=mesh, **fully_shard_kwargs)


class EpochDataLoader(DataLoader):
    """A DataLoader over a DistributedSampler that advances the sampler's epoch itself.

    Forgetting `sampler.set_epoch(epoch)` gives every epoch the same order; here each new
    iteration over the loader starts the next epoch's shuffle. It also knows how far the
    world got in the epoch's global order, so a tracked loader (`ddp_notebook.track`) resumes
    mid-epoch after a rank came back or the world was resized:
    `while loader.epoch < EPOCHS: for batch in loader: ...`
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0  # epochs started
        self.position = 0  # batches of this iteration whose step finished
        self.in_epoch = False
        self.after_batch: Any = None  # called with the loader after each finished step (tracking)
        self.after_pass: Any = None  # called with the loader at the end of each pass (tracking)
        self._start = 0  # samples of the epoch's global order used before this iteration began
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self.epoch)
        self._start, self._resume_at = self._resume_at, 0
        if isinstance(sampler, ResumableSampler):
            sampler.skip = self._start
        self.epoch += 1
        self.position, self.in_epoch = 0, True
        if not self._start:
            return self._counted(timing.TimedBatches(super().__iter__()))
        # a resumed epoch: its first start drew the workers' base seed from torch's generator
        # already, before the snapshot that brought the world back; drawing again would shift
        # every random number after it (dropout masks) against an uninterrupted run
        with torch.random.fork_rng(devices=[]):
            batches = super().__iter__()
        return self._counted(timing.TimedBatches(batches))

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            yield batch
            self.position += 1  # asked for the next batch: the step on this one finished
            if self.after_batch is not None:
                self.after_batch(self)
        self.in_epoch = False
        if self.after_pass is not None:
            self.after_pass(self)

    @property
    def used(self) -> int:
        """Samples of the epoch's global order the world used so far (every rank's batches)."""
        replicas = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return self._start + self.position * int(self.batch_size or 1) * replicas

    @property
    def batches_done(self) -> int:
        """Steps of the epoch in progress, counted at the current world size."""
        replicas = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return self.used // (int(self.batch_size or 1) * replicas)

    def position_state(self) -> tuple[int, int, bool]:
        """(epochs started, samples of the last one's global order used, whether it is in progress)."""
        if not self.in_epoch and self._resume_at:
            # brought back to the middle of an epoch, not iterated since: that place (a snapshot
            # taken now must not start the epoch over)
            return (self.epoch + 1, self._resume_at, True)
        return (self.epoch, self.used, self.in_epoch)

    def resume_from(self, state: tuple[int, int, bool]) -> None:
        """The next iteration continues the epoch `state` was taken in, after the samples it used."""
        epoch, used, in_epoch = state
        self.epoch, self._resume_at = (epoch - 1, used) if in_epoch else (epoch, 0)
        self.position, self.in_epoch, self._start = 0, False, 0


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler that can start an epoch after the first `skip` samples of its global
    order (a resumed epoch), and be dealt again over another number of ranks (`reshard`).

    The global order is DistributedSampler's (shuffled by seed + epoch, padded to a multiple of
    the ranks); rank r takes every num_replicas-th sample of what is left, from position r.
    With skip=0, or skip a multiple of the ranks at an unchanged size, the shard is exactly
    DistributedSampler's. What is left is padded (or, with drop_last, cut) so every rank
    gets as many samples.
    """

    skip = 0

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Deal the data over `num_replicas` ranks from now on (the world was resized)."""
        self.num_replicas, self.rank = num_replicas, rank
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        if skip == 0:
            return super().__iter__()
        whole = self._global_order()
        rest = whole[skip:]
        extra = -len(rest) % self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) - (len(rest) % self.num_replicas)]
        elif extra:
            rest += (whole * math.ceil(extra / len(whole)))[:extra]
        return iter(rest[self.rank :: self.num_replicas])

    def _global_order(self) -> list[int]:
        """Every rank's samples of this epoch, in DistributedSampler's order, before dealing."""
        rank, replicas = self.rank, self.num_replicas
        self.rank, self.num_replicas, total = 0, 1, self.total_size
        try:
            self.total_size = self.num_samples = len(self.dataset)  # type: ignore[arg-type]
            order = list(super().__iter__())
        finally:
            self.rank, self.num_replicas = rank, replicas
            self.reshard(replicas, rank)
        if self.drop_last:
            return order[:total]
        return order + (order * math.ceil(total / len(order)))[: total - len(order)]


def prepare_loader(
    dataset: Dataset[Any],
    batch_size: int,
    shuffle: bool = True,
    *,
    seed: int = 0,
    **loader_kwargs: Any,
) -> EpochDataLoader:
    """A DataLoader over this rank's DistributedSampler shard of `dataset`.

    Shards are disjoint and together cover the dataset (padded to equal length unless
    `drop_last=True`). `batch_size` is per rank: the global batch is batch_size * world_size.
    A plain TensorDataset is fetched a batch at a time (one indexing per tensor, not one per
    sample: `rank/batched_fetch.py`); its batches are the ones a DataLoader gives.
    """
    current = context()
    sampler = ResumableSampler(
        dataset,
        num_replicas=current.world_size,
        rank=current.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=bool(loader_kwargs.get("drop_last", False)),
    )
    RANK.prepared.samplers.add(sampler)
    if current.device.type == "cuda":
        loader_kwargs.setdefault("pin_memory", True)
    from .batched_fetch import batched

    fetched, loader_kwargs = batched(dataset, loader_kwargs)
    return EpochDataLoader(fetched, batch_size=batch_size, sampler=sampler, **loader_kwargs)
