"""The live view's widgets as the tests drive them: what a frontend holds after the messages a
recording comm kept (`frontend_state`, `models_named`), the bytes they came to (`bytes_sent`), a clock
moved by hand and one rank's training cell fed into a view (`train`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ddp_notebook.live.feed import Feed
from ddp_notebook.rank.channel import Channel, Progress

if TYPE_CHECKING:
    from tests.support.comms import RecordingComm


def frontend_state(comms: list[RecordingComm]) -> dict[str, dict[str, Any]]:
    """Each widget model's state as a frontend would hold it after every message so far."""
    models: dict[str, dict[str, Any]] = {}
    for channel in comms:
        for _, msg_type, data, _ in channel.sent:
            state = data.get("state") if msg_type in ("comm_open", "comm_msg") else None
            if state:
                models.setdefault(channel.comm_id, {}).update(state)
    return models


def models_named(comms: list[RecordingComm], name: str) -> list[dict[str, Any]]:
    return [state for state in frontend_state(comms).values() if state.get("_model_name") == name]


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def train(feed: Feed, clock: Clock, rank: int, epochs: int = 2, batches: int = 30) -> None:
    """One rank's cell: nested bars, a loss every step, an accuracy per epoch."""
    channel = Channel(publish=lambda payload: feed(rank, payload), clock=clock)
    for epoch in Progress(channel, range(epochs), "epoch", None):
        for step in Progress(channel, range(batches), "batch", None):
            channel.log(None, {"loss": 1.0 / (1 + step)})
            clock.advance(0.01)
        channel.log(epoch, {"accuracy": 0.5 + epoch / 10})
    channel.end_cell("done")


def bytes_sent(comms: list[RecordingComm]) -> int:
    """What every widget so far sent to the frontend: its messages' JSON and binary buffers."""
    return sum(
        len(json.dumps(data, default=str)) + sum(len(memoryview(buffer).cast("B")) for buffer in buffers)
        for channel in comms
        for _, _, data, buffers in channel.sent
    )
