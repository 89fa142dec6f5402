"""What `ddp_notebook.log()` costs on the training thread with an experiment tracker attached, in one run.

    python benchmarks/tracker_cost.py [--calls 20000] [--repeats 5]

A world of 2 gloo ranks; each repeat runs the same cell once per setting, interleaved (none,
tensorboard, mlflow, wandb offline): every rank calls `log(loss=..., step=...)` `--calls` times
and times the loop on its own clock. Printed: the median microseconds per call on rank 0 for each
setting and its ratio to no tracker, the cell's wall time in the notebook (it returns once every
point is written), and how many points each run holds. The writing happens in the notebook's
kernel, on a thread of its own; on a 2-core machine that thread competes with the ranks for the
cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import exit_on_sigterm, machine_info

sys.path.append(str(Path(__file__).resolve().parent.parent))

CELL = (
    "import time\n"
    "began = time.perf_counter()\n"
    "for step in range({calls}):\n"
    "    ddp_notebook.log(loss=float(step), step=step)\n"
    "(time.perf_counter() - began) / {calls} * 1e6"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    exit_on_sigterm()
    from ddp_notebook import DDPCluster

    folder = tempfile.mkdtemp(prefix="ddp-tracker-cost-")
    os.chdir(folder)  # the trackers' files go here
    os.environ.setdefault("WANDB_MODE", "offline")
    settings = [None, f"tensorboard:{folder}/runs", f"mlflow:sqlite:///{folder}/mlflow.db", "wandb:tracker-cost"]
    per_call: dict[str | None, list[float]] = {setting: [] for setting in settings}
    held: dict[str | None, list[int]] = {setting: [] for setting in settings}
    wall: dict[str | None, list[float]] = {setting: [] for setting in settings}
    print(machine_info())
    with DDPCluster(2, backend="gloo") as world:
        world.execute(CELL.format(calls=1000))  # warm-up
        for _ in range(args.repeats):
            for setting in settings:
                world.track(setting)
                began = time.perf_counter()
                result = world.execute(CELL.format(calls=args.calls))  # returns once every point is written
                wall[setting].append(time.perf_counter() - began)
                per_call[setting].append(float(result.value_text(0)))
                run = world.tracking.run
                world.track(None)  # ends the run
                if run is not None:
                    held[setting].append(run.points)
    base = statistics.median(per_call[None])
    print(f"log() on rank 0, {args.calls} calls per cell, median of {args.repeats} (us per call):")
    for setting in settings:
        name = (setting or "no tracker").split(":")[0]
        median = statistics.median(per_call[setting])
        cell = statistics.median(wall[setting])
        points = f"; points in each run: {sorted(set(held[setting]))}" if setting else ""
        print(f"  {name:<12} {median:7.2f} us   {median / base:5.2f}x   cell {cell:5.2f} s{points}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
