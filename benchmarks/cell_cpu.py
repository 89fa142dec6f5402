"""The CPU a trivial cell costs the kernel's main thread: `%%ddp` against the same cell run with
ipyparallel's `DirectView.execute` on the world's own engines, and the Python API against the view.

    python benchmarks/cell_cpu.py [--ranks 2] [--blocks 6] [--cells 100]

Runs in this process, in an IPython shell (no front end, no kernel's IOPub): `%load_ext ddp_notebook`,
`%ddp_start N`, then blocks of `--cells` cells of each kind in turn, timed with `time.thread_time()`
(this thread's CPU, which the machine's load moves far less than wall time) and the wall clock.
Prints the median per cell of each kind and the differences that are ddp_notebook's: `%%ddp` against
a cell running `dv.execute(..., silent=False)` (the same work asked of the ranks), and
`DDPCluster.execute` against `dv.execute`; then rank 0's main-thread CPU per `dv.execute` cell,
not silent (as `%%ddp` sends its cells: the last value comes back, the cell hooks run) and silent.
`benchmarks/cell_cost.py` times the same cells through a real kernel as a front end waits for them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from harness import exit_on_sigterm, machine_info, machine_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks in the world (default: 2)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each kind, in turn (default: 6)")
    parser.add_argument("--cells", type=int, default=100, help="cells per block (default: 100)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    info = machine_info()
    print(machine_line(info))
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "ddp_notebook")
    shell.run_line_magic("ddp_start", str(args.ranks))
    try:
        world = shell.magics_manager.registry["DDPMagics"].world
        view = world.provisioner.client[[rank.engine_id for rank in world.ranks]]
        shell.user_ns["dv"] = view
        kinds: dict[str, Callable[[], object]] = {
            "%%ddp cell": lambda: shell.run_cell("%%ddp\nx = 1"),
            "cell of dv.execute(silent=False)": lambda: shell.run_cell(
                "_ = dv.execute('x = 1', silent=False, block=True)"
            ),
            "DDPCluster.execute": lambda: world.execute("x = 1"),
            "dv.execute(silent=False)": lambda: view.execute("x = 1", silent=False, block=True),
        }
        for run in kinds.values():  # code paths warm
            for _ in range(30):
                run()
        cpu: dict[str, list[float]] = {name: [] for name in kinds}
        wall: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.blocks):
            for name, run in kinds.items():
                cpu_began, began = time.thread_time(), time.perf_counter()
                for _ in range(args.cells):
                    run()
                cpu[name].append((time.thread_time() - cpu_began) / args.cells * 1e6)
                wall[name].append((time.perf_counter() - began) / args.cells * 1e3)
        rank_cpu: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):
            for silent in (False, True):
                rank_cpu[silent].append(_rank_cpu(world, view, silent, args.cells))
    finally:
        shell.run_line_magic("ddp_stop", "")
    median = {name: statistics.median(values) for name, values in cpu.items()}
    for name in kinds:
        print(f"{name:>34}: {median[name]:6.0f} us of the main thread's CPU, {statistics.median(wall[name]):.2f} ms")
    magic = median["%%ddp cell"] - median["cell of dv.execute(silent=False)"]
    api = median["DDPCluster.execute"] - median["dv.execute(silent=False)"]
    print(f"ddp_notebook's part: %%ddp {magic:+.0f} us per cell, DDPCluster.execute {api:+.0f} us per cell")
    loud, quiet = statistics.median(rank_cpu[False]), statistics.median(rank_cpu[True])
    print(f"rank 0's main thread per cell: {loud:.0f} us with silent=False (what %%ddp sends), {quiet:.0f} us silent")
    return 0


def _rank_cpu(world: object, view: object, silent: bool, cells: int) -> float:
    """Microseconds of rank 0's main thread (where its engine runs cells) per `dv.execute` cell."""
    view.execute("import time as _time\n_cpu0 = _time.thread_time()", silent=silent, block=True)  # type: ignore[attr-defined]
    for _ in range(cells):
        view.execute("x = 1", silent=silent, block=True)  # type: ignore[attr-defined]
    view.execute("_cpu1 = _time.thread_time()", silent=silent, block=True)  # type: ignore[attr-defined]
    spent = world.pull("_cpu1", ranks=[0])[0] - world.pull("_cpu0", ranks=[0])[0]  # type: ignore[attr-defined]
    return spent / (cells + 1) * 1e6


if __name__ == "__main__":
    sys.exit(main())
