"""DDPCluster: one world of ranks on an ipyparallel cluster, driven from Python.

It owns one `ipyparallel.Cluster` (controller + one engine per rank) and one `Client`,
keeps the rank -> engine map (engine ids are not ranks, and change on restart), sets up
the default process group on every rank, and runs cells on chosen ranks with their output
streamed back live. The magics are a thin layer over this class.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from . import _remote, channel, config, devices, layout, network, processes, stacks
from .entrypoints import OWNER_HOST_ENV, OWNER_PID_ENV, SLOT_ENV
from .errors import (
    CellInterruptedError,
    CellTimeoutError,
    DDPError,
    DDPUsageError,
    NotRunningError,
    RankDiedError,
    RankError,
    StartError,
    WorldBrokenError,
    one_line,
)
from .relay import CellRelay, OutputSink
from .syntax import check_syntax

log = logging.getLogger("ddp_notebook")

# ipyparallel's heartbeat paces engine registration: 3 s by default, which dominates start.
HEARTBEAT_PERIOD_MS = 200
# how long a busy rank may miss heartbeats before the controller drops it (10 s)
HEARTBEAT_MISSES = 50
# errors that mean the process group itself is broken and must be set up again
_COLLECTIVE_ERROR = re.compile(
    r"gloo|nccl|Connection closed by peer|Connection reset|ProcessGroup|Timed out|timed out|DistBackendError|"
    r"DistNetworkError|Default process group has not been initialized",
)
STOP_SECONDS = 10.0
# how often a running cell checks that the controller is still there, and how long it may take to answer
CONTROLLER_CHECK_SECONDS = 2.0
CONTROLLER_ANSWER_SECONDS = 3.0
# any other question to the controller
QUERY_SECONDS = 10.0
_BATCH_LAUNCHER_CLASSES = {
    "slurm": "SlurmEngineSetLauncher",
    "pbs": "PBSEngineSetLauncher",
    "sge": "SGEEngineSetLauncher",
    "lsf": "LSFEngineSetLauncher",
    "htcondor": "HTCondorEngineSetLauncher",
}
# engine set of a world started through a launcher that starts all ranks at once (mpi, slurm, ssh...)
WORLD_ENGINE_SET = "world"


class InsecureNetworkWarning(UserWarning):
    """The world's torch.distributed traffic crosses a network: it is neither encrypted nor authenticated."""


@dataclass(frozen=True)
class RankInfo:
    """Where one rank lives."""

    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    device_name: str
    gpu: str | None
    main_thread: int | None = None
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0


@dataclass(frozen=True)
class RankStatus:
    """One row of `status()`."""

    rank: int
    state: str  # idle | busy | gone
    host: str
    pid: int
    device: str
    memory_mb: float | None
    gpu_memory_mb: float | None


@dataclass
class CellResult:
    """What a cell gave back: per-rank last-expression values and (unstreamed) output."""

    ranks: tuple[int, ...]
    values: dict[int, dict[str, Any]] = field(default_factory=dict)
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    elapsed: float = 0.0

    def value_text(self, rank: int) -> str | None:
        """The plain-text form of `rank`'s last expression, if the cell ended in one."""
        bundle = self.values.get(rank)
        return None if bundle is None else str(bundle.get("text/plain", ""))


