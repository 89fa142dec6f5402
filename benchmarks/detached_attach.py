"""A detached world found again from a new kernel: how long `%ddp_attach` takes, and how long after its
kernel's death a world nobody attaches ends itself.

    python benchmarks/detached_attach.py [--ranks 2] [--repeats 3] [--idle-limit 3]

Each repeat: a real kernel starts `%ddp_start N --detach`, sets a variable on every rank and is
SIGKILLed; a second kernel loads the extension, lists the worlds (`%ddp_worlds`, timed: the first
cell after `%load_ext` also waits for what the extension preloads between cells) and runs
`%ddp_attach`, timed as the cell's round trip from the client and as the world's own start
(`world.start_seconds`, what its summary says), then an all-reduce reading the variable, then
`%ddp_stop`. Once more with
`--idle-limit S` and no second kernel: timed from the kill until the last process of the world is
gone. Prints each repeat's seconds and their median. The user's registry goes to a temporary folder.

`--starts`: `%ddp_start N --detach` (its ranks forked from a template of the world's own) and
`%ddp_start N --detach --no-warm-start` (fresh interpreters) alternated in one kernel, each followed
by `%ddp_stop`, each timed as the cell and as the world's own start.

`--journal STEPS`: a cell that prints a line and logs a point per step (STEPS steps) is sent and its
kernel SIGKILLed as it starts; once the ranks are idle again, a new kernel's `%ddp_attach` and
`%ddp_wait` (every line and point the ranks kept, shown from the start, and the end) are timed.
Then what keeping them costs the cell: its steps/s on the ranks of that detached world (which keep
a journal), against a world started without `--detach` (which keeps none; its ranks too are forked
from a warm template), alternated, in the same kernel.
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import exit_on_sigterm, machine_info

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.support.kernel; ddp_notebook as installed


def start_and_kill(ranks: int, extra: str) -> list[int]:
    """A kernel starts a detached world, sets `kept`, and is SIGKILLed; the world's PIDs."""
    from ddp_notebook.platform.processes import descendants
    from ddp_notebook.wire import detached as wire
    from tests.support.kernel import Kernel

    kernel = Kernel()
    try:
        out, error = kernel.run(f"%load_ext ddp_notebook\n%ddp_start {ranks} --detach {extra}")
        assert error is None, out
        out, error = kernel.run("%%ddp\nkept = rank + 40")
        assert error is None, out
        (path,) = wire.registry_dir().glob("*.json")
        entry = wire.read_entry(path)
        assert entry is not None
        pids = [
            entry["controller_pid"],
            *entry["rank_pids"],
            *([entry["template_pid"]] if entry["template_pid"] else []),
        ]
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
    finally:
        kernel.close()
    return pids + descendants(pids)


def attach_once(ranks: int) -> tuple[float, float, float]:
    from tests.support.kernel import Kernel
    from tests.support.processes import wait_gone

    pids = start_and_kill(ranks, "")
    kernel = Kernel()
    try:
        out, error = kernel.run("%load_ext ddp_notebook")
        assert error is None, out
        began = time.perf_counter()
        out, error = kernel.run("%ddp_worlds")
        listing = time.perf_counter() - began
        assert error is None, out
        began = time.perf_counter()
        out, error = kernel.run("%ddp_attach")
        seconds = time.perf_counter() - began
        assert error is None and "attached again" in out, out
        out, error = kernel.run("print(get_ipython().magics_manager.registry['DDPMagics'].world.start_seconds)")
        own = float(out.strip())
        out, error = kernel.run("%%ddp\ny = torch.ones(1)\ndist.all_reduce(y)\n(kept, y.item())")
        assert error is None and f"[rank {ranks - 1}] Out: ({40 + ranks - 1}, {float(ranks)})" in out, out
        kernel.run("%ddp_stop")
    finally:
        kernel.close()
    assert wait_gone(pids) == [], "processes outlived %ddp_stop"
    return listing, seconds, own


