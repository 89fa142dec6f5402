"""A rank's pdb session, driven from the notebook kernel: each line asked with `input()`.

The rank's pdb (`debugger`) reads lines from the rank's X-ray socket; here its output is
printed tagged with the rank, and the user's next line is read the way any Jupyter prompt
is (the kernel's stdin), so the notebook shows a pdb prompt. Interrupting the kernel at the
prompt ends the session: the rank quits pdb and the cell ends. Imports nothing of torch.
"""

from __future__ import annotations

import builtins
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..errors import DDPError, one_line
from ..rank import calls as rank_calls
from ..wire.xray_messages import DebugAnswer, debug_request, report_request
from . import xray
from .output import rank_prefix, tag_lines

# how long the rank gets to answer one line (pdb may run user code for it, e.g. `n` over a step)
LINE_SECONDS = 35.0
PROMPT = "(Pdb) "
# how long a rank gets to open its post-mortem session
OPEN_SECONDS = 10.0


def drive(
    reach: xray.Reach,
    rank: int,
    read_line: Callable[[str], str] | None = None,
    out: TextIO | None = None,
) -> None:
    """Run rank `rank`'s waiting pdb session until the user continues or quits."""
    # looked up now: ipykernel installs its own input() for each cell it runs
    read_line = read_line or builtins.input
    answer = xray.ask(reach, rank, debug_request(None), timeout=LINE_SECONDS)
    while answer is not None:
        _show(rank, answer, out or sys.stdout)
        if not answer.get("active"):
            return
        if not answer.get("waiting"):
            time.sleep(0.05)  # pdb is still running the last line
            answer = xray.ask(reach, rank, debug_request(None), timeout=LINE_SECONDS)
            continue
        try:
            line = read_line(f"{rank_prefix(rank)}{PROMPT}")
        except (KeyboardInterrupt, EOFError):
            xray.ask(reach, rank, debug_request("q"), timeout=LINE_SECONDS)
            raise KeyboardInterrupt from None
        except Exception as failure:  # noqa: BLE001  (no stdin here: nbclient, a script, ...)
            (out or sys.stderr).write(
                f"{rank_prefix(rank)}pdb cannot ask here ({one_line(failure)}): continuing; "
                "give the lines up front with ddp_notebook.breakpoint(rank, commands=[...])\n"
            )
            line = "c"
        answer = xray.ask(reach, rank, debug_request(line), timeout=LINE_SECONDS)


def _show(rank: int, answer: DebugAnswer, out: TextIO) -> None:
    text = str(answer.get("output", ""))
    if text.endswith(PROMPT):
        text = text[: -len(PROMPT)]  # the notebook asks with its own prompt
    lines = text.splitlines()
    if lines:
        out.write(tag_lines(rank, lines))
        out.flush()


def post_mortem(engine: Any, reach: xray.Reach | None, rank: int) -> None:
    """pdb on rank `rank`'s last failed cell (its engine: an ipyparallel view of that one rank)."""
    assert reach is not None  # a running world's supervisor reaches its ranks
    pending = engine.apply_async(rank_calls.post_mortem)
    deadline = time.monotonic() + OPEN_SECONDS
    while not pending.ready():
        answer = xray.ask(reach, rank, report_request())
        if answer is not None and answer.get("debugger"):
            drive(reach, rank)
            break
        if time.monotonic() > deadline:
            raise DDPError(f"rank {rank} did not open pdb within {OPEN_SECONDS:g} s: is it busy running a cell?")
        time.sleep(0.05)
    try:
        said = pending.get(timeout=LINE_SECONDS)
    except Exception as failure:  # noqa: BLE001  (any remote failure: one line)
        raise DDPError(f"pdb on rank {rank} failed: {one_line(failure)}") from None
    if said:
        raise DDPError(f"rank {rank}: {said}")