class DDPCluster:
    """A world of DDP ranks on this machine.

    >>> with DDPCluster(2) as world:                      # doctest: +SKIP
    ...     world.execute("print(rank, world_size)")
    [rank 0] 0 2
    [rank 1] 1 2

    Nothing starts until `start()` (or entering the `with` block); arguments are checked
    first, so a bad request starts nothing.
    """

    def __init__(
        self,
        n_ranks: int | None = None,
        *,
        backend: str = "auto",
        gpus: str | list[int | str] | tuple[int | str, ...] | None = None,
        timeout: float = config.DEFAULT_COLLECTIVE_TIMEOUT,
        cell_timeout: float | None = None,
        start_timeout: float = config.DEFAULT_START_TIMEOUT,
        env: dict[str, str] | None = None,
        ip: str | None = None,
        curve: bool = False,
        launcher: str = "local",
        hosts: str | Mapping[str, int] | None = None,
        partition: str | None = None,
        account: str | None = None,
        time_limit: str | None = None,
        mpi_args: str | Iterable[str] | None = None,
        ssh_args: str | Iterable[str] | None = None,
        settings: Iterable[str] | Mapping[str, Mapping[str, Any]] = (),
        profile: str | None = None,
        python: str | None = None,
        attach: config.AttachTarget | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        launch = config.LaunchConfig(
            launcher=launcher,
            profile=profile,
            settings=config.launcher_settings(
                launcher,
                hosts=hosts,
                partition=partition,
                account=account,
                time_limit=time_limit,
                mpi_args=mpi_args if mpi_args is None or isinstance(mpi_args, str) else list(mpi_args),
                ssh_args=ssh_args if ssh_args is None or isinstance(ssh_args, str) else list(ssh_args),
                settings=settings if isinstance(settings, Mapping) else list(settings),
            ),
            python=python or sys.executable,
            attach=attach,
        )
        self.config = config.resolve(
            n_ranks,
            backend=backend,
            gpus=gpus,
            timeout=timeout,
            cell_timeout=cell_timeout,
            start_timeout=start_timeout,
            env=env,
            ip=ip,
            curve=curve,
            launch=launch,
        )
        self._stdout = stdout
        self._stderr = stderr
        self._cluster: Any = None
        self._client: Any = None
        self._private_dir: str | None = None
        self._views: dict[tuple[int, ...], Any] = {}
        self._ranks: dict[int, RankInfo] = {}
        self._placements: list[layout.Placement] = []
        # per rank: (MASTER_ADDR, interface toward it); kept for heals
        self._network: dict[int, tuple[str, str | None]] = {}
        self._backend: str | None = None
        self._clear_namespaces = False
        self._controller_checked_at = 0.0
        self.start_seconds: float | None = None
        # what the ranks logged with ddp_notebook.log / progress, one Feed per cell
        self.recorder = channel.Recorder()
        # ranks whose process died, with how; a world with dead ranks must be restarted
        self.broken: dict[int, str] = {}
        # healthy | healing | broken; `needs_heal` once a cell broke the process group
        self.state = "stopped"
        self.needs_heal = False
        self.last_heal_seconds: float | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        return self._client is not None

    @classmethod
    def attach_to(
        cls,
        url_file: str | None = None,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        n_ranks: int | None = None,
        **options: Any,
    ) -> DDPCluster:
        """A world built from the engines of an ipyparallel cluster started elsewhere.

        Find it by its client connection file (`ipcontroller-client.json`), or by profile and
        cluster id (`ipcluster start --profile P --cluster-id C`). `n_ranks`: wait for that
        many engines (default: the ones registered now). `stop()` lets go of the engines and
        leaves them running: they belong to whoever started them.
        """
        target = config.AttachTarget(url_file=url_file, profile=profile, cluster_id=cluster_id)
        return cls(n_ranks, attach=target, **options)

    @property
    def world_size(self) -> int:
        if self._placements:
            return len(self._placements)
        return self.config.n_ranks or 0

    @property
    def backend(self) -> str:
        """nccl or gloo (for ranks started elsewhere: decided once they reported their GPUs)."""
        return self._backend or str(self.config.backend)

    @property
    def attached(self) -> bool:
        return self.config.launch.attach is not None

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts the ranks run on, in rank order."""
        return tuple(dict.fromkeys(info.host for info in self.ranks))

    @property
    def metrics(self) -> channel.Metrics:
        """Every point the ranks logged (`ddp_notebook.log`) in the latest cell that logged any."""
        return self.recorder.metrics

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return tuple(self._ranks[r] for r in sorted(self._ranks))

    def __enter__(self) -> DDPCluster:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<DDPCluster {self.world_size} ranks, {self.backend}, {state}>"

    def start(self) -> DDPCluster:
        """Start the controller and the ranks, and join them into one process group."""
        if self.running:
            raise DDPUsageError("this world is already running; stop() it first")
        began = time.perf_counter()
        # for files only this user may read: the ranks' stack dumps
        self._private_dir = tempfile.mkdtemp(prefix="ddp-notebook-")
        deadline = began + self.config.start_timeout
        try:
            if self.attached:
                self._connect_attached()
            elif self.config.launch.is_local:
                self._launch()
            else:
                self._launch_elsewhere()
            identities = self._wait_for_ranks(deadline)
            if self._clear_namespaces:
                self._client.clear(targets=[i.engine_id for i in identities], block=True)
            self._place(identities)
            self._plan_network(deadline)
            self._init_process_group(deadline)
        except BaseException as failure:
            self._teardown()
            if isinstance(failure, (DDPError, KeyboardInterrupt)):
                raise
            raise StartError(f"could not start the world: {failure}") from failure
        self.start_seconds = time.perf_counter() - began
        self.state = "healthy"
        return self

    def restart(self) -> DDPCluster:
        """Stop this world (whatever state it is in) and start a full one with the same settings.

        The ranks are new processes: their Python state is gone. An attached world cannot
        start processes: its engines' namespaces are cleared instead, and a lost engine must
        be started again where the cluster runs.
        """
        self.stop()
        self._clear_namespaces = self.attached
        try:
            return self.start()
        finally:
            self._clear_namespaces = False

    def stop(self) -> bool:
        """Stop every rank and the controller. Returns False if nothing was running."""
        if self._cluster is None and self._client is None:
            return False
        self._leave_process_group()
        self._teardown()
        return True

    def _launch(self) -> None:
        import ipyparallel as ipp

        cfg = self.config
        self._cluster = ipp.Cluster(
            n=0,
            delay=0,
            # no cluster file: nothing here reconnects to a world from another process
            cluster_file="",
            # start the ranks together with the controller, not after it: their imports
            # (ipyparallel, then torch) overlap the controller's start-up; they wait for its
            # connection file in the (user-private) profile security directory
            send_engines_connection_env=False,
            controller_ip=cfg.master_addr,
            controller_args=self._controller_args(),
            # ipyparallel logs every engine's log file when it exits non-zero; our own
            # messages say what matters, in one line
            log_level=logging.ERROR,
        )
        owner = {OWNER_PID_ENV: str(os.getpid())}
        self._cluster.start_controller_sync(
            controller_cmd=[sys.executable, "-m", "ddp_notebook.entrypoints", "controller"],
            environment=dict(owner),
        )
        # gloo and NCCL pick their interface from the hostname unless told: pin them to the
        # interface of the address the world listens on
        interface = network.interface_of(cfg.master_addr)
        for slot in range(cfg.n_ranks):
            environment = {
                **cfg.env,
                **owner,
                SLOT_ENV: str(slot),
                "OMP_NUM_THREADS": str(cfg.threads_per_rank),
                "PYTHONUNBUFFERED": "1",
            }
            if cfg.gpus:
                environment["CUDA_VISIBLE_DEVICES"] = cfg.gpus[slot]
            elif devices.visible_gpus():
                environment["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks on a GPU machine stay off the GPUs
            if interface:
                environment["GLOO_SOCKET_IFNAME"] = interface
                environment["NCCL_SOCKET_IFNAME"] = interface
            self._cluster.start_engines_sync(
                n=1,
                engine_set_id=_engine_set_id(slot),
                environment=environment,
                engine_cmd=[sys.executable, "-m", "ddp_notebook.entrypoints", "engine"],
                engine_args=[
                    f"--IPEngine.wait_for_url_file={cfg.start_timeout:g}",
                    # the nanny is one more Python process per rank, only needed to signal
                    # engines through the controller; we signal the PIDs we started
                    "--IPEngine.enable_nanny=False",
                ],
                delay=0,
            )
        self._client = self._cluster.connect_client_sync()

    def _launch_elsewhere(self) -> None:
        """Start the controller here and every rank through one ipyparallel engine launcher."""
        import ipyparallel as ipp
        from traitlets.config import Config

        cfg = self.config
        launch = cfg.launch
        settings = Config(self._launcher_defaults())
        settings.merge(Config({name: dict(traits) for name, traits in launch.settings.items()}))
        options: dict[str, Any] = {"profile": launch.profile} if launch.profile else {}
        self._cluster = ipp.Cluster(
            n=0,
            delay=0,
            cluster_file="",
            engines=launch.launcher,
            config=settings,
            controller_ip=cfg.master_addr,
            controller_args=self._controller_args(),
            log_level=logging.ERROR,
            **options,
        )
        owner = {OWNER_PID_ENV: str(os.getpid()), OWNER_HOST_ENV: socket.gethostname()}
        self._cluster.start_controller_sync(
            controller_cmd=[sys.executable, "-m", "ddp_notebook.entrypoints", "controller"],
            environment=dict(owner),
        )
        environment = {**cfg.env, **owner, "OMP_NUM_THREADS": str(cfg.threads_per_rank), "PYTHONUNBUFFERED": "1"}
        # the connection info (with the key) goes to the engines in their environment, so no
        # file has to be copied to their hosts; the nanny lets ranks elsewhere be interrupted
        self._cluster.start_engines_sync(
            n=cfg.n_ranks,
            engine_set_id=WORLD_ENGINE_SET,
            environment=environment,
            engine_cmd=[launch.python, "-m", "ddp_notebook.entrypoints", "engine"],
        )
        self._client = self._cluster.connect_client_sync()

    def _launcher_defaults(self) -> dict[str, dict[str, Any]]:
        """ipyparallel launcher settings that suit a world; the user's settings override them."""
        launch = self.config.launch
        if launch.launcher == "ssh":
            return {
                # every remote step runs this Python (ipyparallel's default is the remote PATH's
                # python3); no connection file is copied: the engines get the connection info
                # through ssh's stdin, never on a command line
                "SSHLauncher": {"remote_python": launch.python},
                "SSHEngineLauncher": {"to_send": []},
            }
        batch_class = _BATCH_LAUNCHER_CLASSES.get(launch.launcher)
        if batch_class is not None and self._private_dir is not None:
            # ipyparallel writes the batch script into the current (the notebook's) directory
            return {batch_class: {"batch_file_name": os.path.join(self._private_dir, f"{launch.launcher}_engines.sh")}}
        return {}

    def _connect_attached(self) -> None:
        import ipyparallel as ipp

        target = self.config.launch.attach
        assert target is not None
        arguments: dict[str, Any] = {}
        connection_file = target.url_file
        if connection_file is None:
            # the profile's client connection file, as ipyparallel names it
            profile_dir = self._profile_dir(target.profile)
            name = f"ipcontroller-{target.cluster_id}-client.json" if target.cluster_id else "ipcontroller-client.json"
            connection_file = os.path.join(profile_dir, "security", name)
        if not os.path.isfile(connection_file):
            raise DDPUsageError(
                f"no cluster connection file at {connection_file}: is the cluster running? "
                "(give its ipcontroller-client.json, or --profile and --cluster-id as given to ipcluster start)"
            )
        try:
            self._client = ipp.Client(connection_file, timeout=min(10.0, self.config.start_timeout), **arguments)
        except (OSError, TimeoutError, ValueError, KeyError) as failure:
            raise StartError(f"could not connect to the cluster at {target.describe()}: {one_line(failure)}") from None

    @staticmethod
    def _profile_dir(profile: str | None) -> str:
        """An IPython profile's directory: a path as given, a name looked up in IPYTHONDIR."""
        if profile and os.path.isdir(profile):
            return os.path.abspath(profile)
        from IPython.paths import get_ipython_dir

        return os.path.join(get_ipython_dir(), f"profile_{profile or 'default'}")

    def _controller_args(self) -> list[str]:
        return [
            f"--HeartMonitor.period={HEARTBEAT_PERIOD_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
            *(["--IPController.enable_curve=True"] if self.config.curve else []),
        ]

    def _wait_for_ranks(self, deadline: float) -> list[layout.EngineIdentity]:
        wanted = self.config.n_ranks
        client = self._client
        if wanted is None:  # attached, "every engine there": those registered by now
            wanted = len(client.ids)
            if wanted == 0:
                raise StartError(
                    f"the cluster at {self.config.launch.attach.describe() if self.config.launch.attach else '?'} "
                    "has no engines yet: start some, or say how many to wait for (%ddp_attach -n N)"
                )
        while len(client.ids) < wanted:
            dead = self._exited_slots()
            if dead:
                slot, detail = dead[0]
                who = f"rank {slot}" if self.config.launch.is_local else f"the {self.config.launch.launcher} launcher"
                raise StartError(f"{who} exited while starting{detail}")
            if time.perf_counter() > deadline:
                raise StartError(self._too_few_message(len(client.ids), wanted))
            time.sleep(0.02)
        engine_ids = sorted(client.ids)[:wanted] if self.attached else sorted(client.ids)
        described = client[engine_ids].apply_async(_remote.describe)
        try:
            reports = described.get(timeout=max(1.0, deadline - time.perf_counter()))
        except Exception as failure:  # noqa: BLE001  (any remote failure ends the start)
            raise StartError(f"the ranks did not say who they are: {one_line(failure)}") from None
        return [
            layout.EngineIdentity(
                engine_id=engine_id,
                host=report["host"],
                pid=report["pid"],
                slot=report["slot"],
                launcher_rank=report.get("launcher_rank"),
                gpus=tuple(report.get("gpus", ())),
            )
            for engine_id, report in zip(described.engine_id, reports)
        ]

    def _too_few_message(self, registered: int, wanted: int) -> str:
        cfg = self.config
        message = f"only {registered} of {wanted} ranks registered within {cfg.start_timeout:g} s"
        if cfg.launch.attach is not None:
            return message + f" at {cfg.launch.attach.describe()}; start more engines there, or attach with fewer"
        if cfg.launch.is_local:
            return message + "; raise start_timeout on a slow machine"
        hint = f"; ranks on other hosts must reach this machine at {cfg.master_addr}"
        if config.is_loopback(cfg.master_addr):
            hint = "; the controller listens on loopback only: give an address the rank hosts reach (--ip ADDRESS)"
        if cfg.launch.launcher in ("slurm", "pbs", "sge", "lsf", "htcondor"):
            hint += " (a batch job may also still be waiting in the queue: raise --start-timeout)"
        return message + hint

    def _place(self, identities: list[layout.EngineIdentity]) -> None:
        cfg = self.config
        if cfg.launch.is_local:
            self._backend = cfg.backend
            use_gpus = False  # local ranks got their GPU before they started
        else:
            has_gpus = layout.gpus_everywhere(identities)
            if cfg.backend == "nccl" and not has_gpus:
                raise StartError("backend 'nccl' needs one GPU per rank on every host; use --backend gloo")
            self._backend = "nccl" if cfg.backend == "nccl" or (cfg.backend == "auto" and has_gpus) else "gloo"
            use_gpus = self._backend == "nccl"
        self._placements = layout.place_ranks(identities, use_gpus)

    def _plan_network(self, deadline: float) -> None:
        """Pick MASTER_ADDR and each rank's interface; across hosts, check every rank reaches rank 0."""
        cfg = self.config
        placements = self._placements
        if cfg.launch.is_local or not layout.spans_hosts(placements):
            # one host: everything stays on its loopback (or on --ip for a local world)
            address = cfg.master_addr if cfg.launch.is_local else "127.0.0.1"
            interface = network.interface_of(address)
            self._network = {p.rank: (address, interface) for p in placements}
            return
        client = self._client
        engine_of_rank = {p.rank: p.engine_id for p in placements}
        wait = max(1.0, deadline - time.perf_counter())
        # rank 0's address on the route to the controller: the hosts reach the controller, so
        # this is the address of rank 0's host on the network they share
        rank0 = client[engine_of_rank[0]]
        destination = cfg.master_addr if not config.is_loopback(cfg.master_addr) else "192.0.2.1"
        address = rank0.apply_async(_remote.call_network, "source_address", destination).get(timeout=wait)
        if not address:
            raise StartError(f"rank 0 on {placements[0].host} has no route to {destination}")
        port = rank0.apply_async(_remote.call_network, "open_probe", address).get(timeout=wait)
        try:
            checks = {
                p.rank: client[p.engine_id].apply_async(_remote.call_network, "reach", address, port)
                for p in placements
            }
            unreachable = []
            for placement in placements:
                result = checks[placement.rank].get(timeout=max(1.0, deadline - time.perf_counter()) + 10)
                if result["error"]:
                    unreachable.append(f"rank {placement.rank} on {placement.host}: {result['error']}")
                self._network[placement.rank] = (address, result["interface"])
        finally:
            rank0.apply_async(_remote.call_network, "close_probe").get(timeout=10)
        if unreachable:
            raise StartError(
                f"rank 0 on {placements[0].host} listens at {address}, and "
                f"{'; '.join(unreachable)}: open TCP between the hosts (firewall), or start rank 0 on a host the "
                "others reach"
            )
        warnings.warn(
            InsecureNetworkWarning(
                f"the ranks span {len(set(p.host for p in placements))} hosts: torch.distributed's rendezvous and "
                "gloo/NCCL traffic between them is neither encrypted nor authenticated; run this only on a "
                "network you trust (ipyparallel's own messages are encrypted with CurveZMQ)"
            ),
            stacklevel=3,
        )

    def _init_process_group(self, deadline: float) -> None:
        cfg = self.config
        client = self._client
        placements = self._placements
        rank0_address = self._network[0][0]
        try:
            port = (
                client[placements[0].engine_id]
                .apply_async(_remote.call_rank, "open_rendezvous", rank0_address)
                .get(timeout=max(1.0, deadline - time.perf_counter()))
            )
        except Exception as failure:  # noqa: BLE001  (any remote failure ends the start)
            raise StartError(f"rank 0 could not set up torch.distributed: {one_line(failure)}") from None
        pending = {}
        for placement in placements:
            address, interface = self._network[placement.rank]
            spec = {
                "rank": placement.rank,
                "world_size": len(placements),
                "local_rank": placement.local_rank,
                "local_world_size": placement.local_world_size,
                "group_rank": placement.group_rank,
                "master_addr": address,
                "master_port": port,
                "backend": self.backend,
                "timeout": cfg.timeout,
                "threads": cfg.threads_per_rank,
                "stack_dir": self._private_dir if placement.host == socket.gethostname() else None,
                "gpu": placement.gpu,
                # a user's own GLOO/NCCL_SOCKET_IFNAME (env=...) wins over the route's
                "socket_ifname": None if "GLOO_SOCKET_IFNAME" in cfg.env else interface,
            }
            pending[placement.rank] = client[placement.engine_id].apply_async(_remote.call_rank, "init_world", spec)
        for placement in placements:
            rank = placement.rank
            try:
                info = pending[rank].get(timeout=max(1.0, deadline - time.perf_counter()))
            except Exception as failure:  # noqa: BLE001  (any remote failure ends the start)
                raise StartError(
                    f"rank {rank} on {placement.host} could not set up torch.distributed: {one_line(failure)}"
                ) from None
            self._ranks[rank] = RankInfo(
                rank=rank,
                engine_id=placement.engine_id,
                host=placement.host,
                pid=placement.pid,
                device=info["device"],
                device_name=info["device_name"],
                gpu=cfg.gpus[rank] if cfg.gpus else placement.gpu,
                main_thread=info.get("main_thread"),
                local_rank=placement.local_rank,
                local_world_size=placement.local_world_size,
                group_rank=placement.group_rank,
            )

    def _engine_set_of(self, rank: int) -> Any:
        if self._cluster is None:
            return None
        set_id = _engine_set_id(rank) if self.config.launch.is_local else WORLD_ENGINE_SET
        return self._cluster.engines.get(set_id)

    def _exit_code(self, rank: int) -> tuple[int | None, str] | None:
        """(exit code or None if unknown, log file) of a launcher process that has exited; None while it runs.

        Locally launched worlds have one launcher per rank; others one for all (mpiexec, one
        ssh per host, none that stays for a batch job).
        """
        import psutil  # ipyparallel depends on it

        engine_set = self._engine_set_of(rank)
        if engine_set is None:
            return None
        recorded = processes.recorded_exit(engine_set)
        if recorded is not None:
            return recorded, ""
        launchers = getattr(engine_set, "launchers", None)
        for launcher in launchers.values() if launchers else [engine_set]:
            log_file = getattr(launcher, "output_file", "")
            process = getattr(launcher, "process", None)
            if process is None:
                continue
            try:
                return process.wait(timeout=0), log_file
            except psutil.TimeoutExpired:
                continue  # still running
            except psutil.Error:  # reaped by the launcher's wait thread in the meantime
                return None, log_file
        info = self._ranks.get(rank)
        if info is not None and info.host == socket.gethostname() and not processes.pid_alive(info.pid):
            # gone, but its launcher has not recorded how yet: give it a moment to
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                recorded = processes.recorded_exit(engine_set)
                if recorded is not None:
                    return recorded, ""
                time.sleep(0.02)
            return None, ""
        return None

    def _exited_slots(self) -> list[tuple[int, str]]:
        exited = []
        slots = range(self.config.n_ranks or 0) if self.config.launch.is_local else [0]
        for slot in slots:
            found = self._exit_code(slot)
            if found is not None:
                code, log_file = found
                tail = processes.log_tail(log_file)
                exited.append((slot, f" ({processes.describe_exit(code)}){': ' + tail if tail else ''}"))
        return exited

    def _controller_lost(self, now_please: bool = False) -> str | None:
        """Why the controller cannot be reached any more (None while it can): checked at most every 2 s.

        Without it no result and no death notice would ever arrive, and a question to it
        (queue status) would wait forever.
        """
        now = time.monotonic()
        if not now_please and now < self._controller_checked_at + CONTROLLER_CHECK_SECONDS:
            return None
        self._controller_checked_at = now
        pid = processes.controller_pid(self._cluster)
        if pid is not None:
            return None if processes.pid_alive(pid) else "the controller process exited"
        if self._client is None:
            return None
        try:
            self._queue_status(CONTROLLER_ANSWER_SECONDS)
        except TimeoutError:
            return f"the controller did not answer within {CONTROLLER_ANSWER_SECONDS:g} s"
        except Exception as failure:  # noqa: BLE001  (closed sockets and the like)
            return f"the controller cannot be asked ({one_line(failure)})"
        return None

    def _queue_status(self, seconds: float) -> dict[int, Any]:
        """The controller's queue status; TimeoutError if it does not answer within `seconds`.

        `Client.queue_status` waits for the answer without limit; this sends the same request
        through the client's IO thread and bounds the wait (a late answer is simply dropped).
        """
        from ipyparallel import util

        client = self._client
        future = client._send(client._query_stream, "queue_request", content={"targets": None, "verbose": False})
        if not future.wait(seconds):
            raise TimeoutError(f"no answer within {seconds:g} s")
        content = dict(future.result()["content"])
        if content.pop("status") != "ok":
            raise DDPError(f"the controller could not say which ranks are busy: {content}")
        return util.int_keys(content)

    def _dead_ranks(self, ranks: Iterable[int]) -> dict[int, str]:
        """Ranks among `ranks` whose process is gone, with how each one ended."""
        ranks = list(ranks)
        lost = self._controller_lost()
        if lost is not None:
            return {rank: f"cannot be reached: {lost}" for rank in ranks}
        dead = {}
        if self.config.launch.is_local:
            for rank in ranks:
                found = self._exit_code(rank)
                if found is not None:
                    dead[rank] = processes.describe_exit(found[0])
            return dead
        # ranks elsewhere: a local PID can be checked; a remote rank is known lost once the
        # controller stops hearing its heartbeat (it then unregisters the engine)
        registered = set(self._client.ids) if self._client is not None else set()
        here = socket.gethostname()
        for rank in ranks:
            info = self._ranks.get(rank)
            if info is None:
                continue
            if info.host == here and not processes.pid_alive(info.pid):
                dead[rank] = "exited"
            elif info.engine_id not in registered:
                dead[rank] = (
                    f"on {info.host} was lost (it stopped answering the controller: its process, host or network "
                    "went down)"
                )
        return dead

    def _leave_process_group(self) -> None:
        # destroying the group before the processes go avoids gloo/nccl aborting on exit
        client = self._client
        if client is None:
            return
        if self._controller_lost(now_please=True) is not None:
            return  # nobody to ask; the processes go anyway
        try:
            skip = set(self._busy_ranks()) | set(self.broken)  # dead ranks cannot answer
            idle = [info.engine_id for info in self._ranks.values() if info.rank not in skip]
            if idle:
                client[idle].apply_async(_remote.call_rank, "shutdown_world").get(timeout=3)
        except Exception:
            log.debug("leaving the process group failed", exc_info=True)

    def _busy_ranks(self) -> list[int]:
        """Ranks with a request queued or running, in one question to the controller."""
        queues = self._queue_status(QUERY_SECONDS)
        return [info.rank for info in self.ranks if queues.get(info.engine_id, {}).get("queue", 0) > 0]

    def _teardown(self) -> None:
        client, cluster = self._client, self._cluster
        self._client = None
        self._cluster = None
        self._ranks = {}
        self._views = {}
        self._placements = []
        self._network = {}
        self.broken = {}
        self.state = "stopped"
        self.needs_heal = False
        if self.attached:
            # the engines belong to whoever started them: let go, leave them running
            if client is not None:
                try:
                    client.close()
                except Exception:
                    log.debug("closing the client failed", exc_info=True)
            self._remove_private_dir()
            return
        pids = self._started_pids(cluster)
        # the controller forks helpers (schedulers, hub); a rank may have DataLoader workers
        family = pids + processes.descendants(pids)
        if client is not None:
            try:
                # ask the ranks to exit cleanly first; stragglers get SIGTERM, then SIGKILL
                client.shutdown(targets="all", block=False)
                processes.wait_gone(
                    [info_pid for info_pid in pids if info_pid != processes.controller_pid(cluster)], 3.0
                )
            except Exception:
                log.debug("asking the ranks to shut down failed", exc_info=True)
            try:
                client.close()
            except Exception:
                log.debug("closing the client failed", exc_info=True)
        if cluster is not None:
            try:
                processes.run_with_timeout(cluster.stop_cluster_sync, STOP_SECONDS)
            except Exception:
                log.debug("stopping the cluster failed", exc_info=True)
            processes.kill_survivors(family)
        self._remove_private_dir()

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    @staticmethod
    def _started_pids(cluster: Any) -> list[int]:
        """PIDs of the processes this world launched (the only ones we may ever kill)."""
        if cluster is None:
            return []
        launchers = []
        if cluster.controller is not None:
            launchers.append(cluster.controller)
        for engine_set in cluster.engines.values():
            # a set of local engines has one launcher per engine; mpiexec is one for all
            per_engine = getattr(engine_set, "launchers", None)
            launchers.extend(per_engine.values() if per_engine is not None else [engine_set])
        return [launcher.pid for launcher in launchers if getattr(launcher, "pid", -1) > 0]

    @property
    def pids(self) -> list[int]:
        """PIDs of the controller and rank processes of this world."""
        return self._started_pids(self._cluster)

    @property
    def all_pids(self) -> list[int]:
        """`pids` and every process they started (all of it ends with `stop()`)."""
        pids = self.pids
        return pids + processes.descendants(pids)

    # ------------------------------------------------------------------ running cells

    def execute(
        self,
        code: str,
        ranks: Iterable[int] | str | None = None,
        *,
        timeout: float | None = None,
        stream: bool = True,
        on_data: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> CellResult:
        """Run `code` as a cell on `ranks` (default: all) and wait for it.

        Output streams back while the cell runs, each line tagged `[rank N] ` (written to
        this process's stdout/stderr); with `stream=False` it is collected in the result
        instead. Raises `RankError` if any rank raised (root cause first),
        `CellTimeoutError` past `timeout` seconds and `CellInterruptedError` on Ctrl-C /
        the notebook's stop button; in all three cases the ranks are left usable.

        `on_data(rank, data)` is called in this thread for each batch of plain data a rank
        publishes while the cell runs (metrics and progress, see `ddp_notebook.channel`).
        By default, progress is printed as text and the metrics are kept in `self.metrics`.
        """
        client = self._require_running()
        targets = self._select(ranks)
        if self.needs_heal:
            self.heal()
        if on_data is None:
            on_data = self.recorder.feed(self._text_view if stream else None, ranks=targets)
        check_syntax(code)
        timeout = self.config.cell_timeout if timeout is None else timeout
        if timeout is not None:
            config._check_seconds("cell timeout", timeout)
        engine_ids = [self._ranks[r].engine_id for r in targets]
        began = time.perf_counter()
        relay = CellRelay(client, targets)
        result = CellResult(ranks=targets)
        async_result = self._view(tuple(engine_ids)).execute(code, silent=False, block=False)
        relay.attach(async_result)
        sink = OutputSink(self._stdout, self._stderr, result if not stream else None, on_data)
        outcome = relay.wait(
            sink,
            timeout,
            interrupt=lambda: self._signal(targets, signal.SIGINT),
            find_dead=lambda: self._dead_ranks(targets),
            report_stuck=self.where_stuck,
            release=self._release_group,
        )
        result.elapsed = time.perf_counter() - began
        failures = relay.failures()
        if relay.released or any(_COLLECTIVE_ERROR.search(f.summary) for f in failures):
            self.needs_heal = True
        heal_note = self._heal_after_cell(relay) if self.needs_heal and not relay.dead else ""
        for rank, bundle in relay.values().items():
            result.values[rank] = bundle
        if outcome == "interrupted":
            busy = relay.unfinished()
            detail = f"; still running: {', '.join(map(str, busy))}" if busy else ""
            raise CellInterruptedError(f"cell interrupted on ranks {_rank_list(targets)}{detail}{heal_note}")
        if outcome == "timeout":
            assert timeout is not None
            raise CellTimeoutError(timeout, relay.unfinished(), relay.stuck_report + heal_note)
        if relay.dead:
            self.broken = dict(relay.dead)
            raise RankDiedError(relay.dead, failures)
        if failures:
            raise RankError(failures, busy_ranks=relay.unfinished(), note=heal_note.strip())
        return result

    # ------------------------------------------------------------------ healing

    def _release_group(self, ranks: tuple[int, ...]) -> None:
        """Make `ranks` let go of the process group, so peers blocked in it with them fail."""
        client = self._client
        engine_ids = [self._ranks[r].engine_id for r in ranks]
        try:
            client[engine_ids].apply_async(_remote.call_rank, "release_group").get(timeout=10)
        except Exception:
            log.debug("releasing the process group on ranks %s failed", ranks, exc_info=True)

    def _heal_after_cell(self, relay: CellRelay) -> str:
        busy = relay.unfinished()
        if busy:
            return (
                f"\nranks {_rank_list(busy)} are still blocked in a collective; they fail at the collective "
                f"timeout ({self.config.timeout:g} s), and the next cell then sets the process group up again "
                "(or %ddp_restart now)"
            )
        seconds = self.heal()
        return (
            f"\nthe process group was set up again in {seconds:.1f} s (variables kept; "
            "models from prepare_model were moved onto the new group)"
        )

    def heal(self) -> float:
        """Set the process group up again on every rank, keeping the ranks' Python state.

        Every rank leaves the old group; rank 0 opens a fresh rendezvous port; all join a new
        default group; models wrapped by `prepare_model` are moved onto it. Returns seconds.
        """
        client = self._require_running()
        began = time.perf_counter()
        busy = self._busy_ranks()
        if busy:
            raise DDPUsageError(
                f"rank(s) {_rank_list(busy)} are still busy (blocked in a collective until the collective "
                f"timeout of {self.config.timeout:g} s); wait for them, or %ddp_restart"
            )
        self.state = "healing"
        all_engines = [info.engine_id for info in self.ranks]
        try:
            client[all_engines].apply_async(_remote.call_rank, "release_group").get(timeout=30)
            self._init_process_group(time.perf_counter() + self.config.start_timeout)
        except DDPError:
            self.state = "broken"
            raise
        except Exception as failure:  # noqa: BLE001  (any remote failure leaves the world broken)
            self.state = "broken"
            raise DDPError(f"could not set the process group up again: {one_line(failure)}; %ddp_restart") from None
        self.state = "healthy"
        self.needs_heal = False
        self.last_heal_seconds = time.perf_counter() - began
        return self.last_heal_seconds

    def _text_view(self) -> channel.View:
        from .widgets import TextView

        return TextView(self._stdout)

    def _view(self, engine_ids: tuple[int, ...]) -> Any:
        # a DirectView costs ~0.2 ms to make; a notebook reuses a handful of rank sets
        view = self._views.get(engine_ids)
        if view is None:
            view = self._views[engine_ids] = self._client.direct_view(list(engine_ids))
        return view

    def _signal(self, ranks: Iterable[int], signum: int) -> None:
        if not self.config.launch.is_local:
            self._signal_elsewhere(ranks, signum)
            return
        cluster = self._cluster
        if cluster is None:
            return
        for rank in ranks:
            engine_set = cluster.engines.get(_engine_set_id(rank))
            if engine_set is not None:
                try:
                    engine_set.signal(signum)
                except Exception:
                    log.debug("signal to rank %s failed", rank, exc_info=True)

    def _signal_elsewhere(self, ranks: Iterable[int], signum: int) -> None:
        # a rank on this host gets the signal directly; one elsewhere through its engine's
        # nanny (ipyparallel's signal request, sent over the control channel)
        here = socket.gethostname()
        remote = []
        for rank in ranks:
            info = self._ranks[rank]
            if info.host == here and processes.pid_alive(info.pid):
                try:
                    os.kill(info.pid, signum)
                except OSError:
                    log.debug("signal to rank %s failed", rank, exc_info=True)
            else:
                remote.append(info.engine_id)
        if remote and self._client is not None:
            try:
                self._client.send_signal(signum, targets=remote, block=False)
            except Exception:
                log.debug("signal to engines %s failed", remote, exc_info=True)

    def where_stuck(self, ranks: Iterable[int] | str | None = None) -> str:
        """One line per rank saying where its main thread is (works while it is blocked)."""
        self._require_running()
        chosen = self._select(ranks)
        local = socket.gethostname()
        infos = {r: self._ranks[r] for r in chosen if self._ranks[r].host == local}
        if not infos or self._private_dir is None:
            return ""
        dumps = stacks.request_stacks({r: info.pid for r, info in infos.items()}, self._private_dir)
        lines = []
        for rank, info in infos.items():
            frames = stacks.main_thread_frames(dumps.get(rank, ""), info.main_thread or 0)
            lines.append(f"rank {rank}: {stacks.describe_stuck_rank(frames)}")
        return "\n".join(lines)

    def interrupt(self, ranks: Iterable[int] | str | None = None) -> None:
        """Send KeyboardInterrupt (SIGINT) to `ranks` (default: all)."""
        self._require_running()
        self._signal(self._select(ranks), signal.SIGINT)

    # ------------------------------------------------------------------ data in and out

    def push(self, namespace: Mapping[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        """Copy `namespace`'s values into the user namespace of `ranks` (default: all)."""
        client = self._require_running()
        targets = self._select(ranks)
        for name, value in namespace.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise DDPUsageError(f"cannot push {name!r}: names must be valid Python identifiers")
            try:
                pickle.dumps(value)
            except Exception as failure:  # noqa: BLE001
                raise DDPUsageError(
                    f"cannot push '{name}': {type(value).__name__} cannot be pickled ({one_line(failure)}); "
                    "send what it is built from and build it on the ranks instead"
                ) from None
        client[[self._ranks[r].engine_id for r in targets]].push(dict(namespace), block=True)

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> dict[int, Any]:
        """`name`'s value on each of `ranks` (default: all), as {rank: value}."""
        client = self._require_running()
        targets = self._select(ranks)
        pending = {
            rank: client[self._ranks[rank].engine_id].apply_async(_remote.pull_names, [name]) for rank in targets
        }
        values: dict[int, Any] = {}
        missing: list[int] = []
        for rank, result in pending.items():
            try:
                reply = result.get(timeout=60)
            except Exception as failure:  # noqa: BLE001
                raise DDPError(f"could not pull '{name}' from rank {rank}: {one_line(failure)}") from None
            if reply["missing"]:
                missing.append(rank)
            else:
                values[rank] = reply["found"][name]
        if missing:
            raise DDPUsageError(f"'{name}' is not defined on rank(s) {_rank_list(missing)}")
        return values

    # ------------------------------------------------------------------ status

    def status(self) -> list[RankStatus]:
        """State (idle/busy/gone), host, pid, device and memory of every rank."""
        self._require_running(allow_broken=True)
        try:
            queues = self._queue_status(QUERY_SECONDS)
        except TimeoutError:
            raise DDPError(
                f"the controller did not answer within {QUERY_SECONDS:g} s: is its host reachable? %ddp_restart"
            ) from None
        gpu_memory = devices.gpu_memory_by_pid() if any(info.gpu for info in self.ranks) else {}
        local_host = socket.gethostname()
        rows = []
        for info in self.ranks:
            entry = queues.get(info.engine_id)
            if entry is None or info.rank in self.broken:
                state = "gone"
            else:
                state = "busy" if entry.get("queue", 0) > 0 else "idle"
            rows.append(
                RankStatus(
                    rank=info.rank,
                    state=state,
                    host=info.host,
                    pid=info.pid,
                    device=info.device,
                    memory_mb=devices.resident_memory_mb(info.pid) if info.host == local_host else None,
                    gpu_memory_mb=gpu_memory.get(info.pid),
                )
            )
        return rows

    # ------------------------------------------------------------------ helpers

    def _require_running(self, allow_broken: bool = False) -> Any:
        if self._client is None:
            raise NotRunningError("no DDP world is running: start one first (%ddp_start N, or DDPCluster(N).start())")
        if self.broken and not allow_broken:
            ranks = ", ".join(f"rank {r} {how}" for r, how in sorted(self.broken.items()))
            raise WorldBrokenError(
                f"the world is broken ({ranks}): %ddp_restart (or restart()) starts a full world again"
            )
        return self._client

    def _select(self, ranks: Iterable[int] | str | None) -> tuple[int, ...]:
        size = self.world_size
        if ranks is None:
            return tuple(range(size))
        if isinstance(ranks, str):
            return config.parse_ranks(ranks, size)
        chosen = tuple(sorted(set(ranks)))
        outside = [r for r in chosen if not (isinstance(r, int) and 0 <= r < size)]
        if outside:
            raise DDPUsageError(f"rank(s) {_rank_list(outside)} do not exist: this world has ranks 0-{size - 1}")
        if not chosen:
            raise DDPUsageError("no ranks selected")
        return chosen


def _engine_set_id(slot: int) -> str:
    return f"rank{slot}"


def _rank_list(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks)
