"""What a world costs as its rank count grows: a simulation with light ranks, in a real kernel.

    python benchmarks/run.py scale [--sizes 2,8,32,128,256] [--seconds 5] [--json PATH] [--hosts K]
    python benchmarks/scale.py ...   (the same)

SIMULATED RANKS: each rank is a real ipyparallel engine forked from the warm template, with the
real channel, X-ray, live view and reports, but it joins torch's fake process group (no
communication; `DDPCluster(n, simulated=True)`), so hundreds of ranks fit one machine. What it
measures is the control plane: the collectives of a real world add their own cost on top.

For each size, in a fresh Jupyter kernel driven as a notebook front end drives it:
- start: `DDPCluster(n, simulated=True).start()`, in the kernel;
- round trip: a trivial `%%ddp` cell (`x = 1`), from the execute request to the kernel going idle
  (the median of 5, after one untimed), and the CPU seconds per such cell of the kernel, the
  controller and all the ranks together (where the time goes);
- streaming: a cell in which every rank logs a loss at 10 Hz and prints a line a second for
  `--seconds`: the kernel's and the controller's CPU (cores' worth over the cell) and resident
  memory, bytes per second into the kernel (TCP, every socket of the kernel process: what
  ipyparallel brings it) and to the front end (every iopub message of the cell: what a browser gets);
- a dead rank named: the last rank writes the time and exits mid-cell (`os._exit`); the seconds
  until the front end gets the error naming it;
- a rank's memory: the mean unique (USS) memory of the ranks, and so how many fit the memory free.

With `--hosts K` (as root): the ranks spread evenly over K "hosts" made of network namespaces with
an sshd each (tests/support/multihost.py), started by the SSH launcher with the controller on the bridge
(CurveZMQ). No warm template runs on a host, so every rank there is a Python process of its own
that imports torch: its memory is a real remote rank's, not a fork's.

With `--browser N`: the same streaming cell at N ranks in JupyterLab, drawn by a real chromium
(Playwright), the aggregate live view on screen: the time between the page's frames from when rank
0's loop began to when it ended (median, 99th percentile, longest; the first and the last frame
measured against those times). Twice: chromium on a CPU of its own and everything else on the
others (a browser on the user's own machine, as where the ranks run elsewhere), then chromium
sharing every CPU with the kernel, JupyterLab and the N ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from harness import exit_on_sigterm, machine_info, machine_line, print_table, write_json
from subjects import SETUP_TIMEOUT, Kernel

SIZES = (2, 8, 32, 128, 256)
ROUND_TRIPS = 5
START = """
import json, time, warnings, ddp_notebook
warnings.simplefilter("ignore", ddp_notebook.InsecureNetworkWarning)  # --hosts: a bridge of this machine's own
_began = time.perf_counter()
world = ddp_notebook.DDPCluster({n}, simulated=True, on_loss="stop", start_timeout={start_timeout}{spread})
world.start()
world.activate()
print("SCALE", json.dumps({{"start_s": time.perf_counter() - _began, "rank_pids": [i.pid for i in world.ranks],
                           "controller_pid": world.provisioner.controller_pid}}))
"""
STREAM = """%%ddp --timeout {limit}
import time
for step in range({steps}):
    ddp_notebook.log(loss=1.0 / (step + 1) + rank * 1e-3)
    if step % 10 == 0:
        print(f"step {{step}}")
    time.sleep(0.1)
"""
DEATH = """%%ddp --timeout 120
import os, time
if rank == {last}:
    time.sleep(1.0)
    with open({mark!r}, "w") as handle:
        handle.write(repr(time.time()))
    os._exit(3)
