"""The multi-host test infrastructure (tests/support/multihost.py) works, and ipyparallel's MPI, SSH
and Slurm launchers start engines through it that register with a controller.

Each test checks that every process it started is gone afterwards; the fixtures check that the
namespaces are empty before they delete them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import multihost
from tests.support.multihost import Network, SlurmCluster, SSHHosts, mpi_env, mpiexec_args
from tests.support.processes import wait_gone

# the fixtures this module uses
multihost_network = multihost.multihost_network
multihost_ssh = multihost.multihost_ssh
multihost_slurm = multihost.multihost_slurm
slurm = multihost.slurm

pytestmark = pytest.mark.multihost

# MPIEngineSetLauncher always appends the `--mpi` flag, which makes the engine import mpi4py
# (a traitlets flag beats `--IPEngine.use_mpi=False` on the same command line); this engine
# command drops it, so the engines run without mpi4py and read their rank from the environment
ENGINE_WITHOUT_MPI4PY = [
    sys.executable,
    "-c",
    "import sys; sys.argv.remove('--mpi'); from ipyparallel.engine.app import main; main()",
]


def _shipped(function):
    """ipyparallel sends a function's code, and imports its module on the engine for its
    globals: a test module is not importable there, and these functions need no globals."""
    function.__module__ = "__main__"
    return function


@_shipped
def _describe(controller_ip: str) -> dict:
    """Runs on an engine: where it is."""
    import os
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((controller_ip, 9))  # no packet: only picks the route to the controller
        address = probe.getsockname()[0]
    with open("/proc/self/cmdline", "rb") as handle:
        cmdline = handle.read().decode()
    return {
        "hostname": socket.gethostname(),
        "address": address,
        "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMPI_COMM_WORLD", "SLURM_", "IPP_"))},
        "cmdline": cmdline,
    }


def _tree(pid: int) -> list[int]:
    try:
        process = psutil.Process(pid)
        return [pid, *(child.pid for child in process.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


@dataclass
class Started:
    cluster: Any  # ipyparallel.Cluster
    engines: list[dict]  # each engine's _describe()
    pids: list[int]  # checked after the stop: add what the test starts


@contextlib.contextmanager
def running_cluster(
    tmp_path: Path, engines: str, n: int, config, *, controller_ip: str = "127.0.0.1", curve: bool = False
) -> Iterator[Started]:
    """An ipyparallel Cluster with `n` engines from the `engines` launcher, stopped on exit,
    and then every PID in Started.pids must be gone."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(
        config=config,
        engines=engines,
        n=n,
        profile_dir=str(tmp_path / "profile"),
        cluster_file="",
        delay=0,
        controller_ip=controller_ip,
        controller_args=[
            "--HeartMonitor.period=200",
            *(["--IPController.enable_curve=True"] if curve else []),
        ],
        log_level=logging.WARNING,
    )
    pids: list[int] = []
    client = None
    try:
        client = cluster.start_and_connect_sync()
        pids += _tree(cluster.controller.pid)
        described = client[:].apply_async(_describe, controller_ip).get(timeout=60)
        pids += [d["pid"] for d in described]
        yield Started(cluster, described, pids)
    finally:
        if client is not None:
            client.close()
        cluster.stop_cluster_sync()
        assert wait_gone(pids) == [], "processes outlived the cluster"


def _wait_for_quiet(network: Network, ssh: SSHHosts, seconds: float = 10.0) -> list[int]:
    """PIDs in the hosts' namespaces other than the sshds, after waiting up to `seconds`."""
    others = [pid for pid in network.pids() if pid not in ssh.pids]
    return wait_gone(others, seconds)


# --------------------------------------------------------------------------------------------
# the infrastructure itself


def _tx_bytes(link: str) -> int:
    return int(Path(f"/sys/class/net/{link}/statistics/tx_bytes").read_text())


SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, peer = server.accept()
    received = 0
    while chunk := conn.recv(65536):
        received += len(chunk)
    print(peer[0], received, flush=True)
"""

CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
    conn.sendall(b"x" * int(sys.argv[3]))
"""


