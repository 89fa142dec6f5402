"""Rank -> notebook messages of the live view: what a rank's channel publishes, in one shape.

A rank batches `log()` points and progress bars and publishes them as one plain-data message
through ipyparallel's `publish_data` (a signed `data_message` on IOPub); the notebook's `Feed`
reads them (`live/feed.py`). Standard library only: both sides import this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypedDict

# the rank publishes at most this often (and once more when the cell ends)
FLUSH_SECONDS = 0.1
# ... in a world of up to this many ranks; a larger world's ranks publish less often, so that all of
# them together send the notebook about this many messages a second (1,024 ranks: each one a second)
MESSAGES_PER_SECOND = 1000


def flush_seconds(world_size: int) -> float:
    """How often each rank of a world of `world_size` ranks publishes its live-view batch."""
    return max(FLUSH_SECONDS, world_size / MESSAGES_PER_SECOND)


# the key of our messages in a published dict; other keys belong to the user
MESSAGE_KEY = "ddp_notebook"
# ipyparallel keeps what a rank published before the notebook listened (under load, the first
# messages of a cell can arrive before the relay's callback is registered) as ONE dict, each
# message updating it: a message is published under a key of its own among this many (its
# sequence number modulo), so that merge keeps the last few instead of the last one, bounded
KEPT_MESSAGES = 8
# a new optional field keeps the version (readers ignore what they do not know, and take a missing
# one as absent); a field whose meaning changes, or a new required one, needs the next version
MESSAGE_VERSION = 1

# a rank's run of a cell, on both sides: running, or how it ended
RunState = Literal["running", "done", "failed", "stopped"]
# how a cell that is over ended, for the ranks that never said (None: cleanly)
CellEnd = Literal["failed", "stopped"]
# a progress bar: running, done (its loop ran out), closed (its loop was left early)
BarRun = Literal["running", "done", "closed"]


class BarMessage(TypedDict):
    """One progress bar as it stood at the flush."""

    id: int  # per rank and cell, in the order the bars were opened
    level: int  # nesting depth: 0 is the outermost loop
    desc: str
    n: int  # iterations finished
    total: int | None  # None while the length is unknown
    elapsed: float  # seconds since the bar opened (rank clock), frozen when it closed
    state: BarRun


class StepsMessage(TypedDict):
    """The rank's recent training steps (`timing.StepClock.summary`): mean seconds per phase."""

    steps: int  # steps timed since the model was prepared
    window: int  # the recent steps the means are over
    total: float
    data: float
    compute: float
    comm: float
    optimizer: float


class _OptionalFields(TypedDict, total=False):
    # only when the rank timed steps in this cell (models from prepare_model), and they changed
    steps: StepsMessage
    # only in a message merged from several (`wire.journal`): the sequence number of the oldest of them
    first: int


class RankMessage(_OptionalFields):
    """Everything a rank buffered since its last flush."""

    v: int
    seq: int  # 0, 1, 2... per rank and cell: a gap means a lost message
    t: float  # seconds since the cell started (rank clock)
    count: int  # log() calls without step= so far in this cell: the rank's step count
    calls: int  # all log() calls so far in this cell
    # metric name -> [steps, values] of the points logged since the last flush, as arrays
    # ('q' or 'd' steps, 'd' values): ipyparallel pickles them whole, not item by item
    metrics: dict[str, list[Sequence[float]]]
    explicit: list[str]  # names logged with step=...: those steps are kept as given
    bars: list[BarMessage]  # the bars that changed since the last flush
    state: RunState


def message_key(seq: int) -> str:
    """The key message number `seq` is published under."""
    return f"{MESSAGE_KEY}.{seq % KEPT_MESSAGES}"


def messages_in(data: object) -> list[dict[str, object]]:
    """Our messages in a published dict (one, or several that ipyparallel merged), oldest first."""
    if not isinstance(data, dict):
        return []
    found = [
        value
        for key, value in data.items()
        if isinstance(key, str)
        and (key == MESSAGE_KEY or key.startswith(MESSAGE_KEY + "."))
        and isinstance(value, dict)
    ]
    return sorted(found, key=lambda message: message.get("seq", 0) if isinstance(message.get("seq"), int) else 0)
