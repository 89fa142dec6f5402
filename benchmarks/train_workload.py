"""What the benchmarks run on the ranks, and the one torchrun driver.

`train()` uses the default process group that is already up: inside a ddp_notebook rank, a
hand-made one in ipyparallel, nbdistributed's, Accelerate's, or torchrun's (set up by the
`__main__` block here). On its own:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/train_workload.py --steps 300

The benchmarks start it with `--serve DIR` (stay up, train once per request file) or
`--exec FILE` (run one cell's code on every rank, as a script would, then exit).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import threading
import time
import timeit
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES, HIDDEN, CLASSES = 64, 512, 10
BATCH_PER_RANK = 64
DISTINCT_BATCHES = 16  # cycled through; made up front so data generation is not timed
# bounds every collective under torchrun (torch's default of 30 minutes would hide a hang)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
POLL_SECONDS = 0.05  # a waiting job polls a file: it must not use CPU while the other side is timed
WAIT_SECONDS = 900.0  # a waiting job gives up if the benchmark went away


def _device() -> torch.device:
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    # cuda:LOCAL_RANK, as torchrun and ddp_notebook number GPUs (a rank shown one GPU only: cuda:0)
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _setup(seed: int, data: str = "tensors") -> tuple[Any, torch.device]:
    """The DDP model, its optimizer and a step function over this rank's synthetic batches."""
    rank, device = dist.get_rank(), _device()
    torch.manual_seed(seed)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    ).to(device)
    if data == "helpers":
        import ddp_notebook

        ddp = _setup.last_model = ddp_notebook.prepare_model(model)  # type: ignore[attr-defined]
    else:
        ddp = _setup.last_model = DistributedDataParallel(model)  # type: ignore[attr-defined]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if data != "tensors":
        return _loader_step(ddp, optimizer, seed, data, device), device
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    inputs = torch.randn(DISTINCT_BATCHES, BATCH_PER_RANK, IN_FEATURES, generator=generator).to(device)
    targets = torch.randint(0, CLASSES, (DISTINCT_BATCHES, BATCH_PER_RANK), generator=generator).to(device)

    def step(index: int) -> torch.Tensor:
        batch = index % DISTINCT_BATCHES
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        return loss

    return step, device


def _loader_step(ddp: Any, optimizer: Any, seed: int, data: str, device: torch.device) -> Any:
    """A step that takes its batch from a loader over one shared in-memory dataset, epoch after epoch."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    generator = torch.Generator().manual_seed(seed)  # the same dataset on every rank; the sampler shards it
    samples = DISTINCT_BATCHES * BATCH_PER_RANK * dist.get_world_size()
    inputs = torch.randn(samples, IN_FEATURES, generator=generator)
    dataset = TensorDataset(inputs, torch.randint(0, CLASSES, (samples,), generator=generator))
    if data == "helpers":
        import ddp_notebook

        loader = ddp_notebook.prepare_loader(dataset, batch_size=BATCH_PER_RANK, seed=seed)
    else:
        sampler = DistributedSampler(dataset, seed=seed)
        loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)
    epoch, batches = 0, iter(())

    def step(index: int) -> torch.Tensor:
        nonlocal epoch, batches
        try:
            inputs, targets = next(batches)
        except StopIteration:
            if data == "loader":
                loader.sampler.set_epoch(epoch)  # prepare_loader's loader does this itself
            epoch, batches = epoch + 1, iter(loader)
            inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(inputs.to(device)), targets.to(device))
        loss.backward()
        optimizer.step()
        return loss

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def thread_cpu_ns() -> dict[int, tuple[str, int]]:
    """Each thread of this process: native id -> (name, nanoseconds on a CPU so far), from the
    scheduler's own accounting (/proc/self/task/*/schedstat: nanosecond resolution, unlike the
    10 ms ticks of utime). The calling thread is "main"; other Python threads go by their name,
    native ones (gloo's, torch's) by their `comm`."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.get_native_id()  # the training thread (a forked rank's main thread keeps a stale id)
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            ran = int((task / "schedstat").read_text().split()[0])
            comm = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        tid = int(task.name)
        found[tid] = ("main" if tid == main else names.get(tid, f"native {comm}"), ran)
    return found


def main_runqueue_ns() -> int:
    """Nanoseconds the calling (training) thread spent ready to run but waiting for a CPU: what the
    other processes on the machine took from it (schedstat's second field)."""
    try:
        return int(Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def launcher_side(device: Any) -> list[int]:
    """The processes that run the ranks but are not ranks, on this host: the notebook's kernel (or
    the harness holding a DDPCluster), its controller and template, or torchrun's agent; each
    one's CPU competes with the ranks' for the cores."""
    import psutil

    from ddp_notebook.platform.processes import OWNER_PID_ENV

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, os.getpid())
    owner = int(os.environ.get(OWNER_PID_ENV) or os.getppid())  # a kernel's rank names its kernel
    try:
        tree = [owner, *(child.pid for child in psutil.Process(owner).children(recursive=True))]
    except psutil.Error:
        return []
    return [pid for pid in tree if pid not in ranks]


