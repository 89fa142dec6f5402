"""Rank output as the notebook shows it: whole lines, each tagged `[rank N] `.

The one place that formats rank-tagged text: streamed lines, output collected until the
cell ended, and each rank's last value.

Ranks send stdout/stderr in chunks that can split a line anywhere; `LineAssembler` keeps the
partial line of each (rank, stream) until it is complete, so tags never land mid-line. The
cost is linear in what is printed: each chunk is handled once and never re-sent
(ipyparallel's `%%px --stream` re-sends the whole accumulated output on every update).
"""

from __future__ import annotations

from collections.abc import Iterable


def rank_prefix(rank: int) -> str:
    return f"[rank {rank}] "


def tag_lines(rank: int, lines: Iterable[str]) -> str:
    """Prefix each line with its rank; returns text ending in a newline (or empty)."""
    prefix = rank_prefix(rank)
    return "".join(f"{prefix}{line}\n" for line in lines)


def tag_text(rank: int, text: str) -> str:
    """A block of output (as collected from a rank) with every line tagged."""
    if not text:
        return ""
    return tag_lines(rank, text.rstrip("\n").split("\n"))


def tag_value(rank: int, text: str) -> str:
    """A rank's last-expression value, like a kernel's Out[]: continuation lines indented under it."""
    prefix = f"{rank_prefix(rank)}Out: "
    first, *rest = text.split("\n")
    indent = " " * len(prefix)
    return prefix + first + "".join("\n" + indent + line for line in rest)


def _settle_carriage_returns(line: str) -> str:
    # a progress bar redraws its line with '\r': only the last drawing is worth showing
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


class LineAssembler:
    """Reassembles chunks of text into whole lines, per (rank, stream)."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}

    def feed(self, rank: int, stream: str, text: str) -> list[str]:
        """Add a chunk; return the lines it completed (without newlines)."""
        if not text:
            return []
        key = (rank, stream)
        pending = self._partial.pop(key, "") + text
        *complete, rest = pending.split("\n")
        if rest:
            self._partial[key] = rest
        return [_settle_carriage_returns(line) for line in complete]

    def drawing(self, rank: int, stream: str) -> str | None:
        """The latest drawing of an unfinished line that redraws itself with '\\r' (a text progress
        bar such as plain tqdm's), or None: such a line is complete only when the bar closes."""
        rest = self._partial.get((rank, stream), "")
        if "\r" not in rest:
            return None
        return _settle_carriage_returns(rest) or None

    def flush(self, rank: int, stream: str) -> list[str]:
        """Return what is left of an unfinished last line, if anything."""
        rest = self._partial.pop((rank, stream), "")
        settled = _settle_carriage_returns(rest)
        return [settled] if settled else []

    def flush_all(self) -> list[tuple[int, str, str]]:
        """Every unfinished line as (rank, stream, line), in rank order."""
        leftovers = []
        for rank, stream in sorted(self._partial):
            for line in self.flush(rank, stream):
                leftovers.append((rank, stream, line))
        return leftovers
