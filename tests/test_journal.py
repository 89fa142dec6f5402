"""A detached world's cell journal, pure logic: what a rank keeps of its newest cell (`rank.cell_journal`),
within its bounds, how a kernel reads it a page at a time (`wire.journal`), and what the live view makes
of merged messages (`live.feed`). The journal in real ranks and kernels: tests/test_detached_world.py."""

from __future__ import annotations

import time
from array import array
from typing import Any

import pytest

from ddp_notebook.live.feed import Feed
from ddp_notebook.rank.cell_journal import CellJournal
from ddp_notebook.wire import journal as wire
from ddp_notebook.wire.channel import MESSAGE_VERSION, message_key
from ddp_notebook.wire.results import ERROR_RAISED_KEY
from ddp_notebook.world.earlier_cell import EarlierCell

CELL = {"msg_id": "cell-1", "msg_type": "execute_request", "session": "kernel-a"}


def message(seq: int, start: int, count: int, bars: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A live-view message of `count` loss points, steps start.., as a rank's channel publishes it."""
    values = array("d", [1.0 / (1 + i) for i in range(count)])
    return {
        "v": MESSAGE_VERSION,
        "seq": seq,
        "t": float(seq),
        "count": start + count,
        "calls": start + count,
        "metrics": {"loss": [array("q", range(start, start + count)), values]},
        "explicit": [],
        "bars": bars or [],
        "state": "running",
    }


def started_journal() -> CellJournal:
    journal = CellJournal()
    journal.begin("cell-1", "kernel-a", "for step in range(10):\n    train()")
    return journal


def test_a_cells_output_displays_and_reply_are_kept_and_nothing_else() -> None:
    journal = started_journal()
    journal.sent("stream", {"name": "stdout", "text": "step 0\n"}, CELL)
    journal.sent("stream", {"name": "stdout", "text": "late\n"}, {**CELL, "msg_id": "cell-0"})  # an earlier cell's
    journal.sent("stream", {"name": "stdout", "text": "pull\n"}, {"msg_id": "call", "msg_type": "apply_request"})
    journal.sent("display_data", {"data": {"text/plain": "fig"}, "metadata": {}}, CELL)
    journal.sent("clear_output", {"wait": True}, CELL)
    journal.sent("status", {"execution_state": "busy"}, CELL)
    journal.data(message(0, 0, 3))
    answer = journal.answer(0, wire.PAGE_BYTES)
    assert [entry[:2] for entry in answer["entries"]] == [[0, "stream"], [1, "display"], [2, "clear"], [3, "data"]]
    assert answer["entries"][3][2]["metrics"]["loss"][0] == [0, 1, 2], "arrays answered as JSON lists"
    cell = answer["cell"]
    assert cell is not None and (cell["status"], cell["ended"], cell["session"]) == ("running", None, "kernel-a")
    reply = {"status": "error", "ename": "ValueError", "evalue": "bad", "traceback": ["tb 1", "tb 2"]}
    journal.sent("execute_reply", {**reply, "engine_info": {ERROR_RAISED_KEY: 12.5}}, CELL)
    cell = journal.answer(0, 0)["cell"]
    assert cell is not None and cell["status"] == "error" and cell["ended"] is not None
    # when it raised, as the reply says: a detached world's root cause is the rank that raised first
    assert cell["error"] == {"ename": "ValueError", "evalue": "bad", "traceback": ["tb 1", "tb 2"], "raised": 12.5}
    journal.begin("cell-1", "kernel-a", "1 / 0")
    journal.sent("execute_reply", reply, CELL)  # a reply that does not say: None
    assert journal.answer(0, 0)["cell"]["error"]["raised"] is None  # type: ignore[index]
    journal.told("ddp_notebook.group_broken")
    assert journal.answer(0, 0)["cell"]["told"] == ["ddp_notebook.group_broken"]  # type: ignore[index]
    journal.begin("cell-2", "kernel-b", "x = 1")  # the next cell: the previous one's record goes
    assert journal.answer(0, wire.PAGE_BYTES)["entries"] == []


def test_a_kernel_reads_a_page_at_a_time_from_where_it_stopped() -> None:
    journal = started_journal()
    for step in range(10):
        journal.sent("stream", {"name": "stdout", "text": f"{step:03d}" * 100 + "\n"}, CELL)  # 301 bytes each
    assert wire.ENTRY_BYTES == 128  # each entry costs 429 bytes of a page: three of them 1,287
    first = journal.answer(0, 1300)["entries"]
    assert [entry[0] for entry in first] == [0, 1, 2, 3], "a page stops once its bytes are spent"
    rest = journal.answer(first[-1][0] + 1, 10_000)["entries"]
    assert [entry[0] for entry in rest] == list(range(4, 10))
    assert journal.answer(0, 1)["entries"][0][0] == 0, "a page holds one entry at least"
    assert journal.answer(10, wire.PAGE_BYTES)["entries"] == [] and journal.answer(0, 0)["entries"] == []
    times = [entry[3] for entry in first + rest]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 60, "each entry says when it was sent"


def test_past_the_output_bound_the_oldest_text_goes_and_is_counted() -> None:
    journal = started_journal()
    line = "x" * 1023 + "\n"
    per_limit = wire.TEXT_LIMIT_BYTES // (len(line) + wire.ENTRY_BYTES)
    journal.data(message(0, 0, 5))
    for _ in range(per_limit):
        journal.sent("stream", {"name": "stdout", "text": line}, CELL)
    assert journal.answer(0, 0)["cell"]["dropped_bytes"] == 0, "up to the bound, everything"  # type: ignore[index]
    count = per_limit + 10
    for _ in range(10):
        journal.sent("stream", {"name": "stdout", "text": line}, CELL)
    answer = journal.answer(0, 1 << 30)
    cell = answer["cell"]
    texts = [entry for entry in answer["entries"] if entry[1] == "stream"]
    kept = sum(len(entry[2]["text"]) for entry in texts)
    assert cell is not None and cell["dropped_bytes"] + kept == count * len(line), "every byte kept or counted"
    # once past the bound, down to three quarters of it in one pass (then the lines that came after)
    dropped_lines = cell["dropped_bytes"] // len(line)
    assert dropped_lines * (len(line) + wire.ENTRY_BYTES) >= wire.TEXT_LIMIT_BYTES - wire.TEXT_KEPT_BYTES
    assert kept <= wire.TEXT_KEPT_BYTES + 10 * len(line)
    assert [entry[0] for entry in texts] == list(range(count + 1 - len(texts), count + 1)), "the newest, in order"
    assert answer["entries"][0][1] == "data", "the live view's points are not output: they stay"
    assert cell["first"] == 0


def test_past_the_points_bound_the_oldest_are_merged_and_thinned_and_a_follower_reads_none_twice() -> None:
    journal = started_journal()
    per_message = 1000
    messages = wire.POINTS_LIMIT // per_message + wire.RECENT_MESSAGES + 20
    seen: list[list[Any]] = []
    read_from = 0
    for seq in range(messages):
        journal.data(message(seq, seq * per_message, per_message, bars=[{"id": 0, "n": seq, "state": "running"}]))
        if seq % 7 == 0:  # a kernel following the cell reads as it goes
            page = journal.answer(read_from, wire.PAGE_BYTES)["entries"]
            seen.extend(page)
            read_from = page[-1][0] + 1 if page else read_from
    seen.extend(journal.answer(read_from, 1 << 30)["entries"])
    numbers = [entry[0] for entry in seen]
    assert numbers == sorted(set(numbers)) == list(range(messages)), "every message read once, in order"
    kept = journal.answer(0, 1 << 30)
    cell = kept["cell"]
    assert cell is not None and cell["thinned"] >= 1
    points = sum(len(entry[2]["metrics"]["loss"][1]) for entry in kept["entries"])
    assert points <= wire.POINTS_LIMIT
    merged = kept["entries"][0][2]
    assert kept["entries"][0][0] == 0 and merged["first"] == 0 and merged["seq"] > 0
    steps = merged["metrics"]["loss"][0]
    assert steps == sorted(steps) and steps[0] <= per_message, "the curve keeps its start, at a coarser step"
    following = kept["entries"][1][2]
    assert following["seq"] == merged["seq"] + 1, "merged up to the message that follows it"
    assert following["metrics"]["loss"][0][0] == steps[-1] + 1, "the newest merged point stays"


def test_merged_messages_read_as_the_feed_would_have_read_them_all() -> None:
    first = message(
        0, 0, 4, bars=[{"id": 0, "level": 0, "desc": "", "n": 4, "total": 10, "elapsed": 1.0, "state": "running"}]
    )
    second = message(
        1, 4, 3, bars=[{"id": 0, "level": 0, "desc": "", "n": 7, "total": 10, "elapsed": 2.0, "state": "running"}]
    )
    second["metrics"]["loss"][0] = array("d", [4.5, 5.5, 6.5])  # fractional steps: the merged steps become floats
    second["explicit"] = ["loss"]
    merged = wire.merge_messages([first, second], thin=False)
    assert list(merged["metrics"]["loss"][0]) == [0, 1, 2, 3, 4.5, 5.5, 6.5]
    assert merged["metrics"]["loss"][0].typecode == "d" and merged["explicit"] == ["loss"]
    assert [bar["n"] for bar in merged["bars"]] == [7] and (merged["seq"], merged["first"]) == (1, 0)
    thinned = wire.merge_messages([first, second], thin=True)
    assert list(thinned["metrics"]["loss"][0]) == [0, 2, 4.5, 6.5], "every other point, the newest kept"
    again = wire.merge_messages([thinned, message(2, 7, 2)], thin=False)
    assert again["first"] == 0 and again["seq"] == 2

    feed = Feed()
    feed(0, {message_key(merged["seq"]): wire.as_json(merged)})
    feed(0, {message_key(2): wire.as_json(message(2, 7, 2))})
    assert feed.ranks[0].lost == 0, "a merged message stands for the messages it holds: none lost"
    assert list(feed.metrics.series("loss", 0)[0]) == [0, 1, 2, 3, 4.5, 5.5, 6.5, 7, 8]
    feed(0, {message_key(5): wire.as_json(message(5, 9, 1))})
    assert feed.ranks[0].lost == 2, "a real gap still counts"


@pytest.mark.parametrize(
    ("statuses", "said"),
    [
        (("running", "running"), "still runs on ranks 0-1: %ddp_wait shows its output and follows it"),
        (("ok", "error"), "failed on rank 1 "),
        (("ok", "ok"), "and ended "),
    ],
)
def test_attach_says_what_the_earlier_cell_does(statuses: tuple[str, str], said: str) -> None:
    now = time.time()
    journals = {
        rank: {
            "id": f"r{rank}",
            "session": "kernel-a",
            "code": "\n# train\nfor epoch in range(100):  # a long line, cut at forty characters\n",
            "started": now - 300,
            "ended": None if status == "running" else now - 30,
            "status": status,
            "error": None,
            "told": [],
            "first": 0,
            "next": 0,
            "dropped_bytes": 0,
            "thinned": 0,
        }
        for rank, status in enumerate(statuses)
    }
    line = EarlierCell(journals).describe(now)  # type: ignore[arg-type]
    assert line.startswith("a cell sent by an earlier kernel ('# train') began 5 min ago"), line
    assert said in line, line


def test_a_cell_printing_a_character_at_a_time_is_bounded_as_one_printing_long_lines() -> None:
    journal = started_journal()
    count = 3 * wire.TEXT_LIMIT_BYTES // wire.ENTRY_BYTES
    for step in range(count):
        journal.sent("stream", {"name": "stdout", "text": "\r" if step % 2 else "."}, CELL)
    footprint = journal.footprint()
    assert footprint["text_bytes"] <= wire.TEXT_LIMIT_BYTES, footprint
    assert footprint["entries"] <= wire.TEXT_LIMIT_BYTES // wire.ENTRY_BYTES, "each entry counts what it costs"
    cell = journal.answer(0, 0)["cell"]
    assert cell is not None
    assert cell["dropped_bytes"] + footprint["entries"] == count, "the characters dropped, not their cost"


def bar(bar_id: int, level: int, n: int, total: int, state: str = "running") -> dict[str, Any]:
    return {
        "id": bar_id,
        "level": level,
        "desc": f"epoch {bar_id}",
        "n": n,
        "total": total,
        "elapsed": n * 0.1,
        "state": state,
    }


def test_past_the_messages_bound_bars_and_counters_merge_to_their_latest_and_a_follower_reads_none_twice() -> None:
    """Messages with no point (a progress bar's, a counter's every 0.1 s) count against their own bound:
    a night of them is one merged message and the newest few, which the live view reads as it would
    have read them all."""
    journal = started_journal()
    every = Feed()
    per_epoch = 50
    messages = 3 * wire.MESSAGES_LIMIT
    seen: list[list[Any]] = []
    read_from = 0
    for seq in range(messages):
        epoch, n = divmod(seq, per_epoch)
        bars = [bar(epoch, 1, n + 1, per_epoch, "done" if n + 1 == per_epoch else "running")]
        if n == 0:
            bars.insert(0, bar(10_000, 0, epoch, messages // per_epoch))  # the outer loop steps once an epoch
        sent = {**message(seq, 0, 0, bars=bars), "metrics": {}, "count": seq, "calls": seq}
        journal.data(sent)
        every(0, {message_key(seq): wire.as_json(sent)})
        if seq % 13 == 0:  # a kernel following the cell reads as it goes
            page = journal.answer(read_from, wire.PAGE_BYTES)["entries"]
            seen.extend(page)
            read_from = page[-1][0] + 1 if page else read_from
        assert journal.footprint()["messages"] <= wire.MESSAGES_LIMIT
    seen.extend(journal.answer(read_from, 1 << 30)["entries"])
    numbers = [entry[0] for entry in seen]
    assert numbers == sorted(set(numbers)) == list(range(messages)), "every message read once, in order"
    kept = journal.answer(0, 1 << 30)
    cell = kept["cell"]
    assert cell is not None and cell["merged"] >= messages - wire.MESSAGES_LIMIT and cell["thinned"] == 0
    merged = kept["entries"][0][2]
    assert len(merged["bars"]) == 2, "one bar per nesting level, not one per loop that ever ran"
    later = Feed()  # a kernel attaching after the night reads what is kept
    for _number, _, payload, _ in kept["entries"]:
        later(0, {message_key(payload["seq"]): payload})
    assert later.ranks[0].lost == 0 and later.ranks[0].count == every.ranks[0].count == messages - 1
    assert {key: (b.id, b.n, b.total, b.state) for key, b in later.bars.items()} == {
        key: (b.id, b.n, b.total, b.state) for key, b in every.bars.items()
    }, "the final bars as a kernel that saw every message shows them"