def test_tcp_between_namespaces_crosses_the_bridge(multihost_network: Network) -> None:
    h1, h2 = multihost_network
    assert h1.address != h2.address
    route = subprocess.run(h1.exec_args("ip", "route", "get", h2.address), capture_output=True, text=True)
    assert "dev eth0" in route.stdout, route.stdout
    size = 1_000_000
    before = _tx_bytes(h2.veth)  # the bridge delivers to h2 through this end of its link
    server = subprocess.Popen(h2.exec_args(sys.executable, "-c", SERVER, h2.address), stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        subprocess.run(h1.exec_args(sys.executable, "-c", CLIENT, h2.address, port, str(size)), check=True, timeout=30)
        peer, received = server.stdout.readline().split()
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert (peer, int(received)) == (h1.address, size)
    assert _tx_bytes(h2.veth) - before >= size
    assert multihost_network.pids() == []


def test_ssh_hosts_have_their_own_hostname_and_python(multihost_ssh: SSHHosts, multihost_network: Network) -> None:
    here = socket.gethostname()
    for host, name in zip(multihost_network, multihost_ssh.hosts):
        out = subprocess.run(
            multihost_ssh.ssh(
                name,
                sys.executable,
                "-c",
                "'import socket, sys; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()),"
                " sys.executable)'",
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [name, host.address, sys.executable]
        assert subprocess.run(multihost_ssh.ssh(name, "hostname"), capture_output=True, text=True).stdout == f"{name}\n"
    assert socket.gethostname() == here  # the hosts' names live in their own UTS namespaces
    assert _wait_for_quiet(multihost_network, multihost_ssh) == []


# --------------------------------------------------------------------------------------------
# Open MPI


def _require_mpi() -> None:
    if shutil.which("mpiexec") is None:
        pytest.skip("needs Open MPI's mpiexec (installed by .ci/install)")


def test_mpiexec_runs_ranks() -> None:
    _require_mpi()
    out = subprocess.run(
        [*mpiexec_args(2), sys.executable, "-c", "import os; print('rank=' + os.environ['OMPI_COMM_WORLD_RANK'])"],
        env={**os.environ, **mpi_env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # the ranks' lines reach mpiexec's stdout in any order, sometimes run together ("rank=0rank=1")
    assert sorted(re.findall(r"rank=(\d+)", out.stdout)) == ["0", "1"]
    assert out.stderr == ""


def test_ipyparallel_mpi_launcher(tmp_path: Path) -> None:
    _require_mpi()
    from traitlets.config import Config

    config = Config()
    launcher = config.MPIEngineSetLauncher
    launcher.environment = mpi_env()
    launcher.engine_cmd = ENGINE_WITHOUT_MPI4PY
    launcher.engine_args = ["--IPEngine.enable_nanny=False"]
    with running_cluster(tmp_path, "mpi", 2, config) as started:
        assert started.cluster.engine_set.args[:3] == ["mpiexec", "-n", "2"]
        started.pids += _tree(started.cluster.engine_set.pid)  # mpiexec, the one process ipyparallel tracks
        assert sorted(d["env"]["OMPI_COMM_WORLD_RANK"] for d in started.engines) == ["0", "1"]
        assert {d["env"]["OMPI_COMM_WORLD_SIZE"] for d in started.engines} == {"2"}


def test_ipyparallel_mpi_launcher_across_hosts(
    tmp_path: Path, multihost_network: Network, multihost_ssh: SSHHosts
) -> None:
    _require_mpi()
    from traitlets.config import Config

    config = Config()
    launcher = config.MPIEngineSetLauncher
    launcher.environment = mpi_env(multihost_network.subnet)
    # ranks on other hosts get only OMPI_* and the variables named by -x (values never on a
    # command line; OMPI_MCA_* values are, on orted's)
    launcher.mpi_args = [
        *mpiexec_args(2, multihost_ssh.hosts, multihost_ssh.config)[3:],
        *("-x", "IPP_CONNECTION_INFO", "-x", "IPP_CLUSTER_ID", "-x", "IPP_PROFILE_DIR"),
    ]
    launcher.engine_cmd = ENGINE_WITHOUT_MPI4PY
    launcher.engine_args = ["--IPEngine.enable_nanny=False"]
    with running_cluster(tmp_path, "mpi", 2, config, controller_ip=multihost_network.address, curve=True) as started:
        started.pids += _tree(started.cluster.engine_set.pid)
        by_rank = {d["env"]["OMPI_COMM_WORLD_RANK"]: d for d in started.engines}
        assert {rank: d["hostname"] for rank, d in by_rank.items()} == {"0": "ddp-h1", "1": "ddp-h2"}
        assert {rank: d["address"] for rank, d in by_rank.items()} == {
            "0": multihost_network[0].address,
            "1": multihost_network[1].address,
        }
    assert _wait_for_quiet(multihost_network, multihost_ssh) == []


# --------------------------------------------------------------------------------------------
# SSH


def _cmdlines() -> dict[int, str]:
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        found[process.pid] = " ".join(process.info["cmdline"] or [])
    return found


def test_ipyparallel_ssh_launcher(tmp_path: Path, multihost_network: Network, multihost_ssh: SSHHosts) -> None:
    from traitlets.config import Config

    config = Config()
    launcher = config.SSHEngineSetLauncher
    # to_send=[]: no connection files are copied, the engines get theirs from
    # $IPP_CONNECTION_INFO, which ipyparallel sends on ssh's stdin
    launcher.engines = {name: {"n": 1, "to_send": []} for name in multihost_ssh.hosts}
    launcher.ssh_args = multihost_ssh.ssh_args
    launcher.scp_args = multihost_ssh.ssh_args
    launcher.remote_python = sys.executable
    launcher.engine_args = ["--IPEngine.enable_nanny=False"]
    with running_cluster(tmp_path, "ssh", 2, config, controller_ip=multihost_network.address, curve=True) as started:
        launchers = started.cluster.engine_set.launchers
        assert sorted(launchers) == ["ddp-h1/0", "ddp-h2/0"]
        # the launcher's pid is the engine's, as seen on its host (one pid space here)
        assert sorted(launcher.pid for launcher in launchers.values()) == sorted(d["pid"] for d in started.engines)
        assert sorted((d["hostname"], d["address"]) for d in started.engines) == [
            (host.name, host.address) for host in multihost_network
        ]
        info = json.loads(started.engines[0]["env"]["IPP_CONNECTION_INFO"])
        # with CurveZMQ, ipyparallel drops HMAC signing (key ""), and nothing checks client
        # keys: the controller's public key is all a peer needs, so it must stay private
        assert info["key"] == "" and info["curve_serverkey"]
        assert info["interface"] == f"tcp://{multihost_network.address}"
        leaks = {pid: line for pid, line in _cmdlines().items() if info["curve_serverkey"] in line}
        assert leaks == {}, "connection info on a command line"
        assert all("IPP_CONNECTION_INFO" not in d["cmdline"] for d in started.engines)
    assert _wait_for_quiet(multihost_network, multihost_ssh) == []


# --------------------------------------------------------------------------------------------
# Slurm


def test_slurm_runs_a_job(slurm: SlurmCluster) -> None:
    out = slurm.run("srun", "-n", "2", "sh", "-c", "echo $SLURM_PROCID")
    assert sorted(out.stdout.split()) == ["0", "1"]
    assert slurm.wait_for_empty_queue() == []


def test_ipyparallel_slurm_launcher_across_hosts(
    tmp_path: Path, multihost_network: Network, multihost_slurm: SlurmCluster
) -> None:
    from traitlets.config import Config

    config = Config()
    launcher = config.SlurmEngineSetLauncher
    launcher.environment = dict(multihost_slurm.env)  # sbatch's environment (the job's too: --export=ALL)
    # ...but scancel runs with this process's environment only
    launcher.delete_command = ["env", f"SLURM_CONF={multihost_slurm.config}", "scancel"]
    launcher.signal_command = ["env", f"SLURM_CONF={multihost_slurm.config}", "scancel", "-s"]
    # the batch script goes to the current directory unless the name is a path
    launcher.batch_file_name = str(tmp_path / "engines.sbatch")
    # the default template asks only for --ntasks={n}, which Slurm packs onto one node
    launcher.batch_template = (
        "#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=ipengine-{cluster_id}\n"
        "#SBATCH --ntasks={n}\n#SBATCH --ntasks-per-node=1\n#SBATCH --output={output_file}\n"
        "srun {program_and_args}\n"
    )
    launcher.engine_args = ["--IPEngine.enable_nanny=False"]
    with running_cluster(tmp_path, "slurm", 2, config, controller_ip=multihost_network.address, curve=True) as started:
        job = started.cluster.engine_set.job_id
        assert multihost_slurm.jobs() == [job]
        by_rank = {d["env"]["SLURM_PROCID"]: d for d in started.engines}
        assert {rank: (d["hostname"], d["address"]) for rank, d in by_rank.items()} == {
            str(i): (host.name, host.address) for i, host in enumerate(multihost_network)
        }
        assert {d["env"]["SLURM_JOB_ID"] for d in started.engines} == {job}
        # the connection info travels in the job's environment, not in the script
        assert all("IPP_CONNECTION_INFO" in d["env"] for d in started.engines)
        assert "IPP_CONNECTION_INFO" not in (tmp_path / "engines.sbatch").read_text()
    assert multihost_slurm.wait_for_empty_queue() == []
