"""A memory cgroup of our own (root only): what the limits test runs a world in, and where the
fault storm (benchmarks/fault_storm.py) injects out-of-memory kills. Not a test module."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddp_notebook.platform.limits import Cgroup, Platform


class Unavailable(Exception):
    """Why no memory cgroup can be made here (not root, no memory controller, ...)."""


def make(name: str, limit: int | None = None) -> tuple[Cgroup, Path]:
    """A new memory cgroup beside or below this process's own, with `limit` bytes (None: none
    yet, `set_limit` later): (it, the cgroup.procs of the cgroup this process is in now)."""
    if os.geteuid() != 0:
        raise Unavailable("creating a cgroup needs root")
    chain = Platform().cgroups("memory")
    if not chain:
        raise Unavailable("no memory cgroup controller is mounted here")
    own = chain[0]
    if own.version == 1:
        parents = [own.directory]  # v1: any cgroup may have children
    else:
        # v2: a cgroup with processes cannot give its children controllers; a sibling can
        parents = [d for d in (own.directory, own.directory.parent) if _delegates_memory(d)]
        if not parents:
            raise Unavailable(f"cgroup v2: memory is not in cgroup.subtree_control of {own.name} or its parent")
    directory = parents[0] / name
    try:
        directory.mkdir()
    except OSError as failure:
        raise Unavailable(f"cannot create a cgroup under {parents[0]}: {failure}") from None
    cgroup = Cgroup(directory, directory.name, own.version)
    if limit is not None:
        try:
            set_limit(cgroup, limit)
        except Unavailable:
            remove(directory)
            raise
    return cgroup, own.directory / "cgroup.procs"


def set_limit(cgroup: Cgroup, limit: int) -> None:
    """Memory (and swap) of the cgroup's processes together, in bytes."""
    settings = (
        [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)]
        if cgroup.version == 1
        else [("memory.max", limit), ("memory.swap.max", 0)]
    )
    for file, value in settings:
        if (cgroup.directory / file).exists():
            try:
                (cgroup.directory / file).write_text(str(value))
            except OSError:
                pass  # v1: memsw below the memory limit is refused until the memory limit moved
    if cgroup.memory_limit() != limit:
        raise Unavailable(f"could not set a memory limit on {cgroup.directory}")


def enter(cgroup: Cgroup, pid: int) -> None:
    """Move `pid` into `cgroup` (what it starts from then on is there too)."""
    (cgroup.directory / "cgroup.procs").write_text(str(pid))


def remove(directory: Path, seconds: float = 15.0) -> None:
    """Remove an empty cgroup, waiting up to `seconds` for its last processes to exit."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _delegates_memory(directory: Path) -> bool:
    try:
        return "memory" in (directory / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
