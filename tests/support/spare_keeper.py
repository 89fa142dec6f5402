"""A rank template kept ready in the test process, as `%load_ext ddp_notebook` keeps one in a kernel.

A world started in a process with no spare template starts one of its own first: about 6 s of
importing torch, on every `DDPCluster(...).start()` of the suite. Here a spare is ready when the
first test that may start a world (not a unit test: tests/support/lanes.py) sets up, and again a
second after a world took it, so the next test's world forks its ranks at once. Each spare is a
fork of one template kept for the session (tests/support/template_source.py): it imports torch
once, where a spare started afresh would import it again for every world (8 s of a core each, on
a machine of two). Where that source does not suit (another interpreter or start-up environment),
a spare starts afresh as a kernel's does (`ddp_notebook.warm_up`). Unit tests start none: their
timings run beside no template's imports. Both are the session's, not a test's: the leak checks
leave out their PIDs (`session_pids`). The modules that test the template and the spare
themselves run without them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

import ddp_notebook
from ddp_notebook.world import spare, template
from tests.support import kernel, lanes
from tests.support.template_source import TemplateSource

# their tests start worlds without a spare, watch the spare itself, or what an unstarted world holds;
# or they set the environment of hosts, a Slurm cluster or a hub, whose teardown counts every process
# carrying it as theirs (a spare started meanwhile would inherit it)
WITHOUT_SPARE = frozenset(
    {
        "test_spare.py",
        "test_template.py",
        "test_template_source.py",
        "test_provisioning.py",
        "test_multinode.py",
        "test_multihost_infra.py",
        "test_jobs.py",
        "test_fault_storm.py",
        "test_jupyterhub.py",
    }
)
# a world that took the spare is still forking its ranks and joining its group for about this long:
# the next spare's imports would only slow that down
AFTER_A_TAKE_SECONDS = 1.0


class Keeper:
    """A thread that starts a spare whenever none waits, while the running test wants one."""

    def __init__(self) -> None:
        self.wanted = threading.Event()
        self.ending = threading.Event()
        self.thread = threading.Thread(target=self._keep, name="spare-keeper", daemon=True)

    def _keep(self) -> None:
        missing_since: float | None = None
        while not self.ending.wait(0.25):
            if not self.wanted.is_set() or spare.spare_pid() is not None:
                missing_since = None
                continue
            now = time.monotonic()
            missing_since = missing_since or now
            if now - missing_since >= AFTER_A_TAKE_SECONDS:
                start_spare()
                missing_since = None

    def want(self, wanted: bool) -> None:
        if wanted:
            self.wanted.set()
        else:
            self.wanted.clear()


KEEPER = Keeper()
SOURCE = TemplateSource()
_starting = threading.Lock()  # the keeper's thread and a test's setup: one spare, not two


def start_spare() -> None:
    """A spare, forked from the session's source where it suits, started afresh otherwise; as
    `ddp_notebook.warm_up` does, none where spares are off or ranks cannot be forked."""
    with _starting:
        if spare.spare_pid() is not None or os.environ.get(spare.SPARE_ENV, "1") == "0":
            return
        forked = SOURCE.fork_template() if template.can_fork_ranks({}) is None else None
        if forked is not None:
            spare.hand_over(forked)
        else:
            ddp_notebook.warm_up()


def source_for_kernels() -> tuple[str, tuple[str, tuple[tuple[str, str], ...]]] | None:
    """Where a test's kernel forks its spare (the source's socket, and the start-up signature a
    kernel must have for a fork of it to be what it would start): while the test wants a spare."""
    if not KEEPER.wanted.is_set() or os.environ.get(spare.SPARE_ENV, "1") == "0":
        return None
    path = SOURCE.socket_path()
    if path is None:
        return None
    return path, SOURCE.signature


kernel.spare_source = source_for_kernels


def session_pids() -> set[int]:
    """The PIDs of the spare waiting now and of its source: the session's, never a test's leftover."""
    return {pid for pid in (spare.spare_pid(), SOURCE.pid) if pid is not None}


@pytest.fixture(scope="session", autouse=True)
def _spare_keeper() -> Iterator[None]:
    KEEPER.thread.start()
    try:
        yield
    finally:
        KEEPER.ending.set()
        KEEPER.thread.join(5)
        ddp_notebook.discard_warm_up()
        SOURCE.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if Path(str(item.path)).name in WITHOUT_SPARE:
        KEEPER.want(False)
        ddp_notebook.discard_warm_up()
    elif item.stash.get(lanes.UNIT, False):
        KEEPER.want(False)  # a unit test starts no world: no template importing torch beside its timings
    else:
        KEEPER.want(True)
        start_spare()  # at once, not a beat later: the test's fixtures may start a world now
    yield
