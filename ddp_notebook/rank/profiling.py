"""Runs on ranks: torch.profiler over a profiled cell's optimizer steps (`%%ddp --profile`).

`start` makes the profiler with a wait/warm-up/active schedule counted in optimizer steps and
puts one global optimizer post-step hook in (torch's own, as the step timing uses), which calls
the profiler's `step()`; `finish`, after the cell, stops it, takes the hook out and hands back
the trace. Nothing of this exists while no cell is profiled: no profiler object, no hook.

At every step the hook also records a clock mark, a zero-length annotation named after
`time.time_ns()`, so the notebook can put every rank's trace on the hosts' common clock, and
reads the rank's memory.
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..wire.profiling import CLOCK_MARK, PROFILE_VERSION, MemorySample, ProfileRequest, RankProfile
from .state import RANK, Profiling


def start(request: ProfileRequest) -> None:
    """Profile this rank's next optimizer steps as `request` says (a profile left running is dropped)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    if request["v"] != PROFILE_VERSION:
        raise ValueError(f"profile request of version {request['v']}; this rank reads version {PROFILE_VERSION}")
    _drop()
    activities = [ProfilerActivity.CPU]
    if _cuda_device() is not None:
        activities.append(ProfilerActivity.CUDA)
    state = Profiling(folder=tempfile.mkdtemp(prefix="ddp_notebook_profile_"))
    state.profiler = profile(
        activities=activities,
        schedule=schedule(wait=request["wait"], warmup=request["warmup"], active=request["active"], repeat=1),
        on_trace_ready=_trace_ready,
        profile_memory=request["memory"],
        record_shapes=request["shapes"],
        with_stack=request["stack"],
    )
    state.memory_on = request["memory"]
    RANK.profiling = state
    state.quiet = _quiet()
    state.profiler.start()
    state.hook = register_optimizer_step_post_hook(_stepped)


def finish() -> RankProfile:
    """Stop the profiler (a cell that ended before its last active step keeps the steps it
    recorded), take its hook out and return the trace."""
    state = RANK.profiling
    profile = RankProfile(
        v=PROFILE_VERSION, rank=_rank(), host=socket.gethostname(), steps=0, trace_gz=None, memory=[], note=""
    )
    if state is None:
        profile["note"] = "this rank was not profiled"
        return profile
    try:
        _stop(state)
        profile["steps"], profile["memory"] = state.steps, list(state.memory)
        if state.trace is not None:
            profile["trace_gz"] = gzip.compress(Path(state.trace).read_bytes(), compresslevel=3)
        else:
            profile["note"] = f"no step was recorded ({state.steps} optimizer steps ran while profiled)"
    finally:
        _drop()
    return profile


def _stepped(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """torch's global post-step hook: one optimizer step is one profiler step."""
    state = RANK.profiling
    if state is None or state.done:
        return  # the hook is taken out after the cell: not from inside torch's loop over the hooks
    state.steps += 1
    if state.memory_on:
        state.memory.append(_memory(state.steps))
    state.profiler.step()
    if not state.done:
        _mark_clock()


def _trace_ready(profiler: Any) -> None:
    state = RANK.profiling
    if state is None or state.folder is None:
        return
    path = os.path.join(state.folder, f"rank{_rank()}.json")
    profiler.export_chrome_trace(path)
    state.trace, state.done = path, True


def _mark_clock() -> None:
    from torch.profiler import record_function

    with record_function(f"{CLOCK_MARK}{time.time_ns()}"):
        pass


def _stop(state: Profiling) -> None:
    if state.hook is not None:
        state.hook.remove()
        state.hook = None
    if state.profiler is not None and not state.done:
        state.profiler.stop()  # while recording: the trace of the steps so far (`_trace_ready`)
    state.done = True
    if state.quiet is not None:
        state.quiet.close()
        state.quiet = None


# What torch's native profiler writes to stderr in a profiled cell: a line at every start and stop of
# a recording, whatever its log level short of hiding its errors too, and a warning when memory
# allocated before the recording is freed. A rank's output would carry them every profiled cell.
PROFILER_CHATTER = (
    b"SyncActivityProfilerHandler.cpp",
    b"Memory block of unknown size was allocated before the profiling",
)


class ChatterFilter:
    """While a cell is profiled, file descriptor 2 (where native code writes) goes through a pipe
    whose reader passes every write on at once, less the profiler's routine lines: its errors,
    and anything else, still show, in order."""

    def __init__(self) -> None:
        self._passed_to = os.dup(2)
        self._pipe, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._reader = threading.Thread(target=self._pass_on, name="ddp_notebook-profiler-stderr", daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Put file descriptor 2 back. The reader ends when nobody holds the pipe any more (a process
        forked meanwhile, a data loader's worker, may hold it a while: its lines still get through)."""
        os.dup2(self._passed_to, 2)
        self._reader.join(timeout=1.0)

    def _pass_on(self) -> None:
        inside = False  # in a dropped line still to end: kineto writes its newline on its own
        try:
            while chunk := os.read(self._pipe, 65536):
                kept = []
                for piece in chunk.splitlines(keepends=True):
                    if inside or _chatter(piece):
                        inside = not piece.endswith((b"\n", b"\r"))
                    else:
                        kept.append(piece)
                if kept:
                    os.write(self._passed_to, b"".join(kept))
        finally:
            os.close(self._pipe)
            os.close(self._passed_to)


def _chatter(line: bytes) -> bool:
    return any(marker in line for marker in PROFILER_CHATTER)


def _quiet() -> ChatterFilter | None:
    try:
        return ChatterFilter()
    except OSError:
        return None  # no descriptor to spare: the chatter shows, nothing is lost


def _drop() -> None:
    """Forget the profile: its hook, its profiler, its files."""
    state, RANK.profiling = RANK.profiling, None
    if state is None:
        return
    try:
        _stop(state)
    finally:
        if state.folder is not None:
            shutil.rmtree(state.folder, ignore_errors=True)


def _memory(step: int) -> MemorySample:
    import torch

    from ..platform.devices import resident_memory_mb

    rss = resident_memory_mb(os.getpid())
    device = _cuda_device()
    return MemorySample(
        step=step,
        time_ns=time.time_ns(),
        cpu_rss=int(rss * 2**20) if rss is not None else None,
        cuda_allocated=torch.cuda.memory_allocated(device) if device is not None else None,
        cuda_reserved=torch.cuda.memory_reserved(device) if device is not None else None,
    )


def _cuda_device() -> Any:
    context = RANK.membership.context
    if context is not None and context.device.type == "cuda":
        return context.device
    return None


def _rank() -> int:
    context = RANK.membership.context
    if context is not None:
        return context.rank
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else 0
