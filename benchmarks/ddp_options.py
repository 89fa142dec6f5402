"""DistributedDataParallel's options on the training benchmark's model, side by side in one world.

Each option set wraps the same model (same weights) and trains `--steps` steps, the sets taking
turns in an order that rotates every round, so the machine's load hits them alike. Prints steps/s
per set and each set's ratio to plain DDP (the median of the per-round ratios, their range).
It is what chose `prepare_model`'s defaults (docs/performance.md, "What prepare_model adds").

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_options.py [--rounds 8] [--steps 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_workload import BATCH_PER_RANK, CLASSES, DISTINCT_BATCHES, HIDDEN, IN_FEATURES

OPTION_SETS: dict[str, dict[str, Any]] = {
    "plain DDP": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "smaller buckets (bucket_cap_mb=0.5)": {"bucket_cap_mb": 0.5},
    "view + static": {"gradient_as_bucket_view": True, "static_graph": True},
}


def run(options: dict[str, Any], steps: int, warmup: int) -> float:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    ddp = DistributedDataParallel(model, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(DISTINCT_BATCHES, BATCH_PER_RANK, IN_FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (DISTINCT_BATCHES, BATCH_PER_RANK), generator=generator)

    def step(index: int) -> None:
        batch = index % DISTINCT_BATCHES
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(inputs[batch]), targets[batch]).backward()
        optimizer.step()

    for index in range(warmup):
        step(index)
    dist.barrier()
    began = time.perf_counter()
    for index in range(warmup, warmup + steps):
        step(index)
    dist.barrier()
    return steps / (time.perf_counter() - began)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    names = list(OPTION_SETS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(args.rounds):
        shift = round_number % len(names)
        order = names[shift:] + names[:shift]
        if round_number % 2:
            order.reverse()
        for name in order:
            rates[name].append(run(OPTION_SETS[name], args.steps, args.warmup))
    if dist.get_rank() == 0:
        base = rates["plain DDP"]
        print(f"{dist.get_world_size()} ranks, {args.rounds} rounds x {args.steps} steps, 1 thread per rank")
        for name in names:
            ratios = [mine / plain for mine, plain in zip(rates[name], base)]
            print(
                f"{name:50s} {statistics.median(rates[name]):7.1f} steps/s  "
                f"{statistics.median(ratios):.3f}x plain ({min(ratios):.2f}-{max(ratios):.2f})"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
