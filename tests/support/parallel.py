"""The suite on worker processes (`pytest -n 3`, pytest-xdist): which tests run one at a time.

Much of a test's time is a world waiting out what its behaviour needs (a collective's timeout, a
heartbeat, a host's silence): on the 2-core machine one test process keeps the cores busy about
half the time, two workers 77% of a run, three 90% (docs/testing.md). Each worker is a test process
of its own, with its own shared world, spare template and source (tests/support/spare_keeper.py),
its own processes (owned_pids) and its own ipyparallel profile (tests/conftest.py). What stays one at a time:

- the modules that use what the machine has one of, each kind one after another on one worker: the
  network-namespace hosts with their sshd and Slurm daemons (`hosts`); a hub and its Linux users,
  cgroups, chromium with JupyterLab, whose live view's timings a second browser's load would
  stretch (`one-of-a-kind`). The two kinds share nothing and run beside each other;
- the tour's notebooks: the Binder test's runs serve tests/test_notebooks.py and the docs site in the
  same test process (tests/conftest.py's ExecutedNotebooks), so the three run on one worker.

Each group is one unit of work (`--dist loadgroup`, set here when `-n` is given without `--dist`,
and told to the workers, which parse the command line afresh); every other module is a group of its
own (a module's fixtures are set up once, on one worker). The groups are handed out first, longest
first: the two kinds of one-of-a-kind modules (a worker each); then the tour, but only once the
Binder environment it runs in is built (from the session's start, by the controller, at nice 19 on
what the tests leave idle; `place_tour`): until then the other modules go first, where the Binder
test would keep a worker waiting for the build (on 2026-12-04 the build ended 6.5-7.3 minutes into
a run, about when the tour's turn came; a build that downloads its packages afresh takes longer).
The Binder test itself is the tour's 12 notebooks, run in it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# in each test's id under -n (test_x.py::test_y@one-of-a-kind)
HOSTS = "hosts"
ONE_MACHINE = "one-of-a-kind"
TOUR = "tour"
LOADGROUP_INPUT = "ddp_notebook_loadgroup"
GROUPS = {
    HOSTS: frozenset({"test_multinode.py", "test_multihost_infra.py", "test_jobs.py", "test_fault_storm.py"}),
    ONE_MACHINE: frozenset({"test_jupyterhub.py", "test_limits.py", "test_browser.py"}),
    TOUR: frozenset({"test_binder.py", "test_notebooks.py", "test_docs_site.py"}),
}


# the modules of most minutes (docs/testing.md's table of a full run, 2026-12-03), handed out after
# the groups, longest first; every other module follows in the order pytest collects them
LONGEST_MODULES = (
    "test_torchrun_scripts.py",
    "test_detached_world.py",
    "test_kernel.py",
    "test_launchers.py",
    "test_elastic.py",
    "test_nothing_left_behind.py",
    "test_failures_at_every_size.py",
    "test_failures.py",
    "test_architecture.py",
    "test_persisting.py",
    "test_template.py",
)


# what the tour waits for before it is handed out (set by tests/conftest.py: the controller's Binder build)
TOUR_READY_KEY = pytest.StashKey[Callable[[], bool]]()


def is_worker(config: pytest.Config) -> bool:
    """Whether this pytest is a worker of `-n` (pytest-xdist gives only those a `workerinput`); not the
    environment's PYTEST_XDIST_WORKER, which a pytest started from inside a worker inherits."""
    return hasattr(config, "workerinput")


def group_of(path: Path) -> str | None:
    return next((group for group, names in GROUPS.items() if path.name in names), None)


def dist_asked(config: pytest.Config) -> bool:
    """Whether the command line (or PYTEST_ADDOPTS) names a `--dist` of its own."""
    words = [*map(str, config.invocation_params.args), *os.environ.get("PYTEST_ADDOPTS", "").split()]
    return any(word in ("--dist", "-d") or word.startswith("--dist=") for word in words)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # after every pytest_cmdline_main (pytest-xdist's makes `-n` mean `--dist load`, test by test,
    # which would set up a module's fixtures on both workers and split the groups), before the
    # scheduler is chosen at the session's start
    if config.getoption("numprocesses", None) and config.option.dist == "load" and not dist_asked(config):
        config.option.dist = "loadgroup"
        # pytest-xdist hands the units out by their count of tests, most first (a unit of 4 hub tests
        # of minutes each after a module of 50 unit tests of milliseconds): here, in the order below
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    # a worker parses the command line afresh: it never sees a `--dist` set above, and without it
    # pytest-xdist leaves the group marks out of the test ids (and runs a group's tests on both)
    if node.config.getoption("dist", "no") == "loadgroup":
        node.workerinput[LOADGROUP_INPUT] = True


def grouping(config: pytest.Config) -> bool:
    """Whether this worker's tests are handed out by group (the controller said so)."""
    return bool(getattr(config, "workerinput", {}).get(LOADGROUP_INPUT))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not grouping(config):  # only a worker has the controller's word
        return
    config.option.loadgroup = True  # what pytest-xdist's hook reads to add the group to each test's id
    groups = list(GROUPS)
    grouped: list[tuple[int, pytest.Item]] = []
    for item in items:
        path = Path(str(item.path))
        group = group_of(path)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            grouped.append((groups.index(group), item))
            continue
        item.add_marker(pytest.mark.xdist_group(path.stem))  # a unit of its own under loadgroup: its module
        if path.name in LONGEST_MODULES:
            grouped.append((len(groups) + LONGEST_MODULES.index(path.name), item))
    grouped.sort(key=lambda pair: pair[0])  # stable: each unit keeps its order
    first = {id(item) for _, item in grouped}
    items[:] = [item for _, item in grouped] + [item for item in items if id(item) not in first]


def tour_waits_for(config: pytest.Config, ready: Callable[[], bool]) -> None:
    """Hand the tour out only once `ready()` (the Binder environment is built), or when nothing else is left."""
    config.stash[TOUR_READY_KEY] = ready


def place_tour(workqueue: OrderedDict[str, Any], ready: bool) -> None:
    """Put the tour where the next unit handed out should find it: first once its environment is
    built; while it is not, behind the other units (its test would only wait, a worker idle, for a
    build that runs at nice 19 on the cores the other tests leave), unless it is all that is left."""
    if TOUR not in workqueue or len(workqueue) == 1:
        return
    workqueue.move_to_end(TOUR, last=not ready)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.option.dist != "loadgroup" or TOUR_READY_KEY not in config.stash:
        return None  # pytest-xdist's own
    from xdist.scheduler import LoadGroupScheduling

    ready = config.stash[TOUR_READY_KEY]

    class TourWhenBuilt(LoadGroupScheduling):
        """pytest-xdist's groups, the tour handed out once its environment is built (`place_tour`)."""

        def _assign_work_unit(self, node: Any) -> None:
            place_tour(self.workqueue, ready())
            super()._assign_work_unit(node)

    return TourWhenBuilt(config, log)
