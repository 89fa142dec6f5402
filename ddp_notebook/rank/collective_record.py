"""Runs on ranks: this rank's own record of the collectives it enters on the default group, for
the X-ray where torch keeps no flight recorder for the backend (torch 2.6's gloo).

torch.distributed's Python entry points (`dist.all_reduce`, `dist.barrier`, ...) are wrapped once
per process: each call on the default group gets the next sequence number, its op, its input's
shapes and dtypes, and is retired when it returns (an `async_op=True` call when its work's future
completes). Every rank numbers the same calls the same way, so the notebook compares them as it
compares the flight recorder's. What does not go through those entry points is not seen: DDP's
gradient all-reduce (its C++ reducer), functional collectives (FSDP2, DTensor); `%ddp_start` says so
(`xray_messages.OWN_RECORD_LIMIT`). A name imported before the group was made
(`from torch.distributed import all_reduce` in a module loaded earlier) keeps torch's own function
and is not seen either.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

from ..wire import xray_messages as messages
from .state import RANK

# the entry points recorded, each with the name of its input argument (None: no tensor of its own)
ENTRY_POINTS: tuple[tuple[str, str | None], ...] = (
    ("all_reduce", "tensor"),
    ("broadcast", "tensor"),
    ("reduce", "tensor"),
    ("all_gather", "tensor"),
    ("all_gather_into_tensor", "input_tensor"),
    ("reduce_scatter", "input_list"),
    ("reduce_scatter_tensor", "input"),
    ("all_to_all", "input_tensor_list"),
    ("all_to_all_single", "input"),
    ("gather", "tensor"),
    ("scatter", "tensor"),
    ("barrier", None),
    ("monitored_barrier", None),
    ("all_gather_object", None),
    ("broadcast_object_list", None),
    ("gather_object", None),
    ("scatter_object_list", None),
)
RECORD = RANK.collectives


def start() -> None:
    """Record from now on, numbering afresh (call when a new default group is made: its sequence
    numbers start again, as the flight recorder's do)."""
    if not RECORD.installed:
        _install()
    with RECORD.lock:
        RECORD.entries.clear()
        RECORD.entered = 0
        RECORD.on = True


def progress() -> tuple[int, int] | None:
    """(last entered, last finished with every earlier one finished) sequence numbers; None before any."""
    with RECORD.lock:
        if not RECORD.entered:
            return None
        running = [e["seq"] for e in RECORD.entries if not e["retired"]]
        return RECORD.entered, (min(running) - 1 if running else RECORD.entered)


def entries(finished: int) -> list[messages.CollectiveEntry]:
    """The last `finished` finished collectives and every running one, oldest first."""
    with RECORD.lock:
        kept = [dict(e) for e in RECORD.entries]
    done = [e for e in kept if e["retired"]][-finished:] if finished else []
    return [*done, *(e for e in kept if not e["retired"])]  # type: ignore[list-item]


def _install() -> None:
    import torch.distributed as dist

    for name, argument in ENTRY_POINTS:
        function = getattr(dist, name, None)
        if function is not None and not getattr(function, "_ddp_notebook_recorded", False):
            setattr(dist, name, _recorded(name, function, argument))
    RECORD.installed = True


def _recorded(op: str, function: Any, argument: str | None) -> Any:
    signature = inspect.signature(function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        entry = _enter(op, signature, argument, args, kwargs) if RECORD.on else None
        if entry is None:
            return function(*args, **kwargs)
        try:
            result = function(*args, **kwargs)
        except BaseException:
            _retire(entry)
            raise
        future = getattr(result, "get_future", None)
        if future is None:
            _retire(entry)
        else:  # async_op=True: finished when its work is
            try:
                future().add_done_callback(lambda _: _retire(entry))
            except RuntimeError:  # a backend whose work has no future
                _retire(entry)
        return result

    call._ddp_notebook_recorded = True  # type: ignore[attr-defined]
    return call


def _enter(
    op: str, signature: inspect.Signature, argument: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> messages.CollectiveEntry | None:
    """The entry of a call on the default group, recorded as running; None for another group."""
    import torch
    import torch.distributed as dist

    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None  # torch raises its own error for it
    group = bound.get("group")
    if group is not None and group is not dist.GroupMember.WORLD:
        return None
    given = bound.get(argument) if argument else None
    tensors = [given] if isinstance(given, torch.Tensor) else [t for t in (given or ()) if isinstance(t, torch.Tensor)]
    with RECORD.lock:
        RECORD.entered += 1
        entry: messages.CollectiveEntry = {
            "seq": RECORD.entered,
            "op": op,
            "shapes": [list(t.shape) for t in tensors],
            # "Float", as torch's recorder names them
            "dtypes": [t.type().rsplit(".", 1)[-1].removesuffix("Tensor") for t in tensors],
            "retired": False,
            "created_ns": time.time_ns(),
        }
        RECORD.entries.append(entry)
    return entry


def _retire(entry: messages.CollectiveEntry) -> None:
    with RECORD.lock:
        entry["retired"] = True
