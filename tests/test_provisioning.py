"""Provisioners and the launcher registry: one interface, three ways of getting processes.

Unit tests use no processes (fake clients stand in for ipyparallel's); the last test adds a
real rank process to a running world through the provisioner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ddp_notebook import DDPCluster, WorldConfig
from ddp_notebook.errors import DDPUsageError, StartError
from ddp_notebook.platform import devices
from ddp_notebook.platform.limits import OomVerdict
from ddp_notebook.platform.processes import OWNER_PID_ENV, SLOT_ENV
from ddp_notebook.rank import calls as rank_calls
from ddp_notebook.wire.results import Death, RankInfo
from ddp_notebook.world import launchers
from ddp_notebook.world.config import AttachTarget
from ddp_notebook.world.provisioning import (
    AttachedProvisioner,
    LauncherProvisioner,
    LocalProvisioner,
    Provisioner,
    provisioner_for,
)
from ddp_notebook.world.provisioning.base import death_of
from tests.support.processes import wait_gone


@pytest.fixture
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: ())
    monkeypatch.setattr(devices, "usable_cpus", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "memory_limit", lambda: None)  # this machine's memory plays no part here


def _info(rank: int, pid: int, engine_id: int, host: str = "") -> RankInfo:
    import socket

    return RankInfo(rank, engine_id, host or socket.gethostname(), pid, "cpu", "cpu", None)


def test_each_way_of_getting_processes_has_its_provisioner(cpu_machine: None, tmp_path: object) -> None:
    local = provisioner_for(WorldConfig.build(2, backend="gloo"), "/private")
    mpi = provisioner_for(WorldConfig.build(2, launcher="mpi"), "/private")
    attached = provisioner_for(WorldConfig.build(attach=AttachTarget(profile="p")), "/private")
    assert (type(local), type(mpi), type(attached)) == (LocalProvisioner, LauncherProvisioner, AttachedProvisioner)
    assert all(isinstance(p, Provisioner) for p in (local, mpi, attached))
    assert local.starts_ranks_here and not mpi.starts_ranks_here and not attached.starts_ranks_here
    assert attached.clears_namespaces_on_restart and not local.clears_namespaces_on_restart
    # nothing started yet: nothing to signal, nothing to stop, no controller of ours
    for provisioner in (local, mpi, attached):
        assert provisioner.pids == [] and provisioner.controller_pid is None
        provisioner.stop()  # harmless before start


def test_local_ranks_get_their_environment_before_they_start(
    cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = LocalProvisioner(WorldConfig.build(2, backend="gloo", env={"MY_FLAG": "1"}), "/private")
    env = local.rank_environment(1)
    assert env[SLOT_ENV] == "1" and env[OWNER_PID_ENV] == str(os.getpid()) and env["MY_FLAG"] == "1"
    assert env["OMP_NUM_THREADS"] == "2"  # 4 cores, 2 ranks
    assert "CUDA_VISIBLE_DEVICES" not in env  # no GPUs on this machine: nothing to hide
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"]  # pinned to the loopback interface
    # on a GPU machine: every rank sees the world's GPUs in the same order; CPU ranks see none
    monkeypatch.setattr(devices, "visible_gpus", lambda: ("0", "1", "2", "3"))
    gpu_world = LocalProvisioner(WorldConfig.build(2, gpus="2,3"), "/private")
    assert [gpu_world.rank_environment(slot)["CUDA_VISIBLE_DEVICES"] for slot in (0, 1)] == ["2,3", "2,3"]
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert gpu_world.rank_environment(0)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # --gpus counts as nvidia-smi does
    cpu_world = LocalProvisioner(WorldConfig.build(2, backend="gloo"), "/private")
    assert cpu_world.rank_environment(0)["CUDA_VISIBLE_DEVICES"] == ""


def test_too_few_ranks_is_explained_per_provisioner(cpu_machine: None) -> None:
    local = LocalProvisioner(WorldConfig.build(2, backend="gloo", start_timeout=5), "/p")
    assert local.too_few_message(1, 2) == (
        "only 1 of 2 ranks registered within 5 s; raise start_timeout on a slow machine"
    )
    loopback_mpi = LauncherProvisioner(WorldConfig.build(2, launcher="mpi"), "/p")
    assert "listens on loopback only" in loopback_mpi.too_few_message(0, 2)
    attached = AttachedProvisioner(WorldConfig.build(3, attach=AttachTarget(url_file="/x.json")), "/p")
    assert "at /x.json; start more engines there" in attached.too_few_message(1, 3)


def test_attaching_to_nothing_is_a_usage_error(cpu_machine: None, tmp_path: object) -> None:
    missing = AttachedProvisioner(WorldConfig.build(attach=AttachTarget(url_file="/nonexistent.json")), "/p")
    with pytest.raises(DDPUsageError, match=r"no cluster connection file at /nonexistent\.json"):
        missing.start()


def test_attached_worlds_take_the_engines_there(cpu_machine: None) -> None:
    every = AttachedProvisioner(WorldConfig.build(attach=AttachTarget(profile="p")), "/p")
    every.client = SimpleNamespace(ids=[4, 2, 7])
    assert every.expected_ranks() == 3 and every.engine_ids(3) == [2, 4, 7]
    two = AttachedProvisioner(WorldConfig.build(2, attach=AttachTarget(profile="p")), "/p")
    two.client = SimpleNamespace(ids=[4, 2, 7])
    assert two.expected_ranks() == 2 and two.engine_ids(2) == [2, 4]
    every.client = SimpleNamespace(ids=[])
    with pytest.raises(StartError, match="has no engines yet"):
        every.expected_ranks()


def test_ranks_elsewhere_are_dead_when_their_pid_or_heartbeat_is_gone(cpu_machine: None) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        provisioner = LauncherProvisioner(WorldConfig.build(3, launcher="mpi"), "/p")
        provisioner.client = SimpleNamespace(ids=[10, 11])  # engine 12 was dropped by the controller
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait(10)
        ranks = [_info(0, sleeper.pid, 10), _info(1, gone.pid, 11), _info(2, 1, 12, host="elsewhere")]
        dead = provisioner.dead_ranks(ranks)
        assert set(dead) == {1, 2} and dead[1] == Death("exited", "exited")
        assert dead[2].cause == "lost" and "on elsewhere was lost" in str(dead[2])
        signalled: list[tuple[int, list[int]]] = []
        provisioner.client = SimpleNamespace(
            ids=[10, 11, 12], send_signal=lambda signum, targets, block: signalled.append((signum, targets))
        )
        provisioner.signal([ranks[0], ranks[2]], signal.SIGTERM)  # here by PID, elsewhere through the nanny
        assert sleeper.wait(10) == -signal.SIGTERM
        assert signalled == [(signal.SIGTERM, [12])]
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_local_ssh_and_slurm_worlds_add_ranks_the_other_launchers_do_not(cpu_machine: None) -> None:
    mpi = LauncherProvisioner(WorldConfig.build(2, launcher="mpi"), "/p")
    assert not mpi.starts_ranks
    with pytest.raises(DDPUsageError, match="--launcher mpi cannot add ranks"):
        mpi.add([2])
    assert LauncherProvisioner(WorldConfig.build(launcher="ssh", hosts="a:1,b:2", ip="127.0.0.1"), "/p").starts_ranks
    assert LauncherProvisioner(WorldConfig.build(2, launcher="slurm", ip="127.0.0.1"), "/p").starts_ranks
    assert not LauncherProvisioner(WorldConfig.build(2, launcher="pbs", ip="127.0.0.1"), "/p").starts_ranks


def test_a_slurm_rank_is_added_as_a_job_of_one_task_away_from_a_silent_node(cpu_machine: None) -> None:
    """Each new rank is a job of its own (its slot in its environment); a node whose rank went
    silent is excluded on sbatch's command line, which wins over the template's lines; a rank
    whose process died leaves its node usable; a site's own submit command is kept."""
    started: list[dict[str, object]] = []
    cluster = SimpleNamespace(start_engines_sync=lambda **options: started.append(options))
    settings = ["SlurmEngineSetLauncher.submit_command=['/site/sbatch', '--qos=debug']"]
    provisioner = LauncherProvisioner(WorldConfig.build(3, launcher="slurm", ip="127.0.0.1", settings=settings), "/p")
    provisioner.cluster = cluster
    silent = RankInfo(rank=1, engine_id=4, host="node7", pid=70, device="cpu", device_name="cpu", gpu=None)
    died = RankInfo(rank=2, engine_id=5, host="node8", pid=80, device="cpu", device_name="cpu", gpu=None)
    replacing = {1: (silent, Death("lost", "was lost")), 2: (died, Death("signal", "was killed"))}
    provisioner.add([1, 2], replacing=replacing)
    assert [o["submit_command"] for o in started] == [["/site/sbatch", "--qos=debug", "--exclude=node7"]] * 2
    assert [o["n"] for o in started] == [1, 1]
    assert [o["environment"][SLOT_ENV] for o in started] == ["1", "2"]  # type: ignore[index]
    # a rank waits for the controller's answer to its registration as long as the start may
    assert provisioner.config.start_timeout >= 30  # a batch job may wait in its queue
    wait = f"--IPEngine.timeout={provisioner.config.start_timeout:g}"
    assert [o["engine_args"] for o in started] == [[wait]] * 2
    assert len({o["engine_set_id"] for o in started}) == 2
    started.clear()
    provisioner.add([3])  # a resize: nothing to avoid
    assert started[0]["submit_command"] == ["/site/sbatch", "--qos=debug"]


