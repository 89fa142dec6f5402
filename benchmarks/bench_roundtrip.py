"""Trivial cell round trip: `DDPCluster.execute` vs a raw ipyparallel DirectView.

Both worlds run at the same time and are timed in alternating batches, so whatever else
the machine is doing hits both sides equally. The raw cluster gets the same 200 ms
heartbeat DDPCluster uses, so only the per-cell path differs.

    python benchmarks/bench_roundtrip.py [--ranks 2] [--repeats 200] [--json PATH]
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
    percentile,
    print_header,
    print_table,
    process_tree,
    ratio,
    raw_cluster_pids,
    stop_raw_cluster,
    verdict,
    write_json,
)

from ddp_notebook import DDPCluster

CELL = "x = 1"
CALL_TIMEOUT = 30.0  # seconds; a trivial cell that takes this long means something broke
GOAL_RATIO = 1.2


def time_ddp(world: DDPCluster, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        world.execute(CELL, timeout=CALL_TIMEOUT)
        samples.append(time.perf_counter() - began)
    return samples


def time_raw(view: Any, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        # what execute(block=True) does (get, then wait for the output), with timeouts added
        result = view.execute(CELL, block=False)
        result.get(timeout=CALL_TIMEOUT)
        if not result.wait_for_output(timeout=CALL_TIMEOUT):
            raise TimeoutError(f"raw cell output not complete within {CALL_TIMEOUT:g} s")
        samples.append(time.perf_counter() - began)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], repeats=200, repeats_help="timed cells per side")
    parser.add_argument("--warmup", type=int, default=20, help="untimed cells per side first (default: 20)")
    parser.add_argument("--batch", type=int, default=10, help="cells per side before switching (default: 10)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    check_positive(parser, ranks=args.ranks, repeats=args.repeats, batch=args.batch)

    info = machine_info()
    print_header(
        "trivial cell round trip: DDPCluster.execute vs ipyparallel DirectView.execute",
        info,
        {"ranks": args.ranks, "repeats": args.repeats, "warmup": args.warmup, "batch": args.batch, "cell": CELL},
    )

    world = DDPCluster(args.ranks)
    raw_cluster: Any = None
    raw_client: Any = None
    recorded: list[int] = []
    samples: dict[str, list[float]] = {"ddp_notebook": [], "ipyparallel": []}
    try:
        world.start()
        recorded += process_tree(world.pids)
        raw_cluster = ipp.Cluster(n=args.ranks, controller_args=["--HeartMonitor.period=200"], delay=0)
        raw_client = raw_cluster.start_and_connect_sync()
        recorded += process_tree(raw_cluster_pids(raw_cluster))
        view = raw_client[:]

        time_ddp(world, args.warmup)
        time_raw(view, args.warmup)
        done = 0
        batch_index = 0
        while done < args.repeats:
            count = min(args.batch, args.repeats - done)
            # alternate who goes first, so neither side always follows the other
            if batch_index % 2 == 0:
                samples["ddp_notebook"] += time_ddp(world, count)
                samples["ipyparallel"] += time_raw(view, count)
            else:
                samples["ipyparallel"] += time_raw(view, count)
                samples["ddp_notebook"] += time_ddp(world, count)
            done += count
            batch_index += 1
    finally:
        world.stop()
        if raw_cluster is not None:
            stop_raw_cluster(raw_cluster, raw_client)

    stats = {
        side: {
            "median_ms": median(values) * 1e3,
            "p90_ms": percentile(values, 90) * 1e3,
            "min_ms": min(values) * 1e3,
            "count": len(values),
        }
        for side, values in samples.items()
    }
    ddp, raw = stats["ddp_notebook"], stats["ipyparallel"]
    median_ratio = ratio(ddp["median_ms"], raw["median_ms"])
    p90_ratio = ratio(ddp["p90_ms"], raw["p90_ms"])
    print_table(
        ["", "ddp_notebook", "ipyparallel", "ratio ddp/raw"],
        [
            ["median ms", ddp["median_ms"], raw["median_ms"], median_ratio],
            ["p90 ms", ddp["p90_ms"], raw["p90_ms"], p90_ratio],
            ["min ms", ddp["min_ms"], raw["min_ms"], ratio(ddp["min_ms"], raw["min_ms"])],
            ["cells", ddp["count"], raw["count"], ""],
        ],
    )
    print(f"\nmedian ratio {median_ratio:.2f}x (goal <= {GOAL_RATIO}x): {verdict(median_ratio <= GOAL_RATIO)}")
    alive, line = leak_report(recorded)
    print(line)

    write_json(
        args.json,
        {
            "benchmark": "roundtrip",
            "settings": {"ranks": args.ranks, "repeats": args.repeats, "warmup": args.warmup, "batch": args.batch},
            "machine": info,
            "results": stats,
            "ratio_median": median_ratio,
            "ratio_p90": p90_ratio,
            "goal": {"ratio_median_at_most": GOAL_RATIO, "met": median_ratio <= GOAL_RATIO},
            "pids_alive_after_stop": alive,
            "samples_ms": {side: [v * 1e3 for v in values] for side, values in samples.items()},
        },
    )
    return 1 if alive else 0


if __name__ == "__main__":
    sys.exit(main())
