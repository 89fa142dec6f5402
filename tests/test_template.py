"""Ranks forked from a warm template: their own processes in every way that matters, gone with the world."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from ddp_notebook import DDPCluster, RankDiedError
from ddp_notebook.world import template
from ddp_notebook.world.provisioning import LocalProvisioner
from tests.support.processes import pid_alive, wait_gone

pytestmark = pytest.mark.integration

PROBE = (
    "import os, sys, numpy\n"
    "probe = dict(pid=os.getpid(), ppid=os.getppid(), sid=os.getsid(0), slot=os.environ['DDP_NOTEBOOK_SLOT'],\n"
    "             threads=os.environ['OMP_NUM_THREADS'], draw=float(numpy.random.random()),\n"
    "             torch_threads=torch.get_num_threads(), argv=sys.argv[:1])\n"
)


def _template_of(world: DDPCluster) -> template.TemplateClient:
    provisioner = world.provisioner
    assert isinstance(provisioner, LocalProvisioner) and provisioner.template is not None
    return provisioner.template


def test_ranks_are_forked_from_a_template_and_are_their_own_processes(world: DDPCluster) -> None:
    warm = _template_of(world)
    world.execute(PROBE)
    probes = world.pull("probe")
    assert warm.pid in world.pids
    for rank, probe in probes.items():
        assert probe["ppid"] == warm.pid  # forked, not started
        assert probe["sid"] == probe["pid"]  # a session of its own: signals reach it alone
        assert probe["slot"] == str(rank)  # its own environment
        assert probe["threads"] == str(world.config.threads_per_rank) == str(probe["torch_threads"])
    assert probes[0]["draw"] != probes[1]["draw"], "forked ranks must not share numpy's random state"


def test_a_killed_forked_rank_is_named_with_how_it_ended(no_leaks: None) -> None:
    with DDPCluster(2, backend="gloo") as world:
        _template_of(world)
        kill_rank_1 = "import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(3)"
        with pytest.raises(RankDiedError, match="rank 1 was killed by SIGKILL"):
            world.execute(kill_rank_1)
        pids = world.all_pids
    assert wait_gone(pids) == []


def test_a_dead_ranks_own_children_go_with_it(no_leaks: None) -> None:
    """A rank killed while its DataLoader's workers run: the template, its parent, ends what the
    rank started with it (its process group), instead of leaving them to torch's 5 s watchdog."""
    with DDPCluster(2, backend="gloo", max_restarts=0) as world:
        world.execute(
            "from torch.utils.data import DataLoader\n"
            "loader = DataLoader(list(range(10_000)), batch_size=1, num_workers=2, persistent_workers=True)\n"
            "batches = iter(loader); next(batches)"
        )
        victim = world.ranks[1].pid
        workers = [child.pid for child in psutil.Process(victim).children(recursive=True)]
        assert len(workers) == 2
        os.kill(victim, signal.SIGKILL)
        assert wait_gone(workers, seconds=3) == []
        assert pid_alive(world.ranks[0].pid)  # the other rank and its workers are not touched
        assert len(psutil.Process(world.ranks[0].pid).children(recursive=True)) == 2


def test_restart_reuses_the_template(no_leaks: None) -> None:
    with DDPCluster(2, backend="gloo") as world:
        warm = _template_of(world)
        before = {info.rank: info.pid for info in world.ranks}
        world.execute("x = 1")
        world.restart()
        assert _template_of(world) is warm and warm.alive
        after = {info.rank: info.pid for info in world.ranks}
        assert set(before.values()).isdisjoint(after.values())  # new rank processes...
        assert not any(pid_alive(pid) for pid in before.values())
        assert world.execute("'x' in globals()", stream=False).value_text(0) == "False"  # ...with fresh state
        assert world.execute("rank * 2", stream=False).value_text(1) == "2"
        pids = world.all_pids
    assert wait_gone(pids) == [] and not pid_alive(warm.pid or 0)


def test_ranks_go_when_their_template_dies(no_leaks: None) -> None:
    world = DDPCluster(2, backend="gloo").start()
    try:
        warm = _template_of(world)
        ranks = [info.pid for info in world.ranks]
        os.kill(warm.pid or 0, signal.SIGKILL)
        # re-parented ranks notice their parent is gone and exit (as when a kernel dies)
        assert wait_gone(ranks, seconds=15) == []
    finally:
        world.stop()


def test_where_forking_is_unsafe_ranks_start_fresh() -> None:
    assert template.can_fork_ranks({"MY_SETTING": "1"}) is None
    assert "PYTHONPATH" in (template.can_fork_ranks({"PYTHONPATH": "/x"}) or "")
    assert "LD_PRELOAD" in (template.can_fork_ranks({"LD_PRELOAD": "/x.so"}) or "")
    cold = DDPCluster(1, backend="gloo", warm_start=False)
    provisioner = LocalProvisioner(cold.config, "/private")
    assert provisioner.cold_reason == "warm start is off"
    fresh = LocalProvisioner(DDPCluster(1, backend="gloo", env={"PYTHONPATH": "/x"}).config, "/private")
    assert fresh.cold_reason and "PYTHONPATH" in fresh.cold_reason


def test_a_cold_world_starts_each_rank_as_a_new_interpreter(no_leaks: None) -> None:
    with DDPCluster(1, backend="gloo", warm_start=False) as world:
        assert isinstance(world.provisioner, LocalProvisioner) and world.provisioner.template is None
        rank_pid = world.ranks[0].pid
        assert psutil.Process(rank_pid).cmdline()[1:4] == ["-m", "ddp_notebook.rank.entrypoints", "engine"]
        pids = world.all_pids
    assert wait_gone(pids) == []


def test_the_template_itself_starts_no_thread_and_no_cuda(tmp_path: object) -> None:
    warm = template.TemplateClient(sys.executable, {})
    warm.start()
    try:
        warm.wait_ready(time.monotonic() + 60)
        process = psutil.Process(warm.pid or 0)
        # one thread of Python; native pools (BLAS) are fork-aware; never a CUDA context
        assert process.num_threads() <= 2, process.threads()
        maps = open(f"/proc/{warm.pid}/maps").read()
        assert "libcuda.so" not in maps
    finally:
        warm.stop()
    assert not pid_alive(warm.pid or 0)