def test_ssh_ranks_are_known_by_their_listed_host_and_never_signalled_here(cpu_machine: None) -> None:
    """An SSH launcher's PID is its process's on the other host: it maps a rank to its host of
    the list, and is never among the PIDs this machine may kill."""
    from ipyparallel.cluster.launcher import LocalEngineLauncher, SSHEngineLauncher, SSHEngineSetLauncher

    from ddp_notebook.world.layout import EngineIdentity
    from ddp_notebook.world.provisioning.controlled import launched_pids

    engine_set = SSHEngineSetLauncher()
    for identifier, hostname, pid in (("root@a:22/0", "a", 500), ("b/0", "b", 500), ("b/1", "b", 501)):
        engine_set.launchers[identifier] = SSHEngineLauncher(hostname=hostname, pid=pid)
    local = SimpleNamespace(launchers={"0": LocalEngineLauncher(pid=os.getpid())})
    cluster = SimpleNamespace(controller=None, engines={"world": engine_set, "here": local})
    assert launched_pids(cluster) == [os.getpid()]
    provisioner = LauncherProvisioner(WorldConfig.build(launcher="ssh", hosts="a:1,b:2", ip="127.0.0.1"), "/p")
    provisioner.cluster = cluster
    provisioner.learn([EngineIdentity(1, "a.cluster", 500), EngineIdentity(2, "b", 500), EngineIdentity(3, "b", 501)])
    assert provisioner.listed_host == {("a.cluster", 500): "root@a:22", ("b", 500): "b", ("b", 501): "b"}


