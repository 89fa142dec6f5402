"""What live progress and metrics cost a rank: `ddp_notebook.log()` per call, and DDP training
throughput with and without logging every step, side by side in one run.

Everything runs inside a real DDPCluster (gloo ranks on this machine), as `%%ddp` cells, and
the notebook side consumes the messages the way `%%ddp` does (a Feed drawing a LiveView:
ipywidgets and a plotly FigureWidget; no browser attached).

1. Per call: each rank times CALLS calls of `ddp_notebook.log(loss=x)` against an empty
   loop of the same length. The batches sent every 0.1 s during the loop are included, so
   this is the amortized cost. Also 3 metrics per call, and `progress()` per iteration.
2. Throughput: the same small DDP MLP as train_workload.py (64-512-512-10, batch 64 per
   rank) trains in blocks of BLOCK steps of three kinds: no logging, the same again (a
   control), and `ddp_notebook.log(loss=loss.item())` after every step. Each round runs one
   block of each kind, in an order that rotates so each kind takes each place equally
   often; ROUNDS rounds per cell, CELLS cells. Short alternating blocks in one run cancel
   most of the drift other work on a shared machine adds; the control shows what is left:
   two identical kinds of block differ by that much on this machine.

    python benchmarks/bench_logging.py [--ranks 2] [--calls 200000] [--block 25] [--rounds 60] [--cells 3]
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

from ddp_notebook.channel import FLUSH_SECONDS

BENCH_DIR = Path(__file__).resolve().parent
GOAL_LOG_US = 10.0
GOAL_RATIO = 0.98

# the cells, as a notebook user would run them; their inputs are pushed, not formatted in
IMPORT_CELL = "import sys; sys.path.insert(0, BENCH_DIR); import bench_logging"
COST_CELL = "cost = bench_logging.log_cost(CALLS)"
TRAIN_CELL = "result = bench_logging.train(ROUNDS, BLOCK, WARMUP, FLUSH)"


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


KINDS = ("without", "control", "with")
# each kind in each place equally often (a Latin square, then its mirror)
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (0, 2, 1), (1, 0, 2))


def train(rounds: int, block: int, warmup: int, flush_seconds: float) -> dict[str, list[float]]:
    """Seconds (wall and CPU) per block of `block` DDP steps, for each kind of block."""
    import torch
    from torch import nn

    import ddp_notebook
    from ddp_notebook.channel import rank_channel

    rank_channel().flush_seconds = flush_seconds

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
    seconds: dict[str, list[float]] = {name: [] for kind in KINDS for name in (kind, f"cpu_{kind}")}
    in_log = 0.0  # seconds inside log() calls, batch sends included: its cost amid training
    for round_index in range(rounds):
        for kind in (KINDS[i] for i in ORDERS[round_index % len(ORDERS)]):
            began, cpu_began = time.perf_counter(), time.process_time()
            if kind == "with":
                for index in range(block):
                    loss = step(index)
                    value = loss.item()
                    logging_began = time.perf_counter()
                    ddp_notebook.log(loss=value)
                    in_log += time.perf_counter() - logging_began
            else:
                for index in range(block):
                    step(index)
            seconds[kind].append(time.perf_counter() - began)
            # CPU time of this rank's process: what logging costs it, whatever else runs here
            seconds[f"cpu_{kind}"].append(time.process_time() - cpu_began)
    seconds["in_log"] = [in_log]
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
    parser.add_argument("--rounds", type=int, default=60, help="blocks of each kind per cell (default: 60)")
    parser.add_argument("--cells", type=int, default=3, help="training cells (default: 3)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--flush",
        type=float,
        default=FLUSH_SECONDS,
        help=f"least seconds between two batches of a rank (default: {FLUSH_SECONDS:g})",
    )
    parser.add_argument("--no-widgets", action="store_true", help="notebook side: keep the data, draw nothing")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    for name in ("ranks", "calls", "block", "rounds", "cells"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    from ddp_notebook import DDPCluster

    print(f"== ddp_notebook.log() cost and training throughput; {args.ranks} gloo ranks")
    print(
        f"   {len(os.sched_getaffinity(0))} CPUs, load {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"python {platform.python_version()}; calls={args.calls}, block={args.block}, "
        f"rounds={args.rounds}, cells={args.cells}, flush={args.flush:g} s"
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

        blocks: dict[str, list[float]] = {name: [] for kind in KINDS for name in (kind, f"cpu_{kind}")}
        notebook: list[tuple[float, int, float]] = []
        in_log = 0.0
        world.push({"ROUNDS": args.rounds, "BLOCK": args.block, "WARMUP": args.warmup, "FLUSH": args.flush})
        for _ in range(args.cells):
            consumer = TimedFeed(widgets=not args.no_widgets)
            began = time.perf_counter()
            world.execute(TRAIN_CELL, on_data=consumer, stream=False)
            elapsed = time.perf_counter() - began
            consumer.feed.finish()
            seconds = world.pull("result", ranks=[0])[0]
            for kind in blocks:
                blocks[kind].extend(seconds[kind])
            in_log += seconds["in_log"][0]
            points = len(consumer.feed.metrics)
            assert points == args.ranks * args.rounds * args.block, f"lost points: {points}"
            notebook.append((consumer.seconds, consumer.messages, elapsed))
    finally:
        world.stop()

    def steps_per_s(kind: str) -> float:
        return len(blocks[kind]) * args.block / sum(blocks[kind])

    def against_without(kind: str) -> tuple[float, float, float]:
        """Throughput ratio of `kind` to 'without' per round: mean and its 95% interval."""
        ratios = [without / other for without, other in zip(blocks["without"], blocks[kind])]
        mean = statistics.fmean(ratios)
        margin = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5
        return mean, mean - margin, mean + margin

    plain, logged, control = steps_per_s("without"), steps_per_s("with"), steps_per_s("control")
    ratio = logged / plain
    mean, low, high = against_without("with")
    control_mean, control_low, control_high = against_without("control")
    rounds = len(blocks["with"])
    print(f"\ntraining throughput (steps/s on rank 0; {rounds} rounds of three {args.block}-step blocks)")
    print(f"without logging:                 {plain:8.1f}")
    print(f"the same again (control):        {control:8.1f}   ratio {control / plain:.4f}")
    print(f"log(loss=loss.item()) each step: {logged:8.1f}   ratio {ratio:.4f}")
    print(f"per round, with/without:    mean {mean:.4f}, 95% interval {low:.4f}-{high:.4f}")
    print(f"per round, control/without: mean {control_mean:.4f}, 95% interval {control_low:.4f}-{control_high:.4f}")
    if low >= GOAL_RATIO:
        verdict = "meets it"
    elif high < GOAL_RATIO:
        verdict = "MISSES it"
    else:
        verdict = "too close to call with this machine's noise (see the control)"
    print(f"logging every step, against the goal of >= {GOAL_RATIO:g}: {verdict}")
    cpu_steps = len(blocks["cpu_with"]) * args.block
    cpu_without = sum(blocks["cpu_without"]) / cpu_steps * 1e6
    cpu_with = sum(blocks["cpu_with"]) / cpu_steps * 1e6
    cpu_control = sum(blocks["cpu_control"]) / cpu_steps * 1e6
    print(
        f"rank 0 CPU time per step: {cpu_without:.0f} us without, {cpu_control:.0f} us control, "
        f"{cpu_with:.0f} us with logging"
    )
    # log() amid training is slower than in a tight loop (cold caches), and its batch sends
    # cost more than in isolation: time it where it runs
    log_us = in_log / (len(blocks["with"]) * args.block) * 1e6
    print(
        f"log() inside the training loop on rank 0: {log_us:.1f} us per call on average (batch sends "
        f"included), {log_us * plain / 1e6:.2%} of the rank's time"
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
        "steps_per_s_control": control,
        "round_ratio_mean": mean,
        "round_ratio_95": [low, high],
        "control_ratio_mean": control_mean,
        "control_ratio_95": [control_low, control_high],
        "cpu_us_per_step_control": cpu_control,
        "log_us_in_training": log_us,
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
