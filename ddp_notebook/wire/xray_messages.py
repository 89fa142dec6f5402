"""What the notebook asks a rank's X-ray, and what the rank answers: one typed message each.

Each request names what it asks for (`ask`) and carries the version of this format (`v`);
each answer carries the version too. A rank that gets a request of another version answers
with an error that names both versions (ranks on another host may run another install), and
the notebook takes an answer of another version as no answer. A new optional field keeps the
version (readers ignore what they do not know, and take a missing one as absent); a field
whose meaning changes, or a new required one, needs the next version.

Standard library only: the notebook kernel and the ranks both import this.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from .channel import StepsMessage

XRAY_VERSION = 1

# what a rank says at the start where its torch keeps no flight recorder for its backend (torch 2.6's
# gloo) and its own record of the collectives it enters stands in (`rank.collective_record`)
OWN_RECORD_LIMIT = (
    "the X-ray sees only the collectives cells call through torch.distributed, not DDP's gradient "
    "all-reduce: this torch's gloo keeps no flight recorder (torch 2.9 has one)"
)


# ---------------------------------------------------------------- requests


class ReportRequest(TypedDict):
    """The rank's collectives, cell line, step times, memory and debugger state."""

    v: int
    ask: Literal["report"]
    full: bool  # False: a running collective's entries only once it has run a moment (cheap)


class ReleaseRequest(TypedDict):
    """Shut the rank's process-group connections, so a collective it is blocked in fails."""

    v: int
    ask: Literal["release"]


class StackRequest(TypedDict):
    """The main thread's Python frames, read from the X-ray thread."""

    v: int
    ask: Literal["stack"]


class DebugRequest(TypedDict):
    """One line for the rank's waiting pdb (None: only look at what it printed)."""

    v: int
    ask: Literal["debug"]
    line: str | None


class WatchRequest(TypedDict):
    """Keep this connection open for the rank's life: its closing tells the notebook the process
    ended, sooner than the controller's heartbeat (TCP, ranks on other hosts)."""

    v: int
    ask: Literal["watch"]


Request = ReportRequest | ReleaseRequest | StackRequest | DebugRequest | WatchRequest


def report_request(full: bool = True) -> ReportRequest:
    return {"v": XRAY_VERSION, "ask": "report", "full": full}


def release_request() -> ReleaseRequest:
    return {"v": XRAY_VERSION, "ask": "release"}


def stack_request() -> StackRequest:
    return {"v": XRAY_VERSION, "ask": "stack"}


def debug_request(line: str | None) -> DebugRequest:
    return {"v": XRAY_VERSION, "ask": "debug", "line": line}


def watch_request() -> WatchRequest:
    return {"v": XRAY_VERSION, "ask": "watch"}


# ---------------------------------------------------------------- answers


class CollectiveEntry(TypedDict):
    """One collective of the default group, from the flight recorder (or strict mode's check)."""

    seq: int  # the group's collective sequence number
    op: str  # allreduce, broadcast, ...
    shapes: list[list[int]]  # of its input tensors
    dtypes: list[str]
    retired: bool  # finished
    created_ns: int  # when it was enqueued (the rank's wall clock)


class DebuggerStatus(TypedDict):
    waiting: bool  # pdb waits for the user's next line


class ReportAnswer(TypedDict):
    v: int
    entries: list[CollectiveEntry]  # the recent finished collectives, then the running one(s)
    last_done: int  # the sequence number of the last finished collective
    cell_line: int | None  # the running cell's line in the main thread's stack
    in_cell: bool  # the main thread is in a cell at all
    now_ns: int  # the rank's wall clock at the answer: how long the running collective has waited
    steps: StepsMessage | None  # the recent training steps' means (models from prepare_model)
    memory: dict[str, int]  # rss, and cuda_allocated / cuda_reserved / cuda_peak on a GPU rank
    debugger: DebuggerStatus | None  # a pdb session is open on the rank


class ReleaseAnswer(TypedDict):
    v: int
    released: int  # connections shut


class StackAnswer(TypedDict):
    v: int
    frames: list[tuple[str, int, str]]  # (file, line, function), innermost first


class _DebugBusy(TypedDict, total=False):
    busy: bool  # the line did not bring pdb back to its prompt in time


class DebugAnswer(_DebugBusy):
    v: int
    output: str  # what pdb printed since the last answer
    waiting: bool  # pdb waits for the next line
    active: bool  # the session is still open


class WatchAnswer(TypedDict):
    v: int
    watching: bool  # the rank holds the connection open until its process ends


class ErrorAnswer(TypedDict):
    v: int
    error: str


Answer = ReportAnswer | ReleaseAnswer | StackAnswer | DebugAnswer | WatchAnswer | ErrorAnswer


def error_answer(text: str) -> ErrorAnswer:
    return {"v": XRAY_VERSION, "error": text}


def version_problem(message: object) -> str | None:
    """Why `message` (a request or an answer) is not of this format's version; None if it is."""
    version = message.get("v") if isinstance(message, dict) else None
    if version == XRAY_VERSION:
        return None
    return (
        f"X-ray message version {version!r}, this side reads version {XRAY_VERSION}: "
        "install the same ddp_notebook on every host"
    )
