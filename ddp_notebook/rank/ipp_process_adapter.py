"""Every reach into ipyparallel's and ipykernel's internals in the processes of a world (a rank's
engine kernel, the controller), in one place; the notebook kernel's are in `cell/ipp_adapter.py`.

Exercised by `tests/test_ipp_adapter.py`, which `benchmarks/compat.py` runs on every ipyparallel and
ipykernel of the ranges `pyproject.toml` declares (8.8 to 9.x, 6.29 to 7.x).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
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


def stamp_errors_when_raised(key: str) -> None:
    """A rank's error reply says when its cell raised (`engine_info[key]`, seconds since the epoch), not only when the
    reply went.

    Between the two the kernel formats the traceback, which takes seconds when 64 ranks share two
    cores: by the reply's time a rank that gave up waiting for the failed one could look first,
    and be named the root cause. The time is taken as the exception reaches the shell
    (`showtraceback`, before any formatting) and put in the reply as it is finished
    (`finish_metadata`, which every request of an engine goes through, so it never outlives one).
    """
    from ipykernel.zmqshell import ZMQInteractiveShell
    from ipyparallel.engine.kernel import IPythonParallelKernel

    show, finish = ZMQInteractiveShell.showtraceback, IPythonParallelKernel.finish_metadata
    raised: list[float] = []

    def showtraceback(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not raised:
            raised.append(time.time())
        return show(self, *args, **kwargs)

    def finish_metadata(self: Any, parent: Any, metadata: Any, reply_content: Any) -> Any:
        if raised and isinstance(reply_content, dict) and reply_content.get("status") == "error":
            info = reply_content.get("engine_info")
            if not isinstance(info, dict):
                info = reply_content["engine_info"] = {}
            info[key] = raised[0]
        raised.clear()
        return finish(self, parent, metadata, reply_content)

    ZMQInteractiveShell.showtraceback = showtraceback  # type: ignore[method-assign]
    IPythonParallelKernel.finish_metadata = finish_metadata  # type: ignore[method-assign]


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


def current_request(shell: Any) -> tuple[str, str]:
    """(request id, sending session) of the request the rank's kernel runs now (a cell, in
    `pre_run_cell`): ipykernel's parent message of the shell channel (ipykernel 6 and later)."""
    parent = shell.kernel.get_parent("shell") or {}
    header = parent.get("header") or {}
    return str(header.get("msg_id", "")), str(header.get("session", ""))


def watch_sent(shell: Any, seen: Callable[[str, dict[str, Any], dict[str, Any]], None]) -> None:
    """Call `seen(msg_type, content, parent_header)` for every message the rank's kernel sends, before
    it goes: its output and displays on IOPub (from whichever thread sends them), its replies.

    Every one of them goes through the kernel's `Session.send`, the same object for the shell
    channel, the output streams and the display publisher (ipyparallel's engine makes them so);
    the hook is on that one object, not on the class (the notebook's own kernel is left alone).
    """
    session = shell.kernel.session
    send = session.send

    def watched(
        stream: Any, msg_or_type: Any, content: Any = None, parent: Any = None, *more: Any, **named: Any
    ) -> Any:
        try:
            if isinstance(msg_or_type, dict):
                msg_type = msg_or_type.get("header", {}).get("msg_type", "")
                said, header = msg_or_type.get("content") or {}, msg_or_type.get("parent_header") or {}
            else:
                msg_type, said = msg_or_type, content
                header = (parent.get("header", parent) if isinstance(parent, dict) else None) or {}
            seen(msg_type, said or {}, header)
        except Exception:  # noqa: BLE001  (what is kept for later must never stop what is sent now)
            pass
        return send(stream, msg_or_type, content, parent, *more, **named)

    session.send = watched