def starts(ranks: int, repeats: int) -> list[tuple[float, float, float, float]]:
    """`%ddp_start N --detach` (its ranks forked from a template of the world's own) and the same with
    `--no-warm-start` (its ranks fresh interpreters, as every detached world's were before), alternated
    in one kernel: (the cell, the world's own start) seconds of each, per repeat."""
    from tests.support.kernel import Kernel

    world = "get_ipython().magics_manager.registry['DDPMagics'].world.start_seconds"
    kernel = Kernel()
    timed = []
    try:
        out, error = kernel.run("%load_ext ddp_notebook")
        assert error is None, out
        for _ in range(repeats):
            pair: list[float] = []
            for start in (f"%ddp_start {ranks} --detach", f"%ddp_start {ranks} --detach --no-warm-start"):
                began = time.perf_counter()
                out, error = kernel.run(start)
                cell = time.perf_counter() - began
                assert error is None, out
                out, error = kernel.run(f"print({world})")
                pair += [cell, float(out.strip())]
                out, error = kernel.run("%ddp_stop")
                assert error is None, out
            timed.append((pair[0], pair[1], pair[2], pair[3]))
    finally:
        kernel.close()
    return timed


def idle_end_once(ranks: int, limit: float) -> float:
    from tests.support.processes import wait_gone

    pids = start_and_kill(ranks, f"--idle-limit {limit:g}")
    began = time.perf_counter()
    assert wait_gone(pids, seconds=limit + 60) == [], "the idle limit did not end the world"
    return time.perf_counter() - began


LOOP = (
    "%%ddp\nimport time\nbegan, cpu = time.perf_counter(), time.process_time()\n"
    "for i in range({steps}):\n    print(f'step {{i}} of the loop')\n    ddp_notebook.log(loss=1.0 / (i + 1))\n"
    "time.sleep(0.5)  # the output's last flush, on ipykernel's IO thread, counted too\n"
    "rate = ({steps} / (time.perf_counter() - began - 0.5), 1e6 * (time.process_time() - cpu) / {steps})"
)


Rate = tuple[float, float]  # (steps/s, the rank process's CPU µs per step, every thread of it)


def journal_once(ranks: int, steps: int, pairs: int) -> tuple[float, float, int, list[tuple[Rate, Rate]]]:
    """(%ddp_attach s, %ddp_wait s, the lines it showed, [(the loop keeping a journal, keeping none)] per pair)."""
    from ddp_notebook.wire import detached as wire
    from tests.support.kernel import Kernel

    kernel = Kernel()
    try:
        out, error = kernel.run(f"%load_ext ddp_notebook\n%ddp_start {ranks} --detach")
        assert error is None, out
        kernel.client.execute(LOOP.format(steps=steps))
        kernel.wait_for_output("step 0 of the loop", seconds=60)
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
    finally:
        kernel.close()
    kernel = Kernel()
    try:
        out, error = kernel.run("%load_ext ddp_notebook")
        deadline = time.monotonic() + 600
        while " running a cell " in kernel.run("%ddp_worlds")[0]:  # the cell ends with no kernel attached
            assert time.monotonic() < deadline, "the loop did not end"
            time.sleep(0.5)
        began = time.perf_counter()
        out, error = kernel.run("%ddp_attach")
        attach = time.perf_counter() - began
        assert error is None and "ended" in out, out
        began = time.perf_counter()
        out, error = kernel.run("%ddp_wait")
        follow = time.perf_counter() - began
        assert error is None and f"[rank {ranks - 1}] step {steps - 1} of the loop" in out, out[-2000:]
        shown = sum(line.startswith("[rank ") for line in out.splitlines())
        (path,) = wire.registry_dir().glob("*.json")
        rates = []
        for _ in range(pairs):
            kept = _loop_rate(kernel, steps)
            # a world that keeps no journal, its ranks forked from a warm template as a detached world's are
            out, error = kernel.run(f"%ddp_stop\n%ddp_start {ranks}")
            assert error is None, out
            plain = _loop_rate(kernel, steps)
            out, error = kernel.run(f"%ddp_stop\n%ddp_start {ranks} --detach")
            assert error is None, out
            rates.append((kept, plain))
        kernel.run("%ddp_stop")
        assert not path.exists()
    finally:
        kernel.close()
    return attach, follow, shown, rates


