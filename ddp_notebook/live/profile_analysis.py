"""What the ranks' profiler traces say: each rank's steps split into compute, communication, data
wait, optimizer and idle on one clock, its top ops, how much of its communication overlaps compute,
its memory, and the straggler with why. Plain data from the Chrome trace JSON; imports no torch.

How a rank's time is split, over the profiled steps (`ProfilerStep#N` on its training thread):

- an op of the training thread inside `Optimizer.step`/`zero_grad` is optimizer, inside the data
  loader's `enumerate(DataLoader)#...` is data wait, a collective (`c10d::`, `gloo:`, `nccl:`,
  `record_param_comms`) is communication, any other op is compute;
- where the training thread runs no op: communication while a collective is in flight on another
  thread of the rank (gloo's threads; DDP's backward waits for its all-reduces there), otherwise
  idle (Python code between ops, sleeps, waits outside torch);
- on GPUs the kernels get a lane of their own: NCCL kernels communication, the others compute,
  the gaps idle.

Clocks: each rank records `ddp_notebook.clock#<time.time_ns()>` marks in its trace at each step
(`rank/profiling.py`), which tie the profiler's clock to the host's wall clock to a few
microseconds; ranks on one host share that clock, ranks on other hosts rely on their hosts'
clocks being in sync (NTP/PTP). A trace without marks falls back to its own `baseTimeNanoseconds`.
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..wire.profiling import CLOCK_MARK, MemorySample
from .stragglers import clear_straggler, describe_straggler

CATEGORIES = ("compute", "communication", "data", "optimizer", "idle")
# where the training thread runs ops of several kinds at once, the innermost meaning wins in this order
_PRIORITY = ("communication", "data", "optimizer", "compute")
_HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms", "ncclkernel", "nccldevkernel")
TOP_OPS = 10
MEMORY_POINTS = 400  # the allocator's curve is thinned to about this many points per rank


@dataclass(frozen=True)
class Segment:
    """A stretch of one lane of a rank's timeline, in seconds on the common clock."""

    start: float
    end: float
    category: str


@dataclass(frozen=True)
class OpTime:
    name: str
    self_seconds: float  # per step
    calls: float  # per step
    device: str  # "cpu" (the host's ops) or "gpu" (kernels)


@dataclass(frozen=True)
class StepBreakdown:
    step: int  # the profiler's step number
    start: float  # seconds on the common clock
    seconds: Mapping[str, float]  # category -> seconds of the training thread

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class RankAnalysis:
    """One rank's profiled steps."""

    rank: int
    steps: list[StepBreakdown]
    host: list[Segment]  # the training thread, classified
    collectives: list[Segment]  # collectives on other threads, or NCCL kernels
    gpu: list[Segment]  # GPU kernels: compute, communication, idle (empty without a GPU)
    top_ops: list[OpTime]
    overlap: float | None  # share of communication time that overlaps compute (None: no communication)
    idle_before: dict[str, float]  # idle seconds per step, by what came right after it
    memory: list[MemorySample]
    cpu_allocated: list[tuple[float, int]]  # (seconds on the common clock, bytes torch's CPU allocator holds)
    clock: str  # how this trace was put on the common clock
    offset_us: float  # added to the trace's timestamps: microseconds since the epoch

    def per_step(self, category: str) -> float:
        """Mean seconds per step in `category` on the training thread."""
        if not self.steps:
            return 0.0
        return statistics.fmean(step.seconds.get(category, 0.0) for step in self.steps)

    @property
    def step_seconds(self) -> float:
        return statistics.fmean(step.total for step in self.steps) if self.steps else 0.0

    @property
    def busy(self) -> float:
        """Seconds per step outside communication: what the rank itself took."""
        return self.step_seconds - self.per_step("communication")

    @property
    def gpu_idle(self) -> float | None:
        if not self.gpu:
            return None
        return sum(s.end - s.start for s in self.gpu if s.category == "idle") / max(1, len(self.steps))


@dataclass(frozen=True)
class TraceStraggler:
    rank: int
    phase: str  # data, compute, optimizer or idle
    where: str  # what in that phase: the op, or what the idle time came before
    busy: float  # its seconds per step outside communication
    peers_busy: float  # the median of the others'

    def describe(self) -> str:
        return describe_straggler(self.rank, self.busy, self.peers_busy, f"{self.phase}: {self.where}")


