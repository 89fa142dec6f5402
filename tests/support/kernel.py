"""Driving a real Jupyter kernel (jupyter_client) as a notebook does: `Kernel` runs a cell and collects
what it printed (`CellOutput` folds a cell's iopub messages as a notebook shows them, for tests/support/hub.py's
kernels too), `running_kernel` is the body of a fixture yielding one, `kernel_world_pids` reads the pids of the
world its magics hold, and `outs` checks the ranks' `Out:` lines of a %%ddp cell."""

from __future__ import annotations

import json
import os
import queue
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager


@dataclass
class CellOutput:
    """What a cell's iopub messages said, as a notebook shows it: its text (stream, results and
    displays as text/plain, tracebacks) and its error's name; `take` says when the cell is done."""

    text: list[str] = field(default_factory=list)
    error: str | None = None

    def take(self, kind: str, content: dict[str, Any]) -> bool:
        """Fold in one iopub message of the cell; True once the kernel went idle after it."""
        if kind == "stream":
            self.text.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            self.text.append(content["data"].get("text/plain", "") + "\n")
        elif kind == "error":
            self.error = content["ename"]
            self.text.append("\n".join(content["traceback"]) + "\n")
        return kind == "status" and content["execution_state"] == "idle"


# where the session's template source listens while the running test wants a spare (set by
# tests/support/spare_keeper.py; None: each kernel starts its own spare, as a user's does)
spare_source: Callable[[], tuple[str, tuple[tuple[str, str], ...]] | None] = lambda: None  # noqa: E731
REPOSITORY = str(Path(__file__).resolve().parents[2])
# run in a new kernel before its first cell: its spare template is forked from the session's source
# (torch imported once for the session) where a kernel's `%load_ext` would start one that imports it
ADOPT_SPARE = """
def _adopt_spare(socket_path, signature):
    import sys
    added = {repository!r} not in sys.path
    if added:
        sys.path.append({repository!r})
    try:
        from ddp_notebook.world import spare, template
        from tests.support.template_source import fork_template

        python, startup = template.start_signature()
        if [python, [list(pair) for pair in startup]] != signature:
            return  # the kernel would start another kind of template: it starts its own
        forked = fork_template(socket_path, environ_shown=True)
        if forked is not None:
            spare.hand_over(forked)
    finally:
        if added:
            sys.path.remove({repository!r})
_adopt_spare({socket_path!r}, {signature!r})
del _adopt_spare
"""


def adopt_spare_code(socket_path: str, signature: tuple[str, tuple[tuple[str, str], ...]]) -> str:
    """ADOPT_SPARE for the source at `socket_path` whose start-up signature is `signature`
    (`ddp_notebook.world.template.start_signature()`, as lists: the kernel compares its own)."""
    python, startup = signature
    as_lists = [python, [list(pair) for pair in startup]]
    return ADOPT_SPARE.format(repository=REPOSITORY, socket_path=socket_path, signature=as_lists)


