"""Runs on ranks: each training step's time split into waiting for data, compute, waiting for
communication and the optimizer, for models from `prepare_model` and loaders from `prepare_loader`.

A step runs from one forward of a prepared model to the next. Inside it:

- data: time spent in the prepared loader's `next()`;
- communication: from the gradient of the model's first parameter (about the last one backward
  computes; a post-accumulate-grad hook) to the end of backward; DDP's backward ends only once its
  all-reduces are done, so this is the time the rank waited for its peers' gradients;
- optimizer: inside `Optimizer.step` (torch's global step hooks);
- compute: the rest (forward, backward, and the user's own code in the loop).

A rank that is slow in compute makes its peers wait in communication, so the straggler is the
rank with the most time outside communication. A few Python calls per step: the overhead is
measured by `python benchmarks/run.py seeing`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from .state import RANK

# how many recent steps the averages are taken over
WINDOW = 20
PHASES = ("data", "compute", "comm", "optimizer")
_KEYS = ("total", *PHASES)


class StepClock:
    """This rank's recent steps, phase by phase (seconds)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.steps: deque[dict[str, float]] = deque(maxlen=window)
        self.count = 0
        # (sums over the window of total and each phase, steps in the window, steps timed), replaced
        # as one tuple per step: `summary()` is O(1) and reads a consistent picture from any thread
        # (the X-ray thread and the channel's flush read it while the main thread steps)
        self._totals: tuple[tuple[float, ...], int, int] = ((0.0,) * (len(PHASES) + 1), 0, 0)
        self._began: float | None = None
        self._data = self._comm = self._optimizer = 0.0
        self._last_grad: float | None = None
        self._optimizer_began: float | None = None
        self._backward_end_queued = False

    def forward_started(self) -> None:
        now = time.perf_counter()
        if self._began is not None:
            total = now - self._began
            compute = max(0.0, total - self._data - self._comm - self._optimizer)
            self._add_step(
                {
                    "total": total,
                    "data": self._data,
                    "compute": compute,
                    "comm": self._comm,
                    "optimizer": self._optimizer,
                }
            )
        self._began = now
        self._data = self._comm = self._optimizer = 0.0
        self._last_grad = None

    def cell_started(self) -> None:
        """A new cell: the time since the last forward is the user's pause, not a step."""
        self._began = None

    def waited_for_data(self, seconds: float) -> None:
        self._data += seconds

    def gradient_ready(self) -> None:
        """A parameter's gradient is in: at the end of this backward, count the wait since the last one."""
        self._last_grad = time.perf_counter()
        if not self._backward_end_queued:
            self._backward_end_queued = True
            # final callbacks run in order once backward is done; DDP's own (which waits for its
            # all-reduces) is queued by then, so one queued from ours runs after it
            _queue_end_of_backward(lambda: _queue_end_of_backward(self._backward_ended))

    def _backward_ended(self) -> None:
        self._backward_end_queued = False
        if self._last_grad is not None and self._began is not None:
            self._comm += time.perf_counter() - self._last_grad
        self._last_grad = None

    def optimizer_started(self) -> None:
        self._optimizer_began = time.perf_counter()

    def optimizer_ended(self) -> None:
        if self._optimizer_began is not None:
            self._optimizer += time.perf_counter() - self._optimizer_began
            self._optimizer_began = None

    def _add_step(self, step: dict[str, float]) -> None:
        steps = self.steps
        sums = list(self._totals[0])
        if len(steps) == steps.maxlen:
            dropped = steps[0]
            sums = [total - dropped[key] for total, key in zip(sums, _KEYS)]
        steps.append(step)
        self.count += 1
        if self.count % len(steps) == 0:  # once per window, summed afresh: no rounding drift builds up
            sums = [sum(s[key] for s in steps) for key in _KEYS]
        else:
            sums = [total + step[key] for total, key in zip(sums, _KEYS)]
        self._totals = (tuple(sums), len(steps), self.count)

    def summary(self) -> dict[str, Any] | None:
        """Mean seconds per phase over the recent steps, and how many steps were timed; None before any.

        O(1): read at every flush of the rank's channel and by the X-ray thread."""
        sums, window, count = self._totals
        if not window:
            return None
        return {"steps": count, "window": window, **{key: max(0.0, total / window) for key, total in zip(_KEYS, sums)}}


def _queue_end_of_backward(callback: Any) -> None:
    from . import torch_adapter  # imports torch: loaded with the first hooked model

    torch_adapter.queue_end_of_backward(callback)


CLOCK = StepClock()


def remove_optimizer_hooks() -> None:
    """Take the global optimizer hooks out (the next prepare_model puts them back)."""
    for handle in RANK.step_hooks.installed.values():
        handle.remove()
    RANK.step_hooks.installed.clear()


def watch_model(model: Any) -> list[Any]:
    """Time the steps of `model` (a DDP wrapper): its forwards and its parameters' gradients.
    Returns the hooks' handles (`handle.remove()` stops it)."""
    _install_optimizer_hooks()
    handles = [model.register_forward_pre_hook(lambda _module, _args: CLOCK.forward_started())]
    # backward runs in about the reverse order of forward (DDP's buckets count on it), so the
    # first parameter's gradient is about the last one this rank computes; one hook, not one per
    # parameter: each Python call from autograd costs microseconds
    first = next((p for p in model.parameters() if p.requires_grad), None)
    if first is not None:
        handles.append(first.register_post_accumulate_grad_hook(lambda _p: CLOCK.gradient_ready()))
    return handles


def _install_optimizer_hooks() -> None:
    if RANK.step_hooks.installed:
        return
    if "cell" not in RANK.step_hooks.ipython_hooked:
        RANK.step_hooks.ipython_hooked.add("cell")
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
        if shell is not None:
            shell.events.register("pre_run_cell", lambda *_: CLOCK.cell_started())
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    RANK.step_hooks.installed["pre"] = register_optimizer_step_pre_hook(lambda *_: CLOCK.optimizer_started())
    RANK.step_hooks.installed["post"] = register_optimizer_step_post_hook(lambda *_: CLOCK.optimizer_ended())


class TimedBatches:
    """A loader's iterator that adds the time each `next()` takes to this rank's data phase."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> Any:
        began = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            CLOCK.waited_for_data(time.perf_counter() - began)

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batches, name)
