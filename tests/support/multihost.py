"""Several "hosts" on one machine, for tests of worlds spread over hosts (SSH, MPI, Slurm).

Not a test file: context managers and fixtures for other tests. It needs root (CI is root) and
the Debian packages .ci/install adds; without them each skips with the reason.

- `network_namespaces(n)` -> Network: a bridge with an address (10.231.X.1/24, X free on this
  machine) in the root namespace and `n` network namespaces on it, each with its own address
  (10.231.X.11, .12, ...) and a default route via the bridge. Traffic stays on this machine.
- `ssh_hosts(network)` -> SSHHosts: an sshd in each namespace, in its own UTS and mount
  namespace (its hostname ddp-h1, ddp-h2...; an /etc/hosts naming every host, the bridge as
  ddp-gw), key-only root login; `ssh -F SSHHosts.config ddp-h1`. The filesystem is shared: the
  same `sys.executable` runs on every host.
- `mpi_env(subnet)` / `mpiexec_args(n, hosts, ssh_config)`: what Open MPI needs to run here as
  root, on this machine or across the hosts (its daemons started through our ssh config).
- `slurm_cluster(network=None)` -> SlurmCluster: slurmctld + slurmd (Debian 12's 22.05.8, no
  munge: `AuthType=auth/none`, `CredType=cred/none`, `ProctrackType=proctrack/linuxproc`,
  `TaskPlugin=task/none`), own config, ports and state; one node "ddp-n1" on this machine, or
  one node per host of `network` (its slurmd in the host's network and UTS namespaces).
- fixtures: multihost_network (2 hosts), multihost_ssh, slurm, multihost_slurm.

Teardown stops only the processes started here (PIDs checked by start time, plus, for Slurm,
the processes carrying its unique SLURM_CONF), removes every link, namespace and directory it
made, and fails the test if a process of the test outlived it. A run killed before its teardown
is cleaned up by the next one (records in /tmp/ddp-multihost).

Notes on ipyparallel 9.2's launchers (ipyparallel/cluster/launcher.py, shellcmd.py,
shellcmd_receive.py), each checked by test_multihost_infra.py:

All launchers. `Cluster.send_engines_connection_env` (default True) waits for the controller
and puts its engine connection info into `engine_set.environment["IPP_CONNECTION_INFO"]`;
`get_env()` = {IPP_CLUSTER_ID, IPP_PROFILE_DIR} + the `environment` trait. With
`--IPController.enable_curve=True` ipyparallel sets Session.key to b"" (no HMAC signing: "Message
signing is disabled" warnings) and installs no ZAP authenticator, so any peer holding the
controller's public key (`curve_serverkey` in that info) can connect: that key is the secret.
(Giving `Session.key` explicitly keeps HMAC signing on alongside CurveZMQ.)

MPI (`engines="mpi"`, MPIEngineSetLauncher): one local Popen of `mpi_cmd + ["-n", N] + mpi_args
+ engine_cmd + ["--mpi"] + cluster_args + engine_args`, env = os.environ + get_env(). Traits:
mpi_cmd (["mpiexec"]), mpi_args, engine_cmd, engine_args, environment. `--mpi` makes the engine
import mpi4py (engine id = MPI rank, `from mpi4py import MPI` in the user namespace); without
mpi4py the engine dies ("No module named 'mpi4py'"), and `--IPEngine.use_mpi=False` cannot undo
it (traitlets applies flags after key=value options). An engine command that drops "--mpi"
runs without mpi4py; ids are then in registration order and the rank is in the environment:
OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK, PMIX_RANK. Local ranks inherit mpiexec's environment.
Ranks on other hosts get only OMPI_* variables and those named by `-x NAME` (the value travels
inside Open MPI, not on a command line), so add `-x IPP_CONNECTION_INFO -x IPP_CLUSTER_ID -x
IPP_PROFILE_DIR`; but every OMPI_MCA_* value *is* put on the remote `orted` command line (visible
in ps there): no secret in OMPI_MCA_*. Across hosts: `--host h1:1,h2:1 --mca plm_rsh_agent "ssh -F
CONFIG"` plus oob/btl `tcp_if_include` = the hosts' subnet (`mpiexec_args`, `mpi_env(subnet)`);
the controller must listen where the hosts reach it (`Cluster(controller_ip=...)`). Open MPI
binds each rank to one core when N <= 2 (Cpus_allowed 0 and 1 here): mpi_env() turns binding
off. The one process ipyparallel tracks is mpiexec (`engine_set.pid`); SIGTERM to it takes the
ranks down (orted included).

SSH (`engines="ssh"`, SSHEngineSetLauncher): `engines={"HOST": N}` or `{"HOST": {"n": N, <any
SSHEngineLauncher trait>: ...}}` ("user@host:port" too). `ssh_args` / `scp_args` go to every
ssh / scp (`["-F", config]` here; ssh_cmd ["ssh"], scp_cmd ["scp"]). `remote_python` (default
"python3" from the remote PATH, i.e. sshd's default PATH: no venv/pyenv; give sys.executable) is
used for every remote step; engine_cmd defaults to `[remote_python, "-m", "ipyparallel.engine"]`.
Each remote step is `ssh HOST REMOTE_PYTHON` with a script on stdin (base64 JSON) that imports
ipyparallel (~0.6 s of CPU each): per engine, sequentially and blocking the event loop, an
`echo` probe, `python --version`, `python -m IPython profile create --profile-dir
REMOTE_PROFILE_DIR`, for each `to_send` file an exists/mkdir step and an scp, then the start;
then one ssh per engine stays open polling `ssh_waitpid` (poll_seconds 60). Stop per engine:
kill, wait, and get_output (exists, scp, remove of `REMOTE_PROFILE_DIR/log/ipengine-*.out`).
The start script sets os.environ and Popens the engine (start_new_session=True), so the
environment, IPP_CONNECTION_INFO included, is never on a command line (local or remote) and the
engine's argv is only engine_cmd + engine_args; the launcher's `pid` is the remote pid. `to_send`
defaults to scp of both connection files (`security/ipcontroller-<cluster_id>-{client,engine}.json`,
the client one too) into REMOTE_PROFILE_DIR; `to_send=[]` works: the engines use
IPP_CONNECTION_INFO. `remote_profile_dir` defaults to profile_dir less the local home (relative
to the remote home): on a shared filesystem that is the same directory (scp onto itself left
the files intact here). Stop: SIGTERM through ssh, SIGKILL after `stop_seconds_until_kill` (5).

Slurm (`engines="slurm"`, SlurmEngineSetLauncher): writes the batch script to
`os.path.join(work_dir, batch_file_name)`, and Cluster passes work_dir=".": the *current
directory*, unless batch_file_name (default "slurm_engine.sbatch") is absolute. Default
template: `#SBATCH --export=ALL`, `--job-name=ipengine-<cluster_id>`, `--ntasks={n}` (Slurm may
pack them onto one node: add `--ntasks-per-node=1` through `batch_template`),
`--output={output_file}` (profile_dir/log), `srun {program_and_args}`. `sbatch` runs with
os.environ + get_env(), so IPP_CONNECTION_INFO reaches the tasks through the job's environment
(kept by slurmctld in its StateSaveLocation, not written into the script; `{environment_json}`
would write it there); scancel (`delete_command`, `signal_command`) runs with os.environ only:
SLURM_CONF in `environment` does not reach it. Traits: submit_command (["sbatch"]),
delete_command (["scancel"]), signal_command (["scancel", "-s"]), queue (partition), account,
qos, timelimit, options (template-only), batch_template, batch_template_file, namespace.
`poll()` is not implemented: a job that dies goes unnoticed; stop is `scancel JOBID`, and the
job lingers "completing" ~1-2 s after. slurmd logs "mpi/pmix: can not load PMIx library" at
start (harmless: libpmix.so is in libpmix-dev); a first job waits ~2 s for the scheduler.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from tests.support.run_records import RunRecord, left_after, locked, reap_stale_runs, start_time, stop_pids

SUBNET_BASE = "10.231"  # hosts get 10.231.X.11, .12, ...; the bridge 10.231.X.1
STATE_DIR = Path(tempfile.gettempdir()) / "ddp-multihost"
SSH_PORT = 22


# ---------------------------------------------------------------------------------------------
# processes


def processes_with_env(entry: str) -> dict[int, float | None]:
    """Live processes whose environment has `entry` ("NAME=value"): pid -> start time."""
    found = {}
    marker = entry.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    start = start_time(int(name))
                    if start is not None:
                        found[int(name)] = start
        except OSError:
            continue
    return found


SSH_TOOLS = ("sshd", "ssh", "scp", "ssh-keygen", "unshare")


def _run(*cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _tool(name: str) -> str | None:
    """The path of a command, looked up in /usr/sbin and /sbin too (daemons live there)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"]))


