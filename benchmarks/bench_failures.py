"""Seconds from a failure inside a %%ddp cell to the message, and to a healed world.

Each case runs on a real 2-rank gloo world with a DDP model and an optimizer on every rank:
- raise: rank 1 raises mid-training while rank 0 waits for it in backward's all-reduce;
- hang: rank 1 never reaches the all-reduce rank 0 waits in; the cell has --timeout 5;
- interrupt: the same hang, ended by SIGINT to this process 1.5 s in (the notebook's stop
  button sends the kernel SIGINT);
- death: rank 1's process exits (os._exit) while rank 0 waits in the all-reduce.
For each: seconds from the failure to the error, seconds to heal (or to restart after a
death), and whether every rank's Python state (a counter, the model's weights) was kept.
The collective timeout of the world is 120 s (ddp_notebook's default): without release and
heal, the raise, hang and interrupt cases would each block rank 0 for those 120 s.

python benchmarks/bench_failures.py [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from _common import (
    exit_on_sigterm,
    leak_report,
    machine_info,
    make_parser,
    median,
    print_header,
    print_table,
    process_tree,
    write_json,
)

from ddp_notebook import DDPCluster, DDPError

SETUP = (
    "torch.manual_seed(rank)\n"
    "model = ddp_notebook.prepare_model(torch.nn.Linear(32, 4))\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "counter = 100 + rank\n"
    "x = torch.ones(1)\n"
)
# the failing rank fails this long into the cell; the others are then inside a collective
FAIL_AFTER = 0.5
CASES: dict[str, dict[str, Any]] = {
    "raise": {
        "code": (
            "import time\nstarted = time.time()\n"
            "while True:\n"
            "    optimizer.zero_grad()\n"
            "    model(torch.randn(16, 32)).sum().backward()\n"
            "    optimizer.step()\n"
            f"    if rank == 1 and time.time() - started > {FAIL_AFTER}:\n"
            "        raise ValueError('bad batch')\n"
        ),
        "timeout": None,
        "fails_at": FAIL_AFTER,
    },
    "hang (--timeout 5)": {
        "code": "import time\nif rank == 1:\n    time.sleep(600)\ndist.all_reduce(x)\n",
        "timeout": 5.0,
        "fails_at": 5.0,
    },
    "interrupt": {
        "code": "import time\nif rank == 1:\n    time.sleep(600)\ndist.all_reduce(x)\n",
        "timeout": None,
        "fails_at": 1.5,
        "interrupt_at": 1.5,
    },
    "death (os._exit)": {
        "code": f"import os, time\nif rank == 1:\n    time.sleep({FAIL_AFTER})\n    os._exit(9)\ndist.all_reduce(x)\n",
        "timeout": None,
        "fails_at": FAIL_AFTER,
    },
}


def state_kept(world: DDPCluster) -> bool:
    counters = world.pull("counter")
    world.execute("weights = model.module.weight.detach().clone()")
    weights = world.pull("weights")
    return counters == {0: 100, 1: 101} and bool((weights[0] == weights[1]).all())


def run_case(world: DDPCluster, case: dict[str, Any]) -> dict[str, Any]:
    world.execute(SETUP)
    world.last_heal_seconds = None
    timer = None
    if "interrupt_at" in case:
        # what the notebook's stop button does: SIGINT to the process running the cell
        timer = threading.Timer(case["interrupt_at"], os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
    began = time.monotonic()
    error = ""
    try:
        world.execute(case["code"], timeout=case["timeout"], stream=False)
    except DDPError as failure:
        error = type(failure).__name__
    message_s = time.monotonic() - began - case["fails_at"]
    if timer is not None:
        timer.cancel()
    if world.broken:
        restart_began = time.monotonic()
        world.restart()
        how, recover_s, kept = "%ddp_restart", time.monotonic() - restart_began, "no (new processes)"
    else:
        if world.needs_heal:  # ranks were still blocked when the cell ended: heal now
            world.heal()
        how, recover_s = "heal, inside the failing cell", world.last_heal_seconds or 0.0
        kept = "yes" if state_kept(world) else "NO"
    world.execute("y = torch.ones(1)\ndist.all_reduce(y)\nassert y.item() == world_size")
    return {"error": error, "message_s": message_s, "recover_s": recover_s, "recovery": how, "state_kept": kept}


def main() -> int:
    parser = make_parser(__doc__.splitlines()[0], repeats=3, repeats_help="rounds of every case")
    args = parser.parse_args()
    exit_on_sigterm()
    print_header(__doc__.splitlines()[0], machine_info(), {"ranks": args.ranks, "repeats": args.repeats})
    world = DDPCluster(args.ranks, backend="gloo")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    pids: list[int] = []
    try:
        world.start()
        for round_index in range(args.repeats):
            for name, case in CASES.items():
                pids = sorted(set(pids) | set(process_tree(world.pids)))
                outcome = run_case(world, case)
                results[name].append(outcome)
                print(f"round {round_index + 1}/{args.repeats} {name}: {outcome}")
        pids = sorted(set(pids) | set(process_tree(world.pids)))
    finally:
        world.stop()
    rows = []
    for name, outcomes in results.items():
        rows.append(
            (
                name,
                outcomes[0]["error"],
                median([o["message_s"] for o in outcomes]),
                median([o["recover_s"] for o in outcomes]),
                outcomes[0]["recovery"],
                outcomes[0]["state_kept"],
            )
        )
    print()
    print_table(("case", "error", "failure->message s", "heal/restart s", "recovery", "state kept"), rows)
    print("failure->message includes the heal, which runs before the cell returns")
    alive, line = leak_report(pids)
    print(line)
    write_json(args.json, {"machine": machine_info(), "results": results})
    return 1 if alive else 0


if __name__ == "__main__":
    raise SystemExit(main())
