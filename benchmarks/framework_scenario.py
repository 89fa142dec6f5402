"""The `frameworks` scenario: steps/s of Lightning, Accelerate, the HF Trainer, FSDP2 and plain DDP
in `%%ddp` cells of a real kernel, each paired with the same code under torchrun.

Both sides run one cell (under torchrun: one job, `train_workload.py --exec`) that trains with
every framework in turn (`framework_workload.run`); the order of the frameworks rotates every
round, the same on both sides, and which side goes first alternates (the harness's pairing).
Ratios are per round and per framework: `%%ddp` over torchrun.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from harness import BENCH_DIR, fmt, print_table, stats
from scenarios import Run, Scenario, paired, ratio_text
from subjects import RESULT_LINE, TRAIN_TIMEOUT, Subject

NAMES = ("lightning", "accelerate", "hf_trainer", "fsdp2", "ddp")
LABELS = {
    "lightning": 'Lightning `Trainer(strategy="ddp")`',
    "accelerate": "Accelerate `Accelerator` + `prepare`",
    "hf_trainer": "Hugging Face `Trainer`",
    "fsdp2": "FSDP2 (`prepare_model(shard=True)`)",
    "ddp": "plain DDP (the `training` scenario's loop)",
}
CELL = (
    "import json, sys, torch\n{threads}sys.path.insert(0, {bench!r})\nimport framework_workload\n"
    "result = framework_workload.run({names!r}, {steps}, {warmup})\n"
    'if rank == 0:\n    print("BENCH_RESULT " + json.dumps(result), flush=True)'
)


class Frameworks(Scenario):
    """Steps/s of each framework under `%%ddp` against the same code under torchrun."""

    name = "frameworks"
    default_subjects = ("ddp_kernel", "torchrun")
    repeats = 5

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def reference(self, name: str) -> str | None:
        return "torchrun"

    def supports(self, name: str) -> str | None:
        if name not in self.default_subjects:
            return "measured in %%ddp cells of a kernel (ddp_kernel) against torchrun only"
        missing = [module for module in ("lightning", "accelerate", "transformers") if not _importable(module)]
        if missing:
            return f"not installed: {', '.join(missing)} (pip install -e '.[test]')"
        return super().supports(name)

    def run_all(self, subject: Subject, run: Run, names: list[str]) -> dict[str, Any]:
        s = run.s
        threads = "" if s.threads is None else f"torch.set_num_threads({s.threads})\n"
        body = CELL.format(threads=threads, bench=str(BENCH_DIR), names=names, steps=s.steps, warmup=s.warmup)
        cell = subject.cell(body, TRAIN_TIMEOUT * 2, expect=RESULT_LINE.search)
        found = RESULT_LINE.search(cell.text)
        if not found:
            raise RuntimeError(f"no result ({cell.status}): {cell.text[-2000:]}")
        return json.loads(found.group(1))

    def prepare(self, subject: Subject, run: Run, notes: dict[str, Any]) -> None:
        self.run_all(subject, run, list(NAMES))  # untimed: imports and every framework's first run

    def measure(self, subject: Subject, run: Run) -> dict[str, Any]:
        turn = self.calls.get(subject.name, 0)
        self.calls[subject.name] = turn + 1
        order = list(NAMES[turn % len(NAMES) :] + NAMES[: turn % len(NAMES)])  # the same rotation on both sides
        result = self.run_all(subject, run, order)
        return {"steps_per_s": result["steps_per_s"], "torch_threads": result["torch_threads"], "order": order}

    def brief(self, sample: dict[str, Any]) -> str:
        rates = ", ".join(f"{name} {sample['steps_per_s'][name]:.1f}" for name in NAMES)
        return f"steps/s: {rates} ({sample['torch_threads']} thread(s))"

    def report(self, results: dict[str, Any], s: Any) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        rows = []
        ours = next((n for n in results if n != "torchrun"), None)
        for framework in NAMES:
            entry: dict[str, Any] = {}
            for name in results:
                entry[name] = stats([x["steps_per_s"][framework] for x in results[name]["samples"]])
            ratios = paired(results, ours, "torchrun", lambda x, f=framework: x["steps_per_s"][f]) if ours else []
            mine, theirs = entry.get(ours or "", {}).get("median"), entry.get("torchrun", {}).get("median")
            of_medians = mine / theirs if mine and theirs else None
            entry |= {"ratio": stats(ratios), "ratio_of_medians": of_medians}
            summary[framework] = entry
            rows.append([LABELS[framework], mine, theirs, ratio_text(ratios), fmt(of_medians, 3), len(ratios)])
        print_table(["steps/s, median", "%%ddp", "torchrun", "x torchrun per round", "of medians", "rounds"], rows)
        threads = {name: sorted({x["torch_threads"] for x in entry["samples"]}) for name, entry in results.items()}
        print(f"torch threads per rank: {threads}; steps {s.steps} after {s.warmup} untimed, per framework and round")
        summary["threads"] = threads
        all_ratios = [r for f in NAMES for r in paired(results, ours, "torchrun", lambda x, f=f: x["steps_per_s"][f])]
        if all_ratios:
            summary["median_ratio_all"] = statistics.median(all_ratios)
        return summary


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
