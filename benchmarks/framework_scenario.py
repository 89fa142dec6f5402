"""The `frameworks` scenario: steps/s of Lightning, Accelerate, the HF Trainer, FSDP2 and plain DDP
in `%%ddp` cells of a real kernel, each paired with the same code under torchrun.

Each round trains with one framework on every side, one cell each: `%%ddp` in a kernel; torchrun
as a fresh job per cell (`train_workload.py --exec`, a standalone script); and torchrun as one
long-lived script whose processes run every cell in turn (`torchrun_served`), so that, like the
ranks, they carry what the cells before imported and made (the other frameworks too). The
framework changes every round, in turn, and the order of the sides rotates (the harness's
pairing), so the runs of a round are seconds apart on a machine whose load changes by the minute.
Ratios are per round: `%%ddp` over each torchrun, then per framework. A second table gives rank
0's process CPU time per step over the same steps, which other work on the machine moves less
than steps/s.
"""

from __future__ import annotations

import json
from typing import Any

from harness import BENCH_DIR, fmt, print_table, stats
from scenarios import Run, Scenario, paired, ratio_text
from subjects import ON_PATH, RESULT_LINE, TRAIN_TIMEOUT, Subject

NAMES = ("lightning", "accelerate", "hf_trainer", "fsdp2", "ddp")
LABELS = {
    "lightning": 'Lightning `Trainer(strategy="ddp")`',
    "accelerate": "Accelerate `Accelerator` + `prepare`",
    "hf_trainer": "Hugging Face `Trainer`",
    "fsdp2": "FSDP2 (`prepare_model(shard=True)`)",
    "ddp": "plain DDP (the `training` scenario's loop)",
}
CELL = (
    "import json, sys, torch\n{threads}" + ON_PATH + "import framework_workload\n"
    "result = framework_workload.run({names!r}, {steps}, {warmup})\n"
    'if rank == 0:\n    print("BENCH_RESULT " + json.dumps(result), flush=True)'
)


class Frameworks(Scenario):
    """Steps/s of each framework under `%%ddp` against the same code under torchrun."""

    name = "frameworks"
    default_subjects = ("ddp_kernel", "torchrun", "torchrun_served")
    references = ("torchrun_served", "torchrun")
    repeats = 20  # rounds: 4 per framework

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def reference(self, name: str) -> str | None:
        return "torchrun_served"

    def supports(self, name: str) -> str | None:
        if name not in self.default_subjects:
            return "measured in %%ddp cells of a kernel (ddp_kernel) against torchrun (fresh and served) only"
        missing = [module for module in ("lightning", "accelerate", "transformers") if not _importable(module)]
        if missing:
            return f"not installed: {', '.join(missing)} (pip install -e '.[test]')"
        return super().supports(name)

    def run_cell(self, subject: Subject, run: Run, names: list[str]) -> dict[str, Any]:
        s = run.s
        threads = "" if s.threads is None else f"torch.set_num_threads({s.threads})\n"
        body = CELL.format(threads=threads, bench=str(BENCH_DIR), names=names, steps=s.steps, warmup=s.warmup)
        cell = subject.cell(body, TRAIN_TIMEOUT * 2, expect=RESULT_LINE.search)
        found = RESULT_LINE.search(cell.text)
        if not found:
            raise RuntimeError(f"no result ({cell.status}): {cell.text[-2000:]}")
        return json.loads(found.group(1))

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        self.run_cell(subject, run, list(NAMES))  # untimed: imports and every framework's first run

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        turn = self.calls.get(subject.name, 0)
        self.calls[subject.name] = turn + 1
        chosen = run.s.frameworks or NAMES
        framework = chosen[turn % len(chosen)]  # the same on both sides of a round
        result = self.run_cell(subject, run, [framework])
        rate, cpu = result["steps_per_s"][framework], result["cpu_ms_per_step"][framework]
        return {
            "framework": framework,
            "steps_per_s": rate,
            "cpu_ms_per_step": cpu,
            "torch_threads": result["torch_threads"],
        }

    def brief(self, sample: dict[str, Any]) -> str:
        rate, cpu, threads = sample["steps_per_s"], sample["cpu_ms_per_step"], sample["torch_threads"]
        return f"{sample['framework']} {rate:.1f} steps/s, {cpu:.2f} CPU ms/step ({threads} thread(s))"

    def groups(self, active: list[str]) -> list[list[str]]:
        return [active] if active else []  # every side in every round, the framework the same

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        ours = "ddp_kernel" if "ddp_kernel" in results else None
        for reference in (name for name in self.references if name in results and ours):
            print(f"-- %%ddp against {results[reference]['label']}")
            summary[reference] = self._against(results, ours or "", reference, s)
            print()
        threads = {name: sorted({x["torch_threads"] for x in entry["samples"]}) for name, entry in results.items()}
        print(f"torch threads per rank: {threads}; {s.steps} timed steps after {s.warmup} untimed per run")
        summary["threads"] = threads
        return summary

    def _against(self, results: dict[str, Any], ours: str, theirs: str, s: Any) -> dict[str, Any]:
        """The steps/s and CPU tables of `ours` against `theirs`, per framework, pair by pair."""
        summary: dict[str, Any] = {}
        rows, cpu_rows, everything = [], [], []
        for framework in s.frameworks or NAMES:
            only = {
                name: {**entry, "samples": [x for x in entry["samples"] if x["framework"] == framework]}
                for name, entry in results.items()
            }
            row, ratios = _compare(only, ours, theirs, "steps_per_s")
            cpu_row, cpu_ratios = _compare(only, ours, theirs, "cpu_ms_per_step")
            everything += ratios
            summary[framework] = {"steps_per_s": row, "cpu_ms_per_step": cpu_row}
            rows.append([LABELS[framework], *_cells(row, ratios)])
            cpu_rows.append([LABELS[framework], *_cells(cpu_row, cpu_ratios)])
        header = [f"x {theirs}: pairs' median (range)", "of medians", "pairs"]
        print_table(["steps/s, median", "%%ddp", theirs, *header], rows)
        print()
        print_table(["rank 0 CPU ms/step, median", "%%ddp", theirs, *header], cpu_rows)
        if everything:
            summary["all_pairs"] = stats(everything)
            print(f"every pair, all frameworks: median {ratio_text(everything)} over {len(everything)} pairs")
        return summary


def _compare(only: dict[str, Any], ours: str, theirs: str, key: str) -> tuple[dict[str, Any], list[float]]:
    """Medians of `key` on both sides, the ratio of each round's pair, and the ratio of the medians."""
    mine = stats([x[key] for x in only[ours]["samples"]]) if ours in only else {}
    other = stats([x[key] for x in only[theirs]["samples"]]) if theirs in only else {}
    ratios = paired(only, ours, theirs, lambda x: x[key])
    a, b = mine.get("median"), other.get("median")
    of_medians = a / b if a and b else None
    return {"ours": mine, "theirs": other, "ratio": stats(ratios), "ratio_of_medians": of_medians}, ratios


def _cells(row: dict[str, Any], ratios: list[float]) -> list[Any]:
    of_medians = row["ratio_of_medians"]
    return [row["ours"].get("median"), row["theirs"].get("median"), ratio_text(ratios), fmt(of_medians, 3), len(ratios)]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