class Kernel:
    """A real ipykernel with helpers to run a cell and collect what it printed."""

    def __init__(self, cwd: str | None = None, spare_from_source: bool = True, argv: list[str] | None = None) -> None:
        """`argv`: the kernelspec's command (with `{connection_file}`), where it is not this Python's
        ipykernel (a wrapper script, as a hub's kernelspec may be)."""
        # the kernel listens on unix sockets in a private folder of its own: jupyter_client picks
        # free TCP ports and lets go of them before the kernel binds them, and under a parallel run
        # another process (a world, another worker's kernel) may take one first; the kernel then
        # hangs in its start instead of dying, and the test waits out wait_for_ready's 60 s
        sockets = tempfile.mkdtemp(prefix="ddp-kernel-")
        weakref.finalize(self, shutil.rmtree, sockets, True)
        specs = {}
        if argv is not None:
            os.makedirs(os.path.join(sockets, "specs", "wrapped"))
            spec = {"argv": argv, "display_name": "wrapped", "language": "python", "interrupt_mode": "signal"}
            Path(sockets, "specs", "wrapped", "kernel.json").write_text(json.dumps(spec))
            specs = {"kernel_spec_manager": KernelSpecManager(kernel_dirs=[os.path.join(sockets, "specs")])}
        self.manager = KernelManager(
            kernel_name="wrapped" if argv else "python3", transport="ipc", ip=os.path.join(sockets, "kernel"), **specs
        )
        self.manager.start_kernel(**({"cwd": cwd} if cwd else {}))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.iopub_bytes = 0  # what the cells run so far sent a frontend: content JSON and binary buffers
        source = spare_source() if spare_from_source else None
        if source is not None:
            self._run_quietly(adopt_spare_code(*source))

    def _run_quietly(self, code: str, timeout: float = 30) -> None:
        """Run `code` as a frontend's silent request: no output, no history, no execution count."""
        msg_id = self.client.execute(code, silent=True, store_history=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply = self.client.get_shell_msg(timeout=0.5)
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                assert reply["content"]["status"] == "ok", reply["content"]
                return
        raise TimeoutError(f"no reply to a silent request within {timeout} s")

    def run(
        self,
        code: str,
        timeout: float = 120,
        interrupt_after: float | None = None,
        on_prompt: Callable[[str], str | None] | None = None,
    ) -> tuple[str, str | None]:
        """Run `code`; return (printed text, error name or None).

        `on_prompt`: stdin is allowed, and each prompt (input(), pdb) is answered with what it
        returns for the prompt's text; None interrupts the kernel instead.
        """
        msg_id = self.client.execute(code, allow_stdin=on_prompt is not None)
        began = time.monotonic()
        interrupted = False
        output = CellOutput()
        while True:
            if interrupt_after is not None and not interrupted and time.monotonic() - began > interrupt_after:
                self.manager.interrupt_kernel()
                interrupted = True
            if on_prompt is not None:
                self._answer_prompt(on_prompt)
            try:
                msg = self.client.get_iopub_msg(timeout=0.2 if on_prompt is None else 0.05)
            except Exception:  # noqa: BLE001  (queue.Empty: nothing yet)
                if time.monotonic() - began > timeout:
                    raise TimeoutError(self._interrupt_late_cell(msg_id, output, timeout)) from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            self.iopub_bytes += len(json.dumps(msg["content"], default=str))
            self.iopub_bytes += sum(len(memoryview(buffer).cast("B")) for buffer in msg.get("buffers") or ())
            if output.take(msg["msg_type"], msg["content"]):
                return "".join(output.text), output.error

    def wait_for_output(self, text: str, seconds: float) -> str:
        """What the cells sent without waiting (`client.execute`) printed, once it holds `text`."""
        printed = ""
        deadline = time.monotonic() + seconds
        while text not in printed:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} within {seconds} s; printed:\n{printed[-3000:]}")
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except Exception:  # noqa: BLE001  (queue.Empty: nothing yet)
                continue
            if msg["msg_type"] == "stream":
                printed += msg["content"]["text"]
        return printed

    def _interrupt_late_cell(self, msg_id: str, output: CellOutput, timeout: float) -> str:
        """A cell past its limit is interrupted (a %%ddp cell then reports where each rank is), so the
        next cells of a shared kernel do not queue behind it; the message holds what it printed."""
        self.manager.interrupt_kernel()
        settle_by = time.monotonic() + 30
        while time.monotonic() < settle_by:
            try:
                msg = self.client.get_iopub_msg(timeout=0.5)
            except Exception:  # noqa: BLE001  (queue.Empty: nothing yet)
                continue
            if msg["parent_header"].get("msg_id") == msg_id and output.take(msg["msg_type"], msg["content"]):
                break
        printed = "".join(output.text)[-6000:]
        return f"cell did not finish within {timeout} s; interrupted, it had printed:\n{printed}"

    def _answer_prompt(self, on_prompt: Callable[[str], str | None]) -> None:
        try:
            request = self.client.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            return
        if request["msg_type"] == "input_request":
            answer = on_prompt(request["content"]["prompt"])
            if answer is None:
                self.manager.interrupt_kernel()
            else:
                self.client.input(answer)

    def close(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        else:  # killed or shut down by the test: its connection file and sockets go here
            self.manager.cleanup_resources()


def running_kernel(cwd: str | None = None) -> Iterator[Kernel]:
    """Body of a fixture yielding a started kernel (in `cwd`), closed after the test."""
    started = Kernel(cwd)
    try:
        yield started
    finally:
        started.close()


def kernel_world_pids(kernel: Kernel) -> list[int]:
    out, error = kernel.run(
        "import json\n"
        "world = get_ipython().magics_manager.registry['DDPMagics'].world\n"
        "print(json.dumps(world.all_pids))"
    )
    assert error is None, out
    return json.loads(out.strip().splitlines()[-1])


def outs(out: str, values: dict[int, object]) -> bool:
    return all(f"[rank {rank}] Out: {value}" in out for rank, value in values.items())
