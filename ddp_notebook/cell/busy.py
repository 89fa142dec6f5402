"""What ranks still busy with a cell are doing, from their X-ray, for the messages that name them.

A rank left running after a cell ended (its peers failed while it computed, slept or waited) may be
blocked in a collective, or running code that knows nothing of the failure: a refusal of the next
cell says which, grouped ("ranks 1-127 running cell line 3, in no collective"), instead of assuming
a collective. Pure logic over the readings; imports nothing of torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from ..errors import name_ranks
from ..live.xray_readings import RankCollectives

# what the next cell's refusal and a cell's report tell the user to do about busy ranks
WHAT_TO_DO = "wait for them, stop them with %ddp_interrupt, or %ddp_restart"


def doing(reading: RankCollectives | None) -> str:
    """What one rank is doing, its seconds aside: "blocked in all_reduce #4 [1] (cell line 5)",
    "running cell line 3, in no collective"."""
    if reading is None:
        return "not answering (its X-ray thread is silent: the process may be stopped or swapping)"
    line = f" (cell line {reading.cell_line})" if reading.cell_line is not None else ""
    current = reading.current
    if current is not None:
        return f"blocked in {current.describe()}{line}"
    if reading.in_cell:
        where = f"cell line {reading.cell_line}" if reading.cell_line is not None else "the cell"
        return f"running {where}, in no collective"
    return "out of the cell's code (finishing it, or a request of the world)"


def describe(busy: Iterable[int], readings: Mapping[int, RankCollectives], now: float | None = None) -> str:
    """The busy ranks grouped by what they do, on one line: "ranks 1-2 running cell line 3, in no
    collective; rank 3 blocked in all_reduce #2 [1] (cell line 5) since 14:03:07"."""
    now = time.time() if now is None else now
    groups: dict[str, list[int]] = {}
    since: dict[str, float] = {}
    for rank in sorted(set(busy)):
        reading = readings.get(rank)
        what = doing(reading)
        groups.setdefault(what, []).append(rank)
        if reading is not None and reading.current is not None:
            began = now - reading.waited
            since[what] = min(since.get(what, began), began)
    parts = []
    for what, ranks in groups.items():
        clock = f" since {time.strftime('%H:%M:%S', time.localtime(since[what]))}" if what in since else ""
        parts.append(f"{name_ranks(ranks)} {what}{clock}")
    return "; ".join(parts)


def refusal(busy: Iterable[int], readings: Mapping[int, RankCollectives], now: float | None = None) -> str:
    """Why the next cell (a heal, a resize, a rollback) cannot run yet, and what to do."""
    return f"still busy with the last cell ({describe(busy, readings, now)}): {WHAT_TO_DO}"
