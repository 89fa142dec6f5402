"""Shared fixtures: one real 2-rank gloo world per session, the tour's notebooks executed once
per session, and process-leak checks."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import comm
import pytest
from comm.base_comm import BaseComm

from ddp_notebook import DDPCluster
from ddp_notebook.platform.processes import OWNER_PID_ENV

pytest_plugins = ["tests.support.costs"]


def pid_alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    """PIDs still alive after waiting up to `seconds` for them to exit."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if pid_alive(pid)]
        if alive:
            time.sleep(0.1)
    return alive


def owned_pids(owner: int | None = None) -> set[int]:
    """Every live process started on behalf of `owner` (default: this test process).

    The controller, the ranks and whatever they fork carry DDP_NOTEBOOK_OWNER_PID in their
    environment, so this finds them even after they were re-parented.
    """
    marker = f"{OWNER_PID_ENV}={owner or os.getpid()}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0") and pid_alive(int(entry)):
                    found.add(int(entry))
        except OSError:
            continue
    return found


def shared_world(n_ranks: int) -> Iterator[DDPCluster]:
    """Body of a fixture yielding a running n-rank gloo world; nothing of it may outlive its stop()."""
    cluster = DDPCluster(n_ranks, backend="gloo", timeout=60)
    cluster.start()
    pids = cluster.all_pids
    try:
        yield cluster
    finally:
        cluster.stop()
        assert wait_gone(pids) == [], "processes of the shared world outlived stop()"


@pytest.fixture(scope="session")
def world() -> Iterator[DDPCluster]:
    """A 2-rank gloo world shared by tests that do not need their own."""
    yield from shared_world(2)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves child processes, or files in the ipyparallel profile, behind."""
    before, files_before = owned_pids(), profile_files()
    yield
    leftover = wait_gone(sorted(owned_pids() - before))
    assert leftover == [], f"processes left running: {leftover}"
    assert sorted(profile_files() - files_before) == [], "files left in the ipyparallel profile"


def profile_files() -> set[str]:
    """The files of the default ipyparallel profile's logs and connection files."""
    profile = Path(os.environ.get("IPYTHONDIR", Path.home() / ".ipython")) / "profile_default"
    return {str(path) for folder in ("log", "security") for path in (profile / folder).glob("*")}


@dataclass
class ExecutedNotebook:
    notebook: Any  # nbformat.NotebookNode, with the outputs and widget state of the run
    folder: Path  # the notebook's folder while it ran: the files it wrote are there


class ExecutedNotebooks:
    """Each notebook executed once per session by docs/notebook_runner.py (the docs build's
    runner): tests/test_notebooks.py checks the outputs, tests/test_docs_site.py publishes them.

    tests/test_binder.py (which runs first) shares the runs it made in the Binder environment,
    through the same runner; a notebook it did not run, or whose run there failed, runs here on
    first use. The Binder environment is this package and the newest releases pip resolves, as
    a clean install of the test extra gets them.
    """

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
        import notebook_runner

        self.runner = notebook_runner
        self._factory = factory
        self._runs: dict[Path, ExecutedNotebook | BaseException] = {}

    def get(self, path: Path) -> ExecutedNotebook:
        """The executed notebook; a run that raised raises the same error again, without re-running."""
        if path not in self._runs:
            folder = self._factory.mktemp(f"notebook-{path.stem}")
            try:
                self._runs[path] = ExecutedNotebook(self.runner.execute(path, folder), folder)
            except Exception as error:  # noqa: BLE001  (kept for every test that asks)
                self._runs[path] = error
        run = self._runs[path]
        if isinstance(run, BaseException):
            raise run
        return run

    def share(self, path: Path, notebook: Any, folder: Path) -> None:
        """Take a run of `path` made elsewhere without an error (its executed notebook, and the
        folder it ran in); a notebook already run here keeps its own run."""
        self._runs.setdefault(path, ExecutedNotebook(notebook, folder))


# the notebooks read it and run their short setting (the same cells, fewer steps)
QUICK_NOTEBOOKS = {"DDP_NOTEBOOK_QUICK": "1"}


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


@pytest.fixture(scope="session", autouse=True)
def binder_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The Binder test's environment (a tests.binder_build.BinderBuild), built from the session's
    start at nice 19 beside the other tests, where that test is to run (None elsewhere): it is
    mostly pip on one core, which the tests before it leave idle much of the time."""
    if not any(item.path == BINDER_TEST for item in request.session.items):
        yield None
        return
    from tests.binder_build import BinderBuild

    build = BinderBuild(tmp_path_factory.mktemp("binder"), background=True).start()
    try:
        yield build
    finally:
        build.stop()  # where the session ends before the test: nothing of the build runs on


@contextlib.contextmanager
def magics_driving(world: DDPCluster) -> Iterator[Any]:
    """An IPython shell (no kernel: the text view) whose magics drive `world`, which stays running."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "ddp_notebook")
    magics = ip.magics_manager.registry["DDPMagics"]
    magics.world = world
    try:
        yield ip
    finally:
        magics.world = None  # the world is not the shell's to stop
        ip.run_line_magic("unload_ext", "ddp_notebook")


def documented_magic_lines(page: Path, section: str | None = None) -> list[str]:
    """The magic lines (`%...`) of the python blocks of a docs page, or of its `## section`, as
    written there (a trailing comment left out): what a test must run as written."""
    text = page.read_text()
    if section is not None:
        text = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.startswith("%")]


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


class RecordingComm(BaseComm):
    """A comm that keeps every message a widget sends to the frontend."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[tuple[float, str, dict[str, Any], list[Any]]] = []
        super().__init__(*args, **kwargs)

    def publish_msg(
        self, msg_type: str, data: Any = None, metadata: Any = None, buffers: Any = None, **keys: Any
    ) -> None:
        self.sent.append((time.monotonic(), msg_type, data or {}, list(buffers or [])))


@pytest.fixture
def comms(monkeypatch: pytest.MonkeyPatch) -> list[RecordingComm]:
    created: list[RecordingComm] = []

    def create(*args: Any, **kwargs: Any) -> RecordingComm:
        created.append(RecordingComm(*args, **kwargs))
        return created[-1]

    # comm.create_comm is the documented place to plug a comm implementation in
    monkeypatch.setattr(comm, "create_comm", create)
    return created
