"""Questions to a world's ipyparallel controller, each with a time limit.

Without the controller no result and no death notice would ever arrive, and
`Client.queue_status` waits for its answer without limit; so every question here is
bounded, and a running cell checks every few seconds that the controller still answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from ..cell.ipp_adapter import send_queue_request
from ..errors import DDPError, one_line
from ..platform import processes
from ..wire.results import RankInfo

# how often a running cell checks that the controller is still there, and how long it may take to answer
CONTROLLER_CHECK_SECONDS = 2.0
CONTROLLER_ANSWER_SECONDS = 3.0
# any other question to the controller
QUERY_SECONDS = 10.0
# the controller records a finished request a moment after its reply reached us (later still
# with many ranks on few cores): a rank it calls busy is asked about again this often, this
# long apart (half a second in all), before we believe it
SETTLE_TRIES = 11
SETTLE_SECONDS = 0.05


class ControllerLink:
    """The client's view of the controller: is it there, which ranks are busy."""

    def __init__(self, client: Any, controller_pid: int | None) -> None:
        self.client = client
        self.controller_pid = controller_pid  # None: it runs elsewhere (an attached cluster)
        self._checked_at = 0.0

    def queue_status(self, seconds: float = QUERY_SECONDS) -> dict[int, Any]:
        """The controller's queue status per engine; TimeoutError if it does not answer within `seconds`."""
        from ipyparallel import util

        future = send_queue_request(self.client)
        if not future.wait(seconds):
            raise TimeoutError(f"no answer within {seconds:g} s")  # a late answer is simply dropped
        content = dict(future.result()["content"])
        if content.pop("status") != "ok":
            raise DDPError(f"the controller could not say which ranks are busy: {content}")
        return util.int_keys(content)  # type: ignore[no-any-return]

    def settled_queue_status(self, seconds: float = QUERY_SECONDS) -> dict[int, Any]:
        """`queue_status`, asked again while some engine looks busy, so a request whose reply
        we already have is not counted (the controller may not have recorded it yet)."""
        queues = self.queue_status(seconds)
        for _ in range(SETTLE_TRIES - 1):
            if not any(isinstance(entry, dict) and entry.get("queue", 0) > 0 for entry in queues.values()):
                break
            time.sleep(SETTLE_SECONDS)
            queues = self.queue_status(seconds)
        return queues

    def busy(self, ranks: Iterable[RankInfo]) -> list[int]:
        """Ranks with a request queued or running."""
        queues = self.settled_queue_status()
        return [info.rank for info in ranks if queues.get(info.engine_id, {}).get("queue", 0) > 0]

    def lost(self, now_please: bool = False) -> str | None:
        """Why the controller cannot be reached any more (None while it can); asked at most every 2 s."""
        now = time.monotonic()
        if not now_please and now < self._checked_at + CONTROLLER_CHECK_SECONDS:
            return None
        self._checked_at = now
        if self.controller_pid is not None:
            return None if processes.pid_alive(self.controller_pid) else "the controller process exited"
        try:
            self.queue_status(CONTROLLER_ANSWER_SECONDS)
        except TimeoutError:
            return f"the controller did not answer within {CONTROLLER_ANSWER_SECONDS:g} s"
        except Exception as failure:  # noqa: BLE001  (closed sockets and the like)
            return f"the controller cannot be asked ({one_line(failure)})"
        return None
