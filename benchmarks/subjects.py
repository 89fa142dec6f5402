"""The things measured: each runs a cell's code on every rank, as its user would run it.

Every subject starts ranks with a process group and torch (`open`), runs code on every rank
(`cell`, which sees `rank`), trains (`train`), takes the stop button (`interrupt`) and stops
(`close`). Notebook tools run in a real Jupyter kernel of their own, driven cell by cell as a
notebook drives it, so each figure is what their user sees.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harness import BENCH_DIR, bounded

VENV = BENCH_DIR / ".peers-venv"
SETUP_TIMEOUT = 180.0  # seconds for a setup cell (starting ranks, importing torch)
TRAIN_TIMEOUT = 300.0  # seconds for one training run
STOP_TIMEOUT = 60.0  # seconds for a stop cell or call
LATE_GRACE = 2.0  # seconds to wait for output after its cell's reply, where an answer is missing
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
READY_LINE = re.compile(r"ready rank=(\d+) pg=(True|False) threads=(\d+) t=([\d.]+) code=(None|\S+?\.py)")
RESULT_LINE = re.compile(r"BENCH_RESULT (\{.*\})")
# every rank: process group up, torch imported, and which ddp_notebook (if any) it runs
READY = (
    "import sys, time, torch, torch.distributed as dist\n"
    'print(f"ready rank={rank} pg={dist.is_initialized()} threads={torch.get_num_threads()} t={time.time()}'
    " code={getattr(sys.modules.get('ddp_notebook'), '__file__', None)}\", flush=True)"
)
# puts the benchmark directory on a rank's import path once: cells run again and again in the same
# ranks, and each repeated entry makes every lookup of a module that is not installed slower
# (accelerate's optimizer asks for one twice per step), so the ranks' steps would slow round by round
ON_PATH = "if {bench!r} not in sys.path:\n    sys.path.insert(0, {bench!r})\n"
# {threads}: "torch.set_num_threads(N)\n", or "" for the tool's default
TRAIN = (
    "import json, sys, torch\n{threads}" + ON_PATH + "import train_workload\n"
    "result = train_workload.train({steps}, {warmup}, data={data!r})\n"
    'if rank == 0:\n    print("BENCH_RESULT " + json.dumps(result), flush=True)'
)
# a process group by hand, as a raw ipyparallel user makes it (rank, world_size, MASTER_PORT pushed)
PROCESS_GROUP = (
    "import os, torch, torch.distributed as dist\n"
    'os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(MASTER_PORT), LOCAL_RANK=str(rank))\n'
    "dist.init_process_group({backend!r}, rank=rank, world_size=world_size)"
)
# nbdistributed's %dist_shutdown/%dist_reset run `pkill -f` on patterns that match processes of
# other users of the machine; its kernel refuses such calls before the extension loads
PKILL_GUARD = r"""
import os as _os, re as _re, subprocess as _subprocess
_BLOCKED = _re.compile(r"\b(pkill|killall)\b")

