"""What a trivial `%%ddp` cell costs against a raw ipyparallel `DirectView.execute` of the same code,
on the same ranks, in the same real kernel, as a notebook user sees it.

    python benchmarks/cell_cost.py [--ranks 2] [--rounds 40]

The kernel starts a world with `%ddp_start N`; then, alternating round by round, one cell runs
`%%ddp` + `x = 1`, the next `dv.execute('x = 1', block=True)` on a DirectView of the world's own
engines, and a third the same with `silent=False` (what %%ddp asks of the ranks). Each cell is
timed from the execute request to the kernel going idle (what a front end waits for). Prints the
medians and the ratios (the goal: at most 1.05 against the plain DirectView.execute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import exit_on_sigterm, machine_info, machine_line
from subjects import SETUP_TIMEOUT, Kernel

RAW_VIEW = (
    "world = get_ipython().magics_manager.registry['DDPMagics'].world\n"
    "dv = world.provisioner.client[[info.engine_id for info in world.ranks]]"
)
CELLS = {
    "%%ddp": "%%ddp\nx = 1",
    "DirectView.execute": "_ = dv.execute('x = 1', block=True)",
    # what %%ddp asks of the ranks: a cell that is not silent (its last value comes back, the ranks'
    # cell hooks run, its input is echoed), so this ratio is the magic's own cost
    "DirectView.execute(silent=False)": "_ = dv.execute('x = 1', silent=False, block=True)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks in the world (default: 2)")
    parser.add_argument("--rounds", type=int, default=40, help="alternating rounds (default: 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    info = machine_info()
    print(machine_line(info))
    kernel = Kernel(sys.executable, dict(os.environ))
    try:
        for code in ("%load_ext ddp_notebook", f"%ddp_start {args.ranks}", RAW_VIEW):
            cell = kernel.run(code, SETUP_TIMEOUT)
            if cell.status != "ok":
                raise RuntimeError(f"{code.splitlines()[0]!r} failed: {cell.text[-1500:]}")
        times: dict[str, list[float]] = {name: [] for name in CELLS}
        for round_ in range(args.warmup + args.rounds):
            for name, code in CELLS.items():
                began = time.perf_counter()
                cell = kernel.run(code, 60.0)
                took = time.perf_counter() - began
                if cell.status != "ok":
                    raise RuntimeError(f"{name} failed: {cell.text[-1500:]}")
                if round_ >= args.warmup:
                    times[name].append(took)
        kernel.run("%ddp_stop", 60.0)
    finally:
        kernel.shutdown()
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:>33}: median {median * 1e3:.2f} ms over {len(times[name])} cells")
    ratio = medians["%%ddp"] / medians["DirectView.execute"]
    print(f"%%ddp / DirectView.execute: {ratio:.3f} (goal: at most 1.05)")
    like = medians["%%ddp"] / medians["DirectView.execute(silent=False)"]
    print(f"%%ddp / DirectView.execute(silent=False): {like:.3f} (the same work on the ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
