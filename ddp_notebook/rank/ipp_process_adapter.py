"""Every reach into ipyparallel's and ipykernel's internals in the processes of a world (a rank's
engine kernel, the controller), in one place; the notebook kernel's are in `cell/ipp_adapter.py`.

Exercised by `tests/test_ipp_adapter.py`, which `benchmarks/compat.py` runs on every ipyparallel and
ipykernel of the ranges `pyproject.toml` declares (8.8 to 9.x, 6.29 to 7.x).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

SETTLE_SLEEP = "time.sleep(0.25)"


def publish_no_execute_input() -> None:
    """A rank's kernel does not echo each cell's code back on IOPub.

    Every rank sends the notebook's kernel, and a copy to the controller's hub, an `execute_input`
    message per cell: a quarter of the messages a trivial cell costs per rank, read by nobody
    (the notebook already shows the cell). Its busy and idle statuses, output and reply are as before.
    """
    from ipyparallel.engine.kernel import IPythonParallelKernel

    def _publish_execute_input(self: Any, code: str, parent: Any, execution_count: int) -> None:
        return None

    IPythonParallelKernel._publish_execute_input = _publish_execute_input  # type: ignore[method-assign]


class _TimeWithoutSleep:
    """The `time` module as `IPController.init_hub` sees it while it runs: every name but `sleep`."""

    @staticmethod
    def sleep(seconds: float) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def hub_settle_sleep_found() -> bool:
    """Whether this ipyparallel's controller still sleeps a quarter of a second while it starts."""
    from ipyparallel.controller.app import IPController

    return SETTLE_SLEEP in inspect.getsource(IPController.init_hub)


def skip_hub_settle_sleep() -> bool:
    """The controller starts without its 0.25 s sleep; False where this ipyparallel has none.

    `IPController.init_hub` sleeps 0.25 s after making its task database, before it writes the
    connection files every rank and the notebook wait for: time for a database to connect. A
    world's controller keeps no task record (`NoDB`), so the sleep is only a wait, about a third of
    a warm start. Only a hub with `NoDB` skips it.
    """
    from ipyparallel.controller import app

    if not hub_settle_sleep_found():
        return False
    original = app.IPController.init_hub

    def init_hub(self: Any) -> None:
        if self.db_class.__name__ != "NoDB":
            return original(self)
        app.time = _TimeWithoutSleep()  # type: ignore[assignment]  # the module's own name, while init_hub runs
        try:
            return original(self)
        finally:
            app.time = time

    app.IPController.init_hub = init_hub  # type: ignore[method-assign]
    return True