def _require(*tools: str) -> None:
    missing = [tool for tool in tools if _tool(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (installed by .ci/install)")


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: creates network namespaces, a bridge and daemons")


def require_ssh_hosts() -> None:
    """Skip, with the reason, where `network_namespaces` and `ssh_hosts` cannot run (for a test
    that runs them in a process of its own)."""
    require_root()
    _require("ip", *SSH_TOOLS)


# ---------------------------------------------------------------------------------------------
# run records: what a run created, so a later run can clean up after one that was killed


@dataclass
class _Record(RunRecord):
    state_dir: ClassVar[Path] = STATE_DIR
    pid_maps: ClassVar[tuple[str, ...]] = ("processes",)
    links: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    processes: dict[int, float | None] = field(default_factory=dict)  # pid -> start time
    env_markers: list[str] = field(default_factory=list)  # processes with this NAME=value are ours
    paths: list[str] = field(default_factory=list)  # directories to remove

    def track(self, pid: int) -> None:
        self.processes[pid] = start_time(pid)
        self.save()


def _netns_pids(namespace: str) -> dict[int, float | None]:
    out = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    return {int(pid): start_time(int(pid)) for pid in out}


def _remove(record: _Record) -> list[str]:
    """Remove what `record` lists; returns what could not be removed."""
    problems = []
    pids = dict(record.processes)
    for namespace in record.namespaces:
        pids.update(_netns_pids(namespace))
    for marker in record.env_markers:
        pids.update(processes_with_env(marker))
    left = stop_pids(pids)
    if left:
        problems.append(f"processes still alive: {left}")
    existing = set(_run("ip", "netns", "list", check=False).stdout.split())
    for namespace in record.namespaces:
        if namespace in existing:
            result = _run("ip", "netns", "delete", namespace, check=False)
            if result.returncode:
                problems.append(f"ip netns delete {namespace}: {result.stderr.strip()}")
    for link in record.links:
        if Path(f"/sys/class/net/{link}").exists():
            result = _run("ip", "link", "delete", link, check=False)
            if result.returncode and Path(f"/sys/class/net/{link}").exists():
                problems.append(f"ip link delete {link}: {result.stderr.strip()}")
    for path in record.paths:
        shutil.rmtree(path, ignore_errors=True)
    return problems


# ---------------------------------------------------------------------------------------------
# network namespaces


@dataclass(frozen=True)
class Host:
    name: str  # "ddp-h1": its hostname once ssh_hosts runs, and its name in the ssh config
    address: str  # its address on the bridge
    netns: str  # `ip netns exec NETNS ...` runs a command on this host
    veth: str  # the root-namespace end of its link to the bridge

    def exec_args(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]


@dataclass
class Network:
    run_id: str
    bridge: str
    address: str  # the bridge's address: how the hosts reach this (root) namespace
    prefix: int
    hosts: list[Host]

    @property
    def subnet(self) -> str:
        return f"{self.address.rsplit('.', 1)[0]}.0/{self.prefix}"

    def pids(self) -> list[int]:
        """Every process running in one of the hosts' namespaces."""
        return sorted(pid for host in self.hosts for pid in _netns_pids(host.netns))

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]


def _free_subnet() -> str:
    """A 10.231.X prefix that no interface of this machine (in the root namespace) uses."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout + _run("ip", "-4", "route", "show").stdout
    free = [x for x in range(1, 255) if f" {SUBNET_BASE}.{x}." not in used]
    if not free:
        raise RuntimeError(f"no free {SUBNET_BASE}.X.0/24 on this machine")
    return f"{SUBNET_BASE}.{random.choice(free)}"


@contextlib.contextmanager
def network_namespaces(n: int = 2) -> Iterator[Network]:
    """A bridge and `n` namespaces joined to it: yields a Network (iterable of Host)."""
    require_root()
    _require("ip")
    reap_stale_runs(_Record, _remove)
    run_id = secrets.token_hex(3)  # interface names are limited to 15 characters
    record = _Record(run_id)
    bridge = f"ddpbr{run_id}"
    failure: BaseException | None = None
    try:
        with locked(STATE_DIR):  # two runs must not pick the same subnet
            net = _free_subnet()
            record.links.append(bridge)
            record.save()
            result = _run(
                "ip",
                "link",
                "add",
                bridge,
                "type",
                "bridge",
                # bridged frames must not go through the host's iptables FORWARD chain
                "nf_call_iptables",
                "0",
                "nf_call_ip6tables",
                "0",
                "nf_call_arptables",
                "0",
                check=False,
            )
            if result.returncode:
                pytest.skip(f"cannot create a bridge here: {result.stderr.strip()}")
            _run("ip", "addr", "add", f"{net}.1/24", "dev", bridge)
            _run("ip", "link", "set", bridge, "up")
        hosts = []
        for i in range(1, n + 1):
            host = Host(f"ddp-h{i}", f"{net}.{10 + i}", f"ddp-{run_id}-h{i}", f"ddpv{run_id}h{i}")
            record.namespaces.append(host.netns)
            record.links.append(host.veth)
            record.save()
            result = _run("ip", "netns", "add", host.netns, check=False)
            if result.returncode:
                pytest.skip(f"cannot create a network namespace here: {result.stderr.strip()}")
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _run("ip", "link", "set", host.veth, "master", bridge)
            _run("ip", "link", "set", host.veth, "up")
            _run(*host.exec_args("ip", "link", "set", "lo", "up"))
            _run(*host.exec_args("ip", "addr", "add", f"{host.address}/24", "dev", "eth0"))
            _run(*host.exec_args("ip", "link", "set", "eth0", "up"))
            _run(*host.exec_args("ip", "route", "add", "default", "via", f"{net}.1"))
            hosts.append(host)
        yield Network(run_id, bridge, f"{net}.1", 24, hosts)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        # what the test started there (sessions of an sshd, engines) may still be exiting
        leftover = left_after(lambda: {pid for ns in record.namespaces for pid in _netns_pids(ns)}, 5.0, 0.05)
        problems = _remove(record)
        if not problems:
            record.path.unlink(missing_ok=True)
        if failure is None and (problems or leftover):
            raise AssertionError(
                f"network {run_id}: processes left in its namespaces {sorted(leftover)} (stopped now); {problems}"
            )


# ---------------------------------------------------------------------------------------------
# ssh


@dataclass
class SSHHosts:
    config: Path  # ssh -F CONFIG HOST / scp -F CONFIG
    hosts: list[str]  # host names in the config, "ddp-h1", ...
    key: Path  # the client's private key
    pids: dict[int, float | None]  # sshd pid -> start time

    @property
    def ssh_args(self) -> list[str]:
        """For ipyparallel's SSH launchers: ssh_args and scp_args."""
        return ["-F", str(self.config)]

    def ssh(self, host: str, *cmd: str) -> list[str]:
        return ["ssh", *self.ssh_args, host, *cmd]


SSHD_CONFIG = """\
ListenAddress {address}:{port}
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitUserEnvironment no
X11Forwarding no
PrintMotd no
UseDNS no
MaxStartups 100
LogLevel ERROR
Subsystem sftp {sftp_server}
"""

SSH_CONFIG_HOST = """\
Host {name}
    HostName {address}
    Port {port}
"""

SSH_CONFIG_COMMON = """\
Host *
    User root
    IdentityFile {key}
    IdentitiesOnly yes
    BatchMode yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    GlobalKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectTimeout 10
    ServerAliveInterval 5
"""

# in the host's own UTS and mount namespaces: its hostname; an /etc/hosts naming every host
# and a resolv.conf without a reachable nameserver (a name missing from /etc/hosts fails at
# once instead of after a 10 s DNS timeout), both bind-mounted there only; the login user's
# ~/.bashrc hidden (bash reads it for every ssh command: a developer's pyenv/conda set-up there
# costs ~0.3-0.7 s per connection, and a cluster node would not have it); then sshd in the
# foreground (exec: the pid we get is sshd's)
HOST_INIT = (
    'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" /etc/resolv.conf'
    ' && { [ ! -f "$6" ] || mount --bind /dev/null "$6"; } && exec "$4" -D -e -f "$5"'
)


def _sftp_server() -> str:
    for path in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server"):
        if os.path.exists(path):
            return path
    return "internal-sftp"


def _wait_for_ssh(address: str, port: int, process: subprocess.Popen, log: Path, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((address, port), timeout=1) as conn:
                if conn.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {address}:{port} did not come up: {log.read_text().strip()}")
        time.sleep(0.02)


@contextlib.contextmanager
def ssh_hosts(network: Network) -> Iterator[SSHHosts]:
    """An sshd on every host of `network`; yields SSHHosts (config file, host names)."""
    _require(*SSH_TOOLS)
    sshd = _tool("sshd")
    assert sshd is not None
    # sshd refuses to start without its privilege separation directory
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"ddp-ssh-{network.run_id}-"))
    record = _Record(f"{network.run_id}-ssh", paths=[str(tmp)])
    record.save()
    bashrc = os.path.join(pwd.getpwuid(os.geteuid()).pw_dir, ".bashrc")
    processes: dict[int, subprocess.Popen] = {}
    pids: dict[int, float | None] = {}
    failure: BaseException | None = None
    try:
        key = tmp / "id_ed25519"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddp-multihost", "-f", str(key))
        authorized = tmp / "authorized_keys"
        # the key is good only from the bridge's subnet
        authorized.write_text(f'from="{network.subnet}" {key.with_suffix(".pub").read_text()}')
        hosts_file = tmp / "hosts"
        hosts_file.write_text(
            "127.0.0.1 localhost\n::1 localhost\n"
            f"{network.address} ddp-gw {socket.gethostname()}\n"
            + "".join(f"{host.address} {host.name}\n" for host in network)
        )
        resolv = tmp / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        config = tmp / "ssh_config"
        config.write_text(
            "".join(SSH_CONFIG_HOST.format(name=h.name, address=h.address, port=SSH_PORT) for h in network)
            + SSH_CONFIG_COMMON.format(key=key)
        )
        for host in network:
            home = tmp / host.name
            home.mkdir(mode=0o700)
            host_key = home / "ssh_host_ed25519_key"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", str(host_key))
            sshd_config = home / "sshd_config"
            sshd_config.write_text(
                SSHD_CONFIG.format(
                    address=host.address,
                    port=SSH_PORT,
                    host_key=host_key,
                    authorized_keys=authorized,
                    sftp_server=_sftp_server(),
                )
            )
            log = home / "sshd.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    host.exec_args(
                        "unshare",
                        "--uts",
                        "--mount",
                        "sh",
                        "-c",
                        HOST_INIT,
                        "sh",
                        host.name,
                        str(hosts_file),
                        str(resolv),
                        sshd,
                        str(sshd_config),
                        bashrc,
                    ),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            processes[process.pid] = process
            pids[process.pid] = start_time(process.pid)
            record.track(process.pid)
            _wait_for_ssh(host.address, SSH_PORT, process, log)
        yield SSHHosts(config, [host.name for host in network], key, dict(pids))
    except BaseException as exc:
        failure = exc
        raise
    finally:
        left = stop_pids(pids)
        for process in processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0)
        shutil.rmtree(tmp, ignore_errors=True)
        if not left:
            record.path.unlink(missing_ok=True)
        if failure is None and left:
            raise AssertionError(f"sshd processes outlived teardown: {left}")


