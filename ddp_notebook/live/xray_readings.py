"""The collective X-ray's readings as data: what each rank said about its collectives at one moment.

`cell.xray` asks the ranks and watches the readings for a mismatch; the live view draws them
(where each rank waits, once one waited a while). Plain values, parsed from the wire's answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..wire import xray_messages as messages
from .stragglers import StepTimes


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued on the default group, as torch's flight recorder saw it."""

    seq: int
    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    done: bool
    created_ns: int

    def describe(self) -> str:
        shapes = ", ".join("[" + ", ".join(map(str, shape)) + "]" for shape in self.shapes)
        return f"{self.op} #{self.seq} {shapes}".rstrip()

    def signature(self) -> tuple[int, str, tuple[tuple[int, ...], ...]]:
        return (self.seq, self.op, self.shapes)


@dataclass(frozen=True)
class RankCollectives:
    """What one rank said about its collectives at one moment."""

    rank: int
    history: tuple[Collective, ...]  # oldest first; the last few finished ones, then the running ones
    cell_line: int | None  # the line of the cell its main thread is on
    in_cell: bool
    now_ns: int  # the rank's clock when it answered
    steps: StepTimes | None = None  # its recent training steps, phase by phase (`timing`)
    memory: Mapping[str, int] = field(default_factory=dict)  # rss, and cuda_* where it uses a GPU
    debugger: bool = False  # a pdb session on it waits for the user
    last_done: int = 0  # the sequence number of its last finished collective (also when history is empty)

    @property
    def current(self) -> Collective | None:
        """The collective the rank waits in (the oldest one not finished), or None."""
        return next((c for c in self.history if not c.done), None)

    @property
    def last_seq(self) -> int:
        return max([c.seq for c in self.history] + [self.last_done])

    @property
    def waited(self) -> float:
        current = self.current
        return 0.0 if current is None else max(0.0, (self.now_ns - current.created_ns) / 1e9)

    def describe(self, waited: bool = True) -> str:
        """One line: where the rank is (and how long it waited there), then its last finished collectives."""
        current = self.current
        line = f" (cell line {self.cell_line})" if self.cell_line is not None else ""
        if current is not None:
            head = f"in {current.describe()}{line}" + (f", waiting {self.waited:.1f} s" if waited else "")
        elif self.in_cell:
            head = f"running the cell{line}, in no collective"
        else:
            head = "idle"
        finished = [c for c in self.history if c.done][-3:]
        if finished:
            head += "; last: " + ", ".join(c.describe() for c in finished)
        return head


def parse_report(rank: int, answer: messages.ReportAnswer) -> RankCollectives:
    history = tuple(
        Collective(
            seq=int(entry["seq"]),
            op=str(entry["op"]),
            shapes=tuple(tuple(int(n) for n in shape) for shape in entry.get("shapes", ())),
            dtypes=tuple(str(d) for d in entry.get("dtypes", ())),
            done=bool(entry.get("retired")),
            created_ns=int(entry.get("created_ns", 0)),
        )
        for entry in answer.get("entries", ())
    )
    line = answer.get("cell_line")
    return RankCollectives(
        rank=rank,
        history=history,
        cell_line=int(line) if line is not None else None,
        in_cell=bool(answer.get("in_cell")),
        now_ns=int(answer.get("now_ns", 0)),
        steps=StepTimes.parse(answer.get("steps")),
        memory={str(k): int(v) for k, v in (answer.get("memory") or {}).items()},
        debugger=bool(answer.get("debugger")),
        last_done=int(answer.get("last_done") or 0),
    )
