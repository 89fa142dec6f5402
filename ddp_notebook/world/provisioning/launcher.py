"""All ranks through one of ipyparallel's engine launchers (MPI, Slurm, SSH, PBS, ...)."""

from __future__ import annotations

from typing import Any

from .. import launchers
from ..config import is_loopback
from .controlled import ControlledProvisioner

# the one engine set of a world whose launcher starts all ranks at once
WORLD_ENGINE_SET = "world"


class LauncherProvisioner(ControlledProvisioner):
    """The controller here; every rank started by the launcher named in the world's config."""

    def start(self) -> Any:
        from traitlets.config import Config

        cfg = self.config
        launch = cfg.launch
        context = launchers.LaunchContext(python=launch.python, private_dir=self.private_dir)
        settings = Config(launchers.world_defaults(launch.launcher, context))
        settings.merge(Config({name: dict(traits) for name, traits in launch.settings.items()}))
        self.make_cluster(
            engines=launch.launcher,
            config=settings,
            **({"profile": launch.profile} if launch.profile else {}),
        )
        # the connection info (with the key) goes to the engines in their environment, so no
        # file has to be copied to their hosts; the nanny lets ranks elsewhere be interrupted
        self.cluster.start_engines_sync(
            n=self.expected_ranks(),
            engine_set_id=WORLD_ENGINE_SET,
            environment={
                **cfg.env,
                **self.owner_environment(),
                "OMP_NUM_THREADS": str(cfg.threads_per_rank),
                "PYTHONUNBUFFERED": "1",
            },
            engine_cmd=self.engine_command(launch.python),
        )
        self.client = self.cluster.connect_client_sync()
        return self.client

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
        return message + hint
