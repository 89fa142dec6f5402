"""What is measured, on every subject alike, and the driver that alternates the subjects.

Each scenario measures one thing through the subjects' common interface, so the peers
comparison is the same code run on more subjects. A persistent scenario (subjects stay up)
runs each subject next to its reference subject, both up at once, alternating which goes
first each round; start opens and closes every subject once per round.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import BENCH_DIR, Tracker, Unsupported, cpu_seconds, fmt, mean_interval, print_table, rounds, stats
from subjects import ON_PATH, SUBJECTS, InProcess, KernelSubject, Subject

CELL_TIMEOUT = 60.0  # seconds for a probe or trivial cell
RECOVERY_TIMEOUT = 10.0  # seconds for the first cell with a collective after a failure
FAIL_AFTER = 0.5  # seconds into a failing cell; the other ranks are in a collective by then
INTERRUPT_AT = 1.5  # seconds into a hung cell, the stop button
# the ratio each subject is shown against, where that subject runs too
SAME_PATH = {"ddp_notebook": "ipyparallel", "ddp_kernel": "px_kernel", "nbdistributed": "px_kernel"}
SAME_PATH |= {"accelerate": "px_kernel", "ddp_notebook_cold": "ddp_notebook"}
SAME_PATH |= {"ddp_notebook_prewarmed": "ddp_notebook", "ddp_kernel_prewarmed": "ddp_kernel"}

# ---------------------------------------------------------------- code run on the ranks (sees `rank`)

TRIVIAL = "x = 1"
# `global` makes the name outlive a function (Accelerate); at the top level of a cell it is a no-op
STATE_SET = "global persist_probe\npersist_probe = 1000 + rank"
STATE_GET = "print(f\"persist rank={rank} value={globals().get('persist_probe')}\", flush=True)"
# three lines per rank, 0.3 s apart, so the ranks' lines interleave
TAG = 'import time\nfor i in range(3):\n    print(f"tagprobe:{rank}:{i}", flush=True)\n    time.sleep(0.3)'
# @MODEL@: the tool's way to wrap a module in DDP
SETUP = (
    "import torch, torch.distributed as dist\ntorch.manual_seed(0)\nmodel = @MODEL@\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\nprobe = 1000 + rank"
)
# @EVENT@: a file where rank 1 writes when it failed
FAILING = {
    # rank 1 raises mid-training while the others wait for it in backward's all-reduce
    "raise": "import time, torch\nmodel = @MODEL@\noptimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "started = time.time()\nwhile True:\n    optimizer.zero_grad()\n    model(torch.randn(16, 32)).sum().backward()\n"
    f"    optimizer.step()\n    if rank == 1 and time.time() - started > {FAIL_AFTER}:\n"
    "        with open(@EVENT@, 'w') as f:\n            f.write(repr(time.time()))\n"
    "        raise ValueError('rank 1 fails on purpose')",
    # rank 1 never reaches the all_reduce the others wait in
    "hang": "import time, torch, torch.distributed as dist\nx = torch.ones(1)\n"
    "if rank == 1:\n    time.sleep(600)\ndist.all_reduce(x)",
    # rank 1's process exits while the others wait in the all_reduce
    "death": "import os, time, torch, torch.distributed as dist\nx = torch.ones(1)\n"
    f"if rank == 1:\n    time.sleep({FAIL_AFTER})\n"
    "    with open(@EVENT@, 'w') as f:\n        f.write(repr(time.time()))\n"
    "    os._exit(9)\ndist.all_reduce(x)",
}
FAILING["interrupt"] = FAILING["hang"]
# collectives that can never match: rank 1 broadcasts where the others all-reduce (every rank blocks)
FAILING["mismatch"] = (
    "import time, torch, torch.distributed as dist\nx = torch.ones(4)\nif rank == 1:\n"
    "    with open(@EVENT@, 'w') as f:\n        f.write(repr(time.time()))\n    dist.broadcast(x, 0)\n"
    "else:\n    dist.all_reduce(x)"
)
# rank 1 skips the all_reduce the others wait in, and finishes the cell
FAILING["skipped"] = (
    "import time, torch, torch.distributed as dist\nx = torch.ones(4)\nif rank == 1:\n"
    "    with open(@EVENT@, 'w') as f:\n        f.write(repr(time.time()))\nelse:\n    dist.all_reduce(x)"
)
# the next cell: a DDP step and a collective on every rank, and the state of earlier cells
AFTER = (
    "import torch, torch.distributed as dist\n"
    "if 'model' not in globals():  # nothing kept: a fork per call\n    model = @MODEL@\n"
    "model(torch.randn(16, 32)).sum().backward()\ny = torch.ones(1)\ndist.all_reduce(y)\n"
    "print(f\"after rank={rank} sum={y.item()} probe={globals().get('probe')}\", flush=True)"
)
PERSIST_LINE = re.compile(r"persist rank=(\d+) value=(None|\d+)")
AFTER_LINE = re.compile(r"after rank=(\d+) sum=([\d.]+) probe=(None|\d+)")
TAG_MARK = re.compile(r"tagprobe:(\d+):(\d+)")
# how tools name a rank: [rank 1], [stdout:1], [1:execute], [default1], "Rank 1:", "rank: 1"
RANK_TAG = re.compile(r"\[(?:rank |stdout:|stderr:|default)(\d+)\]|\[(\d+):\w+\]|\brank:? ?(\d+):", re.I)
FAILURE_WORDS = re.compile(
    r"Error|error|Traceback|Timeout|timed out|failed|FAILED|interrupted|Interrupt|killed|mismatch"
)
WORKLOAD = "import json, sys\n" + ON_PATH.format(bench=str(BENCH_DIR)) + "import train_workload\n"
HEALED = re.compile(r"set up again in ([\d.]+) s")  # what ddp_notebook tells the user after a heal
# the elastic scenario: train_workload's MLP on synthetic data, tracked (a snapshot every K steps)
ELASTIC_STEPS = 60
ELASTIC_SETUP = """
import time, json, torch
from torch.utils.data import TensorDataset
torch.manual_seed(0)
data = TensorDataset(torch.randn(16384, 64), torch.randint(0, 10, (16384,)))
model = ddp_notebook.@WRAP@(torch.nn.Sequential(
    torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = ddp_notebook.prepare_loader(data, batch_size=64)
plain_loader = ddp_notebook.prepare_loader(data, batch_size=64)
step = 0
ddp_notebook.track(model=model, optimizer=optimizer, loader=loader, step=step)
"""
ELASTIC_COST = """
from ddp_notebook.rank import elastic
from ddp_notebook.rank.state import RANK
def run(source, steps):
    global step
    dist.barrier()
    began = time.perf_counter()
    for number, (x, y) in enumerate(source):
        if number == steps:
            break
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        step += 1
    dist.barrier()
    return time.perf_counter() - began
tracked = plain = 0.0
for block in range({blocks}):
    for kind in (("tracked", "plain") if block % 2 == 0 else ("plain", "tracked")):
        took = run(loader if kind == "tracked" else plain_loader, {steps})
        if kind == "tracked":
            tracked += took
        else:
            plain += took
snapshot_s = []
for _ in range(10):
    began = time.perf_counter()
    elastic.snapshot()
    snapshot_s.append(time.perf_counter() - began)
print(json.dumps({{"tracked_s": tracked, "plain_s": plain, "steps": {blocks} * {steps},
    "every": RANK.tracked.every, "snapshot_mib": elastic.snapshot_bytes() / 2**20,
    "snapshot_ms": 1000 * sorted(snapshot_s)[len(snapshot_s) // 2]}}))
"""
ELASTIC_DEATH = """
import os, signal, time
weights_before = [p.detach().clone() for p in model.parameters()]
if rank == 1:
    with open(@EVENT@, "w") as handle:
        handle.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
"""
ELASTIC_CHECK = """
now = [getattr(p, "full_tensor", p.detach)().detach() for p in model.parameters()]
reference = [t.clone() for t in now]
for t in reference:
    dist.broadcast(t, src=0)
print("same", all(torch.equal(a, b) for a, b in zip(now, reference)))
"""
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
GLOG_PREFIX = re.compile(r"^[EWIF]\d{4} [\d:.]+ \d+ \S+\] |^\[/\S+:\d+\] ")


def first_line(text: str) -> str:
    """The first line that reports a failure, without log prefixes, shortened."""
    for line in text.splitlines():
        line = " ".join(GLOG_PREFIX.sub("", UUID.sub("<id>", line)).split())
        if FAILURE_WORDS.search(line):
            return line if len(line) <= 110 else line[:107] + "..."
    return ""


# ---------------------------------------------------------------- the driver


class Run:
    """One scenario's run: settings, every process started (for the leak check), scratch files."""

    def __init__(self, s: Any) -> None:
        self.s = s
        self.tracker = Tracker()
        self.leaks: dict[str, list[int]] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="bench-"))

    def open(self, name: str) -> tuple[Subject, dict[str, Any]]:
        subject = SUBJECTS[name](self.s)
        try:
            notes = subject.open()
        except BaseException:
            self.close(subject)
            raise
        self.note(subject)
        return subject, notes

    def note(self, subject: Subject) -> None:
        subject.pids = sorted(set(getattr(subject, "pids", [])) | set(self.tracker.note(subject.roots())))

    def close(self, subject: Subject) -> float:
        self.note(subject)
        began = time.perf_counter()
        try:
            subject.close()
        except Exception as failure:  # noqa: BLE001  (what is left is killed by PID below)
            print(f"warning: stopping {subject.name} failed: {failure}")
        took = time.perf_counter() - began
        if leaked := self.tracker.leaked(subject.pids):
            print(f"LEAK: {len(leaked)} process(es) of {subject.name} alive 5 s after its stop: {leaked}")
            self.leaks.setdefault(subject.name, []).extend(leaked)
        return took

    def reopen(self, subject: Subject) -> None:
        self.close(subject)
        subject.open()
        self.note(subject)

    def finish(self) -> list[int]:
        """Every process noted during the run must be gone; the ones that are not are killed."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.tracker.note()
        leaked = self.tracker.leaked()
        print(f"PID check: {len(leaked)} of {len(self.tracker.seen)} processes started in this run still alive", end="")
        print(f" (killed): {leaked}" if leaked else " (all gone)")
        return sorted(set(leaked) | {pid for pids in self.leaks.values() for pid in pids})


class Scenario:
    name = ""
    persistent = True
    default_subjects: tuple[str, ...] = ("ddp_notebook",)
    repeats = 3
    peers_repeats = 3

    def reference(self, name: str) -> str | None:
        return SAME_PATH.get(name)

    def supports(self, name: str) -> str | None:
        return SUBJECTS[name].unavailable()

    def groups(self, active: list[str]) -> list[list[str]]:
        if not self.persistent:
            return [active] if active else []
        groups = []
        for name in active:
            reference = self.reference(name)
            if reference in active and reference != name:
                groups.append([name, reference])
            elif not any(self.reference(other) == name and other != name for other in active):
                groups.append([name])
        return groups

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        pass

    def measure(self, subject: Any, run: Run) -> dict[str, Any]:
        raise NotImplementedError

    def brief(self, sample: dict[str, Any]) -> str:
        return ""

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        raise NotImplementedError


def drive(scenario: Scenario, names: list[str], run: Run) -> dict[str, Any]:
    """Run `scenario` on the subjects `names`; every sample, per subject."""
    results = {
        name: {"label": SUBJECTS[name].label, "samples": [], "notes": {}, "na": scenario.supports(name), "error": None}
        for name in names
    }
    active = [name for name in names if not results[name]["na"]]
    print(f"== {scenario.name}: {', '.join(names)}")
    for number, group in enumerate(scenario.groups(active)):
        opened: list[Subject] = []
        current = group[0]
        try:
            for current in group if scenario.persistent else ():
                subject, notes = run.open(current)
                opened.append(subject)
                results[current]["notes"].update(notes, threads=subject.threads, code=subject.code)
                scenario.prepare(subject, run, results[current]["notes"])
            by_name = {subject.name: subject for subject in opened}
            for index, current in rounds(group, run.s.repeats):
                entry = results[current]
                if entry["na"] or entry["error"]:
                    continue
                others = [pid for subject in opened if subject.name != current for pid in subject.pids]
                idle, began = cpu_seconds(others), time.perf_counter()
                try:
                    sample = scenario.measure(by_name.get(current, current), run)
                except Unsupported as why:
                    entry["na"] = str(why)
                    continue
                except Exception as failure:  # noqa: BLE001  (one subject failing must not end the run)
                    entry["error"] = f"{type(failure).__name__}: {failure}"
                    traceback.print_exc()
                    continue
                if others:  # what the idle side cost while this one was measured, in % of one core
                    sample["others_cpu_pct"] = 100 * (cpu_seconds(others) - idle) / (time.perf_counter() - began)
                entry["samples"].append(sample | {"group": number, "round": index})
                print(f"   round {index + 1}/{run.s.repeats} {current}: {scenario.brief(sample)}", flush=True)
                if current in by_name:
                    run.note(by_name[current])
        except Exception as failure:  # noqa: BLE001
            results[current]["error"] = f"{type(failure).__name__}: {failure}"
            traceback.print_exc()
        finally:
            for subject in reversed(opened):
                run.close(subject)
    for name, entry in results.items():
        if entry["na"] or entry["error"]:
            print(f"   {name}: {'n/a: ' + entry['na'] if entry['na'] else 'FAILED: ' + entry['error']}")
    return results


def paired(results: dict[str, Any], name: str, reference: str | None, value: Any) -> list[float]:
    """Ratios name/reference of `value(sample)`, one per round in which both ran together."""
    if reference not in results:
        return []
    theirs = {(x["group"], x["round"]): value(x) for x in results[reference]["samples"]}
    return [
        value(x) / theirs[key]
        for x in results[name]["samples"]
        if (key := (x["group"], x["round"])) in theirs and theirs[key]
    ]


def ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


# ---------------------------------------------------------------- scenarios


class Start(Scenario):
    """Seconds from nothing to ready to train: process group up, torch imported on every rank."""

    name = "start"
    persistent = False
    default_subjects = ("ddp_notebook", "ipyparallel")

    def measure(self, name: Any, run: Run) -> dict[str, Any]:
        subject, notes = run.open(name)
        return notes | {"stop_s": run.close(subject), "threads": subject.threads, "code": subject.code}

    def brief(self, sample: dict[str, Any]) -> str:
        return f"ready {sample['ready_s']:.2f} s, stop {sample['stop_s']:.2f} s"

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary, rows = {}, []
        for name, entry in results.items():
            ready = stats([x["ready_s"] for x in entry["samples"]])
            ratios = paired(results, name, self.reference(name), lambda x: x["ready_s"])
            started = [x["start_s"] for x in entry["samples"] if "start_s" in x]
            lost = sum(x.get("lost_cells", 0) for x in entry["samples"])
            summary[name] = {"ready_s": ready, "ratio": stats(ratios), "start_only_s": stats(started), "lost": lost}
            summary[name]["threads"] = entry["samples"][0]["threads"] if entry["samples"] else "?"
            stop = stats([x["stop_s"] for x in entry["samples"]]).get("median")
            rows.append([entry["label"], ready.get("median"), ready.get("min"), ready.get("max"), stop])
            rows[-1] += [f"x {self.reference(name)}: {ratio_text(ratios)}" if ratios else "", lost or ""]
            if started:
                rows.append(["  (cluster start alone)", *(stats(started)[k] for k in ("median", "min", "max"))])
                rows[-1] += ["", "", ""]
        print_table(["ready to train", "median s", "min s", "max s", "stop s", "paired ratio", "lost cells"], rows)
        return summary


class Roundtrip(Scenario):
    """A trivial cell (`x = 1`) on every rank; and, once per subject, what cells keep and show."""

    name = "roundtrip"
    default_subjects = ("ddp_notebook", "ipyparallel")
    repeats = 20

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        ranks = run.s.ranks
        if subject.script:
            notes["state"] = "n/a (a script)"
        else:
            subject.cell(STATE_SET, CELL_TIMEOUT)
            cell = subject.cell(STATE_GET, CELL_TIMEOUT, expect=lambda text: len(PERSIST_LINE.findall(text)) >= ranks)
            values = dict(PERSIST_LINE.findall(cell.text))
            kept = [values.get(str(r)) == str(1000 + r) for r in range(ranks)]
            notes["state"] = "yes" if all(kept) else "no" if not any(kept) else f"on {sum(kept)} of {ranks} ranks"
        cell = subject.cell(TAG, CELL_TIMEOUT, expect=lambda text: len(TAG_MARK.findall(text)) >= 3 * ranks)
        notes["tagging"] = tagging_verdict(cell.text, ranks)
        if isinstance(subject, InProcess):  # the harness, not the tool, wrote those tags
            notes["tagging"] = "n/a (a Python API: output comes back per rank)"
        sent, shown = sum(len(o.text) for o in cell.outputs), len(cell.text)
        if sent > 1.5 * shown:  # display updates: the notebook ends up showing less than was sent
            notes["tagging"] += f"; each update re-sends the block ({sent / shown:.1f}x the text shown)"
        notes["late_output"] = any(o.late for o in cell.outputs)
        if subject.script:
            return
        for _ in range(run.s.warmup):  # untimed: the first cells may pay one-off costs
            subject.cell(TRIVIAL, CELL_TIMEOUT)

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        if subject.script:
            raise Unsupported("a script: every cell is a new job")
        samples = []
        for _ in range(run.s.cells):
            cell = subject.cell(TRIVIAL, CELL_TIMEOUT)
            if cell.status != "ok" or cell.elapsed is None:
                raise RuntimeError(f"trivial cell: {cell.status}: {cell.text[-500:]}")
            samples.append(cell.elapsed * 1e3)
        return {"ms": samples}

    def brief(self, sample: dict[str, Any]) -> str:
        return f"median {statistics.median(sample['ms']):.1f} ms"

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary, rows = {}, []
        for name, entry in results.items():
            ms = stats([v for x in entry["samples"] for v in x["ms"]])
            reference = self.reference(name)
            ratios = paired(results, name, reference, lambda x: statistics.median(x["ms"]))
            summary[name] = {"ms": ms, "ratio": stats(ratios), "reference": reference, **entry["notes"]}
            rows.append([entry["label"], *(ms.get(k) for k in ("median", "p90", "min", "max", "n"))])
            rows[-1].append(f"x {reference}: {ratio_text(ratios)}" if ratios else "")
        print_table(["trivial cell", "median ms", "p90 ms", "min ms", "max ms", "cells", "per-round ratio"], rows)
        for name, entry in results.items():
            if entry["notes"]:
                print(f"{name}: state kept across cells: {entry['notes'].get('state')};", end=" ")
                print(f"tagged by rank: {entry['notes'].get('tagging')}")
        return summary


def tagging_verdict(text: str, ranks: int) -> str:
    """Is each probe line shown with its rank (on its line, or in the last header above it)?"""
    header: int | None = None
    own = right = wrong = 0
    seen: list[tuple[int, int]] = []
    glued = False
    for line in text.splitlines():
        tags = [int(next(g for g in m.groups() if g)) for m in RANK_TAG.finditer(line)]
        marks = [(int(r), int(i)) for r, i in TAG_MARK.findall(line)]
        header = tags[-1] if tags else header
        glued = glued or len(marks) > 1
        for rank, _ in marks:
            own += bool(tags)
            right += header == rank
            wrong += header is not None and header != rank
        seen += marks
    expected = {(r, i) for r in range(ranks) for i in range(3)}
    if not expected <= set(seen):
        return f"? ({len(set(seen) & expected)} of {len(expected)} probe lines shown)"
    if wrong:
        verdict = f"wrong: {wrong} of {len(seen)} lines under another rank's header"
    elif right == len(seen):
        verdict = "yes, every line" if own == len(seen) else "yes, a header per block"
    else:
        verdict = "no" if right == 0 else f"partly: {right} of {len(seen)} lines"
    notes = [f"output re-sent: {len(seen)} lines shown for {len(expected)}"] if len(seen) > len(expected) else []
    return "; ".join([verdict, *notes, *(["lines of different ranks run together"] if glued else [])])


class Training(Scenario):
    """Steps/s of `train_workload.train()`, each run paired with a torchrun run of the same function."""

    name = "training"
    default_subjects = ("ddp_notebook", "torchrun")
    peers_repeats = 6

    def reference(self, name: str) -> str | None:
        return "torchrun"

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        subject.train(run.s.steps, run.s.warmup, run.s.threads)  # untimed: a first run pays one-off costs

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        result = subject.train(run.s.steps, run.s.warmup, run.s.threads)
        kept = ("steps_per_s", "elapsed_s", "process_cpu_s", "torch_threads", "device", "main_us_per_step")
        # (an older ddp_notebook's or torchrun's driver may not report the waits)
        waits = ("main_runqueue_us_per_step", "launcher_us_per_step")
        return (
            {k: result[k] for k in kept}
            | {k: result[k] for k in waits if k in result}
            | split_threads(result["threads_us_per_step"], result["elapsed_s"] / run.s.steps)
        )

    def brief(self, sample: dict[str, Any]) -> str:
        idle = f"; the other side idle: {sample['others_cpu_pct']:.1f}% of a core" if "others_cpu_pct" in sample else ""
        return f"{sample['steps_per_s']:.1f} steps/s ({sample['torch_threads']} thread(s), {sample['device']}){idle}"

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary, rows = {}, []
        for name, entry in results.items():
            rate = stats([x["steps_per_s"] for x in entry["samples"]])
            ratios = paired(results, name, "torchrun", lambda x: x["steps_per_s"]) if name != "torchrun" else []
            groups = {x["group"] for x in entry["samples"]}
            theirs = [x["steps_per_s"] for x in results.get("torchrun", entry)["samples"] if x["group"] in groups]
            of_medians = rate["median"] / statistics.median(theirs) if ratios else None
            threads = sorted({x["torch_threads"] for x in entry["samples"]})
            summary[name] = {"steps_per_s": rate, "ratio": stats(ratios), "ratio_of_medians": of_medians}
            summary[name]["threads"] = threads
            rows.append([entry["label"], *(rate.get(k) for k in ("median", "min", "max")), fmt(of_medians, 3)])
            rows[-1] += [ratio_text(ratios), ",".join(map(str, threads))]
        print_table(["steps/s", "median", "min", "max", "x torchrun (medians)", "per pair", "threads"], rows)
        print_thread_cost(results, summary)
        return summary


# torch's own threads (a torchrun worker has them too): what a rank runs beside them is the tool's
TORCH_THREADS = re.compile(r"^native (gloo|pt_|cuda|nccl|ncclProxy|torch)")


def split_threads(threads: dict[str, float], seconds_per_step: float | None = None) -> dict[str, Any]:
    """A rank's background CPU per step: torch's own threads, and the rest (the tool's) by name.
    Given the steps' wall time, also the tool's threads as a share of one core while they ran: they
    work on a clock (the X-ray's 4 reports a second, ZMQ's heartbeats), not per step, so per step
    they grow as a loaded machine slows the steps, and per second they do not."""
    tool = {name: us for name, us in threads.items() if not TORCH_THREADS.match(name)}
    split = {
        "torch_threads_us_per_step": sum(us for name, us in threads.items() if TORCH_THREADS.match(name)),
        "tool_threads_us_per_step": sum(tool.values()),
        "tool_threads": tool,
    }
    if seconds_per_step:
        split["tool_threads_core_pct"] = sum(tool.values()) / (seconds_per_step * 1e6) * 100
    return split


# what print_thread_cost shows, in its order: the key in a sample, and its column
COST_COLUMNS = {
    "main_us_per_step": "training thread",
    "main_runqueue_us_per_step": "its wait for a CPU",
    "torch_threads_us_per_step": "torch's threads",
    "tool_threads_us_per_step": "the tool's threads",
    "launcher_us_per_step": "launcher side",
    "tool_threads_core_pct": "the tool's threads, % of a core",
}


def print_thread_cost(results: dict[str, Any], summary: dict[str, Any]) -> None:
    """CPU per training step on rank 0 beside the user's code, the median of the runs: it does not move
    with the machine's load the way steps/s does, so a regression shows here first. Beside it, how long
    the training thread waited for a CPU, and the CPU of the processes that run the ranks (the kernel,
    the controller; torchrun's agent) per step, which compete with the ranks for the cores."""
    keys = [k for k in COST_COLUMNS if all(k in x for entry in results.values() for x in entry["samples"])]
    rows = []
    for name, entry in results.items():
        samples = entry["samples"]
        medians = {key: statistics.median(x[key] for x in samples) for key in keys}
        names = sorted({n for x in samples for n in x["tool_threads"]})
        top = {n: statistics.median(x["tool_threads"].get(n, 0.0) for x in samples) for n in names}
        shown = ", ".join(f"{n} {us:.0f}" for n, us in sorted(top.items(), key=lambda item: -item[1])[:4] if us >= 0.5)
        summary[name]["cpu_us_per_step"] = medians | {"tool_threads": top}
        shares = (f"{medians[k]:.2f}" if k.endswith("_pct") else f"{medians[k]:.0f}" for k in keys)
        rows.append([entry["label"], *shares, shown or "-"])
    print_table(["us per step (rank 0)", *(COST_COLUMNS[k] for k in keys), "largest of the tool's"], rows)


class Failures(Scenario):
    """Seconds from a failure inside a cell to the message; then the next cell, and the state."""

    name = "failures"
    peers_repeats = 1

    def reference(self, name: str) -> str | None:
        return None

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        cases = {}
        for case in run.s.cases:
            try:
                cases[case] = self.case(subject, case, run)
            except Exception as failure:  # noqa: BLE001  (one case failing must not lose the others)
                traceback.print_exc()
                cases[case] = {"error": f"{type(failure).__name__}: {failure}"}
                run.reopen(subject)  # a fresh world for the next case
        return {"cases": cases}

    def brief(self, sample: dict[str, Any]) -> str:
        return "; ".join(f"{case} {fmt(out.get('message_s', 'failed'))} s" for case, out in sample["cases"].items())

    def case(self, subject: Subject, case: str, run: Run) -> dict[str, Any]:
        s, model = run.s, subject.model_idiom.format("torch.nn.Linear(32, 4)")
        setup = subject.cell(SETUP.replace("@MODEL@", model), CELL_TIMEOUT) if not subject.stateless else None
        if setup and setup.status != "ok":
            raise RuntimeError(f"{case}: the set-up cell failed: {setup.text[-800:]}")
        event_file = run.scratch / f"event-{time.monotonic_ns()}"
        body = FAILING[case].replace("@MODEL@", model).replace("@EVENT@", repr(str(event_file)))
        pressed: list[float] = []
        timer = threading.Timer(INTERRUPT_AT, lambda: (pressed.append(time.time()), subject.interrupt()))
        if case == "interrupt":
            timer.start()
        try:
            limit = s.cell_timeout if case == "hang" else None
            cell = subject.cell(body, s.hang_cap + INTERRUPT_AT, cell_timeout=limit)
        finally:
            timer.cancel()
        if case in ("raise", "death", "mismatch", "skipped"):
            event = float(event_file.read_text()) if event_file.exists() else None
        else:
            event = pressed[0] if case == "interrupt" and pressed else cell.sent + s.cell_timeout
        out: dict[str, Any] = {"said": first_line(cell.text), "status": cell.status}
        if event is None:
            raise RuntimeError(f"{case}: rank 1 never failed: {cell.text[-800:]}")
        arrived = [o.wall for o in cell.outputs if o.wall >= event - 0.05 and FAILURE_WORDS.search(o.text)]
        out["message_s"] = arrived[0] - event if arrived else None
        out["returned_s"] = cell.returned - event if cell.returned else None
        if healed := HEALED.search(cell.text):
            out["heal_s"] = float(healed.group(1))
        if cell.returned is None:
            out["stop_button_s"] = subject.after_interrupt()
        if case == "death" and hasattr(subject, "restart"):
            out |= {"recovery": "restart", "recover_s": subject.restart(), "state_kept": False}
        elif subject.script:
            out["recovery"] = "n/a (a script: run it again)"
        else:
            self.recover(subject, run, model, out)
        print(f"     {case}: message {fmt(out['message_s'])} s, returned {fmt(out['returned_s'])} s,", out["recovery"])
        return out

    def recover(self, subject: Subject, run: Run, model: str, out: dict[str, Any]) -> None:
        ranks = run.s.ranks
        cell = subject.cell(
            AFTER.replace("@MODEL@", model), RECOVERY_TIMEOUT, expect=lambda t: len(AFTER_LINE.findall(t)) >= ranks
        )
        answers = {int(r): (float(total), probe) for r, total, probe in AFTER_LINE.findall(cell.text)}
        worked = [r for r, (total, _) in answers.items() if total == ranks]
        if len(worked) == ranks:
            out |= {"recovery": "next cell works", "recover_s": cell.elapsed}
            out["state_kept"] = all(answers[r][1] == str(1000 + r) for r in range(ranks))
            return
        waited = f"{cell.elapsed:.1f} s" if cell.elapsed else f"> {RECOVERY_TIMEOUT:g} s"
        out |= {"recovery": f"no: {len(worked)} of {ranks} ranks answered ({waited})", "state_kept": None}
        out["recovery_said"] = first_line(cell.text)
        if cell.returned is None:
            subject.after_interrupt()
        run.reopen(subject)  # a fresh world for the next case

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary: dict[str, Any] = {name: {} for name in results}
        rows = []
        for name, entry in results.items():
            for case in s.cases:
                outs = [x["cases"][case] for x in entry["samples"] if "error" not in x["cases"].get(case, {"error": 1})]
                errors = [x["cases"][case]["error"] for x in entry["samples"] if "error" in x["cases"].get(case, {})]
                if errors:
                    summary[name][case] = {"error": errors[0], "failed": len(errors), "of": len(entry["samples"])}
                    rows.append([f"{name} {case}", "", "", "", f"failed: {errors[0][:60]}", "", "", ""])
                if not outs:
                    continue
                got = {k: [o[k] for o in outs if o.get(k) is not None] for k in ("message_s", "returned_s", "heal_s")}
                got |= {k: [o[k] for o in outs if o.get(k) is not None] for k in ("recover_s", "stop_button_s")}
                # a median only where every round has the figure: one hang among fast answers is a hang
                one = {k: statistics.median(v) if len(v) == len(outs) else None for k, v in got.items()}
                one |= {k: outs[0].get(k) for k in ("said", "recovery", "state_kept", "recovery_said")}
                summary[name][case] = one
                rows.append([f"{name} {case}", *(one[k] for k in ("message_s", "returned_s", "heal_s", "recovery"))])
                rows[-1] += [one["recover_s"], one["state_kept"], one["said"][:60]]
        print_table(["case", "message s", "returns s", "heal s", "then", "s", "state kept", "said"], rows)
        print(f"seconds from the failure (hang: from the end of the {s.cell_timeout:g} s timeout) to the first message")
        return summary


class _BlocksOnTheRanks(Scenario):
    """Alternating blocks of training steps on the ranks, with a feature, without it and a control;
    and, once per subject, what one call of the feature costs on the ranks."""

    peers_repeats = 1
    feature = ""  # what a subject without it lacks
    cost_call = ""  # train_workload's call that measures one call's cost: formatted with `s`
    cost_note = ""  # where the costs go in the subject's notes
    blocks_call = ""  # train_workload's call that runs the blocks: formatted with `s`

    def reference(self, name: str) -> str | None:
        return None

    def supports(self, name: str) -> str | None:
        return None if name in ("ddp_notebook", "ddp_kernel") else f"no {self.feature}"

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        body = f"{WORKLOAD}cost = dict(train_workload.{self.cost_call.format(s=run.s)}, rank=rank)\n"
        cell = subject.cell(body + 'print("BENCH_COST " + json.dumps(cost))', 300.0, expect=lambda t: "BENCH_COST" in t)
        notes[self.cost_note] = [json.loads(m) for m in re.findall(r"BENCH_COST (\{.*\})", cell.text)]

    @staticmethod
    def pooled(results: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, list[float]]]]:
        """(name, entry, its blocks of every round pooled per kind) of each subject that has samples."""
        for name, entry in results.items():
            if entry["samples"]:
                samples = entry["samples"]
                yield name, entry, {k: [v for x in samples for v in x["blocks"][k]] for k in samples[0]["blocks"]}

    def run_blocks(self, subject: Subject, run: Run) -> dict[str, Any]:
        body = f"{WORKLOAD}blocks = train_workload.{self.blocks_call.format(s=run.s)}\n"
        body += 'if rank == 0:\n    print("BENCH_RESULT " + json.dumps(blocks), flush=True)'
        cell = subject.cell(body, 600.0, expect=lambda t: "BENCH_RESULT" in t)
        found = re.search(r"BENCH_RESULT (\{.*\})", cell.text)
        if not found:
            raise RuntimeError(f"{self.name} cell: {cell.status}: {cell.text[-800:]}")
        return json.loads(found.group(1))


class Logging(_BlocksOnTheRanks):
    """What `ddp_notebook.log()` costs: per call, and steps/s with it every step against without."""

    name = "logging"
    feature = "ddp_notebook.log()"
    cost_call = "log_cost({s.calls})"
    cost_note = "per_call_ns"
    blocks_call = "log_blocks({s.blocks}, {s.block}, {s.warmup})"

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        # the notebook side: this process, or the kernel; it takes in the messages and draws
        notebook = [subject.roots()[0] if isinstance(subject, KernelSubject) else os.getpid()]
        cpu, began = cpu_seconds(notebook), time.perf_counter()
        blocks = self.run_blocks(subject, run)
        took = time.perf_counter() - began
        return {"blocks": blocks, "notebook_cpu_pct": 100 * (cpu_seconds(notebook) - cpu) / took}

    def brief(self, sample: dict[str, Any]) -> str:
        blocks = sample["blocks"]
        ratio = sum(blocks["without"]) / sum(blocks["with"])
        return f"with/without {ratio:.3f}, notebook {sample['notebook_cpu_pct']:.1f}%"

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary = {}
        for name, entry, blocks in self.pooled(results):
            rate = {kind: len(blocks[kind]) * s.block / sum(blocks[kind]) for kind in ("without", "control", "with")}
            with_ = mean_interval([a / b for a, b in zip(blocks["without"], blocks["with"])])
            control = mean_interval([a / b for a, b in zip(blocks["without"], blocks["control"])])
            log_us = sum(blocks["in_log"]) / (len(blocks["with"]) * s.block) * 1e6
            costs = entry["notes"].get("per_call_ns", [])
            per_call = {k: [c[k] for c in costs] for k in ("log_ns", "log3_ns", "progress_ns")}
            notebook = stats([x["notebook_cpu_pct"] for x in entry["samples"]])
            summary[name] = {"steps_per_s": rate, "with_over_without": with_, "control_over_without": control}
            summary[name] |= {"log_us_in_training": log_us, "log_share": log_us * rate["without"] / 1e6}
            summary[name] |= {"per_call_ns": per_call, "notebook_cpu_pct": notebook}
            ranges = ", ".join(f"{k[:-3]} {min(v):.0f}-{max(v):.0f}" for k, v in per_call.items() if v)
            print(f"{entry['label']}: per call on the ranks (ns): {ranges}")
            print(f"   steps/s without {rate['without']:.1f}, control {rate['control']:.1f}, with {rate['with']:.1f}")
            print(f"   per round with/without {with_[0]:.4f} (95% {with_[1]:.4f}-{with_[2]:.4f}); ", end="")
            print(f"control/without {control[0]:.4f} ({control[1]:.4f}-{control[2]:.4f})")
            print(
                f"   log() amid training: {log_us:.1f} us per call, {log_us * rate['without'] / 1e6:.2%} of the time;"
                f" notebook side {notebook.get('median', 0):.1f}% of one core"
            )
        return summary


class Elastic(Scenario):
    """A dead rank comes back with the tracked state; snapshot cost and memory; resizing."""

    name = "elastic"
    default_subjects = ("ddp_notebook",)

    def reference(self, name: str) -> str | None:
        return None

    def supports(self, name: str) -> str | None:
        if name not in ("ddp_notebook", "ddp_notebook_cold"):
            return "no replacement of a dead rank with its state, no resize"
        return super().supports(name)

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        world = subject.world  # type: ignore[attr-defined]
        if not hasattr(world, "resize"):
            raise Unsupported("this ddp_notebook has no comeback (ddp_notebook.track)")
        # --sharded: FSDP2, whose snapshots gather the whole model (a collective every rank takes)
        wrap = "shard_model" if run.s.sharded else "prepare_model"
        world.execute(ELASTIC_SETUP.replace("@WRAP@", wrap), setup=True, stream=False)
        notes["model"] = wrap
        template = getattr(world.provisioner, "template", None)
        if template is not None and template.pid:
            from ddp_notebook.platform import devices

            notes["spare_template_rss_mb"] = devices.resident_memory_mb(template.pid)

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        world = subject.world  # type: ignore[attr-defined]
        world.restarts = 0  # every round kills a rank: never past max_restarts
        out: dict[str, Any] = {}
        # snapshot cost: blocks of steps through the tracked loader (a snapshot every K steps)
        # and through an untracked one over the same data, alternating
        cost = world.execute(ELASTIC_COST.format(blocks=4, steps=ELASTIC_STEPS), stream=False).stdout[0]
        timing = json.loads(cost.strip().splitlines()[-1])
        out |= timing
        # one snapshot against the K steps it covers; and, noisier, the tracked loop against the plain one
        step_ms = 1000 * timing["plain_s"] / timing["steps"]
        out["snapshot_cost_pct"] = 100 * timing["snapshot_ms"] / (timing["every"] * step_ms)
        out["tracked_over_plain_pct"] = 100 * (timing["tracked_s"] / timing["plain_s"] - 1)
        # death -> world ready with the state restored: rank 1 SIGKILLs itself, the cell returns once
        # the new rank joined and every rank loaded the snapshot
        from ddp_notebook import RankDiedError

        event = run.scratch / f"death-{time.monotonic_ns()}"
        try:
            world.execute(ELASTIC_DEATH.replace("@EVENT@", repr(str(event))), stream=False)
        except RankDiedError as died:
            if not died.came_back:
                raise RuntimeError(f"the rank did not come back: {died}") from None
        returned = time.time()
        out["death_to_ready_s"] = returned - float(event.read_text())
        out["comeback_s"] = world.last_comeback_seconds
        check = world.execute(ELASTIC_CHECK, stream=False).stdout
        out["state_restored"] = all("same True" in text for text in check.values())
        # resize 2 -> 3 -> 2 (or N -> N+1 -> N)
        size = world.world_size
        began = time.perf_counter()
        out["grow_reported_s"] = world.resize(size + 1)
        out["grow_s"] = time.perf_counter() - began
        began = time.perf_counter()
        out["shrink_reported_s"] = world.resize(size)
        out["shrink_s"] = time.perf_counter() - began
        return out

    def brief(self, sample: dict[str, Any]) -> str:
        return (
            f"death->ready {sample['death_to_ready_s']:.2f} s, snapshot cost {sample['snapshot_cost_pct']:.1f}%, "
            f"grow {sample['grow_s']:.2f} s, shrink {sample['shrink_s']:.2f} s"
        )

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        rows = []
        keys = ("death_to_ready_s", "comeback_s", "snapshot_ms", "snapshot_cost_pct", "tracked_over_plain_pct")
        keys += ("snapshot_mib", "grow_s", "shrink_s")
        for name, entry in results.items():
            samples = entry["samples"]
            if not samples:
                continue
            one = {k: statistics.median(x[k] for x in samples) for k in keys}
            one |= {"step_ms": statistics.median(1000 * x["plain_s"] / x["steps"] for x in samples)}
            one |= {"every": samples[0]["every"], "state_restored": all(x["state_restored"] for x in samples)}
            one["spare_template_rss_mb"] = entry["notes"].get("spare_template_rss_mb")
            summary[name] = one
            rows.append([name, *(one[k] for k in keys), one["step_ms"], one["state_restored"]])
        headers = ["subject", "death->ready s", "comeback s", "snapshot ms", "snapshot %", "tracked/plain %"]
        headers += ["snapshots MiB/rank", "grow s", "shrink s"]
        print_table([*headers, "step ms", "state ok"], rows)
        model = "FSDP2 (shard_model)" if s.sharded else "DDP (prepare_model)"
        print(
            f"{model}; median of {s.repeats} rounds; snapshot %: one snapshot over the K steps it covers "
            "(K = the default "
            f"{rows and summary[rows[0][0]]['every']}); tracked/plain %: the same steps through the tracked loader "
            "(snapshots included) against an untracked one, alternating blocks"
        )
        return summary


class Seeing(_BlocksOnTheRanks):
    """What seeing inside the ranks costs: steps/s of a model from prepare_model (its steps timed
    phase by phase) against the same plain DDP model, in one cell the X-ray reads 4 times a second."""

    name = "seeing"
    feature = "step timing"
    cost_call = "strict_cost(200)"
    cost_note = "strict_us"
    blocks_call = "timing_blocks({s.blocks}, {s.block}, {s.warmup})"

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        return {"blocks": self.run_blocks(subject, run)}

    def brief(self, sample: dict[str, Any]) -> str:
        blocks = sample["blocks"]
        return f"with/without {sum(blocks['with']) / sum(blocks['without']):.4f}"

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary = {}
        for name, entry, blocks in self.pooled(results):
            kinds = ("without", "control", "with")
            step_ms = {kind: sum(blocks[kind]) / (len(blocks[kind]) * s.block) * 1e3 for kind in kinds}
            with_ = mean_interval([b / a for a, b in zip(blocks["without"], blocks["with"])])
            control = mean_interval([b / a for a, b in zip(blocks["without"], blocks["control"])])
            cpu_with = mean_interval([b / a for a, b in zip(blocks["cpu_without"], blocks["cpu_with"])])
            cpu_control = mean_interval([b / a for a, b in zip(blocks["cpu_without"], blocks["cpu_control"])])
            report_us = statistics.median(blocks["report_us"])
            polling = report_us * 4 / 1e6  # 4 reports a second: the share of one rank's time
            summary[name] = {"step_ms": step_ms, "with_over_without": with_, "control_over_without": control}
            summary[name] |= {"report_us": report_us, "polling_share": polling}
            summary[name] |= {"cpu_with_over_without": cpu_with, "cpu_control_over_without": cpu_control}
            print(f"   rank 0's CPU time per block with/without {cpu_with[0]:.4f} (95% {cpu_with[1]:.4f}-", end="")
            print(f"{cpu_with[2]:.4f}); control/without {cpu_control[0]:.4f} ", end="")
            print(f"({cpu_control[1]:.4f}-{cpu_control[2]:.4f})")
            for cost in entry["notes"].get("strict_us", []):
                summary[name].setdefault("strict_us", []).append(cost)
                sizes = ", ".join(
                    f"{size} floats {cost[f'plain_{size}_us']:.0f} -> {cost[f'checked_{size}_us']:.0f} us"
                    for size in (1, 262144)
                )
                print(f"   strict mode, rank {cost['rank']}: dist.all_reduce of {sizes}")
            print(f"{entry['label']}: ms per step without {step_ms['without']:.3f}, control {step_ms['control']:.3f},")
            print(f"   with step timing {step_ms['with']:.3f}; time per step with/without {with_[0]:.4f} ", end="")
            print(f"(95% {with_[1]:.4f}-{with_[2]:.4f}); control/without {control[0]:.4f} ", end="")
            print(f"({control[1]:.4f}-{control[2]:.4f})")
            print(f"   X-ray report on a rank: {report_us:.0f} us; 4 a second in a cell: {polling:.3%} of its time")
            if blocks.get("alone_with"):  # the hooks' own cost, measured in one process without collectives
                alone = mean_interval([b / a for a, b in zip(blocks["alone_without"], blocks["alone_with"])])
                per_step_us = (
                    (sum(blocks["alone_with"]) - sum(blocks["alone_without"]))
                    / (len(blocks["alone_with"]) * s.block)
                    * 1e6
                )
                share = per_step_us / (step_ms["without"] * 1e3)
                summary[name] |= {"alone_with_over_without": alone, "hooks_us_per_step": per_step_us}
                print(
                    f"   the hooks alone (the same MLP in one process, no collectives; CPU time): with/without "
                    f"{alone[0]:.4f} (95% {alone[1]:.4f}-{alone[2]:.4f}), {per_step_us:.1f} us a step, "
                    f"{share:.2%} of the DDP step above"
                )
        return summary


SCENARIOS: dict[str, Scenario] = {
    x.name: x for x in (Start(), Roundtrip(), Training(), Failures(), Logging(), Elastic(), Seeing())
}
