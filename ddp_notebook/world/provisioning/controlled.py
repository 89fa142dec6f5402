"""What the two provisioners that start their own controller share: the ipyparallel Cluster,
its controller, the exit codes of its engine sets, and ending all of it."""

from __future__ import annotations

import logging
import math
import secrets
import sys
import time
from typing import Any

from ...cell.ipp_adapter import recorded_exit
from ...platform import processes
from ...platform.cluster_files import remove_cluster_files
from .. import detached
from .base import Provisioner

log = logging.getLogger("ddp_notebook")

# ipyparallel's heartbeat paces engine registration (an engine counts once it answered a beat,
# seen at the next one): 3 s by default, which dominates start. At 100 ms the controller wakes
# 10 times a second; a rank answers each beat in a zmq thread, without Python. (At 50 ms a start
# took 0.07 s less, and the controller's heart monitor, in Python, spent twice the CPU: 2.4% of a
# core more for an idle world of 4 ranks, taken from training ranks as well.)
HEARTBEAT_PERIOD_MS = 100
# how long a busy rank may miss heartbeats before the controller drops it: 10 s
HEARTBEAT_LIMIT_MS = 10_000
# the controller answers every rank's beat in Python: a larger world beats slower, so that it
# answers at most this many a second (64 ranks: every 100 ms; 1,024: every 1.6 s), the limit staying 10 s
HEARTBEAT_ANSWERS_PER_SECOND = 640
# ipyparallel's own wait for a registered engine's first heartbeat (its default)
REGISTRATION_SECONDS = 30


def registration_seconds(start_timeout: float) -> int:
    """How long the controller waits for a registered engine's first heartbeat: the world's start limit."""
    return max(REGISTRATION_SECONDS, math.ceil(start_timeout))


def heartbeat_period_ms(n_ranks: int | None) -> int:
    """The controller's heartbeat period for a world of `n_ranks` ranks (None: not known yet)."""
    return max(HEARTBEAT_PERIOD_MS, math.ceil((n_ranks or 0) * 1000 / HEARTBEAT_ANSWERS_PER_SECOND))


STOP_SECONDS = 10.0
ENTRY = "ddp_notebook.rank.entrypoints"


