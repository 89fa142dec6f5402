"""One kernel at a time on a detached world, seen from a kernel: `%ddp_attach` refused while another
live kernel is attached, `--take-over` taking the world from it, and that kernel letting go at its
next call.

The world's registry entry names the kernel attached last (its PID, start time, notebook, since
when). A kernel attaching reads it first: another live kernel there refuses the attach in one line,
unless `take_over`. Once attached, the kernel tells every rank over its X-ray line that its session
is the world's now (`rank.cell_owner`: a cell of another session is refused before it runs, what
holds when two kernels race); every later call of the kernel that lost the world reads the entry,
lets go of the world (its processes and files are the world's: nothing of them ends) and says who
took it. Notebook side (no torch).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cell import xray
from ..errors import DDPUsageError
from ..live.notebook_session import notebook_path
from ..platform.processes import started_at
from ..wire import detached as wire
from . import detached

if TYPE_CHECKING:
    from .running import RunningWorld

log = logging.getLogger("ddp_notebook")


@dataclass(frozen=True)
class AttachedKernel:
    """A live kernel attached to a detached world, as the world's entry names it."""

    pid: int
    notebook: str  # "" when not known
    since: float  # time.time(); 0.0 when the entry does not say
    alive: bool = True

    def describe(self, now: float | None = None) -> str:
        """`PID 4242 (train.ipynb), attached since 19:40:12 (3 min ago)`."""
        now = time.time() if now is None else now
        where = f" ({os.path.basename(self.notebook)})" if self.notebook else ""
        gone = "" if self.alive else ", gone since"
        if not self.since:
            return f"PID {self.pid}{where}{gone}"
        clock = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"PID {self.pid}{where}, attached at {clock} ({detached.ago(max(0.0, now - self.since))} ago){gone}"


def taken_by(entry: wire.Entry) -> AttachedKernel | None:
    """The kernel other than this one that `entry` names as attached last, alive or gone since (None:
    this one, or none): once another kernel attached, this one's hold on the world is over."""
    pid = entry.get("attached_pid") or 0
    if not pid or (pid == os.getpid() and entry.get("attached_started", "") == started_at(pid)):
        return None
    alive = detached.attached_kernel(entry) is not None
    return AttachedKernel(pid, entry.get("attached_notebook", ""), float(entry.get("attached_at", 0.0)), alive)


def claim(entry: wire.Entry, take_over: bool) -> None:
    """Before this kernel attaches to the world of `entry`: refused while another live kernel is
    attached to it, unless `take_over`."""
    holder = taken_by(entry)
    if holder is not None and holder.alive and not take_over:
        raise DDPUsageError(
            f"the detached world {entry['id']} is attached to another kernel, {holder.describe()}: run its "
            "cells there, or %ddp_attach --take-over takes it from that kernel (whose next call is refused)"
        )


def tell_ranks(world: RunningWorld) -> None:
    """This kernel is the world's now: from here on its ranks run this kernel's cells only."""
    reach = world.supervisor.reach()
    if reach is None:
        return
    me = AttachedKernel(os.getpid(), notebook_path(), time.time())
    refusal = (
        f"another kernel took this detached world ({me.describe()}): this cell did not run; "
        "%ddp_attach --take-over takes it back"
    )
    request = wire.owner_request(world.client.session.session, refusal)
    for rank in sorted(world.ranks):
        if xray.ask(reach, rank, request) is None:  # a rank lost meanwhile: the supervision names it
            log.debug("rank %d did not answer the owner request", rank)


def refuse_if_taken(world: RunningWorld, let_go: Callable[[], None]) -> None:
    """Before any call of this kernel on the detached world `world`: when another kernel took it since
    this one attached, `let_go()` (the world runs on, there) and say so in one line."""
    entry = wire.read_entry(wire.entry_path(detached.world_id_of(world)))
    holder = taken_by(entry) if entry is not None else None
    if holder is None:
        return
    let_go()
    again = "%ddp_attach --take-over takes it back" if holder.alive else "%ddp_attach attaches to it again"
    raise DDPUsageError(
        f"another kernel took this detached world, {holder.describe()}: this kernel let go of it (nothing "
        f"of it ended); {again}"
    )
