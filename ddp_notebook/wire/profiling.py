"""What the notebook asks of a profiled cell's ranks, and what each rank gives back.

The notebook sends a `ProfileRequest` before the cell (torch.profiler's schedule and what to
record) and asks for a `RankProfile` after it: the rank's Chrome trace (gzip-compressed JSON),
the optimizer steps it saw and its memory at each of them. Each carries the version of this
format (`v`); the notebook takes a reply of another version as no profile.

Standard library only: the notebook kernel and the ranks both import this.
"""

from __future__ import annotations

from typing import TypedDict

PROFILE_VERSION = 1
# the name prefix of the rank's clock marks in its trace: "ddp_notebook.clock#<time.time_ns()>", a
# zero-length annotation recorded at each profiled step, ties the profiler's clock to the host's
CLOCK_MARK = "ddp_notebook.clock#"
# TensorBoard's profiler view lists files named WORKER.pt.trace.json; Perfetto opens any JSON
TRACE_SUFFIX = ".pt.trace.json"


class ProfileRequest(TypedDict):
    """torch.profiler's schedule in optimizer steps, and what it records."""

    v: int
    wait: int  # steps left alone first (the first one often builds the model, warms caches)
    warmup: int  # steps the profiler runs but discards (its own start-up cost)
    active: int  # steps recorded
    memory: bool  # allocations (profile_memory), and the memory read at each step
    shapes: bool  # record_shapes
    stack: bool  # with_stack


class MemorySample(TypedDict):
    """The rank's memory right after one optimizer step (bytes)."""

    step: int  # optimizer steps since the profile began, 1 for the first
    time_ns: int  # time.time_ns() on the rank
    cpu_rss: int | None  # the process's resident memory
    cuda_allocated: int | None  # torch.cuda.memory_allocated on the rank's GPU (None without one)
    cuda_reserved: int | None  # torch.cuda.memory_reserved


class RankProfile(TypedDict):
    """One rank's profile of the cell."""

    v: int
    rank: int
    host: str
    steps: int  # optimizer steps the rank took while profiled
    trace_gz: bytes | None  # the Chrome trace JSON, gzip-compressed; None when no step was recorded
    memory: list[MemorySample]
    note: str  # why there is no trace, where there is none
