"""A comm that records what the widgets send: the tests (and benchmarks/live_view_bytes.py) plug it in
through comm.create_comm and read every message a frontend would have received."""

from __future__ import annotations

import time
from typing import Any

from comm.base_comm import BaseComm


class RecordingComm(BaseComm):
    """A comm that keeps every message a widget sends to the frontend."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[tuple[float, str, dict[str, Any], list[Any]]] = []
        super().__init__(*args, **kwargs)

    def publish_msg(
        self, msg_type: str, data: Any = None, metadata: Any = None, buffers: Any = None, **keys: Any
    ) -> None:
        self.sent.append((time.monotonic(), msg_type, data or {}, list(buffers or [])))
