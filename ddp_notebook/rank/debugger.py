"""Runs on ranks: a pdb session on one rank, driven from the notebook.

A rank's kernel has no stdin of its own, so its pdb reads commands from a queue and writes into
a buffer; the rank's X-ray thread (`rank/xray.py`) passes lines in and output out, and the
notebook kernel asks the user for each line with `input()`, as a Jupyter kernel does for any
prompt. The rank's main thread waits on the queue with the GIL released, so the X-ray keeps
answering.

`breakpoint(rank=1)` is called by every rank: the chosen rank stops, the others wait on a key
of the world's store (a polling wait, not a collective, so no collective timeout runs out while
the user looks around); `c` lets everyone go on, `q` ends the cell on every rank. The builtin
`breakpoint()` stops only the rank that calls it (peers blocked in a collective with it keep
their collective timeout).
"""

from __future__ import annotations

import pdb
import queue
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from ..wire.xray_messages import XRAY_VERSION, DebugAnswer, DebuggerStatus
from .state import RANK

# how long one notebook request waits for pdb to come back to its prompt
ANSWER_SECONDS = 30.0
# how often the waiting ranks look at the store
POLL_SECONDS = 0.05
_KEY = "ddp_notebook/breakpoint/"


class DebuggerQuit(Exception):
    """The user quit the debugger on another rank: this rank ends the cell too."""


class _Session:
    """The one pdb session of this rank: its input lines, its output, whether it waits for a line."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.changed = threading.Condition()
        self.waiting = False
        self.active = False
        self.scripted: list[str] = []  # lines given up front: run as typed, shown in the cell's output

    def write(self, text: str) -> int:
        if self.scripted:
            sys.stdout.write(text)  # the rank's own output: it reaches the notebook as [rank N] lines
            return len(text)
        with self.changed:
            self.output.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        if self.scripted:
            line = self.scripted.pop(0)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            return line + "\n"
        with self.changed:
            self.waiting = True
            self.changed.notify_all()
        try:
            return self.lines.get() + "\n"
        except KeyboardInterrupt:
            return "q\n"  # the notebook was interrupted at the prompt: quit (pdb would ignore it)
        finally:
            with self.changed:
                self.waiting = False

    def take_output(self) -> str:
        with self.changed:
            text, self.output = "".join(self.output), []
        return text

    def answer(self, line: str | None) -> DebugAnswer:
        """From the X-ray thread: send `line` (None: just look), then wait for the next prompt or the end."""
        if line is not None and self.waiting:
            self.lines.put(line)
            deadline = time.monotonic() + ANSWER_SECONDS
            with self.changed:
                # the line is taken (waiting drops) and pdb comes back to its prompt or ends
                self.changed.wait_for(lambda: not self.active or (self.waiting and self.lines.empty()), ANSWER_SECONDS)
                if time.monotonic() > deadline:
                    output = "".join(self.output)
                    return {"v": XRAY_VERSION, "output": output, "waiting": False, "active": self.active, "busy": True}
        return {"v": XRAY_VERSION, "output": self.take_output(), "waiting": self.waiting, "active": self.active}

    def finished(self) -> None:
        with self.changed:
            self.active = False
            self.waiting = False
            self.changed.notify_all()


SESSION = _Session()


# the machinery between a cell's statements: stepping goes through it to the next statement
_NOT_USER_CODE = (
    *("IPython.*", "ipykernel.*", "ipyparallel.*", "asyncio.*", "tornado.*", "zmq.*", "traitlets.*"),
    *("contextlib", "codeop", "threading", "selectors", "ddp_notebook.*", "torch.*"),
)


class _RankPdb(pdb.Pdb):
    def __init__(self) -> None:
        super().__init__(stdin=SESSION, stdout=SESSION, nosigint=True, skip=_NOT_USER_CODE)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = "(Pdb) "

    # IPython runs each top-level statement of a cell as a module of its own: its start and end
    # are no place to stop, its lines are
    def user_call(self, frame: FrameType, argument_list: Any) -> None:
        if frame.f_code.co_name != "<module>":
            super().user_call(frame, argument_list)

    def user_return(self, frame: FrameType, return_value: Any) -> None:
        if frame.f_code.co_name != "<module>":
            super().user_return(frame, return_value)

    def trace_dispatch(self, frame: FrameType, event: str, arg: Any) -> Any:
        __tracebackhide__ = True  # where IPython honours it, this frame is left out of the traceback too
        try:
            return super().trace_dispatch(frame, event, arg)
        except DebuggerQuit as quit:
            # raised afresh here: the cell's traceback ends at its own line, not in pdb's frames
            raise DebuggerQuit(str(quit)) from None

    def do_quit(self, arg: str) -> Any:
        """q(uit): end the cell (on every rank, after ddp_notebook.breakpoint)."""
        self.set_quit()
        raise DebuggerQuit("pdb was quit: the cell ended here")

    do_q = do_exit = do_quit

    def _cmdloop(self) -> None:
        try:
            self.cmdloop()
        except KeyboardInterrupt:
            # the notebook interrupted the cell: leave pdb (which would ignore it) and end the cell
            self.set_quit()
            raise


def status() -> DebuggerStatus | None:
    """For the X-ray report: a session waiting for the user's next line, or None."""
    if not SESSION.active:
        return None
    return {"waiting": SESSION.waiting}


