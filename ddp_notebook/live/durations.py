"""Durations as the live view, the profiler's report and the straggler's description write them."""

from __future__ import annotations


def milliseconds(seconds: float, *, unit: bool = True, digits: int = 1) -> str:
    """'12.0 ms' ('12.0' in a table whose header carries the unit)."""
    text = f"{seconds * 1000:.{digits}f}"
    return f"{text} ms" if unit else text
