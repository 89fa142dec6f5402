"""Time from nothing to "ready to train": `DDPCluster(n).start()` vs a raw ipyparallel cluster.

ddp_notebook is ready when its process group is up and torch is imported on every rank.
A raw ipyparallel user (default settings) needs `start_and_connect_sync()` and then torch
on the engines; the raw start alone is reported too (a split of the same run). The raw
side sets up no process group, so the comparison favours it.

    python benchmarks/bench_start.py [--ranks 2] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import ipyparallel as ipp
from _common import (
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
    raw_cluster_pids,
    stop_raw_cluster,
    verdict,
    warm_file_cache,
    write_json,
)

from ddp_notebook import DDPCluster

IMPORT_TIMEOUT = 120.0  # seconds for `import torch` on fresh engines


def _import_torch() -> None:
    # what a raw user runs before training: torch on every engine
    __import__("torch")


def start_ddp(n: int, recorded: list[int]) -> dict[str, float]:
    world = DDPCluster(n)
    began = time.perf_counter()
    try:
        world.start()
        ready = time.perf_counter() - began
    finally:
        recorded += process_tree(world.pids)  # read before stop(), which forgets them
        stopping = time.perf_counter()
        world.stop()
        stop = time.perf_counter() - stopping
    return {"ready_s": ready, "stop_s": stop}


def start_raw(n: int, recorded: list[int]) -> dict[str, float]:
    cluster = ipp.Cluster(n=n)
    client: Any = None
    began = time.perf_counter()
    try:
        client = cluster.start_and_connect_sync()  # waits up to the cluster's engine_timeout
        started = time.perf_counter() - began
        client[:].apply_async(_import_torch).get(timeout=IMPORT_TIMEOUT)
        ready = time.perf_counter() - began
    finally:
        recorded += process_tree(raw_cluster_pids(cluster))
        stop = stop_raw_cluster(cluster, client)
    return {"start_s": started, "ready_s": ready, "stop_s": stop}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], repeats=3, repeats_help="rounds, each starting both once")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    check_positive(parser, ranks=args.ranks, repeats=args.repeats)

    info = machine_info()
    print_header(
        "start to ready-to-train: DDPCluster.start() vs ipyparallel Cluster (defaults) + import torch",
        info,
        {"ranks": args.ranks, "repeats": args.repeats},
    )
    warm_file_cache()

    recorded: list[int] = []
    runs: dict[str, list[dict[str, float]]] = {"ddp_notebook": [], "ipyparallel": []}
    for round_index in range(args.repeats):
        # alternate who goes first: a start right after another's stop may find less free CPU
        order = ("ddp_notebook", "ipyparallel") if round_index % 2 == 0 else ("ipyparallel", "ddp_notebook")
        for side in order:
            if side == "ddp_notebook":
                runs[side].append(start_ddp(args.ranks, recorded))
            else:
                runs[side].append(start_raw(args.ranks, recorded))
            print(
                f"round {round_index + 1}/{args.repeats} {side}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in runs[side][-1].items())
            )
    print()

    def column(side: str, key: str) -> list[float]:
        return [run[key] for run in runs[side]]

    ddp_ready = column("ddp_notebook", "ready_s")
    raw_ready = column("ipyparallel", "ready_s")
    raw_start = column("ipyparallel", "start_s")
    ddp_median = median(ddp_ready)
    rows = [
        [f"ddp_notebook: DDPCluster({args.ranks}).start()", ddp_ready, column("ddp_notebook", "stop_s")],
        [f"ipyparallel: Cluster(n={args.ranks}) start + import torch", raw_ready, column("ipyparallel", "stop_s")],
        [f"ipyparallel: Cluster(n={args.ranks}) start only", raw_start, None],
    ]
    print_table(
        ["", "median s", "min s", "max s", "ddp/this", "stop median s"],
        [
            [
                label,
                median(values),
                min(values),
                max(values),
                ratio(ddp_median, median(values)),
                "" if stops is None else median(stops),
            ]
            for label, values, stops in rows
        ],
    )
    ready_ratio = ratio(ddp_median, median(raw_ready))
    print(
        f"\nready-to-train ratio ddp/raw {ready_ratio:.2f}x (goal < 1.0: ready sooner than raw + torch): "
        f"{verdict(ready_ratio < 1.0)}"
    )
    alive, line = leak_report(recorded)
    print(line)

    write_json(
        args.json,
        {
            "benchmark": "start",
            "settings": {"ranks": args.ranks, "repeats": args.repeats},
            "machine": info,
            "results": {
                "ddp_notebook": {"ready_median_s": ddp_median, "runs": runs["ddp_notebook"]},
                "ipyparallel": {
                    "ready_median_s": median(raw_ready),
                    "start_only_median_s": median(raw_start),
                    "runs": runs["ipyparallel"],
                },
            },
            "ratio_ready": ready_ratio,
            "ratio_vs_raw_start_only": ratio(ddp_median, median(raw_start)),
            "goal": {"ratio_ready_below": 1.0, "met": ready_ratio < 1.0},
            "recorded_pids": recorded,
            "pids_alive_after_stop": alive,
        },
    )
    return 1 if alive else 0


if __name__ == "__main__":
    sys.exit(main())
