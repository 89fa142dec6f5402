"""Runs on ranks: a plain `DataLoader` over a `DistributedSampler`, as tutorials write it, tracked in place.

`track(loader=loader)` makes such a loader and its sampler the classes below (the same objects the
loop holds; `isinstance` still says DataLoader and DistributedSampler). The loader then knows its
place: how many passes over it the running cell began, how far the world got in the last one (in
the epoch's global order, so a world resized or shrunk deals the rest of it over its ranks), and the
sampler's epoch. The loop stays the tutorial's, with or without `sampler.set_epoch(epoch)`:

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)          # or not: then every pass has epoch 0's order, as in PyTorch
        for x, y in loader:
            ...

A snapshot taken inside the cell holds that place. After a comeback (or `%ddp_rollback`) brought
the world back to it, running the cell again replays its passes: the ones the world had finished
are empty, the one it was in goes on after the batches it used, and the rest are whole. Code between
the passes runs again for the finished ones (a per-epoch `scheduler.step()` would step again: step
such a scheduler per batch, or start the loop at the epoch the loader resumes in). A snapshot at the
end of a cell holds no pass: the next cell's loop starts from its beginning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from .helpers import ResumableSampler
from .state import RANK


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a plain loader is: what a snapshot holds of it."""

    passes: int  # passes over the loader the cell began (0: none, or the cell ended)
    used: int  # samples of the last pass's global order the world used
    in_pass: bool  # the last pass was still going (False: it ended, or none began)
    epoch: int  # the sampler's epoch
    epoch_set: bool  # the loop calls set_epoch itself


class TrackedSampler(ResumableSampler):
    """A DistributedSampler that can start an epoch mid-way and be dealt again (`ResumableSampler`),
    and knows whether the loop sets its epoch."""

    epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch_set = True
        super().set_epoch(epoch)


class TrackedDataLoader(DataLoader):  # type: ignore[type-arg]
    """A plain DataLoader whose passes are counted per cell and can resume (made by `adopt`)."""

    # set by adopt() on the object the user made (its __init__ has run already)
    passes: int
    position: int  # batches of the current pass whose step finished
    in_pass: bool
    start: int  # samples of the pass's global order used before this pass began (a resumed pass)
    resume: Place | None  # the place a restore left, for the next cell's passes
    after_batch: Callable[[TrackedDataLoader], None] | None
    after_pass: Callable[[TrackedDataLoader], None] | None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        index, self.passes = self.passes, self.passes + 1
        skip, resume = 0, self.resume
        if resume is not None:
            last = resume.passes - 1  # the pass the snapshot was taken in (or after)
            if index >= last:
                self.resume = None  # reached: later passes are whole
            if index < last or (index == last and not resume.in_pass):
                # a pass the world had finished before the snapshot: nothing of it runs again
                self.position, self.in_pass, self.start = 0, False, 0
                return iter(())
            if index == last:
                skip = resume.used
        self.position, self.in_pass, self.start = 0, True, skip
        self.sampler.skip = skip  # type: ignore[attr-defined]
        if not skip:
            return self._counted(super().__iter__())
        # a resumed pass: its first start drew the workers' base seed from torch's generator
        # before the snapshot; drawing again would shift every random number after it
        with torch.random.fork_rng(devices=[]):
            batches = super().__iter__()
        return self._counted(batches)

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            yield batch
            self.position += 1  # asked for the next batch: the step on this one finished
            if self.after_batch is not None:
                self.after_batch(self)
        self.in_pass = False
        if self.after_pass is not None:
            self.after_pass(self)

    @property
    def used(self) -> int:
        """Samples of the pass's global order the world used so far (every rank's batches)."""
        return self.start + self.position * self._global_batch()

    @property
    def batches_done(self) -> int:
        """Steps of the pass in progress, counted at the current world size."""
        return self.used // self._global_batch()

    @property
    def epoch_label(self) -> int:
        """The epoch a message names: the sampler's where the loop sets it, else the pass of the cell."""
        sampler = self.sampler
        return int(sampler.epoch) if getattr(sampler, "epoch_set", False) else max(self.passes - 1, 0)  # type: ignore[attr-defined]

    def place(self) -> Place:
        sampler: Any = self.sampler
        if self.resume is not None and not self.passes:
            # brought back to a place, and the cell that goes on from it has not begun: that place
            return dataclasses.replace(self.resume, epoch=int(sampler.epoch), epoch_set=bool(sampler.epoch_set))
        return Place(self.passes, self.used, self.in_pass, int(sampler.epoch), bool(sampler.epoch_set))

    def go_to(self, place: Place) -> None:
        """The next cell's passes go on from `place` (restored from a snapshot)."""
        sampler: Any = self.sampler
        sampler.epoch, sampler.epoch_set = place.epoch, place.epoch_set
        self.resume = place if place.passes else None
        self.passes, self.position, self.in_pass, self.start = 0, 0, False, 0

    def cell_ended(self) -> None:
        """The cell is over: the next one's passes count from 0 (a place it did not reach is dropped)."""
        if self.passes:
            self.resume = None
        self.passes, self.position, self.in_pass, self.start = 0, 0, False, 0

    def _global_batch(self) -> int:
        return int(self.batch_size or 1) * int(self.sampler.num_replicas)  # type: ignore[attr-defined]


def adopt(name: str, loader: DataLoader) -> TrackedDataLoader:  # type: ignore[type-arg]
    """Make `loader` (a plain DataLoader over a DistributedSampler) trackable, in place.

    Raises TypeError in one line for a loader it cannot follow."""
    if isinstance(loader, TrackedDataLoader):
        return loader
    sampler = loader.sampler
    if type(loader) is not DataLoader:
        raise TypeError(
            f"'{name}' is a {type(loader).__name__}: track a torch DataLoader over a DistributedSampler, "
            "or a loader from ddp_notebook.prepare_loader"
        )
    if loader.batch_size is None:
        raise TypeError(
            f"'{name}' has no batch_size (a batch_sampler of its own, or batch_size=None): track a "
            "DataLoader(data, batch_size=B, sampler=DistributedSampler(data))"
        )
    if type(sampler) not in (DistributedSampler, TrackedSampler):
        raise TypeError(
            f"'{name}' draws its samples with a {type(sampler).__name__}: track a DataLoader over a "
            "DistributedSampler (DataLoader(data, batch_size=B, sampler=DistributedSampler(data))), "
            "or use ddp_notebook.prepare_loader"
        )
    sampler.__class__ = TrackedSampler  # type: ignore[assignment]
    loader.__class__ = TrackedDataLoader
    tracked: TrackedDataLoader = loader  # type: ignore[assignment]
    tracked.passes, tracked.position, tracked.in_pass, tracked.start = 0, 0, False, 0
    tracked.resume, tracked.after_batch, tracked.after_pass = None, None, None
    RANK.prepared.samplers.add(sampler)  # dealt again over the ranks of each new group
    return tracked