# ---------------------------------------------------------------------------------------------
# Open MPI


def mpi_env(subnet: str | None = None) -> dict[str, str]:
    """Environment for Open MPI 4.1 (Debian 12) to run here as root, in a container or VM.

    `subnet` (e.g. network.subnet) keeps Open MPI's own traffic on the namespaces' bridge when
    it spans hosts; otherwise it may pick any interface.
    """
    env = {
        # mpiexec refuses to run as root without both
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # more ranks than cores (2 on CI) is fine for tests
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # by default each rank is bound to one core (N <= 2); let it use all, like a local rank
        "OMPI_MCA_hwloc_base_binding_policy": "none",
        # shared-memory single copy (CMA) needs ptrace rights many containers lack: plain copies
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        # no InfiniBand/UCX probing: TCP and shared memory only
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_btl": "self,vader,tcp",
    }
    if subnet:
        env["OMPI_MCA_oob_tcp_if_include"] = subnet
        env["OMPI_MCA_btl_tcp_if_include"] = subnet
    return env


def mpiexec_args(n: int, hosts: Sequence[str] = (), ssh_config: Path | None = None) -> list[str]:
    """`mpiexec -n N [--host ...]` with everything else in mpi_env(); with hosts, Open MPI
    starts its daemons there through `ssh -F ssh_config`."""
    args = ["mpiexec", "-n", str(n)]
    if hosts:
        slots = -(-n // len(hosts))
        args += ["--host", ",".join(f"{host}:{slots}" for host in hosts)]
    if ssh_config is not None:
        args += ["--mca", "plm_rsh_agent", f"ssh -F {ssh_config}"]
    return args


# ---------------------------------------------------------------------------------------------
# Slurm


@dataclass
class SlurmCluster:
    env: dict[str, str]  # SLURM_CONF: add to the environment of sbatch, squeue, ipyparallel...
    config: Path
    nodes: list[str]  # node names: "ddp-n1" on this machine, or the hosts' names
    partition: str
    pids: dict[int, float | None]  # slurmctld and slurmd(s): pid -> start time

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*cmd, check=check, env={**os.environ, **self.env})

    def jobs(self) -> list[str]:
        """Ids of the jobs in the queue (running, pending or completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def wait_for_empty_queue(self, seconds: float = 20.0) -> list[str]:
        """Wait until no job is left (a cancelled job stays "completing" while its steps
        exit); returns the jobs still there."""
        deadline = time.monotonic() + seconds
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return jobs


SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={controller}({controller_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=2
{nodes}PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def slurm_cluster(network: Network | None = None, idle_timeout: float = 20.0) -> Iterator[SlurmCluster]:
    """slurmctld + slurmd with their own config, ports and state; yields a SlurmCluster.

    Without `network`: one node, "ddp-n1", on this machine (127.0.0.1). With it: one node per
    host of `network`, named after the host; its slurmd runs in the host's network namespace
    with the host's name (own UTS namespace), so its tasks report that host's name and address.
    """
    require_root()
    _require("slurmctld", "slurmd", "sbatch", "sinfo", "scancel", "nsenter", "unshare")
    reap_stale_runs(_Record, _remove)
    run_id = secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix=f"ddp-slurm-{run_id}-"))
    config = tmp / "slurm.conf"
    env = {"SLURM_CONF": str(config)}
    full_env = {**os.environ, **env}
    # every process of this cluster (daemons, steps, tasks) inherits SLURM_CONF
    record = _Record(f"slurm-{run_id}", paths=[str(tmp)], env_markers=[f"SLURM_CONF={config}"])
    record.save()
    cpus = os.cpu_count() or 1
    if network is None:
        nodes = {"ddp-n1": "127.0.0.1"}
        namespaces = {"ddp-n1": None}
        controller_address = "127.0.0.1"
    else:
        nodes = {host.name: host.address for host in network}
        namespaces = {host.name: host.netns for host in network}
        controller_address = network.address
    node_lines = "".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN\n" for n, a in nodes.items())
    (tmp / "state").mkdir()
    for node in nodes:
        (tmp / f"spool-{node}").mkdir()
    config.write_text(
        SLURM_CONF.format(
            cluster=f"ddp{run_id}",
            partition="ddp",
            tmp=tmp,
            # slurmctld checks that it runs on the host this names
            controller=socket.gethostname().split(".")[0],
            controller_address=controller_address,
            ctld_port=_free_port(),
            d_port=_free_port(),
            nodes=node_lines,
        )
    )
    # -D: in the foreground (exec all the way: the pid we get is the daemon's); -N: its node.
    # A host's slurmd enters only the host's network namespace, not `ip netns exec`'s mount
    # namespace: slurmd 22.05 will not start without the cgroup mounts under /sys/fs/cgroup.
    daemons = {"slurmctld": [str(_tool("slurmctld")), "-D"]}
    for node, netns in namespaces.items():
        daemon = [str(_tool("slurmd")), "-D", "-N", node]
        if netns is not None:
            daemon = [
                "nsenter",
                f"--net=/run/netns/{netns}",
                "unshare",
                "--uts",
                "sh",
                "-c",
                'hostname "$1" && shift && exec "$@"',
                "sh",
                node,
                *daemon,
            ]
        daemons[f"slurmd-{node}"] = daemon
    pids: dict[int, float | None] = {}
    processes = []
    cluster: SlurmCluster | None = None
    failure: BaseException | None = None
    try:
        for name, cmd in daemons.items():
            with open(tmp / f"{name}.out", "wb") as out:
                process = subprocess.Popen(
                    cmd,
                    env=full_env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            processes.append(process)
            pids[process.pid] = start_time(process.pid)
            record.track(process.pid)
        deadline = time.monotonic() + idle_timeout
        while True:
            states = _run("sinfo", "-h", "-N", "-o", "%N %T", env=full_env, check=False).stdout.split()
            if states == [word for node in sorted(nodes) for word in (node, "idle")]:
                break
            dead = [" ".join(p.args) for p in processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in sorted(tmp.glob("*.*")) if p.is_file())
                raise RuntimeError(f"slurm nodes not idle ({states}, exited: {dead}):\n{logs}")
            time.sleep(0.2)
        cluster = SlurmCluster(env, config, list(nodes), "ddp", dict(pids))
        yield cluster
    except BaseException as exc:
        failure = exc
        raise
    finally:
        # jobs first: slurmd stops a cancelled job's steps, then the daemons can go
        jobs: list[str] = []
        if cluster is not None:
            with contextlib.suppress(Exception):
                jobs = cluster.jobs()
                if jobs:
                    cluster.run("scancel", "--full", *jobs, check=False)
                    cluster.wait_for_empty_queue()
        left = stop_pids(pids, seconds=10.0)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0)
        # slurmstepd detaches from slurmd (and ignores SIGTERM): find what is left of this
        # cluster (steps and their tasks) by the SLURM_CONF they inherited
        strays = processes_with_env(f"SLURM_CONF={config}")
        left += stop_pids(strays, seconds=2.0)
        shutil.rmtree(tmp, ignore_errors=True)
        if not left:
            record.path.unlink(missing_ok=True)
        if failure is None and (left or jobs or strays):
            raise AssertionError(f"slurm: outlived teardown {left}; jobs left {jobs}; stray processes {sorted(strays)}")


# ---------------------------------------------------------------------------------------------
# pytest fixtures (import them into a test module to use them)


@pytest.fixture
def multihost_network() -> Iterator[Network]:
    """Two namespace hosts on a bridge."""
    with network_namespaces(2) as network:
        yield network


@pytest.fixture
def multihost_ssh(multihost_network: Network) -> Iterator[SSHHosts]:
    """An sshd on each host of multihost_network."""
    with ssh_hosts(multihost_network) as hosts:
        yield hosts


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    """A one-node Slurm on this machine."""
    with slurm_cluster() as cluster:
        yield cluster


@pytest.fixture
def multihost_slurm(multihost_network: Network) -> Iterator[SlurmCluster]:
    """A Slurm node on each host of multihost_network."""
    with slurm_cluster(multihost_network) as cluster:
        yield cluster


if __name__ == "__main__":  # python3 tests/support/multihost.py: bring the hosts up, print how to use them
    with network_namespaces(2) as network, ssh_hosts(network) as ssh:
        print(f"bridge {network.bridge} {network.address}; hosts:")
        for host in network:
            print(f"  {host.name} {host.address} netns {host.netns}")
        print(f"ssh -F {ssh.config} ddp-h1    (Enter to tear down)")
        sys.stdin.readline()
