"""What a world reports back: where its ranks live, their status, what a cell gave back.

Plain data, imported by the facade, the relay and the reports alike (it imports nothing of
the package, so no import circle can go through it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankInfo:
    """Where one rank lives."""

    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    device_name: str
    gpu: str | None
    main_thread: int | None = None
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0


@dataclass(frozen=True)
class RankStatus:
    """One row of `status()`."""

    rank: int
    state: str  # idle | busy | gone
    host: str
    pid: int
    device: str
    memory_mb: float | None
    gpu_memory_mb: float | None


@dataclass
class CellResult:
    """What a cell gave back: per-rank last-expression values and (unstreamed) output."""

    ranks: tuple[int, ...]
    values: dict[int, dict[str, Any]] = field(default_factory=dict)
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    elapsed: float = 0.0

    def value_text(self, rank: int) -> str | None:
        """The plain-text form of `rank`'s last expression, if the cell ended in one."""
        bundle = self.values.get(rank)
        return None if bundle is None else str(bundle.get("text/plain", ""))
