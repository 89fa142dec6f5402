"""Ranks on this machine, one process each, every one started with its own environment."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...errors import StartError
from ...platform import cluster_files, devices, limits, network, processes
from ...platform.processes import SLOT_ENV
from ...wire.results import Death, RankInfo
from .. import layout, spare, template
from ..config import WorldConfig
from .base import death_of
from .controlled import HEARTBEAT_LIMIT_MS, STOP_SECONDS, ControlledProvisioner, launched_pids
from .profile_config import profile_config
from .profile_config import read_ahead as profile_config_read_ahead

log = logging.getLogger("ddp_notebook")
# how long a gone rank's template may take to report its exit code (it reaps every 0.2 s)
EXIT_REPORT_SECONDS = 2.0


def user_profile_dir() -> str:
    """The IPython profile ipyparallel would use here: this shell's, else the default one."""
    from IPython import get_ipython
    from IPython.paths import get_ipython_dir

    profile_dir = getattr(get_ipython(), "profile_dir", None)
    if profile_dir is not None:
        return str(profile_dir.location)
    return os.path.join(get_ipython_dir(), "profile_default")


def read_profile_ahead() -> None:
    """Read the user's ipyparallel configuration now, for the worlds started here later."""
    profile_config_read_ahead(user_profile_dir())


def engine_set_id(slot: int) -> str:
    return f"rank{slot}"