def test_launchers_come_from_ipyparallel_entry_points() -> None:
    names = launchers.names()
    assert names[:4] == ("local", "mpi", "slurm", "ssh")
    assert {"pbs", "sge", "lsf", "htcondor"} <= set(names)
    assert launchers.check("SLURM") == "slurm"
    with pytest.raises(DDPUsageError, match="launcher must be one of local, mpi, slurm, ssh"):
        launchers.check("yarn")
    assert launchers.engine_class("slurm").__name__ == "SlurmEngineSetLauncher"
    assert [launchers.starts_ranks_elsewhere(n) for n in ("local", "mpi", "ssh", "slurm", "pbs")] == [
        False,
        False,
        True,
        True,
        True,
    ]
    context = launchers.LaunchContext(python="/opt/py", private_dir="/private")
    assert launchers.world_defaults("slurm", context) == {
        "SlurmEngineSetLauncher": {"batch_file_name": "/private/slurm_engines.sh"}
    }
    assert launchers.world_defaults("ssh", context)["SSHLauncher"] == {"remote_python": "/opt/py"}
    assert launchers.world_defaults("mpi", context) == {}


@pytest.mark.integration
def test_a_local_world_adds_a_rank_process_through_its_provisioner(no_leaks: None) -> None:
    with DDPCluster(2, backend="gloo") as world:
        provisioner = world.provisioner
        assert isinstance(provisioner, LocalProvisioner)
        provisioner.add([2])
        client = provisioner.client
        deadline = time.monotonic() + 60
        while len(client.ids) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        new = sorted(set(client.ids) - {info.engine_id for info in world.ranks})
        assert len(new) == 1
        identity = client[new[0]].apply_sync(rank_calls.describe)
        assert identity.slot == 2 and identity.pid in world.pids
        pids = world.all_pids
    assert wait_gone(pids) == []


