"""The `%ddp_*` magics and `%%ddp`: each parses its line once and makes one API call.

`core` holds the world magics and the notebook's one world, `cell` the cell magics, `jobs` the
job magics, `worlds` the listing of detached worlds; `arguments` declares the options they share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import DDPUsageError
from ..world import spare
from ..world.provisioning.local import read_profile_ahead
from .arguments import parse_line
from .cell import CellMagics
from .core import DDPMagics, preload_widgets, start_config
from .jobs import JobsMagics
from .worlds import WorldsMagics

# every magics class, the world's holder first: each is registered under its class name
MAGICS_CLASSES = (DDPMagics, CellMagics, JobsMagics, WorldsMagics)

__all__ = [
    "MAGICS_CLASSES",
    "CellMagics",
    "DDPMagics",
    "JobsMagics",
    "WorldsMagics",
    "load",
    "magic",
    "parse_line",
    "start_config",
    "unload",
]


def magic(name: str) -> Callable[..., Any]:
    """The method behind `%name` / `%%name` (its `.parser` reads its line)."""
    for cls in MAGICS_CLASSES:
        for table in cls.magics.values():
            if name in table:
                return getattr(cls, table[name])
    raise KeyError(f"no magic %{name}")


def load(ipython: Any) -> None:
    """Register the magics once per shell."""
    registry = ipython.magics_manager.registry
    if registry.get("DDPMagics") is None:
        worlds = DDPMagics(ipython)
        ipython.register_magics(worlds, CellMagics(ipython, worlds), JobsMagics(ipython, worlds), WorldsMagics(ipython))
    # torch imported in the background while the user reads on: %ddp_start forks ranks from it
    spare.start_spare()
    preload_widgets()  # once this cell has run, between cells
    _between_cells(ipython, read_profile_ahead)  # 0.1 s less at the first %ddp_start


def _between_cells(ipython: Any, call: Callable[[], None]) -> None:
    """Run `call` on the kernel's own thread once the running cell is over (at once outside a kernel)."""
    loop = getattr(getattr(ipython, "kernel", None), "io_loop", None)
    if loop is not None:
        loop.add_callback(call)
    else:
        call()


def unload(ipython: Any) -> None:
    """Stop the running world and remove the magics from the shell."""
    spare.discard_spare()
    registry = ipython.magics_manager.registry
    worlds = registry.get("DDPMagics")
    if worlds is None:
        return
    if worlds.world is not None:
        try:
            worlds.world.stop()
        except DDPUsageError:  # a detached world another kernel took: let go of, it runs on there
            pass
        worlds.world = None
    for cls in MAGICS_CLASSES:
        magics = registry.pop(cls.__name__, None)
        for kind, names in getattr(magics, "magics", {}).items():
            table = ipython.magics_manager.magics[kind]
            for name in names:
                table.pop(name, None)
