"""A pytest plugin that says where each test's time went, by kind of cost.

It wraps the few calls a test spends its waiting in (a world's start, a kernel's start, a notebook
run, pip, the docs build, a sleep, a cell that ran into its limit) and charges each second to the
innermost of them, on the test process's main thread only; what is left is the test's own work.
Each test's figures go into its report's user properties (`cost:<kind>` = seconds), which the JUnit
XML keeps; `benchmarks/suite_time.py` turns them into tables. Setup and teardown count with the
test: a module's shared world is charged to the first test that asked for it.

Active in every run (tests/conftest.py loads it); its own cost is a clock read per wrapped call.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# what each kind means; suite_time.py prints these names
WORLD_START = "world starts"
WORLD_STOP = "world stops"
KERNEL_START = "kernel starts"
KERNEL_STOP = "kernel stops"
TIMEOUTS = "cells that hit a limit"
SLEEPS = "sleeps"
PIP = "pip and venv builds"
DOCS = "the docs build"
NOTEBOOKS = "notebook runs"
SUBPROCESSES = "other subprocesses"
OWN_WORK = "the tests' own work"

KINDS = (WORLD_START, WORLD_STOP, KERNEL_START, KERNEL_STOP, TIMEOUTS, SLEEPS, PIP, DOCS, NOTEBOOKS, SUBPROCESSES)
PROPERTY_PREFIX = "cost:"

# the magic lines that start (or start again) a world inside a kernel the test drives
KERNEL_WORLD_STARTS = ("%ddp_start", "%ddp_restart", "%ddp_attach", "%ddp_resume")
LIMIT_ERRORS = ("CellTimeoutError", "TimeoutError")


Decide = Callable[[Any, BaseException | None], str]  # the kind a finished call is charged to
# kinds that count only on their own: inside another wrapped call (a sleep in a world's start) they
# are part of that call
GENERIC = (SLEEPS, SUBPROCESSES)


class Ledger:
    """Seconds per kind for the test running now, each charged to the innermost wrapped call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open call: the seconds its inner calls took

    def charge(self, kind: str, run: Callable[[], Any], kind_after: Decide) -> Any:
        if threading.current_thread() is not threading.main_thread() or (kind in GENERIC and self._inner):
            return run()
        self._inner.append(0.0)
        began = time.monotonic()
        result: Any = None
        error: BaseException | None = None
        try:
            result = run()
            return result
        except BaseException as raised:
            error = raised
            raise
        finally:
            took = time.monotonic() - began
            inner = self._inner.pop()
            self.seconds[kind_after(result, error) or kind] += max(took - inner, 0.0)
            if self._inner:
                self._inner[-1] += took

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


LEDGER = Ledger()


def _same(kind: str) -> Decide:
    return lambda result, error: kind


def _wrap(
    owner: Any, name: str, kind: Callable[..., str], after: Callable[..., Decide] | None = None
) -> Callable[[], None]:
    """Wrap owner.name so its time is charged to kind(*args); returns the undo."""
    own = name in vars(owner)
    original = vars(owner)[name] if own else getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        chosen = kind(*args, **kwargs)
        if not chosen:
            return original(*args, **kwargs)
        decide = after(*args, **kwargs) if after is not None else _same(chosen)
        return LEDGER.charge(chosen, lambda: original(*args, **kwargs), decide)

    setattr(owner, name, wrapped)
    return (lambda: setattr(owner, name, original)) if own else (lambda: delattr(owner, name))


def _command_kind(*args: Any, **kwargs: Any) -> str:
    command = args[0] if args else kwargs.get("args", "")
    words = " ".join(str(word) for word in command) if isinstance(command, list | tuple) else str(command)
    if " pip " in f" {words} " or " venv " in f" {words} " or "uv pip" in words:
        return PIP
    if "sphinx" in words or "docs/build.py" in words:
        return DOCS
    return SUBPROCESSES


def _cell_limit(*args: Any, **kwargs: Any) -> Decide:
    def decide(result: Any, error: BaseException | None) -> str:
        if error is not None and type(error).__name__ in LIMIT_ERRORS:
            return TIMEOUTS
        if isinstance(result, tuple) and len(result) == 2 and result[1] in LIMIT_ERRORS:
            return TIMEOUTS  # a driven kernel's cell: (text, error name)
        return ""

    return decide


def _kernel_cell_kind(kernel: Any, code: str = "", *args: Any, **kwargs: Any) -> str:
    if any(line.lstrip().startswith(KERNEL_WORLD_STARTS) for line in str(code).splitlines()):
        return WORLD_START
    return OWN_WORK


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001  (an optional part not installed: nothing of it to wrap)
        return None


def install() -> list[Callable[[], None]]:
    """Wrap what is there to wrap; the undos."""
    undo: list[Callable[[], None]] = []

    def wrap(module: str, owner: str | None, name: str, kind: Any, after: Any = None) -> None:
        found = _module(module)
        target = getattr(found, owner, None) if owner else found
        if target is not None and hasattr(target, name):
            undo.append(_wrap(target, name, kind if callable(kind) else (lambda *a, _k=kind, **k: _k), after))

    wrap("ddp_notebook.world.cluster", "DDPCluster", "start", WORLD_START)
    wrap("ddp_notebook.world.cluster", "DDPCluster", "restart", WORLD_START)
    wrap("ddp_notebook.world.cluster", "DDPCluster", "stop", WORLD_STOP)
    wrap("ddp_notebook.world.cluster", "DDPCluster", "execute", OWN_WORK, _cell_limit)
    wrap("jupyter_client.manager", "KernelManager", "start_kernel", KERNEL_START)
    wrap("jupyter_client.manager", "KernelManager", "shutdown_kernel", KERNEL_STOP)
    wrap("jupyter_client.blocking.client", "BlockingKernelClient", "wait_for_ready", KERNEL_START)
    wrap("tests.support.kernel", "Kernel", "run", _kernel_cell_kind, _cell_limit)
    wrap("nbclient", "NotebookClient", "execute", NOTEBOOKS)
    wrap("tests.support.binder_build", "BinderBuild", "wait", PIP)
    for name in ("run", "check_call", "check_output"):
        wrap("subprocess", None, name, _command_kind)
    wrap("time", None, "sleep", SLEEPS)
    return undo


@pytest.fixture(scope="session", autouse=True)
def _cost_ledger() -> Iterator[None]:
    undo = install()
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # junitxml writes the user properties of the teardown report: charge the whole test there
    if call.when == "teardown":
        for kind, seconds in sorted(LEDGER.take().items()):
            if seconds >= 0.001:
                item.user_properties.append((f"{PROPERTY_PREFIX}{kind}", f"{seconds:.3f}"))
    yield
