"""Shared fixtures: one real 2-rank gloo world per session, the tour's notebooks executed once
per session, and process-leak checks."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import comm
import pytest

from ddp_notebook import DDPCluster
from ddp_notebook.world import spare

if os.environ.get("PYTEST_XDIST_WORKER"):
    # each worker process of `pytest -n` has an ipyparallel profile of its own: the leak checks
    # compare the profile's files before and after a test, and another worker's worlds write there too
    os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix=f"ddp-tests-{os.environ['PYTEST_XDIST_WORKER']}-")

# what the tests share keeps pytest's assert messages, as it had in the modules it came from
pytest.register_assert_rewrite("tests.support")

from tests.support.comms import RecordingComm  # noqa: E402
from tests.support.notebooks import QUICK_NOTEBOOKS, ExecutedNotebooks  # noqa: E402
from tests.support.parallel import is_worker, tour_waits_for  # noqa: E402
from tests.support.processes import owned_pids, profile_files, wait_gone  # noqa: E402
from tests.support.spare_keeper import session_pids  # noqa: E402
from tests.support.worlds import shared_world  # noqa: E402

pytest_plugins = [
    "tests.support.costs",
    "tests.support.lanes",
    "tests.support.spare_keeper",
    "tests.support.parallel",
]


@pytest.fixture(scope="session")
def world() -> Iterator[DDPCluster]:
    """A 2-rank gloo world shared by tests that do not need their own."""
    yield from shared_world(2)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves child processes, or files in the ipyparallel profile, behind."""
    before, files_before = owned_pids(), profile_files()
    yield
    # the spare template kept for the next world, and its source, are the session's (tests/support/spare_keeper.py)
    leftover = wait_gone(sorted(owned_pids() - before - session_pids()))
    assert leftover == [], f"processes left running: {leftover}"
    assert sorted(profile_files() - files_before) == [], "files left in the ipyparallel profile"


@pytest.fixture
def no_spare_left() -> Iterator[None]:
    """Fail a test that leaves a spare template (one `warm_up()` or `spare.hand_over` made) waiting."""
    yield
    pid = spare.spare_pid()
    spare.discard_spare()
    assert pid is None or wait_gone([pid]) == []


@pytest.fixture(scope="session")
def executed_notebooks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExecutedNotebooks]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in QUICK_NOTEBOOKS.items():
            patch.setenv(name, value)  # the kernels inherit this process's environment
        yield ExecutedNotebooks(tmp_path_factory)


BINDER_TEST = Path(__file__).resolve().parent / "test_binder.py"


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Binder test runs just before the first module that reads the executed notebooks: its
    runs serve that module (ExecutedNotebooks.share), and its environment has had the tests
    before it to build in (binder_build)."""
    binder = [item for item in items if item.path == BINDER_TEST]
    others = [item for item in items if item.path != BINDER_TEST]
    readers = [item for item in others if "executed_notebooks" in getattr(item, "fixturenames", ())]
    if binder and readers:
        first = next(index for index, item in enumerate(others) if item.path == readers[0].path)
        items[:] = others[:first] + binder + others[first:]


BINDER_BUILD_INPUT = "ddp_notebook_binder_build"  # the controller's build folder, told to each worker
BINDER_BUILD_KEY = pytest.StashKey[Any]()


def binder_test_may_run(config: pytest.Config) -> bool:
    """Whether the whole suite was asked for (no -m, no -k, no path but the tests folder or the
    Binder test's): where the controller of `-n` cannot tell, the Binder test builds for itself."""
    if config.option.markexpr or config.option.keyword:
        return False
    folder = BINDER_TEST.parent
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    return all(path in (folder, folder.parent, BINDER_TEST) for path in paths)


def pytest_configure(config: pytest.Config) -> None:
    # the controller of `pytest -n` runs no test: it builds the Binder environment from the start,
    # at nice 19, and the tour (the Binder test first) is handed out once it has ended
    if is_worker(config) or not config.getoption("numprocesses", None) or not binder_test_may_run(config):
        return
    from tests.support.binder_build import BinderBuild

    build = BinderBuild(Path(tempfile.mkdtemp(prefix="ddp-binder-")), background=True).start()
    config.stash[BINDER_BUILD_KEY] = build
    tour_waits_for(config, build.ended)  # its test would wait for the build, a worker idle


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    build = node.config.stash.get(BINDER_BUILD_KEY, None)
    if build is not None:
        node.workerinput[BINDER_BUILD_INPUT] = str(build.folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    build = config.stash.get(BINDER_BUILD_KEY, None)
    if build is not None:
        build.stop()
        shutil.rmtree(build.folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def binder_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The Binder test's environment (a tests.support.binder_build.BinderBuild), built from the session's
    start at nice 19 beside the other tests, where that test is to run (None elsewhere): it is
    mostly pip on one core, which the tests before it leave idle much of the time. Under `pytest -n`
    the controller builds it (which worker runs the test is known only then); where it does not (a
    part of the suite asked for), the test builds it."""
    if not any(item.path == BINDER_TEST for item in request.session.items):
        yield None
        return
    from tests.support.binder_build import BinderBuild

    if is_worker(request.config):
        elsewhere = getattr(request.config, "workerinput", {}).get(BINDER_BUILD_INPUT)
        build = BinderBuild.elsewhere(Path(elsewhere)) if elsewhere else None
        try:
            yield build
        finally:
            if build is not None:
                build.stop()  # the wait only: the controller's build is the controller's
        return
    build = BinderBuild(tmp_path_factory.mktemp("binder"), background=True).start()
    try:
        yield build
    finally:
        build.stop()  # where the session ends before the test: nothing of the build runs on


@pytest.fixture
def comms(monkeypatch: pytest.MonkeyPatch) -> list[RecordingComm]:
    created: list[RecordingComm] = []

    def create(*args: Any, **kwargs: Any) -> RecordingComm:
        created.append(RecordingComm(*args, **kwargs))
        return created[-1]

    # comm.create_comm is the documented place to plug a comm implementation in
    monkeypatch.setattr(comm, "create_comm", create)
    return created
