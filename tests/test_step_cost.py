"""The regression guard for a rank's cost beside the user's code: the CPU its background threads
spend while it trains, read from the scheduler's accounting of each thread. They work on a clock
(the X-ray's 4 reports a second, ZMQ's heartbeats), not per step: per step their cost grows as a
loaded machine slows the steps (a CI run with three test workers read 92 us per step where a quiet
machine reads 22), per second of training it does not, so that is what holds a bound in CI
(docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from scenarios import split_threads  # noqa: E402

from ddp_notebook import DDPCluster  # noqa: E402

# the tool's threads (X-ray, channel, ipyparallel's) while the steps ran, as a share of one core:
# 0.34% measured, quiet or beside two busy loops (benchmarks/run.py training prints it); a
# regression tripling it fails
TOOL_CORE_BOUND = 0.01
STEPS = 400

TRAIN = f"""
import json, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
import train_workload
print(json.dumps(train_workload.train({STEPS}, 30)))
"""


def test_a_ranks_own_threads_cost_little_cpu_while_it_trains(world: DDPCluster) -> None:
    result = world.execute(TRAIN, stream=False, timeout=300)
    for rank in result.ranks:
        cost = json.loads(result.stdout[rank].strip().splitlines()[-1])
        step_s = cost["elapsed_s"] / cost["steps"]
        split = split_threads(cost["threads_us_per_step"], step_s)
        main = cost["main_us_per_step"]
        # the instrument reads: the training thread and gloo's threads did the work
        assert main > 100 and split["torch_threads_us_per_step"] > 10, cost
        share = split["tool_threads_core_pct"] / 100
        assert share <= TOOL_CORE_BOUND, (
            f"rank {rank}: the tool's threads spend {split['tool_threads_us_per_step']:.0f} us per "
            f"{step_s * 1e6:.0f} us step, {share:.2%} of a core (bound {TOOL_CORE_BOUND:.1%}); the training "
            f"thread {main:.0f} us: {split['tool_threads']}"
        )
