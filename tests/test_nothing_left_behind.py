"""However a world ends, in a real kernel, it leaves no file behind: not in the IPython profile
(ipyparallel's engine registry, logs and connection files), not in the temporary folder (the
world's private folder, with its key); and a world attached to someone's cluster leaves that
cluster's files where they are."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster
from tests.support.kernel import Kernel, kernel_world_pids
from tests.support.launchers import needs_mpi, running_ipcluster
from tests.support.processes import owned_pids, wait_gone

pytestmark = pytest.mark.integration

SETTLE_SECONDS = 30.0


def files_under(*roots: Path) -> set[str]:
    """Every file and folder under `roots` but torch's compile cache (shared by every torch process,
    created by the ranks' import of torch, kept by torch across runs on purpose) and the kernel's
    own history database (its journal comes and goes as the kernel writes its history)."""
    found = set()
    for root in roots:
        for folder, folders, files in os.walk(root):
            folders[:] = [name for name in folders if not name.startswith("torchinductor_")]
            names = folders + [name for name in files if not name.startswith("history.sqlite")]
            found.update(os.path.join(folder, name) for name in names)
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
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """An IPython folder and a temporary folder of the kernel's own: only its files are there.

    The temporary folder is made directly in the system's: the Unix sockets made in it must fit
    108 bytes, which a folder under pytest's tmp_path (longer under pytest -n) may not leave."""
    ipython, temporary = tmp_path / "ipython", Path(tempfile.mkdtemp(prefix="ddp-nlb-"))
    ipython.mkdir()
    monkeypatch.setenv("IPYTHONDIR", str(ipython))  # the kernel started next inherits both
    monkeypatch.setenv("TMPDIR", str(temporary))
    try:
        yield ipython, temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


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


def _world_files(kernel: Kernel, places: tuple[Path, Path], start: str) -> tuple[set[str], list[int], int]:
    """Start a world with `start`; (the files there were before, its PIDs, the kernel's PID)."""
    before = files_under(*places)
    out, error = kernel.run(start, timeout=180)
    assert error is None and "DDP world ready: 2 ranks" in out, out
    return before, kernel_world_pids(kernel), kernel.manager.provisioner.process.pid


def _ended(kernel: Kernel, places: tuple[Path, Path], ending: str, world: tuple[set[str], list[int], int]) -> None:
    before, pids, kernel_pid = world
    ENDINGS[ending](kernel)
    leftover = wait_gone(sorted(set(pids) | owned_pids(kernel_pid)), seconds=SETTLE_SECONDS)
    for pid in leftover:  # fail loudly, but never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert leftover == []
    assert new_files(places, before) == []


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_world_leaves_no_file_however_it_ends(kernel: Kernel, places: tuple[Path, Path], ending: str) -> None:
    world = _world_files(kernel, places, "%ddp_start 2 --backend gloo")
    running = sorted(files_under(*places) - world[0])
    ipython, temporary = places
    # what ipyparallel writes for the world (engine registry, logs, connection files) is in the
    # world's private folder while it runs, none of it in the IPython profile
    assert [path for path in running if path.startswith(str(ipython))] == []
    private = str(temporary / "ddp-notebook-")
    written = [os.path.basename(path) for path in running if path.startswith(private)]
    assert any(name.startswith("engines") and name.endswith(".json") for name in written), running
    assert any(name.startswith("ipcontroller-") and name.endswith("-client.json") for name in written), running
    _ended(kernel, places, ending, world)


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_restarted_world_leaves_no_file_however_it_ends(
    kernel: Kernel, places: tuple[Path, Path], ending: str
) -> None:
    """The world after %ddp_restart has its controller forked from the kernel's warm template,
    which ends its children when the kernel goes: the template removes their world's folder then."""
    before, first_pids, kernel_pid = _world_files(kernel, places, "%ddp_start 2 --backend gloo")
    out, error = kernel.run("%ddp_restart", timeout=180)
    assert error is None and "DDP world ready: 2 ranks" in out, out
    pids = kernel_world_pids(kernel)
    assert len(set(pids) - set(first_pids)) >= 3, "the restart started a new controller and ranks"
    _ended(kernel, places, ending, (before, sorted(set(pids) | set(first_pids)), kernel_pid))


@needs_mpi
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_launched_world_leaves_no_file_in_the_profile_however_it_ends(
    kernel: Kernel, places: tuple[Path, Path], ending: str
) -> None:
    """Ranks started by a launcher may run on hosts that see the user's profile only: their files
    are there while the world runs, and go when it ends."""
    start = '%ddp_start 2 --launcher mpi --backend gloo --mpi-args "--allow-run-as-root --oversubscribe"'
    world = _world_files(kernel, places, start)
    running = sorted(files_under(*places) - world[0])
    registry = [path for path in running if os.path.basename(path).startswith("engines")]
    assert registry and registry[0].startswith(str(places[0] / "profile_default" / "log")), running
    _ended(kernel, places, ending, world)


def test_a_world_that_failed_to_start_leaves_no_file(kernel: Kernel, places: tuple[Path, Path]) -> None:
    before = files_under(*places)
    out, error = kernel.run("%ddp_start 2 --backend gloo --start-timeout 0.2")
    assert error is not None and "ranks registered within 0.2 s" in out, out
    assert new_files(places, before) == []


@pytest.fixture
def ipcluster(tmp_path: Path) -> Iterator[Path]:
    """A 2-engine cluster started the way a user would, outside any world: `ipcluster start`."""
    yield from running_ipcluster(tmp_path)


def test_an_attached_world_leaves_the_clusters_own_files(kernel: Kernel, ipcluster: Path) -> None:
    theirs = files_under(ipcluster)
    assert any(path.endswith("ipcontroller-t1-client.json") for path in theirs), sorted(theirs)
    out, error = kernel.run(f"%ddp_attach --profile {ipcluster} --cluster-id t1")
    assert error is None, out
    _stop(kernel)
    out, error = kernel.run(f"%ddp_attach --profile {ipcluster} --cluster-id t1")
    assert error is None, out
    _shut_down(kernel)  # with the attached world running
    assert sorted(theirs - files_under(ipcluster)) == []


def test_a_world_here_reads_the_users_profile_settings_from_a_profile_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile, read = tmp_path / "ipython" / "profile_default", tmp_path / "read"
    profile.mkdir(parents=True)
    read.mkdir()
    for app in ("ipcluster", "ipcontroller", "ipengine"):  # each one notes that it read its file
        (profile / f"{app}_config.py").write_text(f"open({str(read / app)!r}, 'w').close()\n")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    # outside a shell (a script), the profile is IPYTHONDIR's; an IPython shell an earlier test made
    # in this process would be asked for its own instead
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    with DDPCluster(1, backend="gloo") as world:
        own = Path(world.provisioner.cluster.profile_dir)
        assert own.parent == Path(world.private_dir)
        assert own.stat().st_mode & 0o077 == 0 and (own / "security").stat().st_mode & 0o077 == 0
        assert world.execute("rank + 1", stream=False).value_text(0) == "1"
    assert sorted(os.listdir(read)) == ["ipcluster", "ipcontroller", "ipengine"]
    assert not own.exists()
    # nothing but the user's files and IPython's own profile skeleton (its empty folders, startup/README)
    files = sorted(str(path.relative_to(profile)) for path in profile.rglob("*") if path.is_file())
    assert files == [f"{app}_config.py" for app in ("ipcluster", "ipcontroller", "ipengine")] + ["startup/README"]
