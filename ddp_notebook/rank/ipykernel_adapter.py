"""Every use of ipykernel's private internals on a rank's side, in one place.

Exercised by `tests/test_ipp_adapter.py`, which `benchmarks/compat.py` runs on every ipykernel of
the range `pyproject.toml` declares (6.29 to 7.x).
"""

from __future__ import annotations

from typing import Any


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
