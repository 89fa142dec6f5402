"""What a world reports back: where its ranks live, their status, what a cell gave back.

Plain data, imported by the facade, the relay and the reports alike (it imports nothing of
the package, so no import circle can go through it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# what a rank publishes (ipyparallel's publish_data) when its cell succeeded and the end-of-cell
# snapshot of its tracked state is a collective (a sharded model): the notebook then has every
# rank take it at once (rank_calls.take_snapshot; see elastic.py)
SNAPSHOT_OWED_KEY = "ddp_notebook_snapshot_owed"
# published by a rank whose cell failed because its process group broke (torch's exception type,
# judged on the rank, where the exception is): the notebook then sets the group up again
GROUP_BROKEN_KEY = "ddp_notebook_group_broken"
# in a rank's error reply (its `engine_info`): seconds since the epoch its cell raised, taken before
# the traceback is formatted (seconds, on a loaded machine), so the rank that failed first is named
ERROR_RAISED_KEY = "ddp_notebook_raised"


def raised_at(engine_info: Any) -> float | None:
    """When a rank's failed cell raised, as its error reply's `engine_info` says (None: it does not)."""
    raised = (engine_info if isinstance(engine_info, dict) else {}).get(ERROR_RAISED_KEY)
    return raised if isinstance(raised, float) else None


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
    xray_address: tuple[str, int] | None = None  # a rank on another host: its X-ray's TCP address
    off_here: tuple[str, ...] = ()  # what its releases lack, one line each (`world.capabilities`)


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
    # the memory limit the rank runs under (its cgroup's, else the machine's), on this host only
    memory_limit_mb: float | None = None
    gpu_memory_total_mb: float | None = None

    @property
    def memory_fraction(self) -> float | None:
        """The rank's resident memory as a fraction of its limit."""
        if self.memory_mb is None or not self.memory_limit_mb:
            return None
        return self.memory_mb / self.memory_limit_mb


# why a rank's process is gone: it exited; a signal ended it; the out-of-memory killer did; a rank
# on another host stopped answering the controller; the controller itself cannot be reached
DeathCause = Literal["exited", "signal", "out_of_memory", "lost", "unreachable"]


@dataclass(frozen=True)
class Death:
    """How a rank's process ended, as a value; `str(death)` is what a user reads."""

    cause: DeathCause
    how: str  # in words a user can act on: "was killed by SIGKILL (often the out-of-memory killer)"
    exit_code: int | None = None  # the process's exit status (negative: the signal), where known

    def __str__(self) -> str:
        return self.how


@dataclass(frozen=True)
class MemoryReading:
    """A world's memory on this host against the limit its ranks share, at one moment."""

    rank_bytes: dict[int, int]  # resident memory of each rank on this host
    used: int  # bytes in use under the limit: every process under it, the ranks among them
    limit: int
    limit_text: str  # "the cgroup memory limit of 1.5 GiB", "this machine's 23.5 GiB"
    warning: str | None = None  # set on the reading that crossed the warning level

    @property
    def fraction(self) -> float:
        return self.used / self.limit if self.limit else 0.0


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