class _GuardedPopen(_subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        if _BLOCKED.search(args if isinstance(args, str) else " ".join(map(str, args))):
            raise PermissionError(f"the benchmark blocks {args!r}")
        super().__init__(args, *rest, **kwargs)

def _refuse(*args, **kwargs):
    raise PermissionError(f"the benchmark blocks this call {args!r}")

_subprocess.Popen, _os.killpg, _os.system = _GuardedPopen, _refuse, _refuse
try:
    _subprocess.run(["pkill", "--version"])
    raise RuntimeError("the pkill guard does not work")
except PermissionError:
    print("pkill/killall/killpg blocked in this kernel")
"""


@dataclass
class Output:
    wall: float  # time.time() when it arrived here: comparable with times taken on the ranks
    text: str
    display_id: str | None = None  # a display an update replaces
    update: bool = False
    late: bool = False  # arrived after its cell's reply
    error: bool = False  # an error report
    shown: str = ""  # an error report as the notebook shows it: its traceback (without the ename: evalue line)


@dataclass
class Cell:
    sent: float  # time.time()
    returned: float | None = None  # None: no reply within the time limit
    status: str = "timeout"  # ok | error | interrupted | timeout
    outputs: list[Output] = field(default_factory=list)

    @property
    def elapsed(self) -> float | None:
        return None if self.returned is None else self.returned - self.sent

    @property
    def text(self) -> str:
        """What the notebook shows under the cell: an update replaces its display."""
        shown: list[Output] = []
        for output in self.outputs:
            spot = [i for i, o in enumerate(shown) if output.update and o.display_id == output.display_id]
            if spot:
                shown[spot[0]] = output
            elif not output.update:
                shown.append(output)
        return "".join(output.text for output in shown)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def world(ranks: int, backend: str, **options: Any) -> Any:
    """A DDPCluster, with those `options` this version of ddp_notebook has (an older one lacks some)."""
    from ddp_notebook import DDPCluster

    known = inspect.signature(DDPCluster).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in known.values()):
        options = {k: v for k, v in options.items() if k in known}
    return DDPCluster(ranks, backend=backend, **options)


def tagged(per_rank: dict[int, str]) -> str:
    return "".join(f"[rank {r}] {line}\n" for r, text in sorted(per_rank.items()) for line in text.splitlines())


class Subject:
    """One way of running DDP code; `s` holds the run's settings (ranks, backend, threads, ...).

    `open()` starts ranks with a process group and torch and returns {"ready_s": seconds to
    that, ...}; `roots()` are the processes it launched (the harness adds all below them);
    `run(body, timeout, cell_timeout)` runs code on every rank, waiting up to `timeout` s,
    with the tool's own cell time limit where it has one; `interrupt()` is the stop button;
    `close()` stops it all; `restart()`, where the tool has one, starts a world again.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    script: ClassVar[bool] = False  # a script: every cell is a new job
    stateless: ClassVar[bool] = False  # nothing is kept from one cell to the next
    model_idiom: ClassVar[str] = "torch.nn.parallel.DistributedDataParallel({})"
    helpers: ClassVar[bool] = False  # ddp_notebook's own: run.py training --data helpers uses its helpers

    def __init__(self, s: Any) -> None:
        self.s = s
        self.threads = "?"  # torch threads per rank, at the tool's default
        self.code: list[str] = []  # where the ranks import ddp_notebook from
        self.pids: list[int] = []  # noted by the harness

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    def run(self, body: str, timeout: float, cell_timeout: float | None) -> Cell:
        raise NotImplementedError

    def after_interrupt(self) -> float | None:
        """Seconds until a cell that never returned is stopped and the tool takes cells again."""
        return None

    def wait_late(self) -> None:
        """Output can come after a cell's reply; a notebook shows it under the cell too."""

    def cell(self, body: str, timeout: float, expect: Any = None, cell_timeout: float | None = None) -> Cell:
        """`run`, then a short wait for late output where `expect(text)` finds the answer missing."""
        cell = self.run(body, timeout, cell_timeout)
        if cell.returned is not None and expect is not None and not expect(cell.text):
            self.wait_late()
        return cell

    def probe_ready(self, timeout: float) -> dict[int, tuple[bool, int, float, str]]:
        """rank -> (process group up, torch threads, time, ddp_notebook file) once every rank answers."""
        cell = self.cell(READY, timeout, expect=lambda text: len(READY_LINE.findall(text)) >= self.s.ranks)
        found = {int(r): (pg == "True", int(n), float(t), code) for r, pg, n, t, code in READY_LINE.findall(cell.text)}
        if sorted(found) != list(range(self.s.ranks)) or not all(up for up, *_ in found.values()):
            return {}
        self.threads = ",".join(sorted({str(n) for _, n, _, _ in found.values()}))
        self.code = sorted({code for *_, code in found.values()})
        return found

    def data(self) -> str:
        """How this subject's training reads its batches (harness.DATA_KINDS)."""
        asked = getattr(self.s, "data", "tensors")
        return "loader" if asked == "helpers" and not self.helpers else asked

    def train(self, steps: int, warmup: int, threads: int | None) -> dict[str, Any]:
        setting = "" if threads is None else f"torch.set_num_threads({threads})\n"
        body = TRAIN.format(threads=setting, bench=str(BENCH_DIR), steps=steps, warmup=warmup, data=self.data())
        cell = self.cell(body, TRAIN_TIMEOUT, expect=RESULT_LINE.search)
        found = RESULT_LINE.search(cell.text)
        if not found:
            raise RuntimeError(f"training gave no result ({cell.status}): {cell.text[-1500:]}")
        return json.loads(found.group(1))


# ---------------------------------------------------------------- in this process


class InProcess(Subject):
    """A subject driven from this process: the stop button is SIGINT to it, while a cell runs."""

    _running = _pressed = False

    def interrupt(self) -> None:
        if self._running:
            self._pressed = True
            os.kill(os.getpid(), signal.SIGINT)

    def run(self, body: str, timeout: float, cell_timeout: float | None) -> Cell:
        cell = Cell(sent=time.time())
        self._running, self._pressed = True, False
        try:
            cell.status, text = self.call(body, timeout, cell_timeout)
        except KeyboardInterrupt:
            if not self._pressed:  # the operator's, not the stop button's: it ends the run
                raise
            cell.status, text = "interrupted", "KeyboardInterrupt\n"
        finally:
            self._running = False
        if cell.status != "timeout":
            cell.returned = time.time()
            cell.outputs.append(Output(cell.returned, text))
        return cell

    def call(self, body: str, timeout: float, cell_timeout: float | None) -> tuple[str, str]:
        raise NotImplementedError


class DDPClusterSubject(InProcess):
    name = "ddp_notebook"
    label = "ddp_notebook `DDPCluster`"
    model_idiom = "ddp_notebook.prepare_model({})"
    helpers = True
    # read-only, per subject class; force: 8 ranks on 2 cores is more than a world is allowed by default
    world_options: dict[str, Any] = {"force": True}  # noqa: RUF012

    def open(self) -> dict[str, Any]:
        self.world = world(self.s.ranks, self.s.backend, **self.world_options)
        began = time.perf_counter()
        self.world.start()
        ready = time.perf_counter() - began
        self.probe_ready(SETUP_TIMEOUT)
        return {"ready_s": ready, "start_seconds": self.world.start_seconds}

    def close(self) -> None:
        bounded(self.world.stop, STOP_TIMEOUT, "DDPCluster.stop()")

    def roots(self) -> list[int]:
        return list(self.world.all_pids) if hasattr(self, "world") else []

    def call(self, body: str, timeout: float, cell_timeout: float | None) -> tuple[str, str]:
        from ddp_notebook import CellInterruptedError, CellTimeoutError, RankDiedError, RankError

        try:
            result = self.world.execute(body, timeout=cell_timeout or timeout, stream=False)
            return "ok", tagged(result.stdout) + tagged(result.stderr)
        except (RankError, CellTimeoutError, CellInterruptedError, RankDiedError) as error:
            # what a notebook shows: IPython renders the error through _render_traceback_ where there is one
            shown = getattr(error, "_render_traceback_", list)()
            return "error", "\n".join([f"{type(error).__name__}: {error}", *shown, ""])

    def restart(self) -> float:
        began = time.perf_counter()
        self.world.restart()
        return time.perf_counter() - began


class DDPClusterColdSubject(DDPClusterSubject):
    """ddp_notebook with every rank started as a fresh interpreter (no warm template)."""

    name = "ddp_notebook_cold"
    label = "ddp_notebook `DDPCluster`, ranks as fresh interpreters (--no-warm-start)"
    world_options = {"force": True, "warm_start": False}  # noqa: RUF012

    @classmethod
    def unavailable(cls) -> str | None:
        from ddp_notebook import DDPCluster

        try:
            DDPCluster(1, backend="gloo", warm_start=False)  # checks its options, starts nothing
        except TypeError:
            return "this ddp_notebook has no warm start to turn off"
        return None


class DDPClusterPrewarmedSubject(DDPClusterSubject):
    """ddp_notebook after `warm_up()` (what `%load_ext` starts) had time to import torch: a notebook's
    usual case, where `%ddp_start` runs a cell or more after `%load_ext`."""

    name = "ddp_notebook_prewarmed"
    label = "ddp_notebook `DDPCluster` after `warm_up()` (as after `%load_ext`)"

    @classmethod
    def unavailable(cls) -> str | None:
        import ddp_notebook

        return None if hasattr(ddp_notebook, "warm_up") else "this ddp_notebook has no warm_up()"

    def open(self) -> dict[str, Any]:
        import ddp_notebook

        began = time.perf_counter()
        if not ddp_notebook.warm_up(wait=SETUP_TIMEOUT):
            raise RuntimeError("warm_up() found no template ready")
        return {"warm_up_s": time.perf_counter() - began, **super().open()}


class DirectViewSubject(InProcess):
    name = "ipyparallel"
    label = "ipyparallel `DirectView` by hand"

    def open(self) -> dict[str, Any]:
        import ipyparallel as ipp

        self.client: Any = None
        self.cluster = ipp.Cluster(n=self.s.ranks)  # what a user gets by default
        began = time.perf_counter()
        self.client = self.cluster.start_and_connect_sync()
        started = time.perf_counter() - began
        self.view = self.client[:]
        port = free_port()
        self.rank_of = {engine: rank for rank, engine in enumerate(self.client.ids)}
        for rank, engine in enumerate(self.client.ids):
            self.client[engine].push({"rank": rank, "world_size": self.s.ranks, "MASTER_PORT": port}, block=True)
        cell = self.cell(PROCESS_GROUP.format(backend=self.s.backend), SETUP_TIMEOUT)
        if cell.status != "ok":
            raise RuntimeError(f"no process group: {cell.text[-1500:]}")
        ready = time.perf_counter() - began
        self.probe_ready(SETUP_TIMEOUT)
        return {"ready_s": ready, "start_s": started}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        bounded(self.cluster.stop_cluster_sync, STOP_TIMEOUT, "ipyparallel stop_cluster_sync()")
        try:
            self.cluster.remove_cluster_file()
        except OSError:
            pass

    def roots(self) -> list[int]:
        cluster = getattr(self, "cluster", None)
        if cluster is None:
            return []
        launchers = [cluster.controller] if cluster.controller is not None else []
        for engines in cluster.engines.values():
            launchers += list(getattr(engines, "launchers", {}).values())
        return [launcher.pid for launcher in launchers if (getattr(launcher, "pid", None) or -1) > 0]

    def call(self, body: str, timeout: float, cell_timeout: float | None) -> tuple[str, str]:
        import ipyparallel as ipp

        try:
            # what execute(block=True) does (get, then wait for the output), with time limits
            result = self.view.execute(body, block=False)
            result.get(timeout=timeout)
            result.wait_for_output(timeout=timeout)
            return "ok", tagged(dict(enumerate(result.stdout)))
        except ipp.error.TimeoutError:
            return "timeout", ""
        except ipp.error.CompositeError as error:
            ranks = [self.rank_of.get(e[3].get("engine_id")) for e in error.elist]
            return "error", "".join(f"[rank {r}] {e[0]}: {e[1]}\n" for r, e in zip(ranks, error.elist))
        except Exception as error:  # noqa: BLE001  (a lost engine, say: what the user sees)
            return "error", f"{type(error).__name__}: {error}\n"


# ---------------------------------------------------------------- in a Jupyter kernel


class Kernel:
    """An IPython kernel of the given interpreter, driven as a notebook front end drives it."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        self.spec_dir = tempfile.mkdtemp(prefix="bench-kernelspec-")
        os.makedirs(os.path.join(self.spec_dir, "bench"))
        spec = {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "bench"}
        spec |= {"language": "python", "interrupt_mode": "signal"}
        Path(self.spec_dir, "bench", "kernel.json").write_text(json.dumps(spec))
        specs = KernelSpecManager(kernel_dirs=[self.spec_dir])
        self.manager = KernelManager(kernel_spec_manager=specs, kernel_name="bench")
        self.manager.start_kernel(env=env, cwd=str(BENCH_DIR))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=SETUP_TIMEOUT)
        self.cells: dict[str, Cell] = {}  # by the msg_id of its execute request
        self.idle: set[str] = set()
        self.displays: dict[str, Cell] = {}  # display_id -> the cell showing it

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def run(self, code: str, timeout: float) -> Cell:
        cell = Cell(sent=time.time())
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        self.cells[msg_id] = cell
        if self.drain(timeout, until=msg_id):
            cell.returned = time.time()
            cell.status = "error" if any(o.error for o in cell.outputs) else "ok"
        return cell

    def drain(self, seconds: float, until: str = "") -> bool:
        """File what arrives in `seconds` s under its cell (late output too); True once `until` is idle."""
        deadline = time.monotonic() + seconds
        while until not in self.idle and (left := deadline - time.monotonic()) > 0:
            try:
                self._route(self.client.get_iopub_msg(timeout=left))
            except queue.Empty:
                break
        return until in self.idle

    def _route(self, message: dict[str, Any]) -> None:
        msg_id = message["parent_header"].get("msg_id", "")
        cell, kind, content = self.cells.get(msg_id), message["msg_type"], message["content"]
        if cell is None:
            return
        late = msg_id in self.idle
        if kind == "stream":
            cell.outputs.append(Output(time.time(), ANSI.sub("", content["text"]), late=late))
        elif kind in ("display_data", "update_display_data", "execute_result"):
            text = ANSI.sub("", content["data"].get("text/plain", "")) + "\n"
            display_id = content.get("transient", {}).get("display_id")
            update = kind == "update_display_data"
            if update:  # an update changes its display wherever that is
                cell = self.displays.get(display_id, cell)
            elif display_id:
                self.displays[display_id] = cell
            cell.outputs.append(Output(time.time(), text, display_id, update, late))
        elif kind == "error":
            shown = ANSI.sub("", "\n".join(content["traceback"])) + "\n"
            text = f"{content['ename']}: {content['evalue']}\n" + shown
            cell.outputs.append(Output(time.time(), text, late=late, error=True, shown=shown))
        elif kind == "status" and content["execution_state"] == "idle":
            self.idle.add(msg_id)

    def shutdown(self) -> None:
        try:
            self.client.stop_channels()
            if self.manager.is_alive():
                self.manager.shutdown_kernel(now=False)
        finally:
            shutil.rmtree(self.spec_dir, ignore_errors=True)


class KernelSubject(Subject):
    python: ClassVar[str] = sys.executable
    untimed: ClassVar[tuple[str, ...]] = ()  # cells run before the clock starts
    setup: ClassVar[tuple[str, ...]] = ()
    stop: ClassVar[tuple[str, ...]] = ()
    guard: ClassVar[bool] = False

    def wrap(self, body: str, cell_timeout: float | None) -> str:
        return body

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if Path(self.python).parent == VENV / "bin":
            # the kernel's `python` is the venv's: nbdistributed starts its workers as plain `python`
            env |= {"PATH": f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(VENV)}
        return env

    def open(self) -> dict[str, Any]:
        self.kernel = Kernel(self.python, self.environment())  # the kernel's own start is not timed
        if self.guard and self.kernel.run(PKILL_GUARD, SETUP_TIMEOUT).status != "ok":
            raise RuntimeError("could not install the pkill guard")
        for code in self.untimed:
            if self.kernel.run(code, SETUP_TIMEOUT).status != "ok":
                raise RuntimeError(f"untimed setup cell {code.splitlines()[0]!r} failed")
        began = time.time()
        for code in self.setup:
            cell = self.kernel.run(code.format(ranks=self.s.ranks, backend=self.s.backend), SETUP_TIMEOUT)
            if cell.status != "ok":
                raise RuntimeError(f"setup cell {code.splitlines()[0]!r} failed: {cell.text[-1500:]}")
        setup_s, lost = time.time() - began, 0
        # the first cell that finds every rank ready; a cell that gets no answer is sent again
        while not (found := self.probe_ready(self.s.hang_cap)):
            lost += 1
            if time.time() - began > setup_s + 2 * self.s.hang_cap:
                raise RuntimeError("the ranks never answered")
        return {"ready_s": max(t for _, _, t, _ in found.values()) - began, "setup_s": setup_s, "lost_cells": lost}

    def run(self, body: str, timeout: float, cell_timeout: float | None) -> Cell:
        return self.kernel.run(self.wrap(body, cell_timeout), timeout)

    def wait_late(self) -> None:
        self.kernel.drain(LATE_GRACE)

    def interrupt(self) -> None:
        self.kernel.manager.interrupt_kernel()

    def after_interrupt(self) -> float | None:
        began = time.monotonic()
        self.interrupt()
        # a line magic runs in the kernel itself under every tool (nbdistributed sends plain cells to the ranks)
        return time.monotonic() - began if self.kernel.run("%pwd", 10.0).returned else None

    def close(self) -> None:
        if not hasattr(self, "kernel"):
            return
        for code in self.stop:
            if self.kernel.run(code, STOP_TIMEOUT).returned is None:
                print(f"warning: {code!r} did not finish in {STOP_TIMEOUT:g} s", file=sys.stderr)
        self.kernel.shutdown()

    def roots(self) -> list[int]:
        return [self.kernel.pid] if hasattr(self, "kernel") else []


class DDPKernelSubject(KernelSubject):
    name = "ddp_kernel"
    label = "ddp_notebook `%%ddp`"
    model_idiom = "ddp_notebook.prepare_model({})"
    helpers = True
    # --force: as DDPClusterSubject, so 8 ranks on 2 cores are measured instead of refused
    setup = ("%load_ext ddp_notebook", "%ddp_start {ranks} --backend {backend} --force")
    stop = ("%ddp_stop",)

    def wrap(self, body: str, cell_timeout: float | None) -> str:
        return f"%%ddp --timeout {cell_timeout:g}\n{body}" if cell_timeout else f"%%ddp\n{body}"

    def restart(self) -> float:
        cell = self.kernel.run("%ddp_restart", SETUP_TIMEOUT)
        if cell.status != "ok" or cell.elapsed is None:
            raise RuntimeError(f"%ddp_restart failed: {cell.text[-1000:]}")
        return cell.elapsed


class DDPKernelPrewarmedSubject(DDPKernelSubject):
    """`%ddp_start` a moment after `%load_ext` (untimed, as the kernel's own start), as a notebook runs them.

    `%load_ext` warms up twice: the template (torch imported in a process of its own) and, once
    its cell is over, the live view's imports on the kernel's thread (about a second); the
    second untimed cell waits for the template, and runs after those imports."""

    name = "ddp_kernel_prewarmed"
    label = "ddp_notebook `%%ddp`, `%ddp_start` after `%load_ext` had time to warm up"
    untimed = ("%load_ext ddp_notebook", "import ddp_notebook\nassert ddp_notebook.warm_up(wait=60)")
    setup = ("%ddp_start {ranks} --backend {backend} --force",)

    @classmethod
    def unavailable(cls) -> str | None:
        return DDPClusterPrewarmedSubject.unavailable()


class PxKernelSubject(KernelSubject):
    name = "px_kernel"
    label = "ipyparallel `%%px` by hand"
    setup = (
        "import ipyparallel as ipp\ncluster = ipp.Cluster(n={ranks})\nrc = cluster.start_and_connect_sync()\n"
        "rc.activate()  # the %px magics",
        "# a process group by hand: ranks in engine order, a free port for the rendezvous\nimport socket\n"
        'with socket.socket() as probe:\n    probe.bind(("127.0.0.1", 0))\n    port = probe.getsockname()[1]\n'
        "for rank, engine in enumerate(rc.ids):\n"
        '    rc[engine].push({{"rank": rank, "world_size": len(rc.ids), "MASTER_PORT": port}}, block=True)',
        "%%px\n" + PROCESS_GROUP.replace("{backend!r}", "'{backend}'"),
    )
    stop = ("rc.close()\ncluster.stop_cluster_sync()",)

    def wrap(self, body: str, cell_timeout: float | None) -> str:
        return "%%px\n" + body


class PeerSubject(KernelSubject):
    python = str(VENV / "bin" / "python")

    @classmethod
    def unavailable(cls) -> str | None:
        if not (VENV / "bin" / "python").exists():
            return "not installed: bash benchmarks/peers_env.sh makes benchmarks/.peers-venv"
        return None


class NbdistributedSubject(PeerSubject):
    name = "nbdistributed"
    label = "nbdistributed 0.1.0"
    setup = ("%load_ext nbdistributed", "%dist_init -n {ranks}")
    stop = ("%unload_ext nbdistributed",)  # its graceful path; %dist_shutdown would pkill
    guard = True  # after %dist_init every plain cell runs on the ranks


class AccelerateSubject(PeerSubject):
    name = "accelerate"
    label = "Accelerate `notebook_launcher`"
    stateless = True  # a fork per call
    setup = ("from accelerate import notebook_launcher",)

    def wrap(self, body: str, cell_timeout: float | None) -> str:
        # a fresh port per launch: the ranks of a launch that failed may still hold the last one
        return (
            "def on_every_rank():\n    from accelerate import Accelerator\n"
            "    # on a CPU-only machine a plain Accelerator() sets up no DDP world (1 process, index 0)\n"
            "    accelerator = Accelerator(cpu=True)\n    rank = accelerator.process_index\n"
            f"{textwrap.indent(body, '    ')}\n"
            f'notebook_launcher(on_every_rank, num_processes={self.s.ranks}, use_port="{free_port()}")'
        )


# ---------------------------------------------------------------- torchrun, a script


class Job:
    """One torchrun job of train_workload.py; its output lines with their arrival times."""

    def __init__(self, s: Any, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("OMP_NUM_THREADS", None)
        if s.threads is not None:  # set explicitly: torchrun picks 1 itself only when it is unset
            env["OMP_NUM_THREADS"] = str(s.threads)
        if s.interface:  # what ddp_notebook gives its ranks on one machine
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = s.interface
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={s.ranks}"]
        command += [str(BENCH_DIR / "train_workload.py"), f"--backend={s.backend}", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[Output] = []
        self.results: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(Output(time.time(), line))
            if line.startswith("{"):
                self.results.put(json.loads(line))
        self.results.put(None)  # the end

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            found = self.results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"torchrun gave no result within {timeout:g} s") from None
        if found is None:
            tail = "".join(o.text for o in self.lines[-20:])
            raise RuntimeError(f"torchrun exited with code {self.process.wait(timeout=10)}: {tail}")
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # torchrun ends its workers itself
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()  # the harness kills what is left below it, by PID
            self.process.wait(timeout=10)
        self.pump.join(timeout=10)


class TorchrunSubject(Subject):
    name = "torchrun"
    label = "torchrun (a script)"
    script = stateless = True

    def open(self) -> dict[str, Any]:
        self.scratch = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))
        self.requests, self.once = 0, None
        began = time.time()
        self.job = Job(self.s, f"--serve={self.scratch}")
        ready = self.job.result(SETUP_TIMEOUT)
        self.threads = str(ready["torch_threads"])
        return {"ready_s": ready["t"] - began}

    def train(self, steps: int, warmup: int, threads: int | None) -> dict[str, Any]:
        self._request({"steps": steps, "warmup": warmup, "data": self.data()})
        return self.job.result(TRAIN_TIMEOUT)

    def _request(self, payload: dict[str, Any]) -> None:
        """Hand the served job its next request."""
        request = self.scratch / f"go-{self.requests}.json"
        request.with_suffix(".tmp").write_text(json.dumps(payload))
        request.with_suffix(".tmp").rename(request)  # whole, or not there
        self.requests += 1

    def run(self, body: str, timeout: float, cell_timeout: float | None) -> Cell:
        code = self.scratch / f"cell-{time.monotonic_ns()}.py"
        code.write_text(body)
        cell = Cell(sent=time.time())
        self.once = Job(self.s, f"--exec={code}")
        try:
            self.once.process.wait(timeout=timeout)
            cell.returned, cell.status = time.time(), "ok" if self.once.process.returncode == 0 else "error"
        except subprocess.TimeoutExpired:
            pass
        finally:
            limit = time.time()
            self.once.stop()
        # not what it printed because it was stopped
        cell.outputs = [line for line in self.once.lines if cell.returned or line.wall < limit]
        return cell

    def interrupt(self) -> None:
        if self.once is not None and self.once.process.poll() is None:
            self.once.process.send_signal(signal.SIGINT)  # Ctrl-C in the terminal

    def close(self) -> None:
        if hasattr(self, "job"):
            (self.scratch / "stop").touch()
            try:
                self.job.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.job.stop()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def roots(self) -> list[int]:
        jobs = [getattr(self, "job", None), getattr(self, "once", None)]
        return [job.process.pid for job in jobs if job is not None and job.process.poll() is None]


class TorchrunServedSubject(TorchrunSubject):
    """torchrun running one long-lived script: each cell is the next block of code of the same
    processes (`train_workload.py --serve`), so, like a rank, they keep everything the cells before
    imported and made; the plain TorchrunSubject starts a fresh job per cell."""

    name = "torchrun_served"
    label = "torchrun (one long-lived script)"
    stateless = False

    def run(self, body: str, timeout: float, cell_timeout: float | None) -> Cell:
        code = self.scratch / f"cell-{time.monotonic_ns()}.py"
        code.write_text(body)
        cell, seen = Cell(sent=time.time()), len(self.job.lines)
        self._request({"exec": str(code)})
        deadline = time.monotonic() + timeout
        try:
            # the cell's own output may hold lines that look like results: wait for the job's own
            while not self.job.result(max(0.0, deadline - time.monotonic())).get("done"):
                pass
            cell.returned, cell.status = time.time(), "ok"
        except (TimeoutError, RuntimeError):
            cell.status = "error" if self.job.process.poll() is not None else "timeout"
        cell.outputs = self.job.lines[seen:]
        return cell


SUBJECTS: dict[str, type[Subject]] = {
    kind.name: kind
    for kind in (
        DDPClusterSubject,
        DDPClusterColdSubject,
        DDPClusterPrewarmedSubject,
        DDPKernelSubject,
        DDPKernelPrewarmedSubject,
        DirectViewSubject,
        PxKernelSubject,
        TorchrunSubject,
        TorchrunServedSubject,
        NbdistributedSubject,
        AccelerateSubject,
    )
}
