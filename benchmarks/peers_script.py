"""The user code compare_peers.py runs on every rank, under every tool.

Each body is what a user would put in a cell (or in a function handed to a launcher). It
sees `rank`, the rank it runs on; the tool decides how `rank` gets there and how the
process group is made. Run as a script, under torchrun, this file sets up the process
group itself and runs one body, so the script side runs the same code:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/peers_script.py tag
"""

from __future__ import annotations

import argparse

# prints one line per rank: the process group is up, torch is imported, and when
READY = (
    "import time, torch, torch.distributed as dist\n"
    'print(f"ready rank={rank} pg={dist.is_initialized()} threads={torch.get_num_threads()} t={time.time()}",'
    " flush=True)"
)
# `global` makes the name outlive a function (Accelerate); at the top level of a cell it is a no-op
STATE_SET = "global persist_probe\npersist_probe = 1000 + rank"
STATE_GET = "print(f\"persist rank={rank} value={globals().get('persist_probe')}\", flush=True)"
# three lines per rank, 0.3 s apart, so the ranks' lines interleave
TAG = 'import time\nfor i in range(3):\n    print(f"tagprobe:{rank}:{i}", flush=True)\n    time.sleep(0.3)'
TRIVIAL = "x = 1"
# {threads}: "torch.set_num_threads(N)\n" to match torchrun's threads, or "" for the tool's default
TRAIN = (
    "import json, sys, torch\n"
    "{threads}"
    "sys.path.insert(0, {bench_dir!r})\n"
    "import train_workload\n"
    "result = train_workload.train({steps}, {warmup})\n"
    "if rank == 0:\n"
    '    print("BENCH_RESULT " + json.dumps(result), flush=True)'
)
# rank 1 raises while rank 0 waits for it in an all_reduce; rank 1 notes when it raised
FAIL = (
    "import time, torch, torch.distributed as dist\n"
    "x = torch.ones(1)\n"
    "if rank == 1:\n"
    "    time.sleep({fail_after})\n"
    "    with open({raised!r}, 'w') as handle:\n"
    "        handle.write(repr(time.time()))\n"
    "    raise ValueError('rank 1 fails on purpose')\n"
    "dist.all_reduce(x)"
)
# the cell after the failure: a collective, and the state of earlier cells
AFTER = (
    "import torch, torch.distributed as dist\n"
    "y = torch.ones(1)\n"
    "dist.all_reduce(y)\n"
    "print(f\"after rank={rank} sum={y.item()} probe={globals().get('persist_probe')}\", flush=True)"
)
FAIL_AFTER = 0.5  # seconds into the cell; rank 0 is in the all_reduce by then


def main() -> None:
    parser = argparse.ArgumentParser(description="one body under torchrun")
    parser.add_argument("body", choices=["tag", "fail"])
    parser.add_argument("--raised", default=None, help="(fail) file where rank 1 writes when it raised")
    args = parser.parse_args()

    import datetime

    import torch.distributed as dist

    # bounded, like train_workload.py: torch's default of 30 minutes would hide a hang
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    code = TAG if args.body == "tag" else FAIL.format(fail_after=FAIL_AFTER, raised=args.raised)
    exec(code, {"rank": dist.get_rank()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
