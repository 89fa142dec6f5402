#!/usr/bin/env bash
# Every GPU figure in one command, on the GPUs this machine has:
#
#     bash benchmarks/gpu_suite.sh
#
# 1. the tests marked `gpu` (tests/test_gpu.py: each rank on cuda:LOCAL_RANK, DDP on nccl equal
#    to one process, no CUDA context of a rank on another rank's GPU (CUDA driver and NVML),
#    FSDP2 / Accelerate / HF Trainer / Lightning where installed, notebook 04) and the device
#    plan tests (tests/test_device_plan.py);
# 2. the training throughput benchmark, ddp_notebook against torchrun, nccl, one rank per GPU;
# then writes benchmarks/results/gpu.md: the machine, each test's outcome, every figure.
#
# Raw outputs (JUnit XML, logs, JSON) go to $GPU_SUITE_OUT (default: test-artifacts/gpu-suite).
# $GPU_SUITE_RANKS caps the ranks of the benchmark (default: every GPU); $GPU_SUITE_BENCH_ARGS adds
# options to it (e.g. "--repeats 5 --steps 300"); $GPU_SUITE_TEST_SECONDS and
# $GPU_SUITE_BENCH_SECONDS bound each step (default: 1800 and 1200). $PYTHON picks the
# interpreter; the package is installed into it first (`pip install -e .[test-core]`, the machine's
# torch held by a constraint; GPU_SUITE_INSTALL=0 skips that). Where torch sees no GPU the tests
# skip with their reason and nothing is written.
# `--report-only` writes the results file again from the raw outputs already there.
# Exits non-zero if a test or the benchmark failed.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$root" || exit 2
OUT="${GPU_SUITE_OUT:-$root/test-artifacts/gpu-suite}"
REPORT="${GPU_SUITE_REPORT:-$here/results/gpu.md}"
mkdir -p "$OUT/bin"
# `python` is the one interpreter of every step, the benchmark's included ($PYTHON, or python3)
python_bin="$(command -v "${PYTHON:-python3}")" || { echo "no ${PYTHON:-python3} here" >&2; exit 2; }
printf '#!/bin/sh\nexec %q "$@"\n' "$python_bin" >"$OUT/bin/python"
chmod +x "$OUT/bin/python"
PATH="$OUT/bin:$PATH"

write_report() {
    python - "$OUT" "$REPORT" "$@" <<'PY'
"""Turn the suite's raw outputs into benchmarks/results/gpu.md; any of them may be missing."""
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

out, target = Path(sys.argv[1]), Path(sys.argv[2])
began, tests_status, bench_status, ranks = sys.argv[3:7]


def load(path):
    try:
        return json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError):
        return None


def cell(value):
    text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(columns, rows):
    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows]