def stop_here(
    frame: FrameType | None = None,
    on_end: Callable[[bool], None] | None = None,
    commands: list[str] | None = None,
) -> None:
    """Stop this rank in pdb at the next line of `frame` (default: the caller's).

    `on_end(quit)` runs when the user continues (`c`) or quits (`q`). `commands` run first, as
    if typed (the prompt comes to the notebook once they are used up without a `c`).
    """
    debugger = _RankPdb()
    SESSION.active = True
    SESSION.take_output()
    SESSION.scripted = list(commands or ())
    _finish_when_done(debugger, on_end)
    debugger.set_trace(frame or sys._getframe().f_back)


def _finish_when_done(debugger: pdb.Pdb, on_end: Callable[[bool], None] | None) -> None:
    """Mark the session over when pdb stops tracing (continue or quit)."""
    original = debugger.set_continue
    quit_original = debugger.set_quit

    def set_continue() -> None:
        original()
        SESSION.finished()
        if on_end is not None:
            on_end(False)

    def set_quit() -> None:
        quit_original()
        SESSION.finished()
        if on_end is not None:
            on_end(True)

    debugger.set_continue = set_continue  # type: ignore[method-assign]
    debugger.set_quit = set_quit  # type: ignore[method-assign]


def post_mortem(traceback: TracebackType | None = None) -> str:
    """pdb on the last exception's traceback of this rank (the cell that raised); returns what happened."""
    traceback = traceback or getattr(sys, "last_traceback", None)
    if traceback is None:
        return "this rank has no failed cell to look into"
    debugger = _RankPdb()
    SESSION.active = True
    SESSION.take_output()
    error = getattr(sys, "last_value", None)
    if error is not None:
        SESSION.write(f"{type(error).__name__}: {error}\n")
    debugger.reset()
    try:
        debugger.interaction(None, traceback)
    except DebuggerQuit:
        pass
    finally:
        SESSION.finished()
    return ""


def breakpoint(rank: int = 0, commands: list[str] | None = None) -> None:
    """Stop `rank` in pdb, in the notebook, while the other ranks wait (call it on every rank).

    The others wait on the world's store, not in a collective, so no collective timeout runs
    out while you look around. `c` continues everywhere; `q` ends the cell on every rank.
    `commands` (e.g. `["p loss", "c"]`) run first as if typed, for a notebook run unattended.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    here = dist.get_rank()
    RANK.breakpoints += 1
    count = RANK.breakpoints
    key = f"{_KEY}{count}"
    if here != rank:
        while not store.check([key]):
            time.sleep(POLL_SECONDS)
        if store.get(key) == b"quit":
            raise DebuggerQuit(f"the debugger on rank {rank} was quit")
        return
    stop_here(sys._getframe().f_back, lambda quit: store.set(key, "quit" if quit else "continue"), commands)
