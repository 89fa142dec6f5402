"""Pure logic of worlds past one machine: rank layout per host, launcher options, addresses."""

from __future__ import annotations

import socket

import pytest

from ddp_notebook.errors import DDPUsageError
from ddp_notebook.platform import network
from ddp_notebook.world import config, launchers
from ddp_notebook.world.layout import EngineIdentity, gpus_everywhere, place_ranks, spans_hosts
from ddp_notebook.world.report import describe_layout


def engine(engine_id: int, host: str, launcher_rank: int | None = None, gpus: int = 0) -> EngineIdentity:
    return EngineIdentity(
        engine_id=engine_id,
        host=host,
        pid=1000 + engine_id,
        launcher_rank=launcher_rank,
        gpus=tuple(str(i) for i in range(gpus)),
    )


def test_ranks_are_contiguous_per_host_in_launcher_order() -> None:
    # engines registered in a shuffled order; MPI ranks say where each belongs
    engines = [engine(5, "b", 2), engine(1, "a", 1), engine(7, "b", 3), engine(3, "a", 0)]
    placed = place_ranks(engines, use_gpus=False)
    assert [(p.rank, p.engine_id, p.host, p.local_rank, p.local_world_size, p.group_rank) for p in placed] == [
        (0, 3, "a", 0, 2, 0),
        (1, 1, "a", 1, 2, 0),
        (2, 5, "b", 0, 2, 1),
        (3, 7, "b", 1, 2, 1),
    ]
    assert spans_hosts(placed)


def test_hosts_keep_ranks_together_even_when_the_launcher_interleaves_them() -> None:
    # round-robin placement (mpiexec --map-by node): ranks 0,2 on a and 1,3 on b
    engines = [engine(0, "a", 0), engine(1, "b", 1), engine(2, "a", 2), engine(3, "b", 3)]
    placed = place_ranks(engines, use_gpus=False)
    assert [(p.host, p.local_rank) for p in placed] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert [p.engine_id for p in placed] == [0, 2, 1, 3]


def test_without_launcher_ranks_engine_ids_decide() -> None:
    placed = place_ranks([engine(9, "x"), engine(4, "x")], use_gpus=False)
    assert [p.engine_id for p in placed] == [4, 9]
    assert not spans_hosts(placed)


def test_locally_started_ranks_keep_their_slot() -> None:
    engines = [
        EngineIdentity(engine_id=11, host="h", pid=1, slot=1),
        EngineIdentity(engine_id=10, host="h", pid=2, slot=0),
    ]
    assert [p.engine_id for p in place_ranks(engines, use_gpus=False)] == [10, 11]


def test_gpus_are_pinned_by_local_rank_and_checked() -> None:
    engines = [engine(0, "a", 0, gpus=2), engine(1, "a", 1, gpus=2), engine(2, "b", 2, gpus=1)]
    assert gpus_everywhere(engines)
    placed = place_ranks(engines, use_gpus=True)
    assert [p.gpu for p in placed] == ["0", "1", "0"]
    crowded = [engine(0, "a", 0, gpus=1), engine(1, "a", 1, gpus=1)]
    assert not gpus_everywhere(crowded)
    with pytest.raises(DDPUsageError, match="host a runs 2 ranks but its ranks see 1 GPU"):
        place_ranks(crowded, use_gpus=True)


def test_hosts_option_parses_counts() -> None:
    assert launchers.parse_hosts("node1,node2:2, node1:1") == {"node1": 2, "node2": 2}
    for bad in ("node1:x", "node1:0", ",", ":2"):
        with pytest.raises(DDPUsageError, match=r"host|--hosts"):
            launchers.parse_hosts(bad)


def test_settings_read_python_literals_or_strings() -> None:
    assert launchers.parse_setting("SlurmEngineSetLauncher.qos=high") == ("SlurmEngineSetLauncher", "qos", "high")
    assert launchers.parse_setting("--MPILauncher.mpi_args=['-x', 'A']") == ("MPILauncher", "mpi_args", ["-x", "A"])
    assert launchers.parse_setting("Cluster.engine_timeout=30") == ("Cluster", "engine_timeout", 30)
    with pytest.raises(DDPUsageError, match=r"write Class\.trait=value"):
        launchers.parse_setting("qos=high")


