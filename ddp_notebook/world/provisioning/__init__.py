"""Getting the processes of a world: one provisioner per way of getting them.

- `LocalProvisioner`: one process per rank on this machine, each with its own environment;
- `LauncherProvisioner`: all ranks through one of ipyparallel's engine launchers (MPI, Slurm,
  SSH, ...), with the controller in this process;
- `AttachedProvisioner`: the engines of a cluster someone else started (nothing to start or end);
- `DetachedProvisioner`: a detached world attached again from a new kernel (its group formed before).

Each one owns its processes: it starts them and hands back a connected ipyparallel client,
knows their PIDs and how each one ended, signals them, and ends them. Everything after that
(which engine is which rank, the process group, running cells) is the same for all three.
"""

from __future__ import annotations

from .. import spare
from ..config import WorldConfig
from ..template import TemplateClient
from .attached import AttachedProvisioner
from .base import Provisioner
from .detached import DetachedProvisioner
from .launcher import LauncherProvisioner
from .local import LocalProvisioner

__all__ = [
    "AttachedProvisioner",
    "DetachedProvisioner",
    "LauncherProvisioner",
    "LocalProvisioner",
    "Provisioner",
    "provisioner_for",
]


def provisioner_for(config: WorldConfig, private_dir: str, warm: object = None) -> Provisioner:
    """The provisioner a world described by `config` gets its processes from.

    `warm`: what a previous provisioner of the same world kept warm (`keep_warm()`), for a restart.
    """
    if not config.launch.is_local:  # (an attached world is not local either)
        spare.discard_spare()  # its ranks start elsewhere: a local template would only hold memory
    if config.launch.attach is not None and config.launch.attach.world is not None:
        return DetachedProvisioner(config, private_dir)
    if config.launch.attach is not None:
        return AttachedProvisioner(config, private_dir)
    if config.launch.is_local:
        return LocalProvisioner(config, private_dir, warm if isinstance(warm, TemplateClient) else None)
    return LauncherProvisioner(config, private_dir)
