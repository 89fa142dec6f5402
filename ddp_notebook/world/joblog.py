"""A batch job's log, read as it grows and shown the way `%%ddp` shows a cell: `[rank N] ...`.

Kernel side, standard library only. The log holds every line of every node: `srun --label`
puts the node's index first (`1: ...`), torchrun `--tee` puts the rank's global rank after it
(`1: [rank 1]:...`), and lines with neither come from the batch script itself. What the notebook
shows: rank 0's lines, the error lines of any rank (a traceback whole, a warning with its
source line) and of any node's torchrun (what follows its first error too: the root-cause
summary), and the batch script's own lines; `everything=True` shows every line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..cell.output import rank_prefix

_LINE = re.compile(r"^\s*(?:(?P<node>\d+): )?(?:\[rank (?P<rank>\d+)\]:)?(?P<text>.*)$")
# torch prefixes an uncaught error on a rank with its own "[rankN]: ": the line is tagged already
_TORCH_TAG = re.compile(r"^\[rank\d+\]: ?")
_SEVERE = re.compile(
    r"Traceback \(most recent call last\)|Error\b|Exception\b|error:|FAILED|CANCELLED|Killed|terminate called|"
    r"^\[?[EF]\d{4} "
)
_WARNING = re.compile(r"Warning\b|warning:|WARNING|^\[?W\d{4} ")
_TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class LogLine:
    """One line of the log: who wrote it (a rank, a node's torchrun, or the batch script)."""

    text: str
    rank: int | None = None
    node: int | None = None

    @property
    def tagged(self) -> str:
        if self.rank is not None:
            return f"{rank_prefix(self.rank)}{self.text}"
        if self.node is not None:
            return f"[node {self.node}] {self.text}"
        return self.text


def parse(raw: str) -> LogLine:
    """`1: [rank 1]:text` -> LogLine('text', rank=1, node=1)."""
    found = _LINE.match(raw.rstrip("\n"))
    assert found is not None  # the pattern matches any line
    rank, node = found["rank"], found["node"]
    text = found["text"]
    if rank is not None:
        text = _TORCH_TAG.sub("", text)
    return LogLine(text, int(rank) if rank is not None else None, int(node) if node is not None else None)


@dataclass
class LogFilter:
    """Which lines the notebook shows, line by line (errors span lines: it keeps per-writer state)."""

    everything: bool = False
    # writer -> "traceback" (until its last, unindented line), "indented" (while lines are
    # indented: a warning's source line) or "sticky" (a node's torchrun after its first error)
    _open: dict[tuple[str, int], str] = field(default_factory=dict)

    def keep(self, line: LogLine) -> bool:
        if line.rank is None and line.node is None:
            return True  # the batch script's own lines, srun's errors
        writer = ("rank", line.rank) if line.rank is not None else ("node", line.node or 0)
        if self._continues(writer, line.text):
            return True
        severe = _SEVERE.search(line.text) is not None
        if severe or _WARNING.search(line.text):
            if _TRACEBACK in line.text:
                self._open[writer] = "traceback"
            else:
                self._open[writer] = "sticky" if severe and line.rank is None else "indented"
            return True
        return self.everything or line.rank == 0

    def _continues(self, writer: tuple[str, int], text: str) -> bool:
        """Whether `text` belongs to the error block `writer` has open (and close it where it ends)."""
        mode = self._open.get(writer)
        if mode is None:
            return False
        indented = text[:1].isspace()
        if mode == "sticky":
            return True
        if mode == "traceback":
            if not indented and text.strip() and _TRACEBACK not in text:
                del self._open[writer]  # the exception's own line: the last one
            return True
        if indented:
            return True
        del self._open[writer]
        return False

    def __call__(self, raw: str) -> str | None:
        """The line as the notebook shows it, or None to leave it out."""
        line = parse(raw)
        return line.tagged if self.keep(line) else None


@dataclass
class LogReader:
    """The lines a growing file gained since the last read (a line still being written waits)."""

    path: str
    offset: int = 0
    _partial: bytes = b""

    def new_lines(self) -> Iterator[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return  # not yet: a pending job has written nothing
        self.offset += len(chunk)
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        for line in complete:
            yield line.decode("utf-8", errors="replace")

    def rest(self) -> Iterator[str]:
        """Every line left, the unfinished last one included (the job has ended)."""
        yield from self.new_lines()
        if self._partial:
            last, self._partial = self._partial, b""
            yield last.decode("utf-8", errors="replace")

    @property
    def exists(self) -> bool:
        return os.path.exists(self.path)
