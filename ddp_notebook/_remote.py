"""Functions shipped to the ranks by reference.

ipyparallel sends a function's code and re-imports its module on the rank. These
trampolines live in a module that does not import torch, so the notebook kernel can ship
them without importing torch itself; on the rank they call into `ddp_notebook.rank`.
"""

from __future__ import annotations

from typing import Any


def call_rank(function_name: str, *args: Any) -> Any:
    """Call `ddp_notebook.rank.<function_name>(*args)` on the rank."""
    import importlib

    module = importlib.import_module("ddp_notebook.rank")
    return getattr(module, function_name)(*args)


def call_network(function_name: str, *args: Any) -> Any:
    """Call `ddp_notebook.network.<function_name>(*args)` on the rank (no torch needed)."""
    import importlib

    module = importlib.import_module("ddp_notebook.network")
    return getattr(module, function_name)(*args)


def describe() -> dict[str, Any]:
    """Identity of this rank process (no torch needed), used to build the rank map."""
    import os
    import socket

    from ddp_notebook.devices import visible_gpus
    from ddp_notebook.entrypoints import SLOT_ENV
    from ddp_notebook.layout import LAUNCHER_RANK_VARIABLES

    slot = os.environ.get(SLOT_ENV, "")
    launcher_rank = next(
        (int(os.environ[name]) for name in LAUNCHER_RANK_VARIABLES if os.environ.get(name, "").isdigit()), None
    )
    return {
        "slot": int(slot) if slot.isdigit() else None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launcher_rank": launcher_rank,
        "gpus": list(visible_gpus()),
    }


def pull_names(names: list[str]) -> dict[str, Any]:
    """Values of `names` in the rank's user namespace; a missing name is reported, not raised."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    found: dict[str, Any] = {}
    missing = [name for name in names if name not in namespace]
    for name in names:
        if name in namespace:
            found[name] = namespace[name]
    return {"found": found, "missing": missing}
