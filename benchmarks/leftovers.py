"""How long what a world started outlives a killed kernel, or a killed rank: the last process gone.

    python benchmarks/leftovers.py [--ranks 2] [--workers 2] [--repeats 3]

A real kernel starts a world (`%ddp_start N`), each rank iterates a DataLoader with W worker
processes (its own children), then:
- kernel: the kernel is SIGKILLed; timed until every process the world started is gone;
- rank: rank 1 is SIGKILLed (a world from the Python API, no kernel); timed until its workers are gone.
Prints the seconds of each repeat and their median.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import psutil
from harness import exit_on_sigterm, machine_info, machine_line

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.support.kernel; ddp_notebook as installed

WORKERS = (
    "from torch.utils.data import DataLoader\n"
    "loader = DataLoader(list(range(10_000)), batch_size=1, num_workers={workers}, persistent_workers=True)\n"
    "batches = iter(loader); next(batches)"
)


def descendants(pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            found += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _until_gone(pids: list[int], began: float, limit: float = 30.0) -> float:
    while any(pid_alive(pid) for pid in pids):
        if time.monotonic() - began > limit:
            raise RuntimeError(f"still alive after {limit:g} s: {[pid for pid in pids if pid_alive(pid)]}")
        time.sleep(0.01)
    return time.monotonic() - began


def kernel_killed(ranks: int, workers: int) -> float:
    from tests.support.kernel import Kernel

    kernel = Kernel()
    try:
        for code in ("%load_ext ddp_notebook", f"%ddp_start {ranks}", "%%ddp\n" + WORKERS.format(workers=workers)):
            out, error = kernel.run(code)
            if error is not None:
                raise RuntimeError(f"{code.splitlines()[0]!r} failed: {out[-1000:]}")
        kernel_pid = kernel.manager.provisioner.process.pid
        family = descendants([kernel_pid])
        if len(family) < ranks * (1 + workers):
            raise RuntimeError(f"expected the ranks and their workers, found {len(family)} processes")
        began = time.monotonic()
        os.kill(kernel_pid, signal.SIGKILL)
        return _until_gone(family, began)
    finally:
        kernel.close()


def rank_killed(ranks: int, workers: int) -> float:
    from ddp_notebook import DDPCluster

    with DDPCluster(ranks, backend="gloo", max_restarts=0) as world:
        world.execute(WORKERS.format(workers=workers))
        victim = world.ranks[1].pid
        children = descendants([victim])
        if len(children) != workers:
            raise RuntimeError(f"rank 1 has {len(children)} children, expected {workers}")
        began = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return _until_gone(children, began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default: 2)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    info = machine_info()
    print(machine_line(info))
    import ddp_notebook

    print(f"   ddp_notebook from {Path(ddp_notebook.__file__).parent}")
    for name, case in (
        ("kernel SIGKILLed: last process gone", kernel_killed),
        ("rank SIGKILLed: its workers gone", rank_killed),
    ):
        seconds = [case(args.ranks, args.workers) for _ in range(args.repeats)]
        shown = ", ".join(f"{s:.2f}" for s in seconds)
        where = f"{args.ranks} ranks, {args.workers} workers each"
        print(f"{name}: median {statistics.median(seconds):.2f} s ({shown}; {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