@dataclass
class ProfileAnalysis:
    ranks: dict[int, RankAnalysis] = field(default_factory=dict)
    straggler: TraceStraggler | None = None
    origin: float = 0.0  # seconds on the common clock where the earliest profiled step began


def read_trace(data: bytes) -> dict[str, Any]:
    """A Chrome trace, gzip-compressed or not."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    trace = json.loads(data)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    return trace


def analyse(
    traces: Mapping[int, dict[str, Any]], memory: Mapping[int, list[MemorySample]] | None = None
) -> ProfileAnalysis:
    """Every rank's trace analysed on the common clock, and the straggler among them."""
    ranks = {rank: analyse_rank(rank, trace, (memory or {}).get(rank, [])) for rank, trace in sorted(traces.items())}
    starts = [r.steps[0].start for r in ranks.values() if r.steps]
    return ProfileAnalysis(ranks, find_straggler(ranks), min(starts) if starts else 0.0)


def analyse_rank(rank: int, trace: dict[str, Any], memory: list[MemorySample]) -> RankAnalysis:
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and "ts" in e]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    offset_us, clock = _clock_offset(complete, trace)
    # on a GPU, torch also writes each step's span on the GPU's stream (`gpu_user_annotation`): not a step
    marks = (e for e in complete if str(e.get("name", "")).startswith("ProfilerStep#"))
    steps = sorted((e for e in marks if e.get("cat") in _HOST_CATEGORIES), key=lambda e: float(e["ts"]))
    main = (steps[0]["pid"], steps[0]["tid"]) if steps else None
    host_ops: list[tuple[float, float, str, str]] = []  # (start, end, kind, name) on the training thread
    in_flight: list[tuple[float, float]] = []  # collectives on the rank's other threads
    kernels: list[tuple[float, float, str]] = []
    for e in complete:
        name, cat = str(e.get("name", "")), e.get("cat")
        start = float(e["ts"])
        end = start + float(e["dur"])
        if cat in _GPU_CATEGORIES:
            kernels.append((start, end, "communication" if _is_comm(name) else "compute"))
        elif cat in _HOST_CATEGORIES and not name.startswith(("ProfilerStep#", CLOCK_MARK)):
            if (e.get("pid"), e.get("tid")) == main:
                host_ops.append((start, end, _kind(name), name))
            elif _is_comm(name):
                in_flight.append((start, end))
    host_ops.sort(key=lambda op: (op[0], -op[1]))
    gpu_comm = [(s, e) for s, e, kind in kernels if kind == "communication"]
    comm_spans = gpu_comm or in_flight
    breakdowns: list[StepBreakdown] = []
    host: list[Segment] = []
    gpu: list[Segment] = []
    idle_before: dict[str, float] = {}
    op_starts = [op[0] for op in host_ops]
    to_s = lambda us: (us + offset_us) / 1e6  # noqa: E731  (trace microseconds -> common clock seconds)
    for step in steps:
        begin, finish = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        spans = [(s, e, kind) for s, e, kind, _ in host_ops if e > begin and s < finish]
        spans += [(s, e, "in_flight") for s, e in in_flight if e > begin and s < finish]
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        for start, end, category in _sweep(begin, finish, spans):
            seconds[category] += (end - start) / 1e6
            host.append(Segment(to_s(start), to_s(end), category))
            if category == "idle":
                key = _what_follows(host_ops, op_starts, end, finish)
                idle_before[key] = idle_before.get(key, 0.0) + (end - start) / 1e6
        breakdowns.append(StepBreakdown(int(str(step["name"]).split("#")[1] or 0), to_s(begin), seconds))
        if kernels:
            for start, end, category in _sweep(begin, finish, [k for k in kernels if k[1] > begin and k[0] < finish]):
                gpu.append(Segment(to_s(start), to_s(end), category))
    n_steps = max(1, len(steps))
    if kernels:  # kernels of both kinds run at once on their streams: the raw spans, not the lane
        compute = [(to_s(s), to_s(e)) for s, e, kind in kernels if kind == "compute"]
    else:
        compute = [(s.start, s.end) for s in host if s.category == "compute"]
    comm = _union((to_s(s), to_s(e)) for s, e in comm_spans)
    comm_total = sum(e - s for s, e in comm)
    overlap = _overlap(comm, _union(compute)) / comm_total if comm_total > 0 else None
    return RankAnalysis(
        rank=rank,
        steps=breakdowns,
        host=host,
        collectives=[Segment(s, e, "communication") for s, e in comm],
        gpu=gpu,
        top_ops=_top_ops(complete, main, n_steps),
        overlap=overlap,
        idle_before={k: v / n_steps for k, v in idle_before.items()},
        memory=memory,
        cpu_allocated=_allocator_curve(events, offset_us),
        clock=clock,
        offset_us=offset_us,
    )