def _loop_rate(kernel: Any, steps: int) -> Rate:
    """The loop's steps/s and CPU µs per step on the ranks (medians), its output shown as a user's would be."""
    out, error = kernel.run(LOOP.format(steps=steps) + "\nrate", timeout=600)
    assert error is None, out[-2000:]
    rates = [ast.literal_eval(line.split("Out: ")[1]) for line in out.splitlines() if "Out: " in line]
    return statistics.median(rate for rate, _ in rates), statistics.median(cpu for _, cpu in rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-limit", type=float, default=3.0)
    parser.add_argument("--starts", action="store_true", help="time %%ddp_start --detach, forked and fresh")
    parser.add_argument("--journal", type=int, default=0, metavar="STEPS", help="time %%ddp_wait and the journal")
    parser.add_argument("--pairs", type=int, default=3, help="with --journal: alternated runs of the loop")
    args = parser.parse_args()
    from ddp_notebook.wire import journal

    exit_on_sigterm()
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="bench-detached-")  # the kernels inherit it
    print(machine_info())
    if args.journal:
        attach, follow, shown, rates = journal_once(args.ranks, args.journal, args.pairs)
        lines = args.journal * args.ranks
        print(
            f"a cell of {args.journal} steps (a line and a point each) ended with no kernel attached: %ddp_attach "
            f"{attach:.2f} s, %ddp_wait showing {shown} of its {lines} lines (each rank keeps at most "
            f"{journal.TEXT_LIMIT_BYTES >> 20} MiB), its {lines} points and its end {follow:.2f} s"
        )
        ratios = [kept[0] / plain[0] for kept, plain in rates]
        print(
            "the loop's steps/s keeping a journal (detached) / keeping none, per pair: "
            + ", ".join(f"{kept[0]:.0f}/{plain[0]:.0f} = {kept[0] / plain[0]:.3f}" for kept, plain in rates)
            + f" (median {statistics.median(ratios):.3f})"
        )
        kept_cpu, plain_cpu = (statistics.median(rate[side][1] for rate in rates) for side in (0, 1))
        print(
            "a rank's CPU per step (every thread of its process), keeping a journal / keeping none: "
            + ", ".join(f"{kept[1]:.1f}/{plain[1]:.1f} µs" for kept, plain in rates)
            + f" (medians {kept_cpu:.1f} / {plain_cpu:.1f})"
        )
        return
    if args.starts:
        timed = starts(args.ranks, args.repeats)
        for index, name in ((0, "--detach"), (2, "--detach --no-warm-start")):
            cells = [run[index] for run in timed]
            own = [run[index + 1] for run in timed]
            print(
                f"%ddp_start {args.ranks} ({name}): the cell {', '.join(f'{s:.2f}' for s in cells)} s (median "
                f"{statistics.median(cells):.2f} s); the world's start {', '.join(f'{s:.2f}' for s in own)} s"
            )
        ratios = [run[0] / run[2] for run in timed]
        print(f"forked / fresh interpreters, the cell, per pair: {', '.join(f'{r:.2f}' for r in ratios)}")
        return
    runs = [attach_once(args.ranks) for _ in range(args.repeats)]
    listings, cells, own = ([run[index] for run in runs] for index in range(3))
    print(f"the first cell after %load_ext (%ddp_worlds): {', '.join(f'{s:.2f}' for s in listings)} s")
    print(
        f"%ddp_attach, {args.ranks} ranks, after the kernel was SIGKILLed: the cell "
        f"{', '.join(f'{s:.2f}' for s in cells)} s (median {statistics.median(cells):.2f} s); "
        f"the world's start {', '.join(f'{s:.2f}' for s in own)} s"
    )
    ends = [idle_end_once(args.ranks, args.idle_limit) for _ in range(args.repeats)]
    print(
        f"--idle-limit {args.idle_limit:g}: the world's last process gone after the kernel's kill in "
        f"{', '.join(f'{s:.1f}' for s in ends)} s (median {statistics.median(ends):.1f} s)"
    )


if __name__ == "__main__":
    main()
