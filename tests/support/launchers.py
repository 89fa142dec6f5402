"""What the launchers' tests share: Open MPI's settings for a root user on a small machine
(`MPI_ENV`, `needs_mpi`), the body of a fixture yielding a cluster started elsewhere, as a user
does (`running_ipcluster`: `ipcluster start`), and a world started by the SSH launcher on the hosts of
tests/support/multihost.py (`ssh_world`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ddp_notebook import DDPCluster

if TYPE_CHECKING:
    from tests.support.multihost import Network, SSHHosts

# Open MPI refuses to run as root (CI, containers) unless told; two ranks on a 2-core machine
# need --oversubscribe when other processes hold cores
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
needs_mpi = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="Open MPI's mpiexec is not installed")


def running_ipcluster(tmp_path: Path) -> Iterator[Path]:
    """Body of a fixture yielding a 2-engine cluster started the way a user would, outside any world
    (`ipcluster start`, cluster id t1): its profile folder, under `tmp_path`."""
    profile_dir = tmp_path / "profile_elsewhere"
    command = [
        sys.executable,
        "-m",
        "ipyparallel.cluster",
        "start",
        "--n=2",
        f"--profile-dir={profile_dir}",
        "--cluster-id=t1",
        "--IPController.ip=127.0.0.1",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    connection_file = profile_dir / "security" / "ipcontroller-t1-client.json"
    deadline = time.monotonic() + 60
    while not connection_file.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    try:
        assert connection_file.exists(), "ipcluster did not start"
        import ipyparallel as ipp

        with ipp.Client(str(connection_file), timeout=30) as client:
            client.wait_for_engines(2, timeout=60)
        yield profile_dir
    finally:
        subprocess.run(
            [sys.executable, "-m", "ipyparallel.cluster", "stop", f"--profile-dir={profile_dir}", "--cluster-id=t1"],
            timeout=60,
            capture_output=True,
            check=False,
        )
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: only what it started
            process.wait(timeout=10)


def ssh_world(network: Network, ssh: SSHHosts, **options: object) -> DDPCluster:
    return DDPCluster(
        launcher="ssh",
        hosts=",".join(f"{host}:1" for host in ssh.hosts),
        ssh_args=ssh.ssh_args,
        ip=network.address,
        **{"backend": "gloo", "collective_timeout": 60, "start_timeout": 120, **options},  # type: ignore[arg-type]
    )