class LocalProvisioner(ControlledProvisioner):
    """One ipyparallel engine set per rank, so that each rank gets an environment of its own
    (threads, GPUs, the slot it was started for) before it imports anything."""

    starts_ranks_here = True

    def __init__(self, config: WorldConfig, private_dir: str, warm: template.TemplateClient | None = None) -> None:
        super().__init__(config, private_dir)
        # ranks are forked from a warm template (torch imported once) unless that is off or unsafe
        self.cold_reason = "warm start is off" if not config.warm_start else template.can_fork_ranks(config.env)
        if warm is None and self.cold_reason is None and not config.detach:
            # started at %load_ext, with torch imported by now: the kernel's, which ends with it (a
            # detached world's ranks come from a template of its own, which lasts while they do)
            warm = spare.take_spare(config.env)
        self.template = warm if self.cold_reason is None and warm is not None and warm.running else None
        if warm is not None and self.template is None:
            warm.stop()
        # the out-of-memory kills counted so far where the ranks will run (they inherit this
        # process's cgroup): a rank found killed later is named for what killed it
        self.platform = limits.Platform()
        self.oom_before: limits.OomCounts | None = None
        # each dead process's death as first named (later checks of the same death say the same)
        self._named: dict[int, Death] = {}
        # what CUDA_VISIBLE_DEVICES lists for every rank started here: the world's GPUs, in
        # order; a resize appends free GPUs of this machine, so a running rank's list stays a
        # prefix of it and its CUDA device numbers keep their meaning
        self.world_gpus: tuple[str, ...] = tuple(config.gpus)

    def start(self) -> Any:
        self.oom_before = self.platform.oom_counts()
        options: dict[str, Any] = {}
        controller_options: dict[str, Any] = {}
        if self.cold_reason is None:
            from .fork import ForkControllerLauncher, ForkEngineSetLauncher

            if self.template is None:
                # its imports run while the controller starts
                self.template = template.TemplateClient(sys.executable, self.owner_environment())
                self.template.start()
            elif self.template.try_connect():
                # a template that is ready (kept from a restart, or started at %load_ext) forks the
                # controller too: no interpreter to start and nothing to import
                options["controller"] = ForkControllerLauncher
                controller_options["template"] = self.template
            options["engines"] = ForkEngineSetLauncher
        world_profile = cluster_files.private_profile(self.private_dir, user_profile_dir())
        self.make_cluster(
            controller_options,
            # start the ranks together with the controller, not after it: their imports (or the
            # template's) overlap the controller's start-up; they wait for its connection file
            # in the world's profile (in its private folder, as is everything ipyparallel writes
            # for the world: nothing of it stays in the user's profile, however the world ends)
            send_engines_connection_env=False,
            profile_dir=world_profile,
            profile_config=profile_config(user_profile_dir(), world_profile),
            **options,
        )
        if self.template is not None:
            try:
                self.template.wait_ready(time.monotonic() + self.config.start_timeout)
            except TimeoutError:
                raise StartError(self.too_few_message(0, self.expected_ranks())) from None
            except RuntimeError as failure:
                raise StartError(str(failure)) from None
        self.add(range(self.expected_ranks()))
        self.client = self.cluster.connect_client_sync()
        return self.client

    def keep_warm(self) -> template.TemplateClient | None:
        """Hand the template over to the next world (a restart), so it is not stopped with this one
        (a detached world's tells its processes their world's entry: the next world has its own)."""
        if self.config.detach:
            return None
        warm, self.template = self.template, None
        return warm

    starts_ranks = True

    def add(
        self,
        slots: Iterable[int],
        staying: Sequence[RankInfo] = (),
        replacing: Mapping[int, tuple[RankInfo, Death]] | None = None,
    ) -> None:
        forked = {"template": self.template} if self.template is not None else {}
        for slot in slots:
            self.cluster.start_engines_sync(
                n=1,
                engine_set_id=engine_set_id(slot),
                environment=self.rank_environment(slot),
                engine_cmd=self.engine_command(sys.executable),
                engine_args=[
                    *self.engine_arguments(),
                    f"--IPEngine.wait_for_url_file={self.config.start_timeout:g}",
                    # the nanny is one more Python process per rank, only needed to signal
                    # engines through the controller; we signal the PIDs we started
                    "--IPEngine.enable_nanny=False",
                ],
                delay=0,
                **forked,
            )

    def remove(self, ranks: Iterable[RankInfo]) -> None:
        infos = list(ranks)
        for info in infos:
            engine_set = engine_set_id(info.rank)
            if self.cluster is not None and engine_set in self.cluster.engines:
                stopped = functools.partial(self.cluster.stop_engines_sync, engine_set)
                if not processes.run_with_timeout(stopped, STOP_SECONDS):
                    # its processes end by PID below; the cluster must not list them any more
                    self.cluster.engines.pop(engine_set, None)
        processes.kill_survivors([info.pid for info in infos])

    def prepare_gpus(self, size: int, held: Sequence[str]) -> None:
        if self.world_gpus:
            self.world_gpus = layout.grown_gpus(size, self.world_gpus, held, devices.visible_gpus())

    def rank_environment(self, slot: int) -> dict[str, str]:
        """The environment rank `slot` starts with (the torchrun contract comes when it joins)."""
        cfg = self.config
        environment = {
            **cfg.env,
            **self.owner_environment(),
            SLOT_ENV: str(slot),
            "OMP_NUM_THREADS": str(cfg.threads_per_rank),
            "PYTHONUNBUFFERED": "1",
        }
        visible = layout.gpu_visibility(self.world_gpus, bool(devices.visible_gpus()))
        if visible is not None:
            environment["CUDA_VISIBLE_DEVICES"] = visible
            if self.world_gpus and "CUDA_DEVICE_ORDER" not in os.environ:
                # --gpus numbers GPUs as nvidia-smi does (PCI order); CUDA's default order puts the
                # fastest first, which differs on machines with mixed GPU models
                environment.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        # gloo and NCCL pick their interface from the hostname unless told: pin them to the
        # interface of the address the world listens on
        interface = network.interface_of(cfg.master_addr)
        if interface:
            environment["GLOO_SOCKET_IFNAME"] = environment["NCCL_SOCKET_IFNAME"] = interface
        return environment

    @property
    def pids(self) -> list[int]:
        warm = [self.template.pid] if self.template is not None and self.template.pid else []
        return launched_pids(self.cluster) + warm

    @property
    def template_pid(self) -> int | None:
        return self.template.pid if self.template is not None else None

    def stop(self) -> None:
        super().stop()  # the ranks first, cleanly; then the template they were forked from
        if self.template is not None:
            self.template.stop()
            self.template = None

    def exit_of(self, engine_set_id: str, pid: int | None = None) -> tuple[int | None, str] | None:
        if self.template is not None:  # the ranks' parent knows how each one ended
            engine_set = self.cluster.engines.get(engine_set_id) if self.cluster is not None else None
            launchers = getattr(engine_set, "launchers", None) or {}
            if pid is not None and pid in self.template.forked and self.template.alive:
                # it reaps each rank it forked and reports the exit within its 0.2 s poll: no process
                # to look at (a look at every rank's /proc, 4 times a second, held a core at 1,024 ranks)
                code = self.template.exit_code(pid)
                if code is None:
                    return None
                launcher_logs = [getattr(launcher, "output_file", "") for launcher in launchers.values()]
                return code, launcher_logs[0] if launcher_logs else ""
            # a rank found gone: the template reaps it and says how within a moment (longer when memory is short)
            wait = EXIT_REPORT_SECONDS if pid is not None and not processes.pid_alive(pid) else 0.0
            for candidate in [pid] if pid is not None else [launcher.pid for launcher in launchers.values()]:
                code = self.template.exit_code(candidate, wait)
                if code is not None:
                    launcher_logs = [getattr(launcher, "output_file", "") for launcher in launchers.values()]
                    return code, launcher_logs[0] if launcher_logs else ""
        return super().exit_of(engine_set_id, pid)

    def start_failure(self) -> str | None:
        for slot in range(self.expected_ranks()):
            failure = self.describe_start_exit(f"rank {slot}", engine_set_id(slot))
            if failure is not None:
                return failure
        return None

    def too_few_message(self, registered: int, wanted: int) -> str:
        return (
            f"only {registered} of {wanted} ranks registered within {self.config.start_timeout:g} s; "
            "raise start_timeout on a slow machine"
        )

    def dead_ranks(self, ranks: Iterable[RankInfo]) -> dict[int, Death]:
        dead = {}
        registered = set(self.client.ids) if self.client is not None else None
        named_now = False
        for info in ranks:
            found = self.exit_of(engine_set_id(info.rank), info.pid)
            if found is not None:
                if info.pid not in self._named:
                    before = self.oom_before
                    killed = found[0] == -signal.SIGKILL
                    oom = self.platform.oom_since(before) if before is not None and killed else None
                    self._named[info.pid] = death_of(found[0], oom)
                    named_now = True
                dead[info.rank] = self._named[info.pid]
            elif registered is not None and info.engine_id not in registered:
                # alive but silent past the heartbeat limit (stopped, or hung where not even its
                # heartbeat thread runs): the controller dropped it; the comeback ends its process
                dead[info.rank] = Death(
                    "lost",
                    f"stopped answering the controller for {HEARTBEAT_LIMIT_MS / 1000:g} s "
                    "(its process is stopped or hung; it is ended)",
                )
        if named_now and self.oom_before is not None:
            # kills the killer made so far are accounted for: a later SIGKILL is judged on its own
            self.oom_before = self.platform.oom_counts()
        return dead

    def signal(self, ranks: Iterable[RankInfo], signum: int) -> None:
        if self.cluster is None:
            return
        for info in ranks:
            engine_set = self.cluster.engines.get(engine_set_id(info.rank))
            if engine_set is not None:
                try:
                    engine_set.signal(signum)
                except Exception:
                    log.debug("signal to rank %s failed", info.rank, exc_info=True)