time.sleep(60)
"""
STOP = "world.stop()"
TCP_RECEIVED = re.compile(r"bytes_received:(\d+)")


class CountingKernel(Kernel):
    """A kernel whose iopub messages are also counted in bytes (their content's JSON and buffers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.iopub_bytes = 0

    def _route(self, message: dict[str, Any]) -> None:
        self.iopub_bytes += len(json.dumps(message["content"], default=str))
        self.iopub_bytes += sum(len(memoryview(buffer)) for buffer in message.get("buffers") or ())
        super()._route(message)


def tcp_bytes_received(pid: int) -> int:
    """Bytes every TCP socket of `pid` has received (the kernel's ipyparallel sockets)."""
    listing = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    total, ours = 0, False
    for line in listing.splitlines():
        if not line[:1].isspace():  # a socket's first line names its process
            ours = f"pid={pid}," in line
        elif ours and (found := TCP_RECEIVED.search(line)):
            total += int(found.group(1))
    return total


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_cell(kernel: Kernel, code: str, timeout: float) -> Any:
    cell = kernel.run(code, timeout)
    if cell.status != "ok":
        raise RuntimeError(f"{code.strip().splitlines()[0]!r} failed: {cell.text[-2000:]}")
    return cell


def spread_over(n: int, hosts: Any) -> str:
    """The DDPCluster options that spread `n` ranks evenly over the namespace `hosts` (SSH), or ""."""
    if hosts is None:
        return ""
    network, ssh = hosts
    names = [host.name for host in network]
    slots = ",".join(f"{name}:{n // len(names) + (index < n % len(names))}" for index, name in enumerate(names))
    return f', launcher="ssh", hosts={slots!r}, ssh_args={list(ssh.ssh_args)!r}, ip={network.address!r}'


def measure(n: int, seconds: float, hosts: Any = None) -> dict[str, Any]:
    kernel = CountingKernel(sys.executable, dict(os.environ))
    row: dict[str, Any] = {"ranks": n}
    try:
        run_cell(kernel, "%load_ext ddp_notebook", SETUP_TIMEOUT)
        # over SSH every rank is a process of its own (no template to fork from on a host): slower to start
        start_timeout = max(120, n) * (1 if hosts is None else 4)
        code = START.format(n=n, start_timeout=start_timeout, spread=spread_over(n, hosts))
        started = run_cell(kernel, code, start_timeout + SETUP_TIMEOUT)
        facts = json.loads(re.search(r"SCALE (\{.*\})", started.text).group(1))
        row["start_s"] = facts["start_s"]
        kernel_process = psutil.Process(kernel.pid)
        controller = psutil.Process(facts["controller_pid"])
        uss = [psutil.Process(pid).memory_full_info().uss for pid in facts["rank_pids"]]
        row["rank_uss_mib"] = statistics.mean(uss) / 2**20
        row["ranks_that_fit"] = int(psutil.virtual_memory().available / statistics.mean(uss)) + n

        run_cell(kernel, "%%ddp\nx = 1", 60)
        ranks = [psutil.Process(pid) for pid in facts["rank_pids"]]
        spent = (cpu_seconds(kernel_process), cpu_seconds(controller), sum(cpu_seconds(r) for r in ranks))
        trips = []
        for _ in range(ROUND_TRIPS):
            cell = run_cell(kernel, "%%ddp\nx = 1", 60)
            trips.append(cell.elapsed)
        row["round_trip_s"] = statistics.median(trips)
        # where a trivial cell's time goes: CPU seconds per cell of the kernel, the controller, the ranks
        after = (cpu_seconds(kernel_process), cpu_seconds(controller), sum(cpu_seconds(r) for r in ranks))
        for key, before, now in zip(("cell_cpu_kernel_s", "cell_cpu_controller_s", "cell_cpu_ranks_s"), spent, after):
            row[key] = (now - before) / ROUND_TRIPS

        # the first live view of a notebook loads plotly.js into the page (5 MB, once): not per cell
        run_cell(kernel, STREAM.format(steps=1, limit=60), 120)
        steps = int(seconds * 10)
        cpu_kernel, cpu_controller = cpu_seconds(kernel_process), cpu_seconds(controller)
        into_kernel, to_browser = tcp_bytes_received(kernel.pid), kernel.iopub_bytes
        began = time.perf_counter()
        cell = run_cell(kernel, STREAM.format(steps=steps, limit=seconds * 10 + 60), seconds * 10 + 120)
        took = time.perf_counter() - began
        row["stream_cell_s"] = took
        row["kernel_cores"] = (cpu_seconds(kernel_process) - cpu_kernel) / took
        row["controller_cores"] = (cpu_seconds(controller) - cpu_controller) / took
        row["kernel_mib"] = kernel_process.memory_info().rss / 2**20
        row["controller_mib"] = controller.memory_info().rss / 2**20
        row["into_kernel_kb_s"] = (tcp_bytes_received(kernel.pid) - into_kernel) / took / 1e3
        row["to_browser_kb_s"] = (kernel.iopub_bytes - to_browser) / took / 1e3
        row["printed_lines"] = cell.text.count("step ")

        with tempfile.NamedTemporaryFile("r", prefix="scale-death-", delete=True) as mark:
            cell = kernel.run(DEATH.format(last=n - 1, mark=mark.name), 180)
            died = float(Path(mark.name).read_text() or "nan")
        named = [o.wall for o in cell.outputs if o.error and f"rank {n - 1}" in o.text]
        row["dead_rank_named_s"] = (named[0] - died) if named else None
        kernel.run(STOP, 300)
    finally:
        kernel.shutdown()
    return row


COLUMNS = (
    ("ranks", "ranks"),
    ("start_s", "start s"),
    ("round_trip_s", "round trip s"),
    ("cell_cpu_kernel_s", "cell CPU: kernel s"),
    ("cell_cpu_controller_s", "ctrl s"),
    ("cell_cpu_ranks_s", "ranks s"),
    ("dead_rank_named_s", "dead named s"),
    ("kernel_cores", "kernel cores"),
    ("kernel_mib", "kernel MiB"),
    ("controller_cores", "ctrl cores"),
    ("controller_mib", "ctrl MiB"),
    ("into_kernel_kb_s", "into kernel KB/s"),
    ("to_browser_kb_s", "to browser KB/s"),
    ("rank_uss_mib", "rank USS MiB"),
    ("ranks_that_fit", "ranks fit"),
)


# the page's frames as timestamps (a gap is only known once the next frame comes: the last one
# is measured against the cell's end)
FRAME_TIMES_JS = """() => {
  window.__frameTimes = [];
  const tick = (now) => { window.__frameTimes.push(now); requestAnimationFrame(tick); };
  requestAnimationFrame(tick);
}"""
# printed by rank 0 around the streaming cell's loop, with the time (the cell's own text must not match)
STREAM_MARK = re.compile(r"streaming (begins|ends) at (\d+\.\d+)")


def marked_stream(steps: int, limit: float) -> str:
    """STREAM, rank 0 printing when its loop begins and ends (time.time())."""
    first, _, rest = STREAM.format(steps=steps, limit=limit).partition("\n")
    body = rest.removeprefix("import time\n")
    mark = "if rank == 0:\n    print('streaming', {!r}, 'at', f'{{time.time():.3f}}', flush=True)\n"
    return f"{first}\nimport time\n{mark.format('begins')}{body}{mark.format('ends')}"


def frame_gaps(times: list[float], begins: float, ends: float) -> list[tuple[float, float]]:
    """The gaps between the frames drawn from `begins` to `ends`, both ends included as bounds:
    (gap, when it began, from `begins`), in ms, shortest first."""
    inside = [t for t in times if begins <= t <= ends]
    bounds = [begins, *inside, ends]
    return sorted((later - earlier, earlier - begins) for earlier, later in itertools.pairwise(bounds))


def browser_frames(n: int, seconds: float, own_cpu: bool) -> dict[str, Any]:
    """Frame gaps of JupyterLab's page while `n` simulated ranks stream into the live view, from
    when rank 0's loop began to when it ended (the times it prints). `own_cpu`: chromium on the
    first CPU, everything else (JupyterLab, the kernel, the controller, the ranks) on the others, as a
    browser on a laptop of its own; else all of them share every CPU."""
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.jupyterlab_server import (
        LARGE_JS,
        jupyterlab,
        launch_chromium,
        missing_requirement,
        notebook_text,
        run_all_cells,
        watch_page,
    )

    reason = missing_requirement()
    if reason:
        raise RuntimeError(f"no browser benchmark: {reason}")
    cells = [
        "%load_ext ddp_notebook\nimport ddp_notebook\n"
        f"world = ddp_notebook.DDPCluster({n}, simulated=True, start_timeout={max(300, 2 * n)})\n"
        "world.start()\nworld.activate()",
        STREAM.format(steps=1, limit=60),
        marked_stream(int(seconds * 10), seconds * 10 + 60),
        'world.stop()\nprint("the large world", "stopped")',
    ]
    cpus = sorted(os.sched_getaffinity(0))
    browser_cpus = cpus[:1] if own_cpu else None
    try:
        if own_cpu:
            os.sched_setaffinity(0, cpus[1:])  # inherited by JupyterLab, its kernel and the world
        with tempfile.TemporaryDirectory(prefix="scale-browser-") as base, jupyterlab(Path(base)) as lab:
            (lab.root / "scale.ipynb").write_text(notebook_text(cells))
            with sync_playwright() as playwright:
                browser = launch_chromium(playwright, Path(base) / "chromium", browser_cpus)
                try:
                    page = browser.new_page()
                    page.goto(f"{lab.url}/lab/tree/scale.ipynb?token={lab.token}")
                    run_all_cells(page)
                    page.evaluate(FRAME_TIMES_JS)
                    limit = 600 + 2 * n
                    sample = watch_page(page, LARGE_JS, "the large world stopped", limit, 250)[-1]
                    if sample["errors"]:
                        raise RuntimeError(f"the notebook failed: {sample['errors']}")
                    times = page.evaluate("window.__frameTimes")
                    origin = page.evaluate("performance.timeOrigin")  # the page's clock, in epoch ms
                finally:
                    browser.close()
    finally:
        os.sched_setaffinity(0, cpus)
    # when rank 0's loop began and ended, on the page's clock (one machine: one clock)
    marks = {word: float(at) * 1e3 - origin for word, at in STREAM_MARK.findall(sample["text"])}
    if set(marks) != {"begins", "ends"}:
        raise RuntimeError(f"the page does not show when the streaming cell began and ended: {sorted(marks)}")
    gaps = frame_gaps(times, marks["begins"], marks["ends"])
    return {
        "ranks": n,
        "browser_cpus": "its own CPU" if own_cpu else "every CPU, shared with the rest",
        "window_s": (marks["ends"] - marks["begins"]) / 1e3,
        "frames": len(gaps) - 1,
        "median_ms": gaps[len(gaps) // 2][0],
        "p99_ms": gaps[int(len(gaps) * 0.99)][0],
        "longest_ms": gaps[-1][0],
        "longest_at_s": gaps[-1][1] / 1e3,
        "over_100ms_at_s": sorted(round(at / 1e3, 2) for gap, at in gaps if gap > 100),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="rank counts (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=5.0, help="the streaming cell's length (default: 5)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows here")
    parser.add_argument("--browser", type=int, metavar="N", help="also: frame gaps in JupyterLab at N ranks")
    parser.add_argument(
        "--hosts", type=int, metavar="K", help="the ranks spread evenly over K network-namespace hosts, over SSH (root)"
    )
    args = parser.parse_args(argv)
    if args.hosts is not None and (args.hosts < 1 or os.geteuid() != 0):
        parser.error("--hosts K (K >= 1) makes network namespaces and runs an sshd in each: run it as root")
    sizes = [int(size) for size in args.sizes.split(",")]
    exit_on_sigterm()
    info = machine_info()
    print(machine_line(info))
    print("== SIMULATED ranks (torch's fake process group): the control plane's cost, not a real world's")
    rows: list[dict[str, Any]] = []
    status = 0
    with contextlib.ExitStack() as hosts_made:
        hosts = None
        if args.hosts:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.support.multihost import network_namespaces, ssh_hosts

            network = hosts_made.enter_context(network_namespaces(args.hosts))
            hosts = (network, hosts_made.enter_context(ssh_hosts(network)))
            print(f"== over {args.hosts} network-namespace hosts ({', '.join(h.name for h in network)}), SSH launcher")
        for n in sizes:
            began = time.monotonic()
            try:
                rows.append(measure(n, args.seconds, hosts))
            except RuntimeError as failure:  # said in the table, and the other sizes still measured
                rows.append({"ranks": n, "error": str(failure).strip().splitlines()[-1][:300]})
                status = 1
            print(f"   {n} ranks measured in {time.monotonic() - began:.0f} s", flush=True)
    print()
    print_table([title for _, title in COLUMNS], [[row.get(key) for key, _ in COLUMNS] for row in rows])
    for row in rows:
        if "error" in row:
            print(f"{row['ranks']} ranks: {row['error']}")
    frames = []
    if args.browser:
        # a browser on a CPU of its own (as on the user's laptop), then sharing the CPUs with the world
        for own_cpu in (True, False) if len(os.sched_getaffinity(0)) > 1 else (False,):
            measured = browser_frames(args.browser, args.seconds, own_cpu)
            frames.append(measured)
            print(
                f"\nJupyterLab (chromium on {measured['browser_cpus']}) while {measured['ranks']} ranks stream "
                f"({measured['window_s']:.1f} s): {measured['frames']} frames, "
                f"gap median {measured['median_ms']:.0f} ms, 99th percentile {measured['p99_ms']:.0f} ms, "
                f"longest {measured['longest_ms']:.0f} ms ({measured['longest_at_s']:.1f} s into the loop); "
                f"gaps over 100 ms at {measured['over_100ms_at_s']} s",
                flush=True,
            )
    payload = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": info,
        "hosts": args.hosts,
        "rows": rows,
        "browser": frames,
    }
    write_json(args.json, payload)
    return status


if __name__ == "__main__":
    sys.exit(main())