def dig(data, *path):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def number(value, *keys):
    """A number, or the first of `keys` found in a dict (also one level down) that holds one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        for key in keys:
            found = number(value.get(key), *keys)
            if found is not None:
                return found
    return None


lines = ["# GPU figures", ""]
lines += [
    f"Written by `bash benchmarks/gpu_suite.sh` (started {began}); its raw outputs (JUnit XML, logs, JSON) "
    f"were in `{out.name}/` (`$GPU_SUITE_OUT`). Every rank sees the world's GPUs and uses `cuda:LOCAL_RANK`.",
    "",
    "## Machine",
    "",
]
machine = load(out / "machine.json") or {}
gpus = machine.get("gpus") or []
if gpus:
    lines += table(["index", "GPU", "memory", "driver", "PCI bus"], gpus) + [""]
lines.append(
    f"torch {machine.get('torch')}, CUDA {machine.get('cuda')}, NCCL {machine.get('nccl')}, Python {machine.get('python')}"
)
topology = out / "topology.txt"
if topology.exists():
    lines += ["", "`nvidia-smi topo -m`:", "", "```", topology.read_text(encoding="utf8").rstrip(), "```"]

lines += ["", "## Tests", ""]
try:
    cases = ElementTree.parse(out / "gpu-tests.xml").getroot().iter("testcase")
    rows = []
    for case in cases:
        outcome, note = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[kind]
                text = (found.get("message") or found.text or "").strip()
                note = text.splitlines()[0][:200] if text else ""
                break
        rows.append([case.get("classname", "").rsplit(".", 1)[-1], case.get("name"), outcome, note])
    lines += table(["module", "test", "outcome", "reason / first line"], rows)
except (OSError, ElementTree.ParseError) as failure:
    lines.append(f"No test report ({failure}); pytest exit status {tests_status}.")
lines += ["", f"pytest exit status {tests_status}."]

order = ["placement", "placement_mpi", "ddp_equality", "contexts_driver", "contexts_nvml", "notebook_04"]
figures = sorted((out / "figures").glob("*.json"), key=lambda p: (order.index(p.stem) if p.stem in order else 99, p.stem))
for path in figures:
    figure = load(path)
    if not isinstance(figure, dict):
        continue
    lines += ["", f"## {figure.get('title') or path.stem}", ""]
    if figure.get("columns") and figure.get("rows") is not None:
        lines += table(figure["columns"], figure["rows"])
    if figure.get("note"):
        lines += ["", str(figure["note"])]

lines += ["", "## Training throughput: ddp_notebook against torchrun", ""]
training = load(out / "training.json")
if not isinstance(training, dict):
    lines.append(f"Not measured (benchmark exit status {bench_status}); see `training.log` in the raw outputs.")
else:
    rows = []
    for subject in ("ddp_notebook", "torchrun"):
        summary = dig(training, "summary", subject) or dig(training, "results", subject) or {}
        rate = dig(summary, "steps_per_s")
        samples = dig(training, "subjects", subject, "samples") or dig(training, "results", subject, "runs") or []
        values = [v for v in (number(s, "steps_per_s") for s in samples if isinstance(s, dict)) if v is not None]
        median = number(rate, "median") or number(summary, "steps_per_s_median", "median")
        low = number(rate, "min") or (min(values) if values else None)
        high = number(rate, "max") or (max(values) if values else None)
        ratio = number(summary, "ratio_of_medians") or (number(training, "ratio") if subject == "ddp_notebook" else None)
        error = dig(training, "subjects", subject, "error")
        rows.append([subject, median, low, high, len(values) or None, ratio, error or ""])
    lines += table(["subject", "steps/s median", "min", "max", "runs", "× torchrun", "error"], rows)
    settings = training.get("settings") or {}
    shown = {k: settings.get(k) for k in ("ranks", "backend", "steps", "warmup", "repeats", "threads") if k in settings}
    lines += ["", f"Settings: {shown or 'n/a'}; ranks asked for: {ranks}; exit status {bench_status}."]
    if training.get("command"):
        lines += ["", f"Command: `{training['command']}`"]

target.parent.mkdir(parents=True, exist_ok=True)
target.write_text("\n".join(lines) + "\n", encoding="utf8")
print(f"wrote {target}")
PY
}

if [ "${1:-}" = "--report-only" ]; then
    began="?" tests_status="?" bench_status="?" N="?"
    [ -f "$OUT/status" ] && read -r began tests_status bench_status N <"$OUT/status"
    write_report "$began" "$tests_status" "$bench_status" "$N"
    exit $?
fi

# the package and what its tests need, against the torch this machine has: a constraint holds that
# torch where it is (pip refuses, rather than replaces, a torch outside pyproject.toml's range);
# GPU_SUITE_INSTALL=0 skips this (everything already installed)
if [ "${GPU_SUITE_INSTALL:-1}" != "0" ]; then
    machine_torch="$(python -c 'import torch; print(torch.__version__)')" || {
        echo "no torch here: install the CUDA build of torch this machine's driver takes first" >&2
        exit 2
    }
    printf 'torch==%s\n' "$machine_torch" >"$OUT/torch-constraint.txt"
    echo "== pip install -e .[test-core] against torch $machine_torch"
    PIP_CONSTRAINT="$OUT/torch-constraint.txt" timeout 1200 \
        python -m pip install --quiet --disable-pip-version-check -e ".[test-core]" || exit 2
fi

rm -rf "$OUT/figures"
rm -f "$OUT/gpu-tests.xml" "$OUT/training.json" "$OUT/machine.json" "$OUT/topology.txt" "$OUT/status"
began="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

N="$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
echo "== $N GPU(s) visible to torch"

# the machine, from a process of its own (the tests' process makes no CUDA context)
python - "$OUT/machine.json" <<'PY'
import json, platform, shutil, subprocess, sys

import torch

info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
try:
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception as failure:  # noqa: BLE001
    info["nccl"] = f"unknown ({failure})"
smi = shutil.which("nvidia-smi")
if smi:
    query = "index,name,memory.total,driver_version,pci.bus_id"
    listing = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True)
    info["gpus"] = [[part.strip() for part in line.split(",")] for line in listing.stdout.splitlines() if line.strip()]
with open(sys.argv[1], "w", encoding="utf8") as handle:
    json.dump(info, handle, indent=1)
PY
if command -v nvidia-smi >/dev/null; then
    nvidia-smi topo -m >"$OUT/topology.txt" 2>&1 || true
fi

status=0
echo "== tests (tests/test_gpu.py, tests/test_device_plan.py)"
DDP_NOTEBOOK_GPU_RESULTS="$OUT/figures" timeout --kill-after=30 "${GPU_SUITE_TEST_SECONDS:-1800}" \
    python -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py tests/test_device_plan.py \
    --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
tests_status=${PIPESTATUS[0]}
[ "$tests_status" -ne 0 ] && status=1

bench_status="not run"
if [ "$N" -ge 1 ]; then
    N="${GPU_SUITE_RANKS:-$N}"
    echo "== throughput: ddp_notebook against torchrun, nccl, $N rank(s)"
    # shellcheck disable=SC2086  (the extra options are words)
    timeout --kill-after=30 "${GPU_SUITE_BENCH_SECONDS:-1200}" \
        python benchmarks/run.py training --backend nccl --ranks "$N" --subjects ddp_notebook,torchrun \
        --json "$OUT/training.json" ${GPU_SUITE_BENCH_ARGS:-} \
        2>&1 | tee "$OUT/training.log"
    bench_status=${PIPESTATUS[0]}
    [ "$bench_status" -ne 0 ] && status=1
else
    echo "no GPU here: the GPU tests skipped (reasons above); benchmarks/results/gpu.md left as it was"
    exit "$status"
fi

echo "$began $tests_status $bench_status $N" >"$OUT/status"
write_report "$began" "$tests_status" "$bench_status" "$N"
exit "$status"
