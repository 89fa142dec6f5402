"""However a world ends, in a real kernel, it leaves no file behind: not in the IPython profile
(ipyparallel's engine registry, logs and connection files), not in the temporary folder (the
world's private folder, with its key); and a world attached to someone's cluster leaves that
cluster's files where they are."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import owned_pids, wait_gone
from tests.test_kernel import Kernel, kernel_world_pids
from tests.test_launchers import ipcluster  # noqa: F401  (a fixture: `ipcluster start`, outside any world)

pytestmark = pytest.mark.integration

SETTLE_SECONDS = 30.0


def files_under(*roots: Path) -> set[str]:
    """Every file and folder under `roots` but torch's compile cache (shared by every torch process,
    created by the ranks' import of torch, kept by torch across runs on purpose)."""
    found = set()
    for root in roots:
        for folder, folders, files in os.walk(root):
            folders[:] = [name for name in folders if not name.startswith("torchinductor_")]
            found.update(os.path.join(folder, name) for name in folders + files)
    return found


def new_files(roots: tuple[Path, ...], before: set[str], seconds: float = SETTLE_SECONDS) -> list[str]:
    """What is under `roots` now and was not `before`, once it is all gone or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while True:
        left = sorted(files_under(*roots) - before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An IPython folder and a temporary folder of the kernel's own: only its files are there."""
    ipython, temporary = tmp_path / "ipython", tmp_path / "tmp"
    ipython.mkdir()
    temporary.mkdir()
    monkeypatch.setenv("IPYTHONDIR", str(ipython))  # the kernel started next inherits both
    monkeypatch.setenv("TMPDIR", str(temporary))
    return ipython, temporary


@pytest.fixture
def kernel(places: tuple[Path, Path]) -> Iterator[Kernel]:
    started = Kernel()
    try:
        out, error = started.run("%load_ext ddp_notebook")
        assert error is None, out
        yield started
    finally:
        started.close()


def _stop(kernel: Kernel) -> None:
    out, error = kernel.run("%ddp_stop")
    assert error is None, out


def _shut_down(kernel: Kernel) -> None:
    kernel.manager.shutdown_kernel(now=False)  # a clean exit, the world still running


def _kill(kernel: Kernel) -> None:
    # no clean-up can run in the kernel: the world's controller ends the world (its owner watch)
    os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)


ENDINGS: dict[str, Callable[[Kernel], None]] = {
    "ddp_stop": _stop,
    "kernel_shutdown": _shut_down,
    "kernel_killed": _kill,
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_world_leaves_no_file_however_it_ends(kernel: Kernel, places: tuple[Path, Path], ending: str) -> None:
    before = files_under(*places)
    out, error = kernel.run("%ddp_start 2 --backend gloo")
    assert error is None, out
    pids = kernel_world_pids(kernel)
    kernel_pid = kernel.manager.provisioner.process.pid
    running = sorted(files_under(*places) - before)
    temporary = places[1]
    # the files ipyparallel writes for a world, and the world's private folder, are there while it runs
    assert any(os.path.basename(path).startswith("engines") for path in running), running
    assert any(path.startswith(str(temporary / "ddp-notebook-")) for path in running), running
    ENDINGS[ending](kernel)
    leftover = wait_gone(sorted(set(pids) | owned_pids(kernel_pid)), seconds=SETTLE_SECONDS)
    for pid in leftover:  # fail loudly, but never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert leftover == []
    assert new_files(places, before) == []


def test_a_world_that_failed_to_start_leaves_no_file(kernel: Kernel, places: tuple[Path, Path]) -> None:
    before = files_under(*places)
    out, error = kernel.run("%ddp_start 2 --backend gloo --start-timeout 0.2")
    assert error is not None and "ranks registered within 0.2 s" in out, out
    assert new_files(places, before) == []


def test_an_attached_world_leaves_the_clusters_own_files(kernel: Kernel, ipcluster: Path) -> None:  # noqa: F811
    theirs = files_under(ipcluster)
    assert any(path.endswith("ipcontroller-t1-client.json") for path in theirs), sorted(theirs)
    out, error = kernel.run(f"%ddp_attach --profile {ipcluster} --cluster-id t1")
    assert error is None, out
    _stop(kernel)
    out, error = kernel.run(f"%ddp_attach --profile {ipcluster} --cluster-id t1")
    assert error is None, out
    _shut_down(kernel)  # with the attached world running
    assert sorted(theirs - files_under(ipcluster)) == []
