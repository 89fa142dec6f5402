"""Stragglers named: from each rank's recent step times (phase by phase), the slow rank and why.

A slow rank makes every peer wait for it in the gradient all-reduce, so wall time per step is
the same everywhere; the time a rank spends outside communication is what differs. The
straggler is the rank with the most of it, and its phase is the one (data, compute, optimizer)
where it spends most beyond its peers. Plain data; imports nothing of torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .durations import milliseconds

# a rank is named only when it is this much slower than its peers' median, and by at least this much
SLOWER_FACTOR = 1.2
SLOWER_SECONDS = 0.002
PHASES = ("data", "compute", "comm", "optimizer")


@dataclass(frozen=True)
class StepTimes:
    """One rank's mean seconds per step over its recent steps."""

    steps: int  # steps timed since the model was prepared
    total: float
    data: float
    compute: float
    comm: float
    optimizer: float

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> StepTimes | None:
        if not raw:
            return None
        return cls(int(raw["steps"]), *(float(raw[key]) for key in ("total", *PHASES)))

    @property
    def busy(self) -> float:
        """Time outside communication: what the rank itself took."""
        return self.total - self.comm

    def describe(self) -> str:
        parts = ", ".join(f"{phase} {milliseconds(getattr(self, phase))}" for phase in PHASES)
        return f"{milliseconds(self.total)}/step ({parts}) over {self.steps} steps"


@dataclass(frozen=True)
class Straggler:
    rank: int
    phase: str
    busy: float  # its seconds per step outside communication
    peers_busy: float  # the median of the others'

    def headline(self) -> str:
        """'rank 1 is the straggler: 1.6x, compute (+50.0 ms per step)', for the live view."""
        ratio = f"{self.busy / self.peers_busy:.1f}x, " if self.peers_busy > 0 else ""
        extra = milliseconds(self.busy - self.peers_busy)
        return f"rank {self.rank} is the straggler: {ratio}{self.phase} (+{extra} per step)"

    def describe(self) -> str:
        return describe_straggler(self.rank, self.busy, self.peers_busy, f"in {self.phase}")


def describe_straggler(rank: int, busy: float, peers_busy: float, mostly: str) -> str:
    """The straggler in a sentence, from the live panel's step times or the profiler's traces alike."""
    ratio = f", {busy / peers_busy:.1f}x" if peers_busy > 0 else ""
    return (
        f"rank {rank} is the straggler: {milliseconds(busy)} per step outside communication vs "
        f"{milliseconds(peers_busy)} on the others (+{milliseconds(busy - peers_busy)}{ratio}), mostly {mostly}"
    )


def find_straggler(times: Mapping[int, StepTimes]) -> Straggler | None:
    """The rank clearly slower than its peers, with the phase it loses time in; None if none is."""
    phases = {
        rank: {phase: getattr(t, phase) for phase in ("data", "compute", "optimizer")} for rank, t in times.items()
    }
    found = clear_straggler({rank: t.busy for rank, t in times.items()}, phases)
    return Straggler(*found) if found is not None else None


def clear_straggler(
    busy: Mapping[int, float], phases: Mapping[int, Mapping[str, float]]
) -> tuple[int, str, float, float] | None:
    """(rank, phase, its busy seconds, the peers' median) of the rank clearly slower than its peers
    (SLOWER_FACTOR times and SLOWER_SECONDS more), the phase being where it loses most against
    them; None if no rank is. The live panel's step times and the profiler's traces both ask it."""
    if len(busy) < 2:
        return None
    slowest = max(busy, key=lambda rank: busy[rank])
    peers = [rank for rank in busy if rank != slowest]
    peers_busy = statistics.median(busy[rank] for rank in peers)
    if busy[slowest] < peers_busy * SLOWER_FACTOR or busy[slowest] - peers_busy < SLOWER_SECONDS:
        return None
    excess = {
        phase: seconds - statistics.median(phases[rank][phase] for rank in peers)
        for phase, seconds in phases[slowest].items()
    }
    return slowest, max(excess, key=lambda phase: excess[phase]), busy[slowest], peers_busy
