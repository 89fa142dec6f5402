"""Runs on ranks: strict mode, each collective of the default group checked before it runs.

`check_collectives()` (every rank; `DDPCluster(..., check_collectives=True)` or
`%ddp_start --check-collectives` turn it on at every start, heal and comeback) wraps the collectives of
`torch.distributed` (called as `dist.all_reduce(...)`) so that before each one the ranks
exchange what they are about to call (op, root, dtypes and shapes) over a group of their own,
and raise the same clear error on every rank when they differ, before anything is sent: the
default group stays usable, and a size mismatch that gloo would answer by aborting a rank's
process never reaches gloo. The cost is one small all-gather per collective (measured by
`benchmarks/run.py seeing`). DDP's gradient all-reduces run in C++ and are not checked (DDP
checks its own shapes when it wraps the model).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ..errors import group_ranks, name_ranks
from .state import RANK

CHECKED = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
SIGNATURE_BYTES = 512  # what each rank sends per check (longer descriptions are cut)


class CollectiveMismatch(RuntimeError):
    """The ranks were about to call different collectives; nothing was sent."""


def check_collectives(enabled: bool = True) -> None:
    """Check every collective of the default group before it runs (call on every rank)."""
    import torch.distributed as dist

    originals = RANK.strict.originals
    if enabled:
        if not originals:
            for name in CHECKED:
                original = getattr(dist, name)
                originals[name] = original
                setattr(dist, name, _checked(name, original))
        _check_group()  # made now, while every rank runs this line (after a heal: on the new group)
    elif not enabled and originals:
        for name, original in originals.items():
            setattr(dist, name, original)
        originals.clear()


def _checked(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        import torch
        import torch.distributed as dist

        group = kwargs.get("group")
        if group is None or group is dist.group.WORLD:
            # while its peers have not come to the check, the X-ray shows the rank as waiting in
            # this collective: a peer that skipped it is then named within seconds, as without checks
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            RANK.strict.checking = {
                "op": name,
                "shapes": [list(t.shape) for t in tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "since_ns": time.time_ns(),
            }
            try:
                _check(_signature(name, args, kwargs))
            finally:
                RANK.strict.checking = None
        return original(*args, **kwargs)

    return checked


def checking() -> dict[str, Any] | None:
    """The collective this rank is checking now, waiting for its peers to come to the check
    (op, shapes, dtypes, since_ns), or None."""
    return RANK.strict.checking  # type: ignore[no-any-return]


def _signature(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    import torch

    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return "[" + ", ".join(describe(v) for v in value) + "]"
        return ""

    parts = [describe(a) for a in (*args, *kwargs.values())]
    for key in ("src", "dst", "op"):
        if key in kwargs:
            parts.append(f"{key}={kwargs[key]}")
    if name in ("broadcast", "reduce") and len(args) > 1 and isinstance(args[1], int):
        parts.append(f"{'src' if name == 'broadcast' else 'dst'}={args[1]}")
    return f"{name}(" + ", ".join(p for p in parts if p) + ")"


def _check_group() -> Any:
    """The group the checks travel on; made again after a heal replaced the default group."""
    import torch.distributed as dist

    if RANK.strict.world is not dist.group.WORLD:
        RANK.strict.group = dist.new_group(backend="gloo")
        RANK.strict.world = dist.group.WORLD
    return RANK.strict.group


def _check(signature: str) -> None:
    import torch
    import torch.distributed as dist

    group = _check_group()
    size = dist.get_world_size()
    mine = torch.zeros(SIGNATURE_BYTES, dtype=torch.uint8)
    encoded = signature.encode()[:SIGNATURE_BYTES]
    mine[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    everyone = torch.empty(size * SIGNATURE_BYTES, dtype=torch.uint8)
    # all_gather_single is not wrapped (all_gather_into_tensor, which is, warns it is deprecated)
    dist.all_gather_single(everyone, mine, group=group)
    rows = everyone.view(size, SIGNATURE_BYTES)
    if bool((rows == mine).all()):
        return
    said = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
    groups = group_ranks(enumerate(said))  # the ranks that call the same named once, as runs
    calls = "; ".join(
        f"{name_ranks(ranks)} call{'' if len(ranks) > 1 else 's'} {call}" for call, ranks in groups.items()
    )
    raise CollectiveMismatch(f"collective mismatch caught before it ran (nothing was sent): {calls}")
