"""A detached world's cell journal: what a rank's cell sent the notebook, kept on the rank for a
kernel that attaches later (`%ddp_wait`), in one shape for both sides.

A rank of a detached world keeps its newest cell's output (`rank.cell_journal`): the text it
printed, its rich displays, its live-view messages (`wire.channel.RankMessage`) and how it ended.
A kernel reads it over the rank's X-ray line (a thread of the rank's own, so it answers while the
cell runs), a page at a time from the entry it has seen last.

The bounds, per rank, whatever the cell runs for: TEXT_LIMIT_BYTES of output, each entry counted
with ENTRY_BYTES besides its text (past it the oldest dropped, and counted); MESSAGES_LIMIT live-view
messages (past it the oldest are merged into one: each bar at its latest, the counters the newest
gave); POINTS_LIMIT live-view points (past it the oldest messages are merged and every other point
of them dropped: the curve keeps its shape, its past at a coarser step). Standard library only.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

# what a rank keeps of its newest cell's printed output and displays: past the limit, the oldest go
# until three quarters of it are left (not one chunk at a time: each pass walks the whole record)
TEXT_LIMIT_BYTES = 1 << 20
TEXT_KEPT_BYTES = TEXT_LIMIT_BYTES * 3 // 4
# what an entry costs the rank besides its text (its list, its dict, its numbers): a cell printing
# one character at a time is bounded as one printing long lines
ENTRY_BYTES = 128
# the live-view messages a rank keeps of its newest cell: a progress bar or a counter sends one every
# flush (0.1 s) with no point in it, which the points bound never sees; past the limit the oldest
# are merged into one, each bar at its latest (a night of bars is one message and the newest few)
MESSAGES_LIMIT = 2048
# the live-view points (a metric's step and value) a rank keeps of its newest cell
POINTS_LIMIT = 250_000
# live-view messages left as they are when the older ones are merged: a kernel following the cell
# has read them within a poll (see POLL_SECONDS) and never reads a merged one twice
RECENT_MESSAGES = 64
# one answer carries about this much; a kernel catching up asks again from where it ended
PAGE_BYTES = 4 << 20
# how often a kernel following a cell reads the ranks' journals
POLL_SECONDS = 0.25

EntryKind = Literal["stream", "display", "update", "clear", "data"]
# a cell's state on a rank: running, or how its reply said it ended
CellStatus = Literal["running", "ok", "error", "aborted"]


class JournalRequest(TypedDict):
    v: int
    ask: Literal["journal"]
    since: int  # the first entry number wanted (0: from the start of what is kept)
    limit: int  # about how many bytes of entries to answer with (0: none, only the cell)


class JournalError(TypedDict):
    """What a failed cell's reply said: the exception's name, its message, its traceback's lines,
    and when the cell raised (seconds since the epoch; None where the reply did not say)."""

    ename: str
    evalue: str
    traceback: list[str]
    raised: float | None


class JournalCell(TypedDict):
    """A rank's newest cell, as its journal has it."""

    id: str  # the cell's request id on this rank
    session: str  # the session of the kernel that sent it: another than this kernel's, an earlier kernel's
    code: str
    started: float  # seconds since the epoch
    ended: float | None
    status: CellStatus
    error: JournalError | None
    told: list[str]  # keys of `wire.results` the rank told the notebook (its group broke, ...)
    first: int  # the number of the oldest entry kept
    next: int  # the number the next entry will have
    dropped_bytes: int  # output dropped past TEXT_LIMIT_BYTES
    thinned: int  # times the oldest live-view points were thinned past POINTS_LIMIT
    merged: int  # live-view messages merged into older ones past MESSAGES_LIMIT or POINTS_LIMIT


class JournalFootprint(TypedDict):
    """What a rank's journal holds now, against its bounds."""

    entries: int
    text_bytes: int  # output and displays, ENTRY_BYTES counted for each (bound: TEXT_LIMIT_BYTES)
    messages: int  # live-view messages (bound: MESSAGES_LIMIT)
    points: int  # live-view points (bound: POINTS_LIMIT)


class JournalAnswer(TypedDict):
    v: int
    cell: JournalCell | None  # None: no cell ran since the rank's journal started
    # [number, kind, payload, when], oldest first: stream {"name", "text"}; display and update, the
    # display message's content; clear {}; data, a live-view message; when: seconds since the epoch
    entries: list[list[Any]]


def journal_request(since: int, limit: int = PAGE_BYTES) -> JournalRequest:
    from .xray_messages import XRAY_VERSION

    return {"v": XRAY_VERSION, "ask": "journal", "since": since, "limit": limit}


def points_in(message: dict[str, Any]) -> int:
    """The live-view points a message carries."""
    return sum(len(series[1]) for series in message.get("metrics", {}).values())


def merge_messages(messages: Sequence[dict[str, Any]], thin: bool) -> dict[str, Any]:
    """Live-view messages `messages` (oldest first) as one, as the feed would have read them all: the
    points of each metric in order (every other one of them if `thin`, the last kept), the newest bar
    of each nesting level as it stood last (the live view shows no other: an older loop's bar at a
    level gave way to the next), the counters and state of the newest. It carries the sequence number
    of the newest and, as `first`, of the oldest: the feed counts no lost messages in between."""
    newest = messages[-1]
    metrics: dict[str, list[array[Any]]] = {}
    for message in messages:
        for name, (steps, values) in message.get("metrics", {}).items():
            kept = metrics.get(name)
            if kept is None:
                kept = metrics[name] = [array("q"), array("d")]
            kept[0] = _extended(kept[0], steps)
            kept[1].extend(values)
    if thin:
        for kept in metrics.values():
            start = (len(kept[1]) - 1) % 2  # the newest point stays
            kept[0], kept[1] = kept[0][start::2], kept[1][start::2]
    bars: dict[int, Any] = {}  # level -> its newest bar
    for message in messages:
        for bar in message.get("bars", []):
            level = bar.get("level", 0)
            if level not in bars or bar["id"] >= bars[level]["id"]:
                bars[level] = bar
    explicit = sorted({name for message in messages for name in message.get("explicit", [])})
    merged = {
        **newest,
        "first": messages[0].get("first", messages[0]["seq"]),
        "metrics": metrics,
        "explicit": explicit,
        "bars": [bars[key] for key in sorted(bars)],
    }
    steps = next((message["steps"] for message in reversed(messages) if "steps" in message), None)
    if steps is not None:
        merged["steps"] = steps
    return merged


def _extended(steps: array[Any], more: Sequence[float]) -> array[Any]:
    """`steps` with `more` after them: whole steps stay whole until a fractional one comes."""
    if steps.typecode == "q" and not all(isinstance(step, int) for step in more):
        steps = array("d", steps)
    same_kind = isinstance(more, array) and more.typecode == steps.typecode
    steps.extend(more if same_kind else list(more))
    return steps


def as_json(message: dict[str, Any]) -> dict[str, Any]:
    """A live-view message with its arrays as lists (the X-ray line is JSON)."""
    metrics = {name: [list(steps), list(values)] for name, (steps, values) in message.get("metrics", {}).items()}
    return {**message, "metrics": metrics}
