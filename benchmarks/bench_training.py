"""Training steps/s of one DDP workload under `%%ddp`-style execution vs under torchrun.

Both sides run `train_workload.train()` with the same threads per rank and the same gloo
network interface. Both stay up for the whole benchmark (a notebook world does; the
torchrun job waits for a request file between runs), so their runs can alternate closely
and noise from other work on the machine hits both. While one side trains, the other's
processes idle; their CPU use during the other side's runs is measured and printed.

    python benchmarks/bench_training.py [--ranks 2] [--repeats 3] [--steps 500] [--json PATH]
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from _common import (
    BENCH_DIR,
    check_positive,
    exit_on_sigterm,
    leak_report,
    machine_info,
    make_parser,
    median,
    print_header,
    print_table,
    process_tree,
    ratio,
    stat_fields,
    verdict,
    warm_file_cache,
    write_json,
)

from ddp_notebook import DDPCluster, network

# the cell a notebook user would run; its inputs are pushed, not formatted into the code
IMPORT_CELL = "import sys; sys.path.insert(0, BENCH_DIR); import train_workload"
TRAIN_CELL = "result = train_workload.train(STEPS, WARMUP)"
START_TIMEOUT = 180.0  # seconds until the torchrun job is up
RUN_TIMEOUT = 300.0  # seconds for one training run
GOAL_RATIO = 0.97
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class TorchrunJob:
    """One torchrun job running train_workload.py in --control mode."""

    def __init__(self, ranks: int, steps: int, warmup: int, backend: str, env: dict[str, str]) -> None:
        self.control = Path(tempfile.mkdtemp(prefix="ddp-bench-"))
        self.command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            str(BENCH_DIR / "train_workload.py"),
            f"--steps={steps}",
            f"--warmup={warmup}",
            f"--backend={backend}",
            f"--control={self.control}",
        ]
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        # drain both pipes, so a chatty job never blocks on a full pipe
        threading.Thread(target=self._pump, args=(self.process.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.process.stderr, self.stderr_tail.append), daemon=True).start()
        self.requests = 0
        self.pids: list[int] = [self.process.pid]

    @staticmethod
    def _pump(stream: IO[str] | None, sink: Callable[[Any], None]) -> None:
        assert stream is not None
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    def wait_ready(self) -> None:
        self._next_result(START_TIMEOUT)
        self.pids = process_tree([self.process.pid])

    def run(self) -> dict[str, Any]:
        (self.control / f"go-{self.requests}").touch()
        self.requests += 1
        return self._next_result(RUN_TIMEOUT)

    def _next_result(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"torchrun gave no result within {timeout:g} s") from None
            if line is None:
                code = self.process.wait(timeout=10)
                tail = " | ".join(text for text in self.stderr_tail if text is not None)  # None: the pump's end mark
                raise RuntimeError(f"torchrun exited with code {code}: {tail}")
            if line.startswith("{"):
                return json.loads(line)

    def stop(self) -> None:
        (self.control / "stop").touch()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # SIGTERM lets torchrun end its workers itself; SIGKILL only the PIDs recorded as ours
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                for pid in self.pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.process.wait(timeout=10)
        shutil.rmtree(self.control, ignore_errors=True)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time used so far by `pids` (those still alive)."""
    total = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], repeats=3, repeats_help="rounds, each training once per side")
    parser.add_argument("--steps", type=int, default=500, help="timed optimizer steps per run (default: 500)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps before them (default: 30)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    check_positive(parser, ranks=args.ranks, repeats=args.repeats, steps=args.steps)

    world = DDPCluster(args.ranks)  # nothing starts until start(); its config is final now
    threads = world.config.threads_per_rank
    socket_ifname = network.loopback_interface()  # what DDPCluster gives its ranks
    # set explicitly: torchrun picks 1 itself only when OMP_NUM_THREADS is unset
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = socket_ifname

    info = machine_info()
    print_header(
        "DDP training steps/s: %%ddp-style (DDPCluster.execute) vs torchrun",
        info,
        {
            "ranks": args.ranks,
            "repeats": args.repeats,
            "steps": args.steps,
            "warmup": args.warmup,
            "backend": world.config.backend,
            "world.config.threads_per_rank": threads,
            "torchrun OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
            "GLOO_SOCKET_IFNAME": socket_ifname,
        },
    )
    warm_file_cache()

    recorded: list[int] = []
    runs: dict[str, list[dict[str, Any]]] = {"ddp_notebook": [], "torchrun": []}
    job: TorchrunJob | None = None
    try:
        job = TorchrunJob(args.ranks, args.steps, args.warmup, world.config.backend, env)
        world.start()
        recorded += process_tree(world.pids)
        world.push({"BENCH_DIR": str(BENCH_DIR), "STEPS": args.steps, "WARMUP": args.warmup})
        world.execute(IMPORT_CELL, timeout=RUN_TIMEOUT)
        job.wait_ready()
        recorded += job.pids

        def run_ddp() -> dict[str, Any]:
            world.execute(TRAIN_CELL, timeout=RUN_TIMEOUT)
            return dict(world.pull("result", ranks=[0])[0])

        sides: dict[str, tuple[Callable[[], dict[str, Any]], list[int]]] = {
            "ddp_notebook": (run_ddp, process_tree(world.pids)),
            "torchrun": (job.run, job.pids),
        }
        # one untimed run each: the first run in a process pays one-off costs
        for run, _ in sides.values():
            run()
        for round_index in range(args.repeats):
            order = ("ddp_notebook", "torchrun") if round_index % 2 == 0 else ("torchrun", "ddp_notebook")
            for side in order:
                run, _ = sides[side]
                (other,) = (name for name in sides if name != side)
                idle_before, began = cpu_seconds(sides[other][1]), time.perf_counter()
                result = run()
                wall = time.perf_counter() - began
                # what the idle side cost while this side was timed, in % of one core
                result["other_side_idle_cpu_pct"] = 100 * (cpu_seconds(sides[other][1]) - idle_before) / wall
                runs[side].append(result)
                print(
                    f"round {round_index + 1}/{args.repeats} {side}: {result['steps_per_s']:.1f} steps/s "
                    f"(rank 0: {result['torch_threads']} thread(s), "
                    f"CPU {result['process_cpu_s']:.2f} s in {result['elapsed_s']:.2f} s; "
                    f"{other} idle used {result['other_side_idle_cpu_pct']:.1f}% of a core)"
                )
    finally:
        if job is not None:
            job.stop()
        world.stop()
    print()

    rates = {side: [run["steps_per_s"] for run in side_runs] for side, side_runs in runs.items()}
    ddp_rate, torchrun_rate = median(rates["ddp_notebook"]), median(rates["torchrun"])
    speed_ratio = ratio(ddp_rate, torchrun_rate)
    # pairs run back to back, so slow drift in the machine's load cancels within a pair
    paired = median([ratio(a, b) for a, b in zip(rates["ddp_notebook"], rates["torchrun"])])

    def shown(side: str, key: str) -> str:
        return ", ".join(distinct(runs[side], key))

    def median_of(side: str, key: str) -> float:
        return median([run[key] for run in runs[side]])

    print_table(
        ["", "ddp_notebook", "torchrun", "ratio ddp/torchrun"],
        [
            ["steps/s median", ddp_rate, torchrun_rate, speed_ratio],
            ["same-round ratio (median)", "", "", paired],
            ["steps/s min", min(rates["ddp_notebook"]), min(rates["torchrun"]), ""],
            ["steps/s max", max(rates["ddp_notebook"]), max(rates["torchrun"]), ""],
            [
                "rank 0 CPU s per run (median)",
                median_of("ddp_notebook", "process_cpu_s"),
                median_of("torchrun", "process_cpu_s"),
                "",
            ],
            ["torch threads (rank 0)", shown("ddp_notebook", "torch_threads"), shown("torchrun", "torch_threads"), ""],
            [
                "GLOO_SOCKET_IFNAME",
                shown("ddp_notebook", "gloo_socket_ifname"),
                shown("torchrun", "gloo_socket_ifname"),
                "",
            ],
        ],
    )
    matched = distinct(runs["ddp_notebook"] + runs["torchrun"], "torch_threads") == [str(threads)]
    print(f"\nthreads per rank identical on both sides (= {threads}): {'yes' if matched else 'NO'}")
    print(f"median ratio {speed_ratio:.4f} (goal >= {GOAL_RATIO}): {verdict(speed_ratio >= GOAL_RATIO)}")
    alive, line = leak_report(recorded)
    print(line)

    write_json(
        args.json,
        {
            "benchmark": "training",
            "settings": {
                "ranks": args.ranks,
                "repeats": args.repeats,
                "steps": args.steps,
                "warmup": args.warmup,
                "backend": world.config.backend,
                "threads_per_rank": threads,
                "gloo_socket_ifname": socket_ifname,
            },
            "machine": info,
            "results": {
                "ddp_notebook": {"steps_per_s_median": ddp_rate, "runs": runs["ddp_notebook"]},
                "torchrun": {"steps_per_s_median": torchrun_rate, "runs": runs["torchrun"]},
            },
            "ratio": speed_ratio,
            "ratio_same_round_median": paired,
            "threads_match": matched,
            "goal": {"ratio_at_least": GOAL_RATIO, "met": speed_ratio >= GOAL_RATIO},
            "recorded_pids": recorded,
            "pids_alive_after_stop": alive,
        },
    )
    return 1 if alive or not matched else 0


def distinct(runs: list[dict[str, Any]], key: str) -> list[str]:
    return sorted({str(run[key]) for run in runs})


if __name__ == "__main__":
    sys.exit(main())
