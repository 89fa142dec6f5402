"""Worlds started by ipyparallel's MPI launcher (Open MPI's mpiexec), and worlds attached to a
cluster started elsewhere (`ipcluster start`): real processes, real gloo groups on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster, RankDiedError
from ddp_notebook.errors import DDPUsageError
from ddp_notebook.platform import processes
from tests.support.kernel import Kernel, kernel_world_pids
from tests.support.launchers import MPI_ENV, needs_mpi, running_ipcluster
from tests.support.processes import pid_alive, wait_gone

pytestmark = pytest.mark.integration


@needs_mpi
def test_mpi_launcher_world_follows_mpi_ranks(no_leaks: None) -> None:
    world = DDPCluster(
        2, launcher="mpi", mpi_args="--oversubscribe", env=MPI_ENV, backend="gloo", collective_timeout=60
    )
    with world:
        assert world.backend == "gloo" and world.world_size == 2
        result = world.execute(
            "import os\n"
            "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t)\n"
            "(os.environ['OMPI_COMM_WORLD_RANK'], os.environ['RANK'], os.environ['LOCAL_RANK'], "
            "os.environ['LOCAL_WORLD_SIZE'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], t.item())",
            stream=False,
        )
        for rank in (0, 1):
            assert result.value_text(rank) == f"('{rank}', '{rank}', '{rank}', '2', '2', '127.0.0.1', 3.0)"
        # one launcher process (mpiexec) besides the controller; the ranks are its children
        assert len(world.pids) == 2
        rank_pids = [info.pid for info in world.ranks]
        assert set(rank_pids) <= set(world.all_pids)
    assert wait_gone(rank_pids) == []


@needs_mpi
def test_mpi_args_typed_in_a_kernel_reach_mpiexec_word_by_word() -> None:
    """In a real kernel, as a user types it: `--mpi-args "..."` of several words, `-x NAME=value`
    among them (mpiexec exports it to every rank). IPython's own splitting kept the quotes, and
    mpiexec got one word it did not know."""
    kernel = Kernel()
    try:
        out, error = kernel.run("%load_ext ddp_notebook")
        assert error is None, out
        out, error = kernel.run(
            "%ddp_start 2 --launcher mpi --backend gloo --collective-timeout 60 "
            '--mpi-args "--allow-run-as-root --oversubscribe -x DDP_NOTEBOOK_TYPED=word-by-word"',
            timeout=180,
        )
        assert error is None and "DDP world ready: 2 ranks" in out, out
        pids = kernel_world_pids(kernel)
        out, error = kernel.run("%%ddp\nimport os\nprint(os.environ.get('DDP_NOTEBOOK_TYPED'))")
        assert error is None and {"[rank 0] word-by-word", "[rank 1] word-by-word"} <= set(out.splitlines()), out
        out, error = kernel.run("%ddp_stop")
        assert error is None and "stopped the world of 2 ranks" in out, out
        assert wait_gone(pids) == []
    finally:
        kernel.close()


@needs_mpi
def test_a_rank_killed_under_mpi_is_named_and_restart_recovers(no_leaks: None) -> None:
    world = DDPCluster(
        2, launcher="mpi", mpi_args="--oversubscribe", env=MPI_ENV, backend="gloo", collective_timeout=60
    )
    with world:
        victim = world.ranks[1].pid
        world.execute("x = 41", stream=False)
        began = time.monotonic()
        with pytest.raises(RankDiedError, match=r"rank 1 "):
            world.execute(f"import os, signal, time\nif rank == 1: os.kill({victim}, signal.SIGKILL)\ntime.sleep(30)")
        assert time.monotonic() - began < 15, "the death is reported within seconds"
        world.restart()
        assert world.execute("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False).value_text(1) == "2.0"


@pytest.fixture
def ipcluster(tmp_path: Path) -> Iterator[Path]:
    """A 2-engine cluster started the way a user would, outside any world: `ipcluster start`."""
    yield from running_ipcluster(tmp_path)


def test_attach_builds_a_world_and_stop_leaves_the_engines_running(ipcluster: Path) -> None:
    connection_file = str(ipcluster / "security" / "ipcontroller-t1-client.json")
    world = DDPCluster.attach_to(connection_file, n_ranks=2, collective_timeout=60)
    world.start()
    try:
        assert world.attached and world.pids == []  # nothing of ours to kill
        value = world.execute("t = torch.tensor([rank + 1.0]); dist.all_reduce(t); x = rank; t.item()", stream=False)
        assert [value.value_text(r) for r in (0, 1)] == ["3.0", "3.0"]
        engine_pids = [info.pid for info in world.ranks]
    finally:
        world.stop()
    time.sleep(0.5)
    assert all(pid_alive(pid) for pid in engine_pids), "the engines belong to the cluster: stop() lets them be"

    # the same cluster again, by profile directory and cluster id; state kept on the engines
    again = DDPCluster.attach_to(ipp_profile=str(ipcluster), cluster_id="t1", collective_timeout=60)
    with again:
        assert again.world_size == 2
        assert again.execute("x", stream=False).value_text(1) == "1"
        # restart cannot start processes here: it clears the namespaces and sets the group up again
        again.restart()
        assert again.execute("'x' in globals(), world_size", stream=False).value_text(0) == "(False, 2)"
        with pytest.raises(DDPUsageError, match=r"rank 2 does not exist"):
            again.execute("1", ranks=[2])
    assert all(pid_alive(pid) for pid in engine_pids)


def test_attach_to_more_engines_than_there_are_says_so(ipcluster: Path) -> None:
    world = DDPCluster.attach_to(ipp_profile=str(ipcluster), cluster_id="t1", n_ranks=3, start_timeout=3)
    with pytest.raises(Exception, match=r"only 2 of 3 ranks registered within 3 s at profile .*start more engines"):
        world.start()
    assert not world.running


def test_a_lost_controller_ends_the_cell_within_seconds(tmp_path: Path) -> None:
    """The controller of an attached cluster dies while the engines live on: no cell waits forever."""
    import ipyparallel as ipp

    elsewhere = ipp.Cluster(
        n=2, profile_dir=str(tmp_path / "profile_c"), cluster_id="c", controller_ip="127.0.0.1", log_level=40
    )
    elsewhere.start_cluster_sync()
    engine_pids: list[int] = []
    try:
        elsewhere.connect_client_sync().wait_for_engines(2, timeout=60, interactive=False)
        engine_pids = [launcher.pid for launcher in elsewhere.engines[next(iter(elsewhere.engines))].launchers.values()]
        world = DDPCluster.attach_to(ipp_profile=str(tmp_path / "profile_c"), cluster_id="c", collective_timeout=60)
        with world:
            controller_pid = elsewhere.controller.pid
            began = time.monotonic()
            with pytest.raises(RankDiedError, match=r"ranks 0-1 cannot be reached: the controller did not answer"):
                world.execute(
                    # the controller and the helpers it forked (its process group) go at once
                    "import os, signal, time\n"
                    f"if rank == 0: os.killpg({controller_pid}, signal.SIGKILL)\ntime.sleep(60)"
                )
            assert time.monotonic() - began < 15
            stopping = time.monotonic()
        assert time.monotonic() - stopping < 10, "letting go of a world whose controller is gone is quick"
    finally:
        # the engines this test started and their nannies, by PID (with its controller gone, a
        # nanny would wait for it forever)
        started = engine_pids + processes.descendants(engine_pids)
        for pid in started:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        controller_pid = elsewhere.controller.pid
        if pid_alive(controller_pid):
            os.killpg(controller_pid, signal.SIGKILL)
        assert wait_gone([*started, controller_pid]) == []
        processes.run_with_timeout(elsewhere.stop_cluster_sync, 20)
