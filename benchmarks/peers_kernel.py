"""A real Jupyter kernel driven cell by cell, the way a notebook front end drives it.

compare_peers.py runs every notebook tool in one of these, so each is timed as its users
see it: from the execute request to the reply, with every output the notebook would show.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
KERNEL_START_TIMEOUT = 120.0
DISPLAY_KINDS = {"display_data": "display", "update_display_data": "update", "execute_result": "result"}


@dataclass
class Output:
    wall: float  # time.time() when it arrived here: comparable with times taken on the ranks
    kind: str  # stream, display, update, result, error
    text: str
    display_id: str | None = None  # display and update outputs: the display an update replaces
    late: bool = False  # arrived after its cell had ended


@dataclass
class Cell:
    code: str
    sent: float  # time.time()
    elapsed: float | None = None  # seconds to the reply; None: no reply within the timeout
    status: str = "timeout"  # ok, error, timeout
    idle: bool = False  # the kernel said it is done with the cell
    outputs: list[Output] = field(default_factory=list)

    @property
    def text(self) -> str:
        """What the notebook shows under the cell once it ends: updates replace their display."""
        shown: list[Output] = []
        for output in self.outputs:
            if output.kind != "update":
                shown.append(output)
                continue
            for index, earlier in enumerate(shown):
                if earlier.display_id == output.display_id:
                    shown[index] = Output(earlier.wall, earlier.kind, output.text, earlier.display_id)
        return "".join(output.text for output in shown)

    @property
    def finished(self) -> bool:
        return self.elapsed is not None


class Kernel:
    """An IPython kernel (`python -m ipykernel_launcher`) of the given interpreter."""

    def __init__(self, python: str, env: dict[str, str], cwd: str) -> None:
        self._spec_dir = tempfile.mkdtemp(prefix="peers-kernelspec-")
        kernel_dir = os.path.join(self._spec_dir, "peers")
        os.makedirs(kernel_dir)
        spec = {
            "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "peers",
            "language": "python",
            "interrupt_mode": "signal",
        }
        with open(os.path.join(kernel_dir, "kernel.json"), "w", encoding="utf8") as handle:
            json.dump(spec, handle)
        self.manager = KernelManager(
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[self._spec_dir]), kernel_name="peers"
        )
        self.manager.start_kernel(env=env, cwd=cwd)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT)
        self._cells: dict[str, Cell] = {}  # by the msg_id of its execute request
        self._displays: dict[str, Cell] = {}  # by display_id: where an update lands

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def run(self, code: str, timeout: float) -> Cell:
        """Execute one cell; wait up to `timeout` s for its reply, collecting its outputs."""
        cell = Cell(code=code, sent=time.time())
        began = time.monotonic()
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        self._cells[msg_id] = cell
        while not cell.idle:
            left = timeout - (time.monotonic() - began)
            if left <= 0:
                return cell
            try:
                self._route(self.client.get_iopub_msg(timeout=left))
            except queue.Empty:
                return cell
        cell.elapsed = time.monotonic() - began
        reply = self._reply(msg_id, max(1.0, timeout - cell.elapsed))
        cell.status = reply["content"]["status"] if reply else "error"
        return cell

    def drain(self, seconds: float) -> None:
        """Collect output that arrives in the next `seconds` s, for whichever cell it belongs to."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._route(self.client.get_iopub_msg(timeout=left))
            except queue.Empty:
                return

    def _route(self, message: dict[str, Any]) -> None:
        """File one IOPub message under its cell, as a notebook does (late output included)."""
        cell = self._cells.get(message["parent_header"].get("msg_id", ""))
        if cell is None:
            return
        kind, content, now = message["msg_type"], message["content"], time.time()
        late = cell.idle
        if kind == "stream":
            cell.outputs.append(Output(now, "stream", ANSI.sub("", content["text"]), late=late))
        elif kind in DISPLAY_KINDS:
            text = ANSI.sub("", content["data"].get("text/plain", "")) + "\n"
            display_id = content.get("transient", {}).get("display_id")
            if kind == "update_display_data":
                # an update changes its display wherever that is, whichever cell sent it
                cell = self._displays.get(display_id, cell)
            elif display_id:
                self._displays[display_id] = cell
            cell.outputs.append(Output(now, DISPLAY_KINDS[kind], text, display_id, late=late))
        elif kind == "error":
            traceback = ANSI.sub("", "\n".join(content["traceback"]))
            text = f"{content['ename']}: {content['evalue']}\n{traceback}\n"
            cell.outputs.append(Output(now, "error", text, late=late))
        elif kind == "status" and content["execution_state"] == "idle":
            cell.idle = True

    def _reply(self, msg_id: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply = self.client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        return None

    def interrupt(self) -> None:
        """What the notebook's stop button does (SIGINT to the kernel)."""
        self.manager.interrupt_kernel()

    def shutdown(self) -> None:
        try:
            self.client.stop_channels()
            if self.manager.is_alive():
                self.manager.shutdown_kernel(now=False)
        except Exception as failure:  # noqa: BLE001  (clean-up must go on; leftovers are killed by PID)
            print(f"warning: kernel shutdown failed: {failure}", file=sys.stderr)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError):
                pass
        shutil.rmtree(self._spec_dir, ignore_errors=True)
