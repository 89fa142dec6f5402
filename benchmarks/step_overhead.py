"""What a rank of ddp_notebook costs per operation, against torchrun, side by side in one run.

    python benchmarks/step_overhead.py --backend nccl --ranks 1 --repeats 5

Each subject runs the same loops on every rank and reports rank 0's best time per iteration
(microseconds), each loop timed `--repeats` times:

- `ops`: three small tensor ops (the Python and dispatcher cost of a launch-bound step);
- `all_reduce`: one all-reduce of 16 floats (what the process group adds per collective);
- `ddp_step`: one SGD step of the training benchmark's DDP MLP (`train_workload._setup`).

Subjects: `torchrun` (a script, torch's defaults), `torchrun+recorder` (the same with torch's
flight recorder on, as the X-ray turns it on in a rank), `ddp_notebook` (a `DDPCluster`, the
loops run in a cell, the notebook reading each rank's X-ray 4 times a second as in any cell),
`ddp_notebook-unpaced` (the same, every X-ray report reading torch's flight recorder afresh,
as before the reads were paced by their cost) and `ddp_notebook-recorder` (the same world with
`TORCH_FR_BUFFER_SIZE=0`: no flight recorder, so no collectives in the X-ray). Ratios are
against `torchrun`. For the ddp_notebook subjects it also prints what one light X-ray reading of
the recorder costs on rank 0 (`read_us`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = ("torchrun", "torchrun+recorder", "ddp_notebook", "ddp_notebook-unpaced", "ddp_notebook-recorder")
# a rank's X-ray reads the recorder afresh at every report
UNPACED = "from ddp_notebook.rank import xray\nxray.READ_SHARE = 1e9"
# what one light reading costs (status only: no collective is in flight here)
READ_COST = """
import time
from ddp_notebook.rank import xray
_began = time.perf_counter()
for _ in range(200):
    xray._read_collectives(False)
_read_us = round((time.perf_counter() - _began) / 200 * 1e6, 1)
"""
LOOPS = ("ops", "all_reduce", "ddp_step")


def measure(repeats: int, iterations: int) -> dict[str, float]:
    """Rank 0's best microseconds per iteration of each loop (every rank runs them in step)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import train_workload

    torch.set_num_threads(1)  # every subject alike
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    small = torch.ones(16, device=device)
    step, _ = train_workload._setup(0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    loops = {
        "ops": lambda _i: small.add(1).mul(2).sum(),
        "all_reduce": lambda _i: dist.all_reduce(small),
        "ddp_step": step,
    }
    best: dict[str, float] = {}
    for name, loop in loops.items():
        for index in range(iterations // 10):  # warm
            loop(index)
        sync()
        for _ in range(repeats):
            began = time.perf_counter()
            for index in range(iterations):
                loop(index)
            sync()
            took = (time.perf_counter() - began) / iterations * 1e6
            best[name] = min(best.get(name, took), took)
    return {name: round(value, 2) for name, value in best.items()}


def run_torchrun(ranks: int, backend: str, recorder: bool, repeats: int, iterations: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    if recorder:
        env["TORCH_FR_BUFFER_SIZE"] = "20"
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        command += [__file__, "--child", backend, str(repeats), str(iterations), str(out)]
        subprocess.run(command, env=env, check=True, timeout=600, capture_output=True)
        return json.loads(out.read_text(encoding="utf8"))


def run_ddp_notebook(
    ranks: int, backend: str, recorder: bool, repeats: int, iterations: int, unpaced: bool = False
) -> dict[str, float]:
    sys.path.insert(0, str(HERE.parent))
    from ddp_notebook import DDPCluster

    env = {} if recorder else {"TORCH_FR_BUFFER_SIZE": "0"}
    with DDPCluster(ranks, backend=backend, env=env) as world:
        world.execute(f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport step_overhead", stream=False)
        if unpaced:
            world.execute(UNPACED, stream=False)
        world.execute(f"_overhead = step_overhead.measure({repeats}, {iterations})", stream=False)
        world.execute(READ_COST, stream=False)
        return world.pull("_overhead", ranks=[0])[0] | {"read_us": world.pull("_read_us", ranks=[0])[0]}


def child(backend: str, repeats: int, iterations: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend)
    result = measure(repeats, iterations)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result), encoding="utf8")
    dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timings of each loop per subject (best kept)")
    parser.add_argument("--iterations", type=int, default=2000, help="iterations per timing")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all subjects (best kept)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):  # subjects alternate, so a slow spell of the machine hits them all
        for subject in SUBJECTS:
            recorder = not subject.endswith("-recorder") and subject != "torchrun"
            run = (args.ranks, args.backend, recorder, args.repeats, args.iterations)
            if subject.startswith("torchrun"):
                found = run_torchrun(*run)
            else:
                found = run_ddp_notebook(*run, unpaced=subject.endswith("-unpaced"))
            kept = results.setdefault(subject, found)
            for loop in found:
                kept[loop] = min(kept[loop], found[loop])
            print(f"   {subject}: {found}", flush=True)
    print(f"\nmicroseconds per iteration, {args.ranks} {args.backend} rank(s), best of {args.rounds} x {args.repeats}")
    print(f"{'subject':24}" + "".join(f"{loop:>12}{'x':>7}" for loop in LOOPS) + f"{'read_us':>10}")
    for subject, found in results.items():
        ratios = "".join(f"{found[loop]:>12.2f}{found[loop] / results['torchrun'][loop]:>7.2f}" for loop in LOOPS)
        print(f"{subject:24}{ratios}{found.get('read_us', '-'):>10}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
