"""The regression guard for a rank's cost beside the user's code: the CPU its background threads
spend per training step, read from the scheduler's accounting of each thread. Unlike steps/s it
does not move with the machine's load, so it can hold a bound in CI (docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from scenarios import split_threads  # noqa: E402

from ddp_notebook import DDPCluster  # noqa: E402

# the tool's threads (X-ray, channel, ipyparallel's) per step, against what the training thread
# spends: 1.0% measured (benchmarks/run.py training prints it); a regression doubling it fails
TOOL_SHARE_BOUND = 0.03
STEPS = 400

TRAIN = f"""
import json, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
import train_workload
print(json.dumps(train_workload.train({STEPS}, 30)))
"""


def test_a_ranks_own_threads_cost_little_cpu_per_training_step(world: DDPCluster) -> None:
    result = world.execute(TRAIN, stream=False, timeout=300)
    for rank in result.ranks:
        cost = json.loads(result.stdout[rank].strip().splitlines()[-1])
        split = split_threads(cost["threads_us_per_step"])
        main = cost["main_us_per_step"]
        # the instrument reads: the training thread and gloo's threads did the work
        assert main > 100 and split["torch_threads_us_per_step"] > 10, cost
        share = split["tool_threads_us_per_step"] / main
        assert share <= TOOL_SHARE_BOUND, (
            f"rank {rank}: the tool's threads spend {split['tool_threads_us_per_step']:.0f} us per step, "
            f"{share:.1%} of the training thread's {main:.0f} us (bound {TOOL_SHARE_BOUND:.0%}): "
            f"{split['tool_threads']}"
        )
