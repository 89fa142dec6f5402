"""Ranks that say the same, on one line: the grouped lines of the reports and views, at every size.

Pure text over (rank, what it says) pairs; the relay's reports, the X-ray and the live views use them.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import group_ranks, name_counted


def grouped_lines(described: Iterable[tuple[int, str]]) -> list[str]:
    """The ranks that say the same share a line, in the order of their lowest rank, at every world
    size: `rank 3: what`, `ranks 1-15: what`, `ranks 0-4, 6-1023 (1,023 ranks): what`."""
    return [f"{name_counted(ranks)}: {what}" for what, ranks in group_ranks(described).items()]


def grouped_waits(places: Iterable[tuple[int, str, float | None]], waited: str = " for {}") -> list[str]:
    """`grouped_lines` of (rank, where it is, the seconds it waited there or None): the ranks in the
    same place share a line, ended by how long they waited there, written into `waited`
    (" for 4.0-4.6 s")."""
    seconds: dict[str, list[float]] = {}
    described = []
    for rank, place, wait in places:
        if wait is not None:
            seconds.setdefault(place, []).append(wait)
        described.append((rank, place))
    ranges = {place: waited.format(seconds_range(values)) for place, values in seconds.items()}
    return grouped_lines((rank, place + ranges.get(place, "")) for rank, place in described)


def seconds_range(seconds: list[float]) -> str:
    """ "4.0 s", or "4.0-4.6 s" where they differ at a tenth."""
    low, high = f"{min(seconds):.1f}", f"{max(seconds):.1f}"
    return f"{low} s" if low == high else f"{low}-{high} s"
