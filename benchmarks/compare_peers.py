"""ddp_notebook and its peers on one machine in one run, on the same model, data and user code.

Peers: torchrun (a script), raw ipyparallel (`%%px` on a Cluster, process group made by
hand), nbdistributed 0.1.0 (`%dist_init`, every cell runs on the ranks) and Accelerate's
`notebook_launcher` (a fork per call). Every notebook tool runs in a real Jupyter kernel of
its own, driven cell by cell the way a notebook drives it, so each figure is what its user
sees. For each tool: seconds from the first setup cell to ranks with a process group and
torch; the round trip of a trivial cell (median); training steps/s of
`train_workload.train()` against torchrun running the same function (a fresh torchrun job
per tool; each of the tool's runs is paired with a torchrun run next to it, alternating
which goes first); seconds
from "rank 1 raises while rank 0 is in an all_reduce" to the first message about it and to
the cell returning (capped: a tool that never reports gets "hang (> N s)"); and, by
running probes, whether state survives from one cell to the next and whether output is
tagged with the rank that printed it.

nbdistributed's `%dist_shutdown` and `%dist_reset` run machine-wide `pkill -f`. They are never
called here: its kernel stops it with `%unload_ext` (its graceful path), and before it loads,
that kernel blocks subprocess calls to pkill/killall and os.killpg. Everything started is
stopped by PID in a `finally` block and checked to be gone at the end.

    bash benchmarks/peers_env.sh && benchmarks/.peers-venv/bin/python benchmarks/compare_peers.py

Writes benchmarks/results/peers.md (`--markdown PATH`); `--json PATH` also writes every sample.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from _common import (
    BENCH_DIR,
    exit_on_sigterm,
    kill_survivors,
    leak_report,
    machine_info,
    make_parser,
    median,
    print_table,
    process_tree,
    warm_file_cache,
    write_json,
)
from bench_training import TorchrunJob, cpu_seconds
from peers_kernel import Cell, Kernel
from peers_script import AFTER, FAIL, FAIL_AFTER, READY, STATE_GET, STATE_SET, TAG, TRAIN, TRIVIAL

VENV = BENCH_DIR / ".peers-venv"
DEFAULT_MARKDOWN = BENCH_DIR / "results" / "peers.md"
COMMAND = "bash benchmarks/peers_env.sh && benchmarks/.peers-venv/bin/python benchmarks/compare_peers.py"
PEERS = ("nbdistributed", "accelerate", "jupyter_client", "ipykernel")
SETUP_TIMEOUT = 180.0  # seconds for one setup cell (starting ranks, importing torch)
CELL_TIMEOUT = 60.0  # seconds for a probe or trivial cell
TRAIN_TIMEOUT = 300.0  # seconds for one training run
STOP_TIMEOUT = 60.0  # seconds for a stop cell
TORCHRUN_TIMEOUT = 120.0  # seconds for a torchrun probe script
RECOVERY_TIMEOUT = 10.0  # seconds for the first collective after the failure
INTERRUPT_TIMEOUT = 10.0  # seconds for the kernel to run a cell again after the stop button
DEFAULT_WARMUP = 5  # untimed steps before the short run at a tool's default threads
LATE_GRACE = 2.0  # seconds to wait for output after its cell ended, where a probe found none
READY_LINE = re.compile(r"ready rank=(\d+) pg=(True|False) threads=(\d+) t=([\d.]+)")
PERSIST_LINE = re.compile(r"persist rank=(\d+) value=(None|\d+)")
AFTER_LINE = re.compile(r"after rank=(\d+) sum=([\d.]+) probe=(None|\d+)")
RESULT_LINE = re.compile(r"BENCH_RESULT (\{.*\})")
TAG_MARK = re.compile(r"tagprobe:(\d+):(\d+)")
# how tools name a rank: [rank 1], [stdout:1], [1:execute], [default1], "Rank 1:", "rank: 1"
RANK_TAG = re.compile(r"\[(?:rank |stdout:|stderr:|default)(\d+)\]|\[(\d+):\w+\]|\brank:? ?(\d+):", re.IGNORECASE)
RAISED = "ValueError: rank 1 fails on purpose"  # as an error report shows it (the source line differs)
# torch elastic's summary (torchrun, notebook_launcher): which rank it blames
ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\s*\[\d+\]:\s*time\s*:.*\n\s*host\s*:.*\n\s*rank\s*:\s*(\d+)"
)
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
# torch's and gloo's log-line prefixes: when, pid, source file
GLOG_PREFIX = re.compile(r"^[EWIF]\d{4} [\d:.]+ \d+ \S+\] |^\[/\S+:\d+\] ")
FAILURE_WORDS = re.compile(r"Error|error|Traceback|Timeout|timed out|failed|FAILED")

# nbdistributed's %dist_shutdown/%dist_reset run `pkill -f` on patterns that match processes
# of other users of the machine; its kernel refuses such calls before the extension loads
PKILL_GUARD = r"""
import os as _os, re as _re, subprocess as _subprocess
_BLOCKED = _re.compile(r"\b(pkill|killall)\b")

