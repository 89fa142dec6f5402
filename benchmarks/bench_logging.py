"""What live progress and metrics cost a rank: `ddp_notebook.log()` per call, and DDP training
throughput with and without logging every step, side by side in one run.

Everything runs inside a real DDPCluster (gloo ranks on this machine), as `%%ddp` cells, and
the notebook side consumes the messages the way `%%ddp` does (a Feed drawing a LiveView:
ipywidgets and a plotly FigureWidget; no browser attached).

1. Per call: each rank times CALLS calls of `ddp_notebook.log(loss=x)` against an empty
   loop of the same length. The batches sent every 0.1 s during the loop are included, so
   this is the amortized cost. Also 3 metrics per call, and `progress()` per iteration.
2. Throughput: the same small DDP MLP as train_workload.py (64-512-512-10, batch 64 per
   rank) trains in blocks of BLOCK steps that alternate between no logging and
   `ddp_notebook.log(loss=loss.item())` after every step (ABBA order), PAIRS pairs per cell,
   CELLS cells. Alternating short blocks inside one run cancels the drift that other work
   on a shared machine adds, which separate runs cannot (their spread here exceeds 2%).

    python benchmarks/bench_logging.py [--ranks 2] [--calls 200000] [--block 25] [--pairs 60] [--cells 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import leak_report, process_tree

BENCH_DIR = Path(__file__).resolve().parent
GOAL_LOG_US = 10.0
GOAL_RATIO = 0.98

# the cells, as a notebook user would run them; their inputs are pushed, not formatted in
IMPORT_CELL = "import sys; sys.path.insert(0, BENCH_DIR); import bench_logging"
COST_CELL = "cost = bench_logging.log_cost(CALLS)"
TRAIN_CELL = "result = bench_logging.train(PAIRS, BLOCK, WARMUP)"


# ---------------------------------------------------------------- on the ranks


def log_cost(calls: int) -> dict[str, float]:
    """Nanoseconds per call of log() (1 and 3 metrics) and per progress() step, on this rank."""
    import ddp_notebook

    def empty() -> float:
        began = time.perf_counter()
        for _ in range(calls):
            pass
        return time.perf_counter() - began

    def one_metric() -> float:
        value = 0.5
        began = time.perf_counter()
        for _ in range(calls):
            ddp_notebook.log(loss=value)
        return time.perf_counter() - began

    def three_metrics() -> float:
        value = 0.5
        began = time.perf_counter()
        for _ in range(calls):
            ddp_notebook.log(loss=value, lr=value, accuracy=value)
        return time.perf_counter() - began

    def progress_steps() -> float:
        began = time.perf_counter()
        for _ in ddp_notebook.progress(range(calls), desc="bench"):
            pass
        return time.perf_counter() - began

    def one_batch(points: int = 20) -> tuple[float, float]:
        """Wall and CPU seconds of sending one batch of `points` points (the flush itself)."""
        channel = rank_channel()
        channel.next_flush = float("inf")
        for _ in range(points):
            channel.log(None, {"loss": 0.5})
        began, cpu_began = time.perf_counter(), time.thread_time()
        channel.flush()
        return time.perf_counter() - began, time.thread_time() - cpu_began

    from ddp_notebook.channel import rank_channel

    ddp_notebook.log(warmup=0.0)  # hooks registered, code paths warm
    baseline = min(empty() for _ in range(3))
    batches = [one_batch() for _ in range(200)]
    return {
        "log_ns": (min(one_metric() for _ in range(3)) - baseline) / calls * 1e9,
        "log3_ns": (min(three_metrics() for _ in range(3)) - baseline) / calls * 1e9,
        "progress_ns": (min(progress_steps() for _ in range(3)) - baseline) / calls * 1e9,
        "batch_ns": statistics.median(wall for wall, _ in batches) * 1e9,
        "batch_cpu_ns": statistics.median(cpu for _, cpu in batches) * 1e9,
    }


def train(pairs: int, block: int, warmup: int) -> dict[str, Any]:
    """Seconds (wall and CPU) per block of `block` DDP steps, without and with log() each step."""
    import torch
    from torch import nn

    import ddp_notebook

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(16, 64, 64, generator=generator)
    targets = torch.randint(0, 10, (16, 64), generator=generator)

    def step(index: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(inputs[index % 16]), targets[index % 16])
        loss.backward()
        optimizer.step()
        return loss

    for index in range(warmup):
        step(index)
    torch.distributed.barrier()
    # every step all-reduces gradients, so the ranks stay in step and rank 0's clock times all
    seconds: dict[str, list[float]] = {"without": [], "with": [], "cpu_without": [], "cpu_with": []}
    for pair in range(pairs):
        for logging in (False, True) if pair % 2 == 0 else (True, False):
            began, cpu_began = time.perf_counter(), time.process_time()
            if logging:
                for index in range(block):
                    loss = step(index)
                    ddp_notebook.log(loss=loss.item())
            else:
                for index in range(block):
                    step(index)
            kind = "with" if logging else "without"
            seconds[kind].append(time.perf_counter() - began)
            # CPU time of this rank's process: what logging costs it, whatever else runs here
            seconds[f"cpu_{kind}"].append(time.process_time() - cpu_began)
    return seconds


# ---------------------------------------------------------------- in the notebook process


class TimedFeed:
    """The %%ddp consumer (Feed + LiveView), timing the notebook-side work it does."""

    def __init__(self, widgets: bool) -> None:
        from ddp_notebook.channel import Feed
        from ddp_notebook.widgets import LiveView

        class HeadlessView(LiveView):
            def show(self) -> None:  # no frontend: the widgets are built and updated, not shown
                pass

        self.feed = Feed(HeadlessView if widgets else None)
        self.seconds = 0.0
        self.messages = 0

    def __call__(self, rank: int, data: dict[str, Any]) -> None:
        began = time.perf_counter()
        self.feed(rank, data)
        self.seconds += time.perf_counter() - began
        self.messages += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200_000, help="log() calls per timing (default: 200000)")
    parser.add_argument("--block", type=int, default=25, help="training steps per block (default: 25)")
    parser.add_argument("--pairs", type=int, default=60, help="blocks of each kind per cell (default: 60)")
    parser.add_argument("--cells", type=int, default=3, help="training cells (default: 3)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--no-widgets", action="store_true", help="notebook side: keep the data, draw nothing")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    for name in ("ranks", "calls", "block", "pairs", "cells"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    from ddp_notebook import DDPCluster

    print(f"== ddp_notebook.log() cost and training throughput; {args.ranks} gloo ranks")
    print(
        f"   {len(os.sched_getaffinity(0))} CPUs, load {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"python {platform.python_version()}; calls={args.calls}, block={args.block}, "
        f"pairs={args.pairs}, cells={args.cells}"
    )
    results: dict[str, Any] = {"settings": vars(args) | {"json": str(args.json)}}
    # as %ddp_start does in a notebook: plotly's first import (over a second) is not timed
    from plotly.graph_objs import FigureWidget  # noqa: F401

    world = DDPCluster(args.ranks, backend="gloo")
    recorded: list[int] = []
    try:
        world.start()
        recorded += process_tree(world.pids)
        world.push({"BENCH_DIR": str(BENCH_DIR)})
        world.execute(IMPORT_CELL)

        world.push({"CALLS": args.calls})
        world.execute(COST_CELL, on_data=TimedFeed(widgets=False), stream=False)
        costs = world.pull("cost")
        per_rank = {rank: {k: round(v, 1) for k, v in cost.items()} for rank, cost in costs.items()}
        log_ns = max(cost["log_ns"] for cost in costs.values())
        results["per_call_ns"] = per_rank
        print("\nper call, on the ranks (ns; the batches sent every 0.1 s included)")
        print("rank   log(loss=x)   log(3 metrics)   progress() step   one batch of 20 points (main-thread CPU)")
        for rank, cost in sorted(per_rank.items()):
            print(
                f"{rank:<4} {cost['log_ns']:>13.0f} {cost['log3_ns']:>16.0f} {cost['progress_ns']:>17.0f} "
                f"{cost['batch_ns']:>17.0f} ({cost['batch_cpu_ns']:.0f})"
            )
        verdict = "meets" if log_ns / 1000 <= GOAL_LOG_US else "MISSES"
        print(f"worst log() call: {log_ns / 1000:.2f} us ({verdict} the goal of <= {GOAL_LOG_US:g} us)")

        blocks: dict[str, list[float]] = {"without": [], "with": [], "cpu_without": [], "cpu_with": []}
        notebook: list[tuple[float, int, float]] = []
        world.push({"PAIRS": args.pairs, "BLOCK": args.block, "WARMUP": args.warmup})
        for _ in range(args.cells):
            consumer = TimedFeed(widgets=not args.no_widgets)
            began = time.perf_counter()
            world.execute(TRAIN_CELL, on_data=consumer, stream=False)
            elapsed = time.perf_counter() - began
            consumer.feed.finish()
            seconds = world.pull("result", ranks=[0])[0]
            for kind in blocks:
                blocks[kind].extend(seconds[kind])
            points = len(consumer.feed.metrics)
            assert points == args.ranks * args.pairs * args.block, f"lost points: {points}"
            notebook.append((consumer.seconds, consumer.messages, elapsed))
    finally:
        world.stop()

    plain = len(blocks["without"]) * args.block / sum(blocks["without"])
    logged = len(blocks["with"]) * args.block / sum(blocks["with"])
    ratio = logged / plain
    # each block against its partner of the same pair: what background load did not cancel
    pairs = sorted(without / with_ for without, with_ in zip(blocks["without"], blocks["with"]))
    print(f"\ntraining throughput (steps/s on rank 0; {len(pairs)} pairs of {args.block}-step blocks, ABBA order)")
    print(f"without logging:                 {plain:8.1f}")
    print(f"log(loss=loss.item()) each step: {logged:8.1f}")
    mean = statistics.fmean(pairs)
    margin = 1.96 * statistics.stdev(pairs) / len(pairs) ** 0.5
    low, high = mean - margin, mean + margin
    if low >= GOAL_RATIO:
        verdict = "meets the goal"
    elif high < GOAL_RATIO:
        verdict = "MISSES the goal"
    else:
        verdict = "too noisy here to tell against the goal"
    quartiles = statistics.quantiles(pairs, n=4)
    print(f"ratio with/without: {ratio:.4f} (all blocks); per pair of blocks: mean {mean:.4f}")
    print(f"95% interval of the mean: {low:.4f}-{high:.4f}: {verdict} of >= {GOAL_RATIO:g}")
    print(f"noise: half the pairs lie outside {quartiles[0]:.3f}-{quartiles[2]:.3f}")
    cpu_steps = len(blocks["cpu_with"]) * args.block
    cpu_without = sum(blocks["cpu_without"]) / cpu_steps * 1e6
    cpu_with = sum(blocks["cpu_with"]) / cpu_steps * 1e6
    print(
        f"rank 0 CPU time per step: {cpu_without:.0f} us without, {cpu_with:.0f} us with logging "
        f"({cpu_with - cpu_without:+.1f} us)"
    )
    # what logging adds to a step on the rank, from the noise-free costs above
    worst = max(costs.values(), key=lambda cost: cost["log_ns"] + cost["batch_ns"])
    batches_per_step = min(1.0, 1 / (0.1 * plain))
    added_us = (worst["log_ns"] + worst["batch_ns"] * batches_per_step) / 1000
    print(
        f"rank-side cost at {plain:.0f} steps/s: log() {worst['log_ns'] / 1000:.2f} us + "
        f"{batches_per_step:.3f} batches x {worst['batch_ns'] / 1000:.0f} us = {added_us:.1f} us per step, "
        f"{added_us * plain / 1e6:.2%} of the rank's time"
    )
    spent = statistics.median(seconds / elapsed for seconds, _, elapsed in notebook)
    rate = statistics.median(messages / elapsed for _, messages, elapsed in notebook)
    drawn = "Feed + LiveView widgets" if not args.no_widgets else "Feed only"
    print(
        f"notebook side ({drawn}): {rate:.1f} messages/s from {args.ranks} ranks, "
        f"{spent:.1%} of one core to take them in"
    )
    results |= {
        "block_seconds": blocks,
        "steps_per_s_without": plain,
        "steps_per_s_with": logged,
        "ratio": ratio,
        "cpu_us_per_step_without": cpu_without,
        "cpu_us_per_step_with": cpu_with,
        "pair_ratio_mean": mean,
        "pair_ratio_95": [low, high],
        "rank_side_us_per_step": added_us,
        "worst_log_us": log_ns / 1000,
        "notebook_messages_per_s": rate,
        "notebook_core_fraction": spent,
    }
    alive, line = leak_report(recorded)
    print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf8")
        print(f"\nwrote {args.json}")
    sys.exit(1 if alive else 0)


if __name__ == "__main__":
    main()