def test_launcher_options_map_to_ipyparallel_traits() -> None:
    slurm = launchers.settings_for("slurm", partition="gpu", account="ml", time_limit="1:00:00")
    assert slurm == {"SlurmEngineSetLauncher": {"queue": "gpu", "account": "ml", "timelimit": "1:00:00"}}
    ssh = launchers.settings_for("ssh", hosts="a:2,b", ssh_args="-F cfg", settings=["SSHLauncher.user=me"])
    assert ssh == {
        "SSHEngineSetLauncher": {"engines": {"a": 2, "b": 1}},
        "SSHLauncher": {"ssh_args": ["-F", "cfg"], "scp_args": ["-F", "cfg"], "user": "me"},
    }
    assert launchers.settings_for("mpi", mpi_args="--oversubscribe -x FOO") == {
        "MPIEngineSetLauncher": {"mpi_args": ["--oversubscribe", "-x", "FOO"]}
    }
    with pytest.raises(DDPUsageError, match="--hosts is for the ssh launcher; this world uses --launcher mpi"):
        launchers.settings_for("mpi", hosts="a")
    with pytest.raises(DDPUsageError, match="--partition is for the slurm launcher"):
        launchers.settings_for("local", partition="gpu")


def test_worlds_elsewhere_resolve_their_size_and_address() -> None:
    build = config.WorldConfig.build
    ssh = build(launcher="ssh", hosts="a:2,b:2", ip="127.0.0.1")
    assert ssh.n_ranks == 4 and ssh.backend == "auto"
    assert ssh.launch.settings == {"SSHEngineSetLauncher": {"engines": {"a": 2, "b": 2}}}
    with pytest.raises(DDPUsageError, match="5 ranks asked for but the ssh hosts list has slots for 4"):
        build(5, launcher="ssh", settings={"SSHEngineSetLauncher": {"engines": {"a": 4}}})
    # fewer ranks than slots: the first ones start, the rest are spare
    assert build(3, launcher="ssh", hosts="a:2,b:2", ip="127.0.0.1").n_ranks == 3
    with pytest.raises(DDPUsageError, match="say how many ranks to start with the mpi launcher"):
        build(launcher="mpi")
    with pytest.raises(DDPUsageError, match="--gpus chooses GPUs of this machine"):
        build(2, gpus="0,1", launcher="mpi")
    with pytest.raises(DDPUsageError, match="launcher must be one of local, mpi, slurm, ssh"):
        config.LaunchConfig("yarn")
    with pytest.raises(DDPUsageError, match="launcher must be one of local, mpi, slurm, ssh"):
        build(2, launcher="yarn")
    # mpi may run on this machine only: loopback unless asked; a batch launcher listens beyond it
    assert build(2, launcher="mpi").master_addr == "127.0.0.1"
    primary = network.primary_address()
    if primary is not None:
        slurm = build(2, launcher="slurm")
        assert slurm.master_addr == primary and slurm.curve
    attach = build(attach=config.AttachTarget(profile="p"))
    assert attach.n_ranks is None and not attach.launch.is_local


def test_routes_and_probe_on_loopback() -> None:
    assert network.source_address("127.0.0.1") == "127.0.0.1"
    assert network.interface_toward("127.0.0.1") is not None
    port = network.open_probe("127.0.0.1")
    try:
        assert network.reach("127.0.0.1", port)["error"] is None
    finally:
        network.close_probe()
    refused = network.reach("127.0.0.1", port, timeout=2)
    assert refused["error"] and refused["host"] == socket.gethostname()


def test_layout_line_names_each_hosts_ranks() -> None:
    from ddp_notebook.wire.results import RankInfo

    ranks = [
        RankInfo(rank=r, engine_id=r, host=h, pid=r, device="cpu", device_name="cpu", gpu=None)
        for r, h in enumerate("aab")
    ]
    assert describe_layout(ranks) == "a: ranks 0-1, b: rank 2"


def test_new_ranks_of_an_ssh_world_take_free_slots_of_its_hosts_list() -> None:
    slots = launchers.ssh_slots({"SSHEngineSetLauncher": {"engines": {"a": 1, "b": 2, "root@c:2222": {"n": 1}}}})
    assert slots == {"a": 1, "b": 2, "root@c:2222": 1}
    assert launchers.ssh_host_total({"SSHEngineSetLauncher": {"engines": slots}}) == 4
    # a rank whose process died on a host still there starts there again
    assert launchers.hosts_for_new_ranks([1], slots, {"a": 1, "b": 1}, former={1: "b"}) == {1: "b"}
    # a lost host takes none: its rank goes to the first free slot of the list (the spare one)
    assert launchers.hosts_for_new_ranks([0], slots, {"b": 2}, lost={"a"}, former={0: "a"}) == {0: "root@c:2222"}
    # growth fills the list's free slots in its order
    assert launchers.hosts_for_new_ranks([2, 3], slots, {"a": 1, "b": 1}) == {2: "b", 3: "root@c:2222"}
    with pytest.raises(
        DDPUsageError, match=r"no host of the list has a free slot for rank 3 \(a:1 \(lost\), b:2 \(runs 2\)"
    ):
        launchers.hosts_for_new_ranks([3], {"a": 1, "b": 2}, {"b": 2}, lost={"a"})