def find_straggler(ranks: Mapping[int, RankAnalysis]) -> TraceStraggler | None:
    """The rank clearly slower than its peers outside communication, with the phase and place it
    loses time in (the thresholds of the live straggler panel); None if none is."""
    timed = {rank: r for rank, r in ranks.items() if r.steps}
    phases = {
        rank: {phase: r.per_step(phase) for phase in ("data", "compute", "optimizer", "idle")}
        for rank, r in timed.items()
    }
    found = clear_straggler({rank: r.busy for rank, r in timed.items()}, phases)
    if found is None:
        return None
    slowest, phase, busy, peers_busy = found
    peers = [r for rank, r in timed.items() if rank != slowest]
    return TraceStraggler(slowest, phase, _where(phase, timed[slowest], peers), busy, peers_busy)


def _where(phase: str, slow: RankAnalysis, peers: Sequence[RankAnalysis]) -> str:
    if phase == "data":
        return "waiting for the next batch (the data loader's next())"
    if phase == "optimizer":
        return "in Optimizer.step"
    if phase == "idle":
        place = max(slow.idle_before, key=lambda k: slow.idle_before[k], default="")
        return f"no torch op running (Python code, sleeps, waits outside torch), mostly before {place}"
    peer_ops: dict[str, float] = {}
    for peer in peers:
        for op in peer.top_ops:
            peer_ops[op.name] = peer_ops.get(op.name, 0.0) + op.self_seconds / len(peers)
    op = max(slow.top_ops, key=lambda o: o.self_seconds - peer_ops.get(o.name, 0.0), default=None)
    return f"most of it in {op.name}" if op is not None else "in the model's ops"


def _clock_offset(complete: Iterable[dict[str, Any]], trace: Mapping[str, Any]) -> tuple[float, str]:
    """Microseconds to add to this trace's timestamps to get microseconds since the epoch."""
    offsets = [
        int(name[len(CLOCK_MARK) :]) / 1000 - float(e["ts"])
        for e in complete
        if (name := str(e.get("name", ""))).startswith(CLOCK_MARK) and name[len(CLOCK_MARK) :].isdigit()
    ]
    if offsets:
        return statistics.median(offsets), f"the rank's clock marks ({len(offsets)})"
    return float(trace.get("baseTimeNanoseconds", 0)) / 1000, "the trace's baseTimeNanoseconds (no clock marks)"


def _is_comm(name: str) -> bool:
    return name.lower().startswith(_COMM_PREFIXES) or name.startswith("nccl")


def _kind(name: str) -> str:
    if _is_comm(name):
        return "communication"
    if name.startswith("enumerate(DataLoader)"):
        return "data"
    if name.startswith("Optimizer."):
        return "optimizer"
    return "compute"


def _what_follows(ops: list[tuple[float, float, str, str]], starts: list[float], at: float, finish: float) -> str:
    """What the training thread began as an idle stretch ended at `at`, in the words of a training
    step: the first of the next few ops (within 0.2 ms, or at any time after a seed gradient) that
    says which part of the step it is (backward begins with its seed gradient,
    `aten::ones_like`), else the first op's name."""
    i = bisect.bisect_left(starts, at - 0.001)
    if i >= len(ops) or ops[i][0] >= finish:
        return "the end of the step"
    # a seed gradient is followed by the engine's ops however long a loaded machine takes to start them
    window = float("inf") if ops[i][3] == "aten::ones_like" else 200.0
    for start, _, _, name in ops[i : i + 8]:
        if start > at + window:
            break
        label = _label(name)
        if label != name:
            return label
    return ops[i][3]


