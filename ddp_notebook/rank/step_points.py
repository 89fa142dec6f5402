"""Runs on ranks: a tracked optimizer's steps as snapshot points, where no loader is tracked.

A loop that draws its own batches (random data, an index from a tracked counter, a loader it does
not track) has no loader to count: every `snapshot_every` steps of the first tracked optimizer are
its points. The point is the start of the next step, not the end of this one: right after
`optimizer.step()` the loop has still to count it (`step += 1`), so a copy taken there would hold
the new weights with the old count. The random generators are read right after the step (before
the next batch's random data or dropout draws from them); the rest is copied at the next forward of
a tracked model (or the next step, where none ran forward), with the loop's counters moved on.
Every rank steps alike, so every rank takes the snapshot at the same point.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import generators
from .state import RANK

# takes a snapshot: (where, the generators to keep in it)
Take = Callable[[str, dict[str, Any]], None]


def watch(
    optimizer: torch.optim.Optimizer | None, models: Iterable[torch.nn.Module], take: Take, eligible: Callable[[], bool]
) -> None:
    """Count `optimizer`'s steps as points (replacing what was watched before); `eligible` says
    whether a point may be taken now (something tracked, no loader, every rank at one point)."""
    for handle in RANK.tracked.step_hooks:
        handle.remove()
    RANK.tracked.step_hooks.clear()
    RANK.tracked.step_due = None
    watched = RANK.tracked.stepping() if RANK.tracked.stepping is not None else None
    if optimizer is not watched:
        RANK.tracked.steps = 0  # another optimizer: its steps count from here
    RANK.tracked.stepping = weakref.ref(optimizer) if optimizer is not None else None
    if optimizer is None:
        return

    def after_step(*_: Any) -> None:
        RANK.tracked.steps += 1
        if RANK.tracked.steps % RANK.tracked.every == 0 and eligible():
            RANK.tracked.step_due = generators.capture()

    def before_next(*_: Any) -> None:
        due, RANK.tracked.step_due = RANK.tracked.step_due, None
        if due is not None:
            take(f"optimizer step {RANK.tracked.steps}", due)

    hooks = [optimizer.register_step_post_hook(after_step)]
    models = list(models)
    # the inner module of a DDP model: a comeback gives the wrapper a fresh reducer (and hooks)
    ddp = torch.nn.parallel.DistributedDataParallel
    inner = [model.module if isinstance(model, ddp) else model for model in models]
    hooks += [model.register_forward_pre_hook(before_next) for model in inner]
    hooks.append(optimizer.register_step_pre_hook(before_next))  # where no tracked model ran forward
    RANK.tracked.step_hooks.extend(hooks)


def forget_due() -> None:
    """A cell ended (its own snapshot supersedes a point not yet taken), or the world went back."""
    RANK.tracked.step_due = None