class _GuardedPopen(_subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        words = [args] if isinstance(args, (str, bytes)) else list(args)
        command = str(words[0]) if words else ""
        if _BLOCKED.search(_os.path.basename(command.split()[0] if command.split() else "")) or (
            kwargs.get("shell") and _BLOCKED.search(str(args))
        ):
            raise PermissionError(f"compare_peers.py blocks {args!r}")
        super().__init__(args, *rest, **kwargs)

def _refuse(*args, **kwargs):
    raise PermissionError(f"compare_peers.py blocks this call {args!r}")

_subprocess.Popen = _GuardedPopen
_os.killpg = _refuse
_os.system = _refuse
try:
    _subprocess.run(["pkill", "--version"])
    raise RuntimeError("the pkill guard does not work")
except PermissionError:
    print("pkill/killall/killpg blocked in this kernel")
"""


@dataclass(frozen=True)
class NotebookTool:
    """How a user drives one notebook tool: setup cells, how a cell reaches every rank, stop."""

    name: str
    label: str
    setup: tuple[str, ...]
    wrap: Callable[[str], str]
    stop: tuple[str, ...] = ()
    guard: bool = False
    round_trips: int | None = None  # fewer where every cell starts new processes


@dataclass
class Outcome:
    name: str
    label: str
    start_s: float | None = None
    start_note: str = ""
    threads: str = "?"
    round_trip_ms: list[float] = field(default_factory=list)
    round_trip_note: str = ""
    steps_per_s: list[float] = field(default_factory=list)  # at torchrun's threads per rank
    default_threads_steps_per_s: float | None = None  # where the tool's default differs
    torchrun_steps_per_s: list[float] = field(default_factory=list)
    idle_cpu_pct: list[tuple[float, float]] = field(default_factory=list)  # (this tool, torchrun) while idle
    message_s: float | None = None
    returned_s: float | None = None
    failure_said: str = ""
    names_error: bool = False  # the report shows rank 1's exception and message
    root_cause: str = ""  # the rank torch elastic's summary names as the root cause
    recovery: str = "?"  # the next cell with a collective, after the failure
    recovery_said: str = ""  # what that cell showed, where it did not work
    interrupts: list[tuple[str, float | None]] = field(default_factory=list)  # stop button: cell, seconds
    state: str = "?"
    tagging: str = "?"
    problems: list[str] = field(default_factory=list)
    late_output: list[str] = field(default_factory=list)  # probes whose output came after the cell ended
    failure_text: str = ""

    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.steps_per_s, self.torchrun_steps_per_s) if b]


class Partner:
    """A fresh torchrun job running train_workload.py, to pair training runs with; keeps its results.

    Fresh for each tool, so both sides of a pair have run about as long and as often.
    """

    def __init__(self, args: Any, env: dict[str, str], recorded: list[int]) -> None:
        began = time.time()
        self.job = TorchrunJob(args.ranks, args.steps, args.warmup, "gloo", env)
        try:
            self.job.wait_ready()
            self.start_s = time.time() - began  # launch to init_process_group done on every rank
            recorded.extend(pid for pid in self.job.pids if pid not in recorded)
            self.threads = self.job.run()["torch_threads"]  # untimed: a first run pays one-off costs
        except BaseException:
            self.job.stop()
            raise
        self.runs: list[dict[str, Any]] = []

    def run(self) -> dict[str, Any]:
        result = self.job.run()
        self.runs.append(result)
        return result

    def __enter__(self) -> Partner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.job.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def notebook_tools(ranks: int, accelerate_port: int) -> list[NotebookTool]:
    def accelerate_cell(body: str) -> str:
        return (
            "def on_every_rank():\n"
            "    from accelerate import Accelerator\n"
            "    # on a CPU-only machine a plain Accelerator() sets up no DDP world (1 process, index 0)\n"
            "    accelerator = Accelerator(cpu=True)\n"
            "    rank = accelerator.process_index\n"
            f"{textwrap.indent(body, '    ')}\n"
            f'notebook_launcher(on_every_rank, num_processes={ranks}, use_port="{accelerate_port}")'
        )

    return [
        NotebookTool(
            "ddp_notebook",
            "ddp_notebook `%%ddp`",
            ("%load_ext ddp_notebook", f"%ddp_start {ranks}"),
            lambda body: "%%ddp\n" + body,
            ("%ddp_stop",),
        ),
        NotebookTool(
            "ipyparallel",
            "ipyparallel `%%px` by hand",
            (
                "import ipyparallel as ipp\n"
                f"cluster = ipp.Cluster(n={ranks})\n"
                "rc = cluster.start_and_connect_sync()\n"
                "rc.activate()  # the %px magics",
                "# a process group by hand: ranks in engine order, a free port for the rendezvous\n"
                "import socket\n"
                "with socket.socket() as probe:\n"
                '    probe.bind(("127.0.0.1", 0))\n'
                "    port = probe.getsockname()[1]\n"
                "for rank, engine in enumerate(rc.ids):\n"
                '    rc[engine].push({"rank": rank, "world_size": len(rc.ids), "MASTER_PORT": port})',
                "%%px\n"
                "import os, torch, torch.distributed as dist\n"
                'os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(MASTER_PORT))\n'
                'dist.init_process_group("gloo", rank=rank, world_size=world_size)',
            ),
            lambda body: "%%px\n" + body,
            ("cluster.stop_cluster_sync()",),
        ),
        NotebookTool(
            "nbdistributed",
            "nbdistributed 0.1.0",
            ("%load_ext nbdistributed", f"%dist_init -n {ranks}"),
            lambda body: body,  # after %dist_init every plain cell runs on the ranks
            ("%unload_ext nbdistributed",),  # its graceful path; %dist_shutdown would pkill
            guard=True,
        ),
        NotebookTool(
            "accelerate",
            "Accelerate `notebook_launcher`",
            ("from accelerate import notebook_launcher",),
            accelerate_cell,
            round_trips=5,
        ),
    ]


# ---------------------------------------------------------------- reading what a tool showed


def ready_lines(text: str, ranks: int) -> dict[int, tuple[bool, int, float]] | None:
    """rank -> (process group up, torch threads, time) when every rank reported ready."""
    found = {int(r): (pg == "True", int(threads), float(t)) for r, pg, threads, t in READY_LINE.findall(text)}
    if sorted(found) != list(range(ranks)) or not all(up for up, _, _ in found.values()):
        return None
    return found


def state_verdict(text: str, ranks: int) -> str:
    values = {int(r): v for r, v in PERSIST_LINE.findall(text)}
    if sorted(values) != list(range(ranks)):
        return f"? (no answer from every rank: {sorted(values)})"
    kept = [values[r] == str(1000 + r) for r in range(ranks)]
    if all(kept):
        return "yes"
    return "no" if not any(kept) else f"on {sum(kept)} of {ranks} ranks"


def tagging_verdict(text: str, ranks: int) -> str:
    """Is each probe line shown with the rank that printed it (on its line or in a header above)?

    Lines are attributed the way a reader would: a rank named on the line itself, else the
    last rank named above it.
    """
    header: int | None = None
    own = right = wrong = 0
    seen: list[tuple[int, int]] = []
    glued = False
    for line in text.splitlines():
        tags = [int(next(g for g in m.groups() if g)) for m in RANK_TAG.finditer(line)]
        marks = [(int(r), int(i)) for r, i in TAG_MARK.findall(line)]
        if tags:
            header = tags[-1]
        if not marks:
            continue
        glued = glued or len(marks) > 1
        for rank, index in marks:
            seen.append((rank, index))
            own += bool(tags)
            if header == rank:
                right += 1
            elif header is not None:
                wrong += 1
    expected = {(r, i) for r in range(ranks) for i in range(3)}
    if not expected <= set(seen):
        return f"? ({len(set(seen) & expected)} of {len(expected)} probe lines shown)"
    notes = []
    if len(seen) > len(expected):
        notes.append(f"output re-sent: {len(seen)} lines shown for {len(expected)} printed")
    if glued:
        notes.append("lines of different ranks run together")
    if wrong:
        verdict = f"wrong: {wrong} of {len(seen)} lines under another rank's header"
    elif right == len(seen):
        verdict = "yes, every line" if own == len(seen) else "yes, a header per block"
    elif right == 0:
        verdict = "no"
    else:
        verdict = f"partly: {right} of {len(seen)} lines"
    return "; ".join([verdict, *notes])


def first_line(text: str, pattern: re.Pattern[str] = FAILURE_WORDS) -> str:
    """The first line matching `pattern`, after the nearest line above naming a rank, if any."""
    lines = [" ".join(GLOG_PREFIX.sub("", UUID.sub("<id>", line)).split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    for index, line in enumerate(lines):
        if pattern.search(line):
            if not RANK_TAG.search(line):
                named = [above for above in lines[max(0, index - 3) : index] if RANK_TAG.search(above)]
                line = f"{named[-1]} … {line}" if named else line
            return line if len(line) <= 110 else line[:107] + "..."
    return ""


# ---------------------------------------------------------------- notebook tools, in a kernel


class Session:
    """One tool in one fresh kernel; records every PID below the kernel as it goes."""

    def __init__(self, tool: NotebookTool, env: dict[str, str], recorded: list[int]) -> None:
        self.tool = tool
        self.recorded = recorded  # every PID of the whole run, for the final check
        self.pids: list[int] = []  # this session's: the kernel and everything below it
        self.kernel = Kernel(str(VENV / "bin" / "python"), env, str(BENCH_DIR))
        self.note_pids()

    def note_pids(self) -> None:
        for pid in process_tree([self.kernel.pid]):
            if pid not in self.pids:
                self.pids.append(pid)
            if pid not in self.recorded:
                self.recorded.append(pid)

    def run(self, code: str, timeout: float) -> Cell:
        cell = self.kernel.run(code, timeout)
        self.note_pids()
        return cell

    def on_ranks(self, body: str, timeout: float = CELL_TIMEOUT) -> Cell:
        return self.run(self.tool.wrap(body), timeout)

    def settle(self, cell: Cell, answered: Callable[[str], bool], probe: str, outcome: Outcome) -> None:
        """Where a finished cell shows no answer yet, wait briefly for late output (a notebook shows it too)."""
        if not cell.finished or answered(cell.text):
            return
        self.kernel.drain(LATE_GRACE)
        if any(output.late for output in cell.outputs):
            outcome.late_output.append(probe)

    def close(self) -> list[int]:
        """Stop the tool and the kernel; the PIDs still alive 5 s later (then SIGKILLed)."""
        for code in self.tool.stop:
            cell = self.run(code, STOP_TIMEOUT)
            if not cell.finished:
                print(f"   warning: {code!r} did not finish in {STOP_TIMEOUT:g} s", file=sys.stderr)
        self.note_pids()
        self.kernel.shutdown()
        killed = kill_survivors(self.pids, wait=5.0)
        if killed:
            print(f"   note: SIGKILLed {len(killed)} process(es) of ours still alive after stop: {killed}")
        return killed


def run_notebook_tool(
    tool: NotebookTool, args: Any, env: dict[str, str], job_env: dict[str, str], recorded: list[int], scratch: Path
) -> Outcome:
    outcome = Outcome(tool.name, tool.label)
    print(f"== {tool.label}")
    began = time.monotonic()
    session = Session(tool, env, recorded)
    try:
        if tool.guard:
            cell = session.run(PKILL_GUARD, CELL_TIMEOUT)
            if cell.status != "ok":
                raise RuntimeError(f"could not install the pkill guard: {cell.text}")
        if not measure_start(session, outcome, args):
            return outcome
        check_state(session, outcome, args.ranks)
        check_tagging(session, outcome, args.ranks)
        measure_round_trip(session, outcome, tool.round_trips or args.repeats)
        with Partner(args, job_env, recorded) as job:
            measure_training(session, outcome, args, job)
        measure_failure(session, outcome, args, scratch)
    finally:
        closing = time.monotonic()
        killed = session.close()
        print(f"   stop and kernel shutdown: {time.monotonic() - closing:.1f} s")
        if killed:
            outcome.problems.append(f"{len(killed)} process(es) still alive 5 s after stop and kernel shutdown")
        print(f"   ({time.monotonic() - began:.0f} s for {tool.name}, kernel start and stop included)")
    return outcome


def measure_start(session: Session, outcome: Outcome, args: Any) -> bool:
    began = time.time()
    for code in session.tool.setup:
        cell = session.run(code, SETUP_TIMEOUT)
        if cell.status != "ok":
            outcome.problems.append(f"setup cell {code.splitlines()[0]!r} failed: {first_line(cell.text)}")
            print(f"   setup failed: {cell.text[-2000:]}")
            return False
    setup_s = time.time() - began
    # the first cell that finds every rank ready; a cell that gets no answer is sent again
    lost: list[str] = []  # what each unanswered cell showed
    while time.time() - began < args.hang_cap + setup_s:
        cell = session.on_ranks(READY, timeout=args.hang_cap)
        session.settle(cell, lambda text: bool(ready_lines(text, args.ranks)), "ready", outcome)
        found = ready_lines(cell.text, args.ranks)
        if found:
            outcome.start_s = max(t for _, _, t in found.values()) - began
            outcome.threads = ", ".join(sorted({str(threads) for _, threads, _ in found.values()}))
            break
        lost.append(first_line(cell.text) or f"{cell.status}, nothing shown")
        print(f"   no ready answer from every rank ({cell.status}, {cell.elapsed}): {first_line(cell.text)}")
    if outcome.start_s is None:
        outcome.problems.append("never ready")
        return False
    if lost:
        cells = "the first cell" if len(lost) == 1 else f"the first {len(lost)} cells"
        outcome.start_note = (
            f"the setup cells return in {setup_s:.1f} s, but {cells} sent right after them got no answer"
            f" (`{lost[0]}`) and had to be run again"
        )
    print(f"   start -> ready {outcome.start_s:.2f} s (setup cells {setup_s:.2f} s, lost cells {len(lost)})")
    return True


def check_state(session: Session, outcome: Outcome, ranks: int) -> None:
    session.on_ranks(STATE_SET)
    cell = session.on_ranks(STATE_GET)
    session.settle(cell, lambda text: len(PERSIST_LINE.findall(text)) >= ranks, "state", outcome)
    outcome.state = state_verdict(cell.text, ranks)
    print(f"   state kept across cells: {outcome.state}")


def check_tagging(session: Session, outcome: Outcome, ranks: int) -> None:
    cell = session.on_ranks(TAG)
    session.settle(cell, lambda text: len(TAG_MARK.findall(text)) >= 3 * ranks, "tagging", outcome)
    outcome.tagging = tagging_verdict(cell.text, ranks)
    sent, shown = sum(len(output.text) for output in cell.outputs), len(cell.text)
    if sent > 1.5 * shown:
        # display updates: what the notebook ends up showing is less than what was sent
        outcome.tagging += f"; each update re-sends the block ({sent / shown:.1f}× the text shown)"
    print(f"   output tagged by rank: {outcome.tagging}")
    print(textwrap.indent(cell.text.rstrip(), "   | "))


def measure_round_trip(session: Session, outcome: Outcome, count: int) -> None:
    session.on_ranks(TRIVIAL)  # untimed: the first cell of a kind may pay one-off costs
    for _ in range(count):
        cell = session.on_ranks(TRIVIAL)
        if cell.status != "ok":
            outcome.problems.append(f"trivial cell: {cell.status}: {first_line(cell.text)}")
            return
        assert cell.elapsed is not None
        outcome.round_trip_ms.append(cell.elapsed * 1e3)
    print(f"   trivial cell median {median(outcome.round_trip_ms):.1f} ms over {count}")


def measure_training(session: Session, outcome: Outcome, args: Any, job: Partner) -> None:
    """Steps/s at torchrun's threads per rank, paired with torchrun runs; once at the tool's own."""
    if outcome.threads != str(job.threads):
        # first, while the ranks still have the tool's default (set_num_threads sticks); short,
        # since oversubscribed ranks can be very slow
        result = train_once(session, outcome, args.default_steps, DEFAULT_WARMUP, "")
        if result is None:
            return
        outcome.default_threads_steps_per_s = result["steps_per_s"]
        print(f"   training at the default {result['torch_threads']} thread(s): {result['steps_per_s']:.1f} steps/s")
    threads = f"torch.set_num_threads({job.threads})\n"
    for round_index in range(args.rounds):
        # back to back, so load that drifts hits both; who goes first alternates. While one side
        # trains, the CPU the other side's idle processes use is measured (% of one core).
        paired = idle_cpu(job.run, session.pids) if round_index % 2 else None
        timed = idle_cpu(lambda: train_once(session, outcome, args.steps, args.warmup, threads), job.job.pids)
        if timed[0] is None:
            return
        paired = paired or idle_cpu(job.run, session.pids)
        (result, torchrun_idle), (rate, tool_idle) = timed, paired
        outcome.steps_per_s.append(result["steps_per_s"])
        outcome.torchrun_steps_per_s.append(rate["steps_per_s"])
        outcome.idle_cpu_pct.append((round(tool_idle, 1), round(torchrun_idle, 1)))
        print(
            f"   training round {round_index + 1}: {result['steps_per_s']:.1f} steps/s"
            f" ({result['torch_threads']} thread(s)); torchrun {'before' if round_index % 2 else 'after'}:"
            f" {rate['steps_per_s']:.1f}; idle CPU: {outcome.name} {tool_idle:.1f}%,"
            f" torchrun {torchrun_idle:.1f}% of a core"
        )


def idle_cpu(run: Callable[[], Any], idle_pids: list[int]) -> tuple[Any, float]:
    """run()'s result, and the CPU `idle_pids` used meanwhile, in % of one core."""
    before, began = cpu_seconds(idle_pids), time.perf_counter()
    result = run()
    return result, 100 * (cpu_seconds(idle_pids) - before) / (time.perf_counter() - began)


def train_once(session: Session, outcome: Outcome, steps: int, warmup: int, threads: str) -> dict[str, Any] | None:
    body = TRAIN.format(threads=threads, bench_dir=str(BENCH_DIR), steps=steps, warmup=warmup)
    cell = session.on_ranks(body, timeout=TRAIN_TIMEOUT)
    session.settle(cell, lambda text: bool(RESULT_LINE.search(text)), "training", outcome)
    found = RESULT_LINE.search(cell.text)
    if not found:
        outcome.problems.append(f"training: {cell.status}: {first_line(cell.text) or cell.text[-300:]}")
        print(f"   training failed: {cell.text[-1500:]}")
        return None
    return json.loads(found.group(1))


def measure_failure(session: Session, outcome: Outcome, args: Any, scratch: Path) -> None:
    raised_file = scratch / f"raised-{outcome.name}"
    body = FAIL.format(fail_after=FAIL_AFTER, raised=str(raised_file))
    cell = session.on_ranks(body, timeout=args.hang_cap + FAIL_AFTER + 5)
    try:
        raised = float(raised_file.read_text())
    except (OSError, ValueError):
        outcome.problems.append("failure case: rank 1 never raised")
        raised = None
    if raised is not None:
        for output in cell.outputs:
            if output.wall >= raised and FAILURE_WORDS.search(output.text):
                outcome.message_s = output.wall - raised
                outcome.failure_said = first_line(output.text)
                break
        if cell.finished:
            assert cell.elapsed is not None
            outcome.returned_s = cell.sent + cell.elapsed - raised
    outcome.names_error = RAISED in cell.text
    blamed = ROOT_CAUSE.search(cell.text)
    outcome.root_cause = blamed.group(1) if blamed else ""
    outcome.failure_text = cell.text[-6000:]
    print(
        f"   rank 1 raises -> first message {fmt_s(outcome.message_s, args.hang_cap)},"
        f" cell returns {fmt_s(outcome.returned_s, args.hang_cap)}: {outcome.failure_said}"
    )
    if not cell.finished:
        outcome.interrupts.append(("the failing cell", stop_button(session)))
    check_recovery(session, outcome, args.ranks)


def check_recovery(session: Session, outcome: Outcome, ranks: int) -> None:
    """Does the next cell with a collective work, and is the ranks' state still there?"""
    cell = session.on_ranks(AFTER, timeout=RECOVERY_TIMEOUT)
    session.settle(cell, lambda text: len(AFTER_LINE.findall(text)) >= ranks, "after the failure", outcome)
    answers = {int(r): (float(total), probe) for r, total, probe in AFTER_LINE.findall(cell.text)}
    worked = [r for r, (total, _) in answers.items() if total == ranks]
    if len(worked) == ranks:
        kept = all(answers[r][1] == str(1000 + r) for r in range(ranks))
        outcome.recovery = "yes, state kept" if kept else "yes, on fresh ranks (no state)"
    else:
        waited = f"{cell.elapsed:.1f} s" if cell.finished else f"> {RECOVERY_TIMEOUT:g} s"
        outcome.recovery = f"no: {len(worked)} of {ranks} ranks answered ({waited})"
        outcome.recovery_said = first_line(cell.text)
    print(f"   next cell with a collective: {outcome.recovery}")
    if not cell.finished:
        outcome.interrupts.append(("the next cell", stop_button(session)))


def stop_button(session: Session) -> float | None:
    """Interrupt the kernel as the notebook's stop button does; seconds until it runs a cell again."""
    began = time.monotonic()
    session.kernel.interrupt()
    # a line magic runs in the kernel itself under every tool (nbdistributed sends plain cells to the ranks)
    cell = session.run("%pwd", INTERRUPT_TIMEOUT)
    took = time.monotonic() - began if cell.finished else None
    print(f"   stop button: the kernel runs a cell again after {fmt_s(took, INTERRUPT_TIMEOUT)}")
    return took


# ---------------------------------------------------------------- torchrun, a script


def torchrun_command(ranks: int, *script_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(BENCH_DIR / "peers_script.py"),
        *script_args,
    ]


def run_script(
    command: list[str], env: dict[str, str], timeout: float, recorded: list[int]
) -> tuple[list, float | None]:
    """Run a torchrun job; its output lines with their arrival times, and when it exited."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    exited = None
    while time.monotonic() < deadline:
        for pid in process_tree([process.pid]):  # torchrun starts its workers in sessions of their own
            if pid not in recorded:
                recorded.append(pid)
        if process.poll() is not None:
            exited = time.time()
            break
        time.sleep(0.05)
    if exited is None:
        process.send_signal(signal.SIGTERM)  # torchrun ends its own workers
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            kill_survivors(process_tree([process.pid]), wait=0)
            process.wait(timeout=10)
    reader.join(timeout=5)
    return lines, exited


def run_torchrun(
    args: Any, env: dict[str, str], start_s: float, threads: int, recorded: list[int], scratch: Path
) -> Outcome:
    outcome = Outcome("torchrun", "torchrun (a script)", start_s=start_s)
    outcome.state = "n/a (a script)"
    outcome.recovery = "n/a (a script: run it again)"
    outcome.round_trip_note = "n/a (a script)"
    outcome.threads = str(threads)
    print("== torchrun")
    lines, _ = run_script(torchrun_command(args.ranks, "tag"), env, TORCHRUN_TIMEOUT, recorded)
    text = "".join(line for _, line in lines)
    outcome.tagging = tagging_verdict(text, args.ranks)
    print(f"   output tagged by rank: {outcome.tagging}")
    print(textwrap.indent(text.rstrip(), "   | "))

    raised_file = scratch / "raised-torchrun"
    command = torchrun_command(args.ranks, "fail", f"--raised={raised_file}")
    lines, exited = run_script(command, env, args.hang_cap + 30, recorded)
    try:
        raised = float(raised_file.read_text())
    except (OSError, ValueError):
        outcome.problems.append("failure case: rank 1 never raised")
        return outcome
    for arrived, line in lines:
        if arrived >= raised and FAILURE_WORDS.search(line):
            outcome.message_s = arrived - raised
            outcome.failure_said = first_line(line)
            break
    if exited is not None:
        outcome.returned_s = exited - raised
    text = "".join(line for _, line in lines)
    outcome.names_error = RAISED in text
    blamed = ROOT_CAUSE.search(text)
    outcome.root_cause = blamed.group(1) if blamed else ""
    outcome.failure_text = text[-6000:]
    print(
        f"   rank 1 raises -> first message {fmt_s(outcome.message_s, args.hang_cap)},"
        f" launcher exits {fmt_s(outcome.returned_s, args.hang_cap)}: {outcome.failure_said}"
    )
    return outcome


# ---------------------------------------------------------------- the report


def fmt_s(value: float | None, cap: float) -> str:
    return f"hang (> {cap:g} s)" if value is None else f"{value:.1f} s"


def table(outcomes: list[Outcome], cap: float) -> tuple[list[str], list[list[str]]]:
    headers = [
        "",
        "start → ready to train",
        "trivial cell round trip, median",
        "training steps/s (× torchrun: median of the pairs; their range)",
        "torch threads per rank (tool's default)",
        "rank 1 raises in a collective → first message",
        "→ cell returns",
        "next cell with a collective",
        "state kept across cells",
        "output tagged by rank",
    ]
    rows = []
    for o in outcomes:
        if o.start_s is None:
            rows.append([o.label, "failed: " + "; ".join(o.problems), *[""] * (len(headers) - 2)])
            continue
        start = f"{o.start_s:.1f} s" + (" ¹" if o.start_note else "")
        if o.round_trip_note:
            trip = o.round_trip_note
        elif o.round_trip_ms:
            trip = f"{median(o.round_trip_ms):.0f} ms"
        else:
            trip = "?"
        if o.name == "torchrun":
            rate = f"{median(o.steps_per_s):.0f} (1.00)" if o.steps_per_s else "?"
        elif o.steps_per_s:
            ratios = o.ratios()
            rate = f"{median(o.steps_per_s):.0f} ({median(ratios):.2f}; pairs {min(ratios):.2f}–{max(ratios):.2f})"
            rate += " ²" if o.default_threads_steps_per_s is not None else ""
        else:
            rate = "?"
        message = fmt_s(o.message_s, cap) if o.message_s is not None or o.returned_s is None else "none"
        returned = fmt_s(o.returned_s, cap)
        rows.append([o.label, start, trip, rate, o.threads, message, returned, o.recovery, o.state, o.tagging])
    return headers, rows


def notes(outcomes: list[Outcome], args: Any) -> list[str]:
    cap = args.hang_cap
    lines = []
    for o in outcomes:
        if o.start_note:
            lines.append(f"¹ {o.label}: {o.start_note}.")
    for o in outcomes:
        if o.default_threads_steps_per_s is not None and o.torchrun_steps_per_s:
            rate = o.default_threads_steps_per_s
            lines.append(
                f"² {o.label}: at its default of {o.threads} torch threads per rank (training above: set to"
                f" torchrun's): {rate:.1f} steps/s, {rate / median(o.torchrun_steps_per_s):.2f}× torchrun"
                f" ({args.default_steps} steps)."
            )
    for o in outcomes:
        if o.message_s is not None or o.returned_s is not None:
            said = f"`{o.failure_said}`" if o.failure_said else "(no message)"
            lines.append(
                f"- {o.label}, rank 1 raises: first message {fmt_s(o.message_s, cap)}: {said};"
                f" rank 1's `{RAISED}` shown: {'yes' if o.names_error else 'no'}"
                + (f"; the summary names rank {o.root_cause} as the root cause." if o.root_cause else ".")
            )
        for what, took in o.interrupts:
            lines.append(
                f"- {o.label}: stopping {what} with the stop button (SIGINT to the kernel): the kernel runs a"
                f" cell again after {fmt_s(took, INTERRUPT_TIMEOUT)}."
            )
        if o.recovery_said:
            lines.append(f"- {o.label}, the next cell with a collective: {o.recovery}: `{o.recovery_said}`.")
        for problem in o.problems:
            lines.append(f"- {o.label}: {problem}.")
        if o.late_output:
            lines.append(
                f"- {o.label}: the output of a cell arrived after the cell had ended ({', '.join(o.late_output)});"
                " a notebook shows it under that cell, and so does this count."
            )
    return lines


def markdown(outcomes: list[Outcome], args: Any, info: dict[str, Any], peers: dict[str, str]) -> str:
    headers, rows = table(outcomes, args.hang_cap)
    versions = {**{k: v for k, v in info["versions"].items() if v}, **peers}
    out = [
        "# ddp_notebook and its peers, measured",
        "",
        f"Produced by `{COMMAND}` (defaults: {args.ranks} gloo ranks on CPU, {args.repeats} trivial cells,"
        f" {args.rounds} training rounds of {args.steps} steps, hang cap {args.hang_cap:g} s) on"
        f" {time.strftime('%Y-%m-%d')}: {info['usable_cpus']} CPU cores ({cpu_model()}), no GPU,"
        f" {info['platform']}, Python {info['python']};"
        f" {', '.join(f'{k} {v}' for k, v in versions.items())}. Load average at the start:"
        f" {', '.join(f'{x:.2f}' for x in info['load_average'])}.",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        *notes(outcomes, args),
        "",
        "How each figure is taken (every notebook tool in a fresh Jupyter kernel of its own, driven cell by"
        " cell as a notebook drives it; the same user code everywhere, from `benchmarks/peers_script.py`):",
        "",
        "- start → ready to train: from sending the first setup cell (loading the tool included, the kernel's own"
        " start not) to the moment every rank reports, from a cell, that its process group is up and torch is"
        " imported. Setup cells: `%load_ext ddp_notebook`, `%ddp_start 2`; `ipp.Cluster(n=2)` +"
        ' `start_and_connect_sync()`, rank numbers pushed, `%%px dist.init_process_group("gloo", ...)`;'
        " `%load_ext nbdistributed`, `%dist_init -n 2`; for Accelerate, the import and a first launch"
        " (`Accelerator(cpu=True)` in the function). torchrun: from launching `train_workload.py` to its ranks'"
        " first line after `init_process_group`.",
        "- trivial cell: `x = 1` on every rank, execute request to reply, median. Accelerate forks new ranks"
        " and sets up a new process group in every call; that is its per-cell cost.",
        "- training: `train_workload.train()` (MLP 64→512→512→10, batch 64 per rank, SGD) in a cell, with"
        " `torch.set_num_threads()` at torchrun's threads per rank (torchrun sets `OMP_NUM_THREADS=1`), each"
        " run next to one of the same function in a torchrun job started for that tool (alternating which"
        " goes first); the ratio is the median of those pairs, shown with their range: other work on a shared"
        " machine moves single runs by tens of percent, on either side. Where a tool's default threads"
        " differ, a short run at its default comes first (²).",
        f"- rank 1 raises: rank 1 sleeps {FAIL_AFTER} s and raises `ValueError` while rank 0 waits in"
        " `all_reduce`; seconds from the raise (time written by rank 1) to the first output that reports a"
        f" failure, and to the cell's reply (the launcher's exit for torchrun); capped at {args.hang_cap:g} s,"
        " then the kernel is interrupted. Then a cell with an `all_reduce` on every rank (capped at"
        f" {RECOVERY_TIMEOUT:g} s): does it work, and are the variables of earlier cells still there?",
        "- state: a cell sets `persist_probe = 1000 + rank`, the next prints it on every rank.",
        "- tagging: every rank prints three lines 0.3 s apart; each line counts as tagged if it carries its"
        " rank, or sits under a header naming its rank.",
        "- nbdistributed is stopped with `%unload_ext nbdistributed`: its `%dist_shutdown` and `%dist_reset`"
        " run machine-wide `pkill -f`, so they are never called (and blocked in its kernel).",
        "",
    ]
    return "\n".join(out)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def peer_versions() -> dict[str, str]:
    versions = {}
    for name in PEERS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], repeats=30, repeats_help="timed trivial cells per tool")
    parser.add_argument("--rounds", type=int, default=6, help="training runs per tool, each paired (default: 6)")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per run (default: 100)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps before them (default: 30)")
    parser.add_argument(
        "--default-steps",
        type=int,
        default=30,
        help="steps of the short run at a tool's own default threads, where they differ (default: 30)",
    )
    parser.add_argument(
        "--hang-cap",
        type=float,
        default=35.0,
        help="seconds to wait for a failure report; above nbdistributed's fixed 30 s (default: 35)",
    )
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, help="the table (default: %(default)s)")
    parser.add_argument("--only", nargs="*", default=None, help="only these notebook tools (for trying things)")
    args = parser.parse_args(argv)
    exit_on_sigterm()

    peers = peer_versions()
    missing = [name for name in ("nbdistributed", "accelerate") if not peers[name]]
    if missing or Path(sys.prefix).resolve() != VENV.resolve():
        print(f"run this in the peers' own environment ({', '.join(missing) or 'not in it'}):\n    {COMMAND}")
        return 2

    info = machine_info()
    print(f"== peers on {info['usable_cpus']} CPUs, load {info['load_average']}; {info['versions']}, {peers}")
    warm_file_cache()
    # everything the tools write to their temporary directory goes, with this, at the end
    scratch = Path(tempfile.mkdtemp(prefix="peers-"))
    (scratch / "tmp").mkdir()
    # the kernels' `python` is the venv's: nbdistributed starts its workers as plain `python`
    env = dict(
        os.environ,
        PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(VENV),
        TMPDIR=str(scratch / "tmp"),
    )
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONUNBUFFERED", None)  # a script's user sees line-buffered output in a terminal
    job_env = dict(env, PYTHONUNBUFFERED="1")  # the job's results are read as they come

    recorded: list[int] = []
    outcomes: list[Outcome] = []
    began = time.monotonic()
    try:
        print("== torchrun: start")
        with Partner(args, job_env, recorded) as first:
            torchrun_start, torchrun_threads = first.start_s, first.threads
        print(f"   start -> ready {torchrun_start:.2f} s")
        for tool in notebook_tools(args.ranks, free_port()):
            if args.only is not None and tool.name not in args.only:
                continue
            outcomes.append(run_notebook_tool(tool, args, env, job_env, recorded, scratch))
        torchrun = run_torchrun(args, env, torchrun_start, torchrun_threads, recorded, scratch)
        paired = [o.torchrun_steps_per_s for o in outcomes]
        torchrun.steps_per_s = [rate for rates in paired for rate in rates]
        outcomes.append(torchrun)
    finally:
        kill_survivors(recorded, wait=5.0)
        shutil.rmtree(scratch, ignore_errors=True)
    took = time.monotonic() - began

    print()
    headers, rows = table(outcomes, args.hang_cap)
    print_table(headers, rows)
    for line in notes(outcomes, args):
        print(line)
    print(f"\nwhole run {took:.0f} s; command: {shlex.join(sys.argv)}")
    alive, line = leak_report(recorded)
    print(line)

    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(markdown(outcomes, args, info, peers), encoding="utf8")
    print(f"wrote {args.markdown}")
    write_json(
        args.json,
        {
            "benchmark": "peers",
            "settings": {k: str(v) for k, v in vars(args).items()},
            "machine": info,
            "peers": peers,
            "results": [o.__dict__ for o in outcomes],
            "recorded_pids": recorded,
            "pids_alive_after_stop": alive,
        },
    )
    return 1 if alive else 0


if __name__ == "__main__":
    sys.exit(main())
