"""Runs on the ranks of a detached world: their newest cell's output, kept for a kernel that
attaches later (`%ddp_wait`), within the bounds `wire.journal` states.

What a cell sends the notebook goes to ipyparallel's controller, which drops it when no kernel
listens: a cell still running when its kernel died would be followed from the next kernel blind.
So a detached world's rank also writes down, as it is sent, what its cell prints and displays
(a hook on the engine's session, `ipp_process_adapter.watch_sent`), its live-view messages
(`channel`), what it told the notebook (`tell_notebook`), and its reply: how it ended. The rank's
X-ray thread answers `journal` requests from it, while the cell runs. Only the newest cell is
kept; a world that is not detached keeps nothing and pays nothing.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from ..wire import journal as wire
from ..wire.results import raised_at
from ..wire.xray_messages import XRAY_VERSION, error_answer
from .state import RANK

# the display messages a cell's rank sends on IOPub, and what the journal calls each
DISPLAY_KINDS = (("display_data", "display"), ("update_display_data", "update"), ("clear_output", "clear"))


class _Cell:
    """One cell's record on this rank."""

    def __init__(self, request: str, session: str, code: str) -> None:
        self.request = request
        self.session = session
        self.code = code
        self.started = time.time()
        self.ended: float | None = None
        self.status: wire.CellStatus = "running"
        self.error: wire.JournalError | None = None
        self.told: list[str] = []
        self.entries: list[list[Any]] = []  # [number, kind, payload, bytes, when]
        self.next = 0
        self.text_bytes = 0  # of the output kept, ENTRY_BYTES counted for each entry
        self.messages = 0  # live-view messages kept
        self.points = 0
        self.dropped_bytes = 0
        self.thinned = 0
        self.merged = 0

    def summary(self) -> wire.JournalCell:
        return {
            "id": self.request,
            "session": self.session,
            "code": self.code,
            "started": self.started,
            "ended": self.ended,
            "status": self.status,
            "error": self.error,
            "told": list(self.told),
            "first": self.entries[0][0] if self.entries else self.next,
            "next": self.next,
            "dropped_bytes": self.dropped_bytes,
            "thinned": self.thinned,
            "merged": self.merged,
        }


class CellJournal:
    """The newest cell of this rank, written from the main thread and ipykernel's IO thread, read
    from the X-ray thread: one lock around each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cell: _Cell | None = None

    # ------------------------------------------------------------------ written as the cell runs

    def begin(self, request: str, session: str, code: str) -> None:
        """A cell starts (`pre_run_cell`): the previous one's record goes."""
        with self._lock:
            self._cell = _Cell(request, session, code)

    def sent(self, msg_type: str, content: dict[str, Any], parent: dict[str, Any]) -> None:
        """A message the engine sends (any thread): kept when it is the current cell's output or reply."""
        cell = self._cell
        if cell is None or parent.get("msg_id") != cell.request:
            return  # an earlier cell's late output, a call of the notebook's own (apply_request)
        if msg_type == "stream":
            self._add(cell, "stream", {"name": content.get("name", "stdout"), "text": content.get("text", "")})
        elif (kind := next((kind for sent, kind in DISPLAY_KINDS if sent == msg_type), None)) is not None:
            self._add(cell, kind, content)
        elif msg_type == "execute_reply":
            with self._lock:
                cell.ended = time.time()
                cell.status = content.get("status", "ok")
                if cell.status == "error":
                    cell.error = {
                        "ename": str(content.get("ename", "")),
                        "evalue": str(content.get("evalue", "")),
                        "traceback": [str(line) for line in content.get("traceback") or ()],
                        "raised": raised_at(content.get("engine_info")),
                    }

    def data(self, message: dict[str, Any]) -> None:
        """A live-view message the rank's channel publishes (main thread)."""
        cell = self._cell
        if cell is not None and cell.status == "running":
            self._add(cell, "data", message)

    def told(self, key: str) -> None:
        """The rank told the notebook `key` (`wire.results`: its group broke, a snapshot is owed)."""
        cell = self._cell
        if cell is not None:
            with self._lock:
                cell.told.append(key)

    def _add(self, cell: _Cell, kind: str, payload: dict[str, Any]) -> None:
        with self._lock:
            size = 0
            if kind == "data":
                cell.points += wire.points_in(payload)
                cell.messages += 1
            else:
                text = len(payload["text"]) if kind == "stream" else len(json.dumps(payload, default=str))
                size = text + wire.ENTRY_BYTES
                cell.text_bytes += size
            cell.entries.append([cell.next, kind, payload, size, time.time()])
            cell.next += 1
            if cell.text_bytes > wire.TEXT_LIMIT_BYTES:
                _drop_oldest_text(cell)
            if cell.points > wire.POINTS_LIMIT:
                _merge_oldest_messages(cell, thin=True)
            elif cell.messages > wire.MESSAGES_LIMIT:
                _merge_oldest_messages(cell, thin=False)

    def footprint(self) -> wire.JournalFootprint:
        """What the newest cell's record holds now, against the bounds `wire.journal` states."""
        with self._lock:
            cell = self._cell
            if cell is None:
                return {"entries": 0, "text_bytes": 0, "messages": 0, "points": 0}
            return {
                "entries": len(cell.entries),
                "text_bytes": cell.text_bytes,
                "messages": cell.messages,
                "points": cell.points,
            }

    # ------------------------------------------------------------------ read from the X-ray thread

    def answer(self, since: int, limit: int) -> wire.JournalAnswer:
        """The cell and its entries from number `since`, about `limit` bytes of them (one at least)."""
        with self._lock:
            cell = self._cell
            if cell is None:
                return {"v": XRAY_VERSION, "cell": None, "entries": []}
            entries: list[list[Any]] = []
            budget = limit
            for number, kind, payload, size, when in cell.entries:
                if number < since:
                    continue
                if (budget <= 0 and entries) or limit <= 0:
                    break
                shown = wire.as_json(payload) if kind == "data" else payload
                entries.append([number, kind, shown, when])
                budget -= size or 16 * wire.points_in(payload) + 64
            return {"v": XRAY_VERSION, "cell": cell.summary(), "entries": entries}