def _cpu_ns(pids: list[int]) -> int:
    """Nanoseconds of CPU the live processes of `pids` spent so far, all their threads (a process's
    own /proc/PID/schedstat counts its main thread only). A thread that ended meanwhile drops out."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue  # ended meanwhile
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile
    return total


def thread_cost(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], steps: int) -> dict[str, Any]:
    """Microseconds of CPU per step: the main thread's, and every other thread's by name, summed."""
    per_name: dict[str, float] = {}
    for tid, (name, ran) in after.items():
        spent = ran - before.get(tid, (name, 0))[1]
        if spent > 0:
            per_name[name] = per_name.get(name, 0.0) + spent / 1e3 / steps
    main = per_name.pop("main", 0.0)
    return {
        "main_us_per_step": main,
        "background_us_per_step": sum(per_name.values()),
        "threads_us_per_step": dict(sorted(per_name.items(), key=lambda item: -item[1])),
    }


def train(steps: int, warmup: int, *, seed: int = 0, data: str = "tensors") -> dict[str, Any]:
    """Run `warmup` then `steps` timed SGD steps of a small DDP MLP, its batches read as `data`
    says (harness.DATA_KINDS); steps/s as rank 0 saw it."""
    if not dist.is_initialized():
        raise RuntimeError("train() needs an initialised default process group")
    step, device = _setup(seed, data)
    for index in range(warmup):
        step(index)
    # everyone starts and stops the clock together, so rank 0's time covers all ranks' work
    _sync(device)
    launcher = launcher_side(device)
    began, cpu_began, threads_began = time.perf_counter(), time.process_time(), thread_cpu_ns()
    waited_began, launcher_began = main_runqueue_ns(), _cpu_ns(launcher)
    loss = torch.zeros(())
    for index in range(warmup, warmup + steps):
        loss = step(index)
    _sync(device)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    cost = thread_cost(threads_began, thread_cpu_ns(), steps)
    cost["main_runqueue_us_per_step"] = (main_runqueue_ns() - waited_began) / 1e3 / steps
    cost["launcher_us_per_step"] = (_cpu_ns(launcher) - launcher_began) / 1e3 / steps
    return cost | {
        "steps_per_s": steps / elapsed,
        "elapsed_s": elapsed,
        "process_cpu_s": cpu,  # all threads of this rank's process
        "steps": steps,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "final_loss": float(loss.detach().cpu()),
        "data": data,
    }


# ---------------------------------------------------------------- the logging scenario


def log_cost(calls: int) -> dict[str, float]:
    """Nanoseconds per `ddp_notebook.log()` call (1 and 3 metrics) and per `progress()` step."""
    import ddp_notebook

    loops = {
        "log_ns": "for _ in range(n): log(loss=0.5)",
        "log3_ns": "for _ in range(n): log(loss=0.5, lr=0.5, accuracy=0.5)",
        "progress_ns": "for _ in progress(range(n), desc='bench'): pass",
    }
    names = {"log": ddp_notebook.log, "progress": ddp_notebook.progress, "n": calls}
    ddp_notebook.log(warmup=0.0)  # code paths warm

    def best(loop: str) -> float:
        return min(timeit.repeat(loop, number=1, repeat=3, globals=names))

    baseline = best("for _ in range(n): pass")
    return {name: (best(loop) - baseline) / calls * 1e9 for name, loop in loops.items()}


KINDS = ("without", "control", "with")
# each kind in each place equally often (a Latin square, then its mirror)
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (0, 2, 1), (1, 0, 2))


def log_blocks(rounds: int, block: int, warmup: int) -> dict[str, list[float]]:
    """Seconds (wall and CPU) per block of `block` training steps, for each kind of block:
    no logging, the same again (a control), and `log(loss=loss.item())` after every step."""
    import ddp_notebook

    step, device = _setup(0)
    for index in range(warmup):
        step(index)
    _sync(device)
    seconds: dict[str, list[float]] = {name: [] for kind in KINDS for name in (kind, f"cpu_{kind}")}
    in_log = 0.0  # seconds inside log(), batch sends included: its cost amid training
    for round_index in range(rounds):
        for kind in (KINDS[i] for i in ORDERS[round_index % len(ORDERS)]):
            began, cpu_began = time.perf_counter(), time.process_time()
            for index in range(block):
                loss = step(index)
                if kind == "with":
                    value = loss.item()
                    logging_began = time.perf_counter()
                    ddp_notebook.log(loss=value)
                    in_log += time.perf_counter() - logging_began
            seconds[kind].append(time.perf_counter() - began)
            seconds[f"cpu_{kind}"].append(time.process_time() - cpu_began)
    seconds["in_log"] = [in_log]
    return seconds


# ---------------------------------------------------------------- the seeing-inside scenario


def timing_blocks(rounds: int, block: int, warmup: int) -> dict[str, list[float]]:
    """Seconds (wall and CPU) per block of `block` training steps of one DDP model: as it is
    ("without"), the same again (a control), and with prepare_model's step timing hooked on
    ("with"; its hooks and torch's global optimizer hooks are taken off again after the block);
    plus microseconds per light X-ray reading (what the notebook asks each rank 4 times a second
    while a cell runs)."""
    from ddp_notebook.rank import timing
    from ddp_notebook.rank import xray as xray_rank

    step, device = _setup(0)
    model = _setup.last_model  # type: ignore[attr-defined]
    for index in range(warmup):
        step(index)
    _sync(device)
    seconds: dict[str, list[float]] = {name: [] for kind in KINDS for name in (kind, f"cpu_{kind}")}
    for round_index in range(rounds):
        for kind in (KINDS[i] for i in ORDERS[round_index % len(ORDERS)]):
            handles = timing.watch_model(model) if kind == "with" else []
            began, cpu_began = time.perf_counter(), time.process_time()
            for index in range(block):
                step(index)
            seconds[kind].append(time.perf_counter() - began)
            seconds[f"cpu_{kind}"].append(time.process_time() - cpu_began)
            for handle in handles:
                handle.remove()
            timing.remove_optimizer_hooks()
    seconds |= _hooks_alone(rounds, block)
    calls = 200
    began = time.perf_counter()
    for _ in range(calls):
        xray_rank.report(full=False)  # what a running cell's watch asks
    seconds["report_us"] = [(time.perf_counter() - began) / calls * 1e6]
    return seconds


def _hooks_alone(rounds: int, block: int) -> dict[str, list[float]]:
    """CPU seconds per block of the same MLP's steps in this process alone, no process group:
    plain, and with the step timing hooked on, alternating. Without the collectives (and the
    peer's timing), what is left is the hooks' own cost, which the DDP blocks' noise hides."""
    from ddp_notebook.rank import timing

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(BATCH_PER_RANK, IN_FEATURES), torch.randint(0, CLASSES, (BATCH_PER_RANK,))
    found: dict[str, list[float]] = {"alone_without": [], "alone_with": []}
    for round_index in range(rounds):
        for kind in ("without", "with") if round_index % 2 == 0 else ("with", "without"):
            handles = timing.watch_model(model) if kind == "with" else []
            began = time.process_time()
            for _ in range(block):
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
            found[f"alone_{kind}"].append(time.process_time() - began)
            for handle in handles:
                handle.remove()
            timing.remove_optimizer_hooks()
    return found


def strict_cost(calls: int) -> dict[str, float]:
    """Microseconds per `dist.all_reduce` of 1 and of 262144 floats (1 MiB), plain and checked
    (`ddp_notebook.check_collectives`, the strict mode), alternating blocks of `calls` calls."""
    import ddp_notebook

    found: dict[str, list[float]] = {}
    for size in (1, 262144):
        tensor = torch.ones(size)
        for kind in ("plain", "checked", "plain", "checked"):
            ddp_notebook.check_collectives(kind == "checked")
            dist.barrier()
            began = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            found.setdefault(f"{kind}_{size}_us", []).append((time.perf_counter() - began) / calls * 1e6)
    ddp_notebook.check_collectives(False)
    return {key: min(values) for key, values in found.items()}


# ---------------------------------------------------------------- under torchrun


def main() -> None:
    parser = argparse.ArgumentParser(description="train() under torchrun; rank 0 prints each result as one JSON line")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument(
        "--serve", type=Path, metavar="DIR", help="train (or run a cell file) once per DIR/go-<n>.json until DIR/stop"
    )
    parser.add_argument("--exec", type=Path, metavar="FILE", dest="code", help="run FILE's code on every rank")
    args = parser.parse_args()
    if args.backend == "nccl":  # each rank on its own GPU before the first collective (cuda:LOCAL_RANK)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend, timeout=COLLECTIVE_TIMEOUT)
    if args.code is not None:
        # a script: an exception ends the job, as it would end the user's
        exec(compile(args.code.read_text(), str(args.code), "exec"), {"rank": dist.get_rank(), "__name__": "cell"})
    elif args.serve is not None:
        _serve(args.serve)
    else:
        _report(train(args.steps, args.warmup))
    # exiting with the group still up can abort the process
    dist.destroy_process_group()


def _report(result: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


def _serve(control: Path) -> None:
    """Requests one after the other in this same process: {"steps", "warmup"} trains; {"exec": FILE}
    runs FILE's code as the next cell of a long-lived script (one namespace for all of them)."""
    dist.barrier()
    _report({"ready": True, "t": time.time(), "torch_threads": torch.get_num_threads()})
    namespace: dict[str, Any] = {"rank": dist.get_rank(), "__name__": "cell"}
    for index in itertools.count():
        request, deadline = control / f"go-{index}.json", time.monotonic() + WAIT_SECONDS
        while not request.exists():
            if (control / "stop").exists():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request in {control} for {WAIT_SECONDS:g} s")
            time.sleep(POLL_SECONDS)
        asked = json.loads(request.read_text())
        if "exec" in asked:
            code = Path(asked["exec"])
            exec(compile(code.read_text(), str(code), "exec"), namespace)
            dist.barrier()  # every rank finished the cell
            _report({"done": True})
        else:
            _report(train(**asked))


if __name__ == "__main__":
    main()