class ControlledProvisioner(Provisioner):
    """A provisioner whose world runs its own controller, in an `ipyparallel.Cluster` here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cluster: Any = None
        # chosen before the cluster is made (ipyparallel's form of id): a detached world's processes
        # are told their entry from the first one on, the rank template that starts beside the controller too
        self.world_id = f"{int(time.time())}-{secrets.token_hex(2)}"

    def owner_environment(self) -> dict[str, str]:
        """Tells the processes whose they are: they exit when this kernel dies (a detached world's
        outlive it: its controller ends the world once idle, the ranks end with their controller)."""
        if self.config.detach:
            return detached.environment(self.world_id, self.config.idle_limit)
        return processes.owner_environment()

    def make_cluster(self, controller_options: dict[str, Any] | None = None, **options: Any) -> Any:
        """An ipyparallel Cluster with its controller started; `controller_options` go to the controller's launcher."""
        import ipyparallel as ipp

        period = heartbeat_period_ms(self.config.n_ranks)
        self.cluster = ipp.Cluster(
            n=0,
            delay=0,
            # no cluster file: nothing here reconnects to a world from another process
            cluster_file="",
            cluster_id=self.world_id,
            controller_ip=self.config.master_addr,
            controller_args=[
                f"--HeartMonitor.period={period}",
                f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_LIMIT_MS // period}",
                # the schedulers as threads, not 8 processes: a controller forked from the warm
                # template (torch imported) took 40 ms to fork each; the message queues are
                # zmq devices either way, running without the GIL
                "--IPController.use_threads=True",
                # a registered engine the controller does not hear a heartbeat from within this long is
                # dropped without a word to it (it then waits forever as a rank of no world): 30 s by
                # default, less than a starved rank may take on a loaded machine (2 cores, 128 ranks
                # starting, or a browser drawing), so as long as the world's start may take
                f"--IPController.registration_timeout={registration_seconds(self.config.start_timeout)}",
                *(["--IPController.enable_curve=True"] if self.config.curve else []),
                # the hub keeps no record of tasks and their output: nothing here reads them back,
                # and by default it held every cell's messages for the world's life
                "--IPController.db_class=NoDB",
            ],
            # ipyparallel logs every engine's log file when it exits non-zero; our own
            # messages say what matters, in one line
            log_level=logging.ERROR,
            # ipyparallel's own stop at exit ends the processes but leaves the engine registry
            # and the world's private folder behind, and a stop of any kind can outlast the few
            # seconds a kernel is given to exit (one killed midway leaves its files): a process
            # that exits with its world running leaves the ending to the world's controller,
            # which watches it and ends the world, files and all, as when it is killed
            shutdown_atexit=False,
            **options,
        )
        self.cluster.start_controller_sync(
            controller_cmd=[sys.executable, "-m", ENTRY, "controller"],
            # a kernel that dies cannot remove the world's private folder (its key, the X-ray's
            # sockets, the rendezvous file): the controller, which outlives it by a second, does
            environment={**self.owner_environment(), processes.OWNER_FOLDERS_ENV: self.private_dir},
            **(controller_options or {}),
        )
        return self.cluster

    def engine_command(self, python: str) -> list[str]:
        return [python, "-m", ENTRY, "engine"]

    def engine_arguments(self) -> list[str]:
        """What every rank's engine is told, however it is launched."""
        # an engine waits 5 s for the controller's answer to its registration, then exits (255):
        # a controller answering 128 ranks on 2 cores, or a CurveZMQ handshake with a host under
        # load, takes longer, and the start lost those ranks without a word. The world's start
        # limit bounds the wait instead
        return [f"--IPEngine.timeout={registration_seconds(self.config.start_timeout)}"]

    def exit_of(self, engine_set_id: str, pid: int | None = None) -> tuple[int | None, str] | None:
        """(exit code or None if unknown, log file) of an engine set whose process exited; None while it runs.

        A locally launched rank has an engine set of its own; other launchers have one for
        all (mpiexec, one ssh per host, none that stays for a batch job).
        """
        import psutil  # ipyparallel depends on it

        engine_set = self.cluster.engines.get(engine_set_id) if self.cluster is not None else None
        if engine_set is None:
            return None
        recorded = recorded_exit(engine_set)
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
        if pid is not None and not processes.pid_alive(pid):
            # gone, but its launcher has not recorded how yet: give it a moment to
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                recorded = recorded_exit(engine_set)
                if recorded is not None:
                    return recorded, ""
                time.sleep(0.02)
            return None, ""
        return None

    def describe_start_exit(self, who: str, engine_set_id: str) -> str | None:
        found = self.exit_of(engine_set_id)
        if found is None:
            return None
        code, log_file = found
        tail = processes.log_tail(log_file)
        return f"{who} exited while starting ({processes.describe_exit(code)}){': ' + tail if tail else ''}"

    @property
    def pids(self) -> list[int]:
        return launched_pids(self.cluster)

    @property
    def controller_pid(self) -> int | None:
        return processes.controller_pid(self.cluster)

    def let_go(self) -> None:
        self.cluster = None  # its launchers are the world's now: nothing of them is stopped here
        super().let_go()

    def stop(self) -> None:
        client, cluster = self.client, self.cluster
        self.client = self.cluster = None
        pids = launched_pids(cluster)
        # a controller may fork helpers; a rank may have DataLoader workers
        family = pids + processes.descendants(pids)
        if client is not None:
            try:
                # ask the ranks to exit cleanly first; stragglers get SIGTERM, then SIGKILL
                client.shutdown(targets="all", block=False)
                controller = processes.controller_pid(cluster)
                began = time.monotonic()
                processes.wait_gone([pid for pid in pids if pid != controller], 3.0)
                # ranks elsewhere (no PID here): until their engines unregister, so that the
                # launcher's own stop finds them gone instead of signalling them one by one
                while _ranks_elsewhere(cluster) and client.ids and time.monotonic() - began < 3.0:
                    time.sleep(0.05)
            except Exception:
                log.debug("asking the ranks to shut down failed", exc_info=True)
            try:
                client.close()
            except Exception:
                log.debug("closing the client failed", exc_info=True)
        if cluster is not None:
            try:
                self._end_ranks_elsewhere(cluster)
            except Exception:  # what it left, the launchers' own stop ends
                log.debug("ending the ranks on other hosts failed", exc_info=True)
            try:
                processes.run_with_timeout(cluster.stop_cluster_sync, STOP_SECONDS)
            except Exception:
                log.debug("stopping the cluster failed", exc_info=True)
            processes.kill_survivors(family)
            remove_cluster_files(cluster.profile_dir, cluster.cluster_id)
            if self.config.detach:
                detached.forget(str(cluster.cluster_id))

    def _end_ranks_elsewhere(self, cluster: Any) -> None:
        """End the ranks on other hosts that are still there once asked to exit (a launcher's own way)."""


def launched_pids(cluster: Any) -> list[int]:
    """PIDs of the controller and engine processes an ipyparallel Cluster launched."""
    if cluster is None:
        return []
    launchers = []
    if cluster.controller is not None:
        launchers.append(cluster.controller)
    for engine_set in cluster.engines.values():
        # a set of local engines has one launcher per engine; mpiexec is one for all
        per_engine = getattr(engine_set, "launchers", None)
        launchers.extend(per_engine.values() if per_engine is not None else [engine_set])
    # an SSH launcher's PID is its process's on the other host: never one to signal here
    return [launcher.pid for launcher in launchers if getattr(launcher, "pid", -1) > 0 and not runs_elsewhere(launcher)]


def _ranks_elsewhere(cluster: Any) -> bool:
    """Whether a launcher of `cluster` runs its engine on another host."""
    if cluster is None:
        return False
    sets = cluster.engines.values()
    return any(runs_elsewhere(launcher) for engine_set in sets for launcher in launchers_of(engine_set))


def launchers_of(engine_set: Any) -> list[Any]:
    per_engine = getattr(engine_set, "launchers", None)
    return list(per_engine.values()) if per_engine is not None else [engine_set]


def runs_elsewhere(launcher: Any) -> bool:
    """True for a launcher whose process runs on another host (SSH): its `pid` is that host's."""
    from ipyparallel.cluster.launcher import SSHLauncher

    return isinstance(launcher, SSHLauncher)