def _label(name: str) -> str:
    """What an op is, in the words of a training step (its name where it says nothing more)."""
    if name.endswith(".forward") or name.startswith("nn.Module"):
        return f"the forward ({name})"
    if name.startswith("autograd::engine"):
        return "backward"
    if name.startswith("Optimizer.step"):
        return "the optimizer step"
    if name.startswith("Optimizer.zero_grad"):
        return "zero_grad"
    if name.startswith("enumerate(DataLoader)"):
        return "the data loader"
    return name


def _sweep(begin: float, finish: float, spans: Iterable[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """[begin, finish] cut into stretches of one category each: the highest-priority kind of the
    spans covering it; where none does, communication while one is `in_flight`, else idle."""
    points: list[tuple[float, int, str]] = []
    for start, end, kind in spans:
        points += [(max(start, begin), 1, kind), (min(end, finish), -1, kind)]
    points.sort(key=lambda p: p[0])
    counts = dict.fromkeys((*_PRIORITY, "in_flight"), 0)
    out: list[tuple[float, float, str]] = []
    at, i = begin, 0
    while True:
        category = next((kind for kind in _PRIORITY if counts[kind] > 0), None)
        if category is None:
            category = "communication" if counts["in_flight"] > 0 else "idle"
        upto = points[i][0] if i < len(points) else finish
        if upto > at:
            if out and out[-1][2] == category and out[-1][1] == at:
                out[-1] = (out[-1][0], upto, category)
            else:
                out.append((at, upto, category))
            at = upto
        if i >= len(points):
            return out
        here = points[i][0]
        while i < len(points) and points[i][0] == here:
            counts[points[i][2]] += points[i][1]
            i += 1


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint span lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _top_ops(complete: list[dict[str, Any]], main: Any, n_steps: int) -> list[OpTime]:
    """The ops with the most self time (their time less their children's), per step: the host's
    ops on every thread, and GPU kernels."""
    self_us: dict[tuple[str, str], float] = {}
    calls: dict[tuple[str, str], int] = {}
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in complete:
        name, cat = str(e.get("name", "")), e.get("cat")
        if name.startswith(("ProfilerStep#", CLOCK_MARK)):
            continue
        if cat in _GPU_CATEGORIES:
            key = (name, "gpu")
            self_us[key] = self_us.get(key, 0.0) + float(e["dur"])
            calls[key] = calls.get(key, 0) + 1
        elif cat in _HOST_CATEGORIES:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []  # [end, name, self time so far]
        for e in ops:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                _close(stack.pop(), self_us, calls)
            if stack:
                stack[-1][2] -= min(dur, stack[-1][0] - start)
            stack.append([start + dur, str(e["name"]), dur])
        while stack:
            _close(stack.pop(), self_us, calls)
    ranked = sorted(self_us, key=lambda key: self_us[key], reverse=True)[:TOP_OPS]
    return [
        OpTime(name, self_us[(name, dev)] / 1e6 / n_steps, calls[(name, dev)] / n_steps, dev) for name, dev in ranked
    ]


def _close(entry: list[Any], self_us: dict[tuple[str, str], float], calls: dict[tuple[str, str], int]) -> None:
    key = (entry[1], "cpu")
    self_us[key] = self_us.get(key, 0.0) + max(0.0, entry[2])
    calls[key] = calls.get(key, 0) + 1


def _allocator_curve(events: list[dict[str, Any]], offset_us: float) -> list[tuple[float, int]]:
    """torch's CPU allocator's total over time, from the trace's memory events (thinned)."""
    points = [
        ((float(e["ts"]) + offset_us) / 1e6, int(e["args"].get("Total Allocated", 0)))
        for e in events
        if e.get("name") == "[memory]" and isinstance(e.get("args"), dict) and e["args"].get("Device Type") == 0
    ]
    points.sort()
    every = max(1, len(points) // MEMORY_POINTS)
    return points[::every] + (points[-1:] if points and (len(points) - 1) % every else [])
