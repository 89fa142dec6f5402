"""The DDP training workload timed by bench_training.py, identical under both launchers.

`train()` uses the default process group that is already up: inside a ddp_notebook rank
(set up by `DDPCluster.start()`) or under torchrun (set up by the `__main__` block here).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/train_workload.py --steps 300
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES = 64
HIDDEN = 512
CLASSES = 10
BATCH_PER_RANK = 64
DISTINCT_BATCHES = 16  # cycled through; made up front so data generation is not timed
# bounds every collective under torchrun (torch's default of 30 minutes would hide a hang)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
CONTROL_POLL_SECONDS = 0.05  # latency here is never timed; keep the idle cost low
CONTROL_WAIT_SECONDS = 600.0  # a waiting job gives up if the benchmark went away


def _device() -> torch.device:
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    # ddp_notebook shows each rank only its own GPU (cuda:0); torchrun shows all of them
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def train(steps: int, warmup: int, *, seed: int = 0) -> dict[str, Any]:
    """Run `warmup` then `steps` timed SGD steps of a small DDP MLP; steps/s as rank 0 saw it."""
    if not dist.is_initialized():
        raise RuntimeError("train() needs an initialised default process group")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = _device()

    torch.manual_seed(seed)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    ).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    # each rank its own shard of synthetic data, the same on every run
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    inputs = torch.randn(DISTINCT_BATCHES, BATCH_PER_RANK, IN_FEATURES, generator=generator).to(device)
    targets = torch.randint(0, CLASSES, (DISTINCT_BATCHES, BATCH_PER_RANK), generator=generator).to(device)

    def step(index: int) -> torch.Tensor:
        batch = index % DISTINCT_BATCHES
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        return loss

    for index in range(warmup):
        step(index)
    # everyone starts and stops the clock together, so rank 0's time covers all ranks' work
    _sync(device)
    began, cpu_began = time.perf_counter(), time.process_time()
    loss = torch.zeros(())
    for index in range(warmup, warmup + steps):
        loss = step(index)
    _sync(device)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began

    return {
        "steps_per_s": steps / elapsed,
        "elapsed_s": elapsed,
        "process_cpu_s": cpu,  # all threads of rank 0's process
        "steps": steps,
        "warmup": warmup,
        "rank": rank,
        "world_size": world_size,
        "batch_per_rank": BATCH_PER_RANK,
        "backend": str(dist.get_backend()),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "final_loss": float(loss.detach().cpu()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="train() under torchrun; rank 0 prints each result as one JSON line")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument(
        "--control",
        type=Path,
        default=None,
        metavar="DIR",
        help="(bench_training.py) stay up and train once per DIR/go-<n> file, until DIR/stop appears",
    )
    args = parser.parse_args()
    dist.init_process_group(args.backend, timeout=COLLECTIVE_TIMEOUT)
    try:
        if args.control is None:
            _report(train(args.steps, args.warmup))
        else:
            _serve(args.control, args.steps, args.warmup)
    finally:
        # exiting with the group still up can abort the process
        dist.destroy_process_group()


def _report(result: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


def _serve(control: Path, steps: int, warmup: int) -> None:
    """Train on request, so the benchmark can interleave runs with another launcher's.

    Waiting ranks poll a file instead of sitting in a collective: they must not use CPU
    while the other side is being timed.
    """
    _report({"ready": True})
    for index in itertools.count():
        deadline = time.monotonic() + CONTROL_WAIT_SECONDS
        while not (control / f"go-{index}").exists():
            if (control / "stop").exists():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request in {control} for {CONTROL_WAIT_SECONDS:g} s")
            time.sleep(CONTROL_POLL_SECONDS)
        _report(train(steps, warmup))


if __name__ == "__main__":
    main()
