"""What a rank reports, made by hand for the notebook side's tests: its step timing as the rank's
clock sums it up (`StepsSoFar`, moved by the test) and its collective X-ray (`waiting_in`: waiting in
an all_reduce for so long, or running its cell)."""

from __future__ import annotations

from typing import Any

from ddp_notebook.live.xray_readings import Collective, RankCollectives


class StepsSoFar:
    """A rank's step timing as `timing.CLOCK.summary` gives it, moved by hand."""

    def __init__(self, compute: float = 0.004, comm: float = 0.0) -> None:
        self.steps = 0
        self.compute, self.comm = compute, comm

    def __call__(self) -> dict[str, Any] | None:
        if not self.steps:
            return None
        total = 0.001 + self.compute + self.comm + 0.001
        return {"steps": self.steps, "window": min(self.steps, 20), "total": total, "data": 0.001,
                "compute": self.compute, "comm": self.comm, "optimizer": 0.001}  # fmt: skip


def waiting_in(rank: int, waited: float | None, seq: int = 3, line: int = 2) -> RankCollectives:
    """A rank's X-ray: in all_reduce #seq for `waited` seconds, or (None) running its cell."""
    now_ns = 100 * 10**9
    if waited is None:
        return RankCollectives(rank, (), line, True, now_ns)
    current = Collective(seq, "all_reduce", ((4,),), ("Float",), False, now_ns - int(waited * 1e9))
    return RankCollectives(rank, (current,), line, True, now_ns)
