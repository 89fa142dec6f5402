"""All ranks through one of ipyparallel's engine launchers (MPI, Slurm, SSH, PBS, ...)."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...platform import processes
from ...platform.processes import SLOT_ENV
from ...wire.results import Death, RankInfo
from .. import launchers
from ..config import is_loopback
from . import ssh_hosts
from .controlled import ControlledProvisioner, launchers_of, runs_elsewhere
from .ssh_hosts import ConcurrentSSHEngineSetLauncher

log = logging.getLogger("ddp_notebook")

# the one engine set of a world whose launcher starts all ranks at once
WORLD_ENGINE_SET = "world"
# launchers that can start one more rank while the world runs: SSH on a chosen host of the
# list, Slurm as a job of one task (a node that went silent excluded)
ADDS_RANKS = ("ssh", "slurm")
# how long ranks asked to leave (a resize) may take before they are killed
LEAVE_SECONDS = 10.0
# a start that failed shows the last lines of each rank's output, fetched for at most this long
OUTPUT_FETCH_SECONDS = 5.0
OUTPUT_LINES = 3
# what ipyparallel's engine logs once registered, and the controller's lines on a registration gone wrong
REGISTERED = "Completed registration with id"
REGISTRATION_TROUBLES = ("purging", "failed", "in use", "canceling", "ERROR", "WARNING")


class LauncherProvisioner(ControlledProvisioner):
    """The controller here; every rank started by the launcher named in the world's config."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (hostname, pid) of a rank process -> the host of the --hosts list it was started on
        self.listed_host: dict[tuple[str, int], str] = {}
        self._engine_sets = itertools.count(1)

    @property
    def starts_ranks(self) -> bool:  # type: ignore[override]
        return self.config.launch.launcher in ADDS_RANKS

    def start(self) -> Any:
        from traitlets.config import Config

        cfg = self.config
        launch = cfg.launch
        context = launchers.LaunchContext(python=launch.python, private_dir=self.private_dir)
        settings = Config(launchers.world_defaults(launch.launcher, context))
        settings.merge(Config({name: dict(traits) for name, traits in launch.settings.items()}))
        engines: Any = launch.launcher
        opening: list[Any] = []
        if launch.launcher == "ssh":
            engines, opening = ConcurrentSSHEngineSetLauncher, self._share_ssh_connections(settings)
        try:
            self.make_cluster(
                engines=engines,
                config=settings,
                **({"profile": launch.profile} if launch.profile else {}),
            )
        finally:
            ssh_hosts.wait_opened(opening)  # opened while the controller started
        # the connection info (with the key) goes to the engines in their environment, so no
        # file has to be copied to their hosts; the nanny lets ranks of batch and MPI launchers be
        # interrupted (an SSH world's are signalled over ssh).
        # An SSH hosts list with more slots than ranks starts the first ones (n is its limit).
        self.cluster.start_engines_sync(
            n=self.expected_ranks(),
            engine_set_id=WORLD_ENGINE_SET,
            environment=self._environment(),
            engine_cmd=self.engine_command(launch.python),
            engine_args=self.engine_arguments(),
        )
        self.client = self.cluster.connect_client_sync()
        return self.client

    def _share_ssh_connections(self, settings: Any) -> list[Any]:
        """Every ssh and scp of this world to a host over one connection (unless the user's own
        ssh arguments say how to share them); the masters start opening now, one per host at once."""
        user_args = list(settings.SSHLauncher.get("ssh_args", []))
        os.makedirs(self._ssh_folder(), mode=0o700, exist_ok=True)
        sharing = ssh_hosts.sharing_options(self._ssh_folder(), user_args)
        if not sharing:
            return []
        settings.SSHLauncher.ssh_args = sharing + user_args
        settings.SSHLauncher.scp_args = sharing + list(settings.SSHLauncher.get("scp_args", []))
        hosts = launchers.ssh_slots(self.config.launch.settings)
        ssh_cmd = list(settings.SSHLauncher.get("ssh_cmd", ["ssh"]))
        return ssh_hosts.open_masters(ssh_cmd, settings.SSHLauncher.ssh_args, hosts)

    def _ssh_folder(self) -> str:
        """Where the shared connections' sockets are: in the world's private folder."""
        return os.path.join(self.private_dir, "ssh")

    def _environment(self) -> dict[str, str]:
        cfg = self.config
        return {
            **cfg.env,
            **self.owner_environment(),
            "OMP_NUM_THREADS": str(cfg.threads_per_rank),
            "PYTHONUNBUFFERED": "1",
        }

    def engine_arguments(self) -> list[str]:
        arguments = super().engine_arguments()
        if self.config.launch.launcher == "ssh":
            # the nanny, one more Python process per rank (a starting rank waited 1.2 s for it), is
            # there only to relay the controller's signals; an SSH world signals its ranks over ssh
            arguments.append("--IPEngine.enable_nanny=False")
        return arguments

    def signal(self, ranks: Iterable[RankInfo], signum: int) -> None:
        if self.config.launch.launcher != "ssh":
            super().signal(ranks, signum)
            return
        ranks = list(ranks)
        launchers = self._launchers_of(ranks)
        found = {launcher.pid for launcher in launchers}
        # a rank whose launcher is not known (the ranks of this host, say) goes the usual way
        super().signal([info for info in ranks if info.pid not in found], signum)
        ssh_hosts.signal_on_hosts(launchers, signum)

    def learn(self, identities: Iterable[Any]) -> None:
        """Which host of the list each engine runs on: its launcher's remote PID is its process."""
        if self.cluster is None:
            return
        listed: dict[int, list[tuple[str, str]]] = {}  # pid -> [(host as listed, its hostname)]
        for host, launcher in self._remote_launchers():
            if getattr(launcher, "pid", -1) > 0:
                listed.setdefault(launcher.pid, []).append((host, str(getattr(launcher, "hostname", ""))))
        for identity in identities:
            candidates = listed.get(identity.pid, [])
            # PIDs of different hosts may coincide: the launcher whose hostname is the rank's wins
            named = [host for host, name in candidates if name.split(".")[0] == identity.host.split(".")[0]]
            found = named or [host for host, _ in candidates]
            if len(found) == 1:
                self.listed_host[(identity.host, identity.pid)] = found[0]

    def end_lost(self, ranks: Iterable[RankInfo]) -> None:
        """Lost ranks on this host by PID; a lost rank elsewhere through its launcher, off this
        thread (its host may not answer): a stopped or hung process would otherwise wait for the
        world's stop, whose bound its SIGTERM, wait and SIGKILL over ssh may not fit."""
        lost = list(ranks)
        super().end_lost(lost)
        for launcher in self._launchers_of(lost):
            threading.Thread(target=_kill_quietly, args=(launcher,), name="ddp-end-lost", daemon=True).start()

    def _launchers_of(self, ranks: Iterable[RankInfo]) -> list[Any]:
        """The running launchers on other hosts of `ranks` (by PID and the host `learn` found)."""
        return [
            launcher
            for info in ranks
            for host, launcher in self._remote_launchers()
            if getattr(launcher, "pid", -1) == info.pid and host == self.listed_host.get((info.host, info.pid))
        ]

    def _remote_launchers(self, cluster: Any = None) -> list[tuple[str, Any]]:
        """(host as listed, launcher) of each running engine launcher whose process is on another
        host, of `cluster` (by default the world's, while it has one)."""
        cluster = cluster if cluster is not None else self.cluster
        if cluster is None:
            return []
        return [
            (str(identifier).rpartition("/")[0], launcher)  # ipyparallel names them HOST/INDEX
            for engine_set in cluster.engines.values()
            for identifier, launcher in (getattr(engine_set, "launchers", None) or {}).items()
            if runs_elsewhere(launcher)
        ]

    def add(
        self,
        slots: Iterable[int],
        staying: Sequence[RankInfo] = (),
        replacing: Mapping[int, tuple[RankInfo, Death]] | None = None,
    ) -> None:
        if not self.starts_ranks:
            super().add(slots)
        replacing = replacing or {}
        if self.config.launch.launcher == "slurm":
            self._add_slurm_jobs(slots, replacing)
            return
        where = self.listed_host
        running = Counter(where.get((info.host, info.pid), "") for info in staying)
        # a rank lost without a word (no heartbeat) may have lost its host: none goes there
        lost = {where.get((info.host, info.pid), "") for info, death in replacing.values() if death.cause == "lost"}
        former = {
            rank: where[(info.host, info.pid)]
            for rank, (info, death) in replacing.items()
            if death.cause != "lost" and (info.host, info.pid) in where
        }
        slots_of_list = launchers.ssh_slots(self.config.launch.settings)
        plan = launchers.hosts_for_new_ranks(list(slots), slots_of_list, running, lost, former)
        for rank, host in plan.items():
            # one engine set per new rank, so that its slot (the rank it is for) is in its environment
            self.cluster.start_engines_sync(
                n=1,
                engine_set_id=f"rank-{rank}-{next(self._engine_sets)}",
                engines={host: 1},
                environment={**self._environment(), SLOT_ENV: str(rank)},
                engine_cmd=self.engine_command(self.config.launch.python),
                engine_args=self.engine_arguments(),
            )

    def _add_slurm_jobs(self, slots: Iterable[int], replacing: Mapping[int, tuple[RankInfo, Death]]) -> None:
        """One job of one task per new rank, from the world's own batch template and settings;
        a node whose rank went silent (no heartbeat: maybe the node is gone) is excluded, so Slurm
        does not place the new rank there (sbatch's command line wins over the template's lines)."""
        silent = sorted({info.host for info, death in replacing.values() if death.cause == "lost"})
        submit = list(launchers.slurm_submit_command(self.config.launch.settings))
        if silent:
            submit.append(f"--exclude={','.join(silent)}")
        for rank in slots:
            self.cluster.start_engines_sync(
                n=1,
                engine_set_id=f"rank-{rank}-{next(self._engine_sets)}",
                environment={**self._environment(), SLOT_ENV: str(rank)},
                engine_cmd=self.engine_command(self.config.launch.python),
                engine_args=self.engine_arguments(),
                submit_command=submit,
            )

    def remove(self, ranks: Iterable[RankInfo]) -> None:
        """Ranks leave a resized world: asked to exit through the controller, killed if they do not."""
        infos = list(ranks)
        ids = [info.engine_id for info in infos]
        if not ids or self.client is None:
            return
        try:
            self.client.shutdown(targets=ids, block=False)
        except Exception:
            log.debug("asking ranks %s to exit failed", ids, exc_info=True)
        deadline = time.monotonic() + LEAVE_SECONDS
        while set(ids) & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [info for info in infos if info.engine_id in set(self.client.ids)]
        if left:
            self.signal(left, signal.SIGKILL)

    def stop(self) -> None:
        elsewhere = [launcher for _, launcher in self._remote_launchers()]
        super().stop()
        for launcher in elsewhere:  # a rank whose host is gone was not stopped: nobody waits for it now
            end_watch = getattr(launcher, "end_watch", None)
            if end_watch is not None:
                end_watch()
        if self.config.launch.launcher == "ssh":
            left = ssh_hosts.end_masters(self._ssh_folder())
            if left:  # each ends by itself once idle
                log.debug("shared ssh connections that did not end at once: %s", left)

    def _end_ranks_elsewhere(self, cluster: Any) -> None:
        if self.config.launch.launcher != "ssh":
            return  # a batch system's ranks end with their job; MPI's with mpiexec
        ssh_hosts.end_on_hosts([launcher for _, launcher in self._remote_launchers(cluster)])

    def start_failure(self) -> str | None:
        return self.describe_start_exit(f"the {self.config.launch.launcher} launcher", WORLD_ENGINE_SET)

    def too_few_message(self, registered: int, wanted: int) -> str:
        cfg = self.config
        message = f"only {registered} of {wanted} ranks registered within {cfg.start_timeout:g} s"
        hint = f"; ranks on other hosts must reach this machine at {cfg.master_addr}"
        if is_loopback(cfg.master_addr):
            hint = "; the controller listens on loopback only: give an address the rank hosts reach (--ip ADDRESS)"
        if cfg.launch.launcher in ("slurm", "pbs", "sge", "lsf", "htcondor", "batch"):
            hint += " (a batch job may also still be waiting in the queue: raise --start-timeout)"
        return message + hint + "".join(f"; {said}" for said in self.what_starting_ranks_said())

    def what_starting_ranks_said(self) -> list[str]:
        """The last lines of each rank launcher's output and the controller's registration
        troubles: why a rank that was started never registered (it failed, or never reached the
        controller) is there, not in a file on another host."""
        said = []
        controller = getattr(self.cluster.controller, "output_file", "") if self.cluster is not None else ""
        lines = processes.log_tail(controller, 200, why_first=False).split(" | ")
        troubles = [
            line for line in lines if "registration::" in line and any(word in line for word in REGISTRATION_TROUBLES)
        ]
        if troubles:
            said.append("the controller: " + " | ".join(troubles[-2:]))
        sets = list(self.cluster.engines.values()) if self.cluster is not None else []
        for launcher in [launcher for engine_set in sets for launcher in launchers_of(engine_set)]:
            output: list[str] = []

            def fetch(launcher: Any = launcher, output: list[str] = output) -> None:
                # an SSH launcher fetches its remote log over ssh (bounded below). Removed once
                # read: the start has failed, and ipyparallel removes a remote log only on the
                # call that first fetched it
                output.append(launcher.get_output(remove=True) or "")

            processes.run_with_timeout(fetch, OUTPUT_FETCH_SECONDS)
            lines = [line.strip() for line in "".join(output).splitlines() if line.strip()]
            if lines and _not_registered_or_gave_up(lines):
                where = getattr(launcher, "location", "") or getattr(launcher, "identifier", "a rank")
                said.append(f"{where} said: " + " | ".join(lines[-OUTPUT_LINES:]))
        return said


def _kill_quietly(launcher: Any) -> None:
    try:
        launcher.signal(signal.SIGKILL)  # its engine's waiting thread then sees it end, and reads its log
    except Exception:
        log.debug("ending a lost rank through its launcher failed", exc_info=True)


def _not_registered_or_gave_up(lines: list[str]) -> bool:
    """Whether a rank's log says it never registered, or gave up after it did (a rank that
    registered and then lost the controller left the world before it formed)."""
    marks = [index for index, line in enumerate(lines) if REGISTERED in line]
    if not marks:
        return True
    after = lines[marks[-1] + 1 :]
    return any(mark in line for line in after for mark in processes.FATAL_MARKS)