def _drop_oldest_text(cell: _Cell) -> None:
    """Past the output bound: the oldest text and displays go, down to TEXT_KEPT_BYTES (the live
    view's points stay)."""
    kept = []
    for entry in cell.entries:
        if cell.text_bytes > wire.TEXT_KEPT_BYTES and entry[1] != "data":
            cell.text_bytes -= entry[3]
            cell.dropped_bytes += entry[3] - wire.ENTRY_BYTES  # the output's own bytes
            continue
        kept.append(entry)
    cell.entries = kept


def _merge_oldest_messages(cell: _Cell, thin: bool) -> None:
    """Past the messages or the points bound: the live-view messages but the newest RECENT_MESSAGES
    become one (`thin`: every other point of it dropped). It takes the place and the number of the
    oldest of them, which a kernel following the cell has read already: it never reads the merged
    one twice."""
    data = [entry for entry in cell.entries if entry[1] == "data"]
    older = data[: -wire.RECENT_MESSAGES] or data[:1]
    if len(older) < 1:
        return
    merged = wire.merge_messages([entry[2] for entry in older], thin=thin)
    gone = {id(entry) for entry in older}
    first = older[0]
    cell.entries = [
        [first[0], "data", merged, 0, first[4]] if entry is first else entry
        for entry in cell.entries
        if entry is first or id(entry) not in gone
    ]
    cell.points = sum(wire.points_in(entry[2]) for entry in cell.entries if entry[1] == "data")
    cell.messages -= len(older) - 1
    cell.merged += len(older) - 1
    cell.thinned += thin


def keep(shell: Any) -> CellJournal:
    """Keep this rank's cells from now on (`shell`: a detached world's rank's, as it first joins)."""
    if RANK.journal is not None:
        return RANK.journal
    from . import ipp_process_adapter as adapter

    journal = RANK.journal = CellJournal()

    def before_cell(info: Any = None) -> None:
        request, session = adapter.current_request(shell)
        journal.begin(request, session, getattr(info, "raw_cell", "") or "")

    shell.events.register("pre_run_cell", before_cell)
    adapter.watch_sent(shell, journal.sent)
    return journal


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The X-ray's `journal` request, answered."""
    if RANK.journal is None:
        return dict(error_answer("this rank keeps no journal: its world is not detached"))
    since, limit = int(request.get("since", 0)), int(request.get("limit", wire.PAGE_BYTES))
    return dict(RANK.journal.answer(since, limit))