def test_ranks_wait_for_a_controller_slow_to_answer_their_registration(no_leaks: None) -> None:
    """The controller stops answering for 8 s while the ranks register (as one does answering
    128 ranks on 2 cores): ipyparallel's engine gives up after 5 s and exits, which lost ranks
    from starts; a rank waits as long as the world's start may, and the world starts whole."""
    world = DDPCluster(2, backend="gloo", start_timeout=60)
    original_add = LocalProvisioner.add
    resumed: list[float] = []

    def add_with_controller_paused(self: LocalProvisioner, slots: object, *rest: object, **options: object) -> None:
        assert self.cluster is not None and self.cluster.controller is not None
        controller = self.cluster.controller.process.pid
        os.kill(controller, signal.SIGSTOP)
        try:
            original_add(self, slots, *rest, **options)  # type: ignore[arg-type]
            time.sleep(8)  # the ranks ask for registration into a silent controller
        finally:
            os.kill(controller, signal.SIGCONT)
            resumed.append(time.monotonic())

    LocalProvisioner.add = add_with_controller_paused  # type: ignore[method-assign]
    try:
        world.start()
    finally:
        LocalProvisioner.add = original_add  # type: ignore[method-assign]
    try:
        assert resumed, "the controller was paused while the ranks registered"
        assert world.world_size == 2
        assert world.execute("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False).value_text(0) == "2.0"
    finally:
        world.stop()


def test_a_death_says_its_cause_as_a_value_and_in_words() -> None:
    assert death_of(7) == Death("exited", "exited with code 7", 7)
    assert death_of(None) == Death("exited", "exited")
    segv = death_of(-signal.SIGSEGV)
    assert segv.cause == "signal" and segv.exit_code == -signal.SIGSEGV
    assert str(segv).endswith("(a crash in native code)")
    oom = death_of(-signal.SIGKILL, OomVerdict(True, "cgroup memory limit 1.5 GiB reached"))
    assert oom.cause == "out_of_memory"
    assert str(oom) == "was killed by the out-of-memory killer (cgroup memory limit 1.5 GiB reached)"
    not_memory = death_of(-signal.SIGKILL, OomVerdict(False))
    assert not_memory == Death("signal", "was killed by SIGKILL", -signal.SIGKILL)
    assert death_of(-signal.SIGKILL).cause == "signal"  # unknown: a signal, with the hint in its words


def test_a_start_error_quotes_the_ranks_that_never_registered_or_gave_up_after() -> None:
    from ddp_notebook.world.provisioning.launcher import _not_registered_or_gave_up

    registering = ["[IPEngineApp] Registering with controller at tcp://10.0.0.1:5000"]
    assert _not_registered_or_gave_up(registering)
    registered = [*registering, "[IPEngineApp] Completed registration with id 1"]
    assert not _not_registered_or_gave_up(registered)
    assert not _not_registered_or_gave_up([*registered, "[IPEngineApp] Starting to monitor the heartbeat"])
    assert _not_registered_or_gave_up([*registered, "[IPEngineApp] CRITICAL | received signal 15, stopping"])


def test_the_users_ipcluster_configuration_is_read_once_and_again_when_it_changes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ddp_notebook.world.provisioning import profile_config as profile_configuration

    user, world_profile = tmp_path / "profile_default", tmp_path / "world" / "profile"
    user.mkdir()
    config_file = user / "ipcluster_config.py"
    config_file.write_text("c.Cluster.delay = 0.5\n")
    first = profile_configuration.profile_config(str(user), str(world_profile))
    assert first.Cluster.delay == 0.5
    assert first.ProfileDir.location == str(world_profile)  # as if read from the world's own profile
    reads = []
    original = profile_configuration._read_profile
    profile_configuration._read_profile = lambda folder: reads.append(folder) or original(folder)  # type: ignore[assignment]
    try:
        again = profile_configuration.profile_config(str(user), str(world_profile))
        assert again.Cluster.delay == 0.5 and reads == []  # unchanged files: not read again
        config_file.write_text("c.Cluster.delay = 1.5  # edited\n")
        edited = profile_configuration.profile_config(str(user), str(world_profile))
        assert edited.Cluster.delay == 1.5 and reads == [str(user)]
    finally:
        profile_configuration._read_profile = original  # type: ignore[assignment]
    # a profile that does not exist holds no configuration
    assert not profile_configuration.profile_config(str(tmp_path / "none"), str(world_profile)).Cluster
