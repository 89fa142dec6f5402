"""What reloading edited modules (%ddp_autoreload, on by default) costs a rank per cell, in one run.

    python benchmarks/autoreload_cost.py [--checks 1000]

On a gloo rank (torch imported: a few thousand modules in sys.modules) with a user module of its
own, times the check that runs before each cell: with nothing imported since the last cell (the
usual cell), after an import (the walk over sys.modules that finds the user's new modules), and
when the user's module changed (the reload itself, IPython's superreload). Printed per check.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
from pathlib import Path

from harness import exit_on_sigterm, machine_info

sys.path.append(str(Path(__file__).resolve().parent.parent))

MEASURE = """
import sys, time, types, os
from ddp_notebook.rank.state import RANK
import bench_user_module
reloader = RANK.user_files.reloader
reloader.check()
began = time.perf_counter()
for _ in range({checks}):
    reloader.check()
idle = (time.perf_counter() - began) / {checks}
began = time.perf_counter()
for i in range(100):
    sys.modules[f"bench_fake_{{i}}"] = types.ModuleType(f"bench_fake_{{i}}")
    reloader.check()
walk = (time.perf_counter() - began) / 100
path = bench_user_module.__file__
reloads = []
for i in range(20):
    with open(path, "w") as handle:
        handle.write(f"def f():\\n    return {{i}}\\n")
    stamp = os.stat(path).st_mtime_ns + (i + 1) * 10**6
    os.utime(path, ns=(stamp, stamp))
    began = time.perf_counter()
    reloader.check()
    reloads.append(time.perf_counter() - began)
(len(sys.modules), idle * 1e6, walk * 1e3, sorted(reloads)[10] * 1e3, bench_user_module.f())
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=1000)
    args = parser.parse_args()
    exit_on_sigterm()
    from ddp_notebook import DDPCluster

    folder = tempfile.mkdtemp(prefix="ddp-autoreload-cost-")
    os.chdir(folder)  # the notebook's folder: the rank imports the user's module from here
    Path(folder, "bench_user_module.py").write_text("def f():\n    return 0\n")
    print(machine_info())
    with DDPCluster(1, backend="gloo") as world:
        answer = world.execute(MEASURE.format(checks=args.checks)).value_text(0)
    modules, idle_us, walk_ms, reload_ms, last = ast.literal_eval(answer)
    assert last == 19, "the last edit was not reloaded"
    print(f"a rank with {modules} modules imported, one of them the user's; per check before a cell:")
    print(f"  nothing imported since the last cell: {idle_us:.2f} us")
    print(f"  a cell that imported something:      {walk_ms:.2f} ms (the walk that finds new user modules)")
    print(f"  the user's module changed:           {reload_ms:.2f} ms (its reload, median of 20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
