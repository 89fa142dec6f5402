"""How often a DDP model's first training ends in other bits than the same training again, in plain
torch (no ddp_notebook): why the tests that compare two runs bitwise start both past a first backward.

    python benchmarks/first_backward_bits.py [--ranks 3 4] [--trials 40] [--steps 30]

DDP's first backward all-reduces its gradient buckets laid out in the parameters' order; at its
second forward it rebuilds them in the order the gradients came. Across 3 or more ranks, gloo's ring
sums each element in an order that depends on its place in the bucket, so the first backward may
round differently from every later one (2 ranks: a + b is b + a, always the same bits).

For each world size, one gloo world on 127.0.0.1 runs the trials: each makes a fresh
`DistributedDataParallel(torch.nn.Linear(2, 1))` (its weights seeded by the trial), trains it
`--steps` SGD steps on data seeded by the rank, then loads the start weights back and trains again
(a second reducer state: its buckets rebuilt). "as made" counts the trials whose two runs differ;
"past a first backward" does the same after one backward taken before the start weights are kept.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import machine_info, machine_line, print_table
from subjects import free_port

RESULT_SECONDS = 600.0


def _train(model: torch.nn.Module, rank: int, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(8, 2, generator=generator)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def _differs(rank: int, trial: int, steps: int, first_backward: bool) -> bool:
    torch.manual_seed(trial)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    if first_backward:
        model(torch.zeros(1, 2)).sum().backward()
        model.zero_grad()
    start = {name: value.clone() for name, value in model.state_dict().items()}
    first = _train(model, rank, steps)
    model.load_state_dict(start)
    again = _train(model, rank, steps)
    return not all(torch.equal(a, b) for a, b in zip(first, again))


def _rank(rank: int, size: int, port: int, trials: int, steps: int, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        counts = {
            mode: sum(_differs(rank, trial, steps, first_backward) for trial in range(trials))
            for mode, first_backward in (("as made", False), ("past a first backward", True))
        }
    finally:
        dist.destroy_process_group()
    if rank == 0:  # DDP gives every rank the same weights: rank 0 speaks for all
        results.put(counts)


def measure(size: int, trials: int, steps: int) -> dict[str, int]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, size, port, trials, steps, results)) for rank in range(size)]
    for process in ranks:
        process.start()
    try:
        return results.get(timeout=RESULT_SECONDS)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():  # only the processes started here
                process.kill()
                process.join(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(machine_line(machine_info()), flush=True)
    rows = []
    for size in args.ranks:
        counts = measure(size, args.trials, args.steps)
        rows.extend([size, mode, f"{count} of {args.trials}"] for mode, count in counts.items())
    print_table(["ranks", "start", "trials whose two runs differ"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
