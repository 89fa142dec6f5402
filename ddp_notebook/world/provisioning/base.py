"""The interface every provisioner offers, and what ranks on other hosts share."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...cell import ipp_adapter
from ...errors import DDPUsageError
from ...platform import processes
from ...platform.limits import OomVerdict
from ...wire.results import Death, RankInfo
from .. import detached
from ..config import WorldConfig

log = logging.getLogger("ddp_notebook")

# a world formed before: backend, where each rank runs (`layout.Placement`s), its route to rank 0, who
# each rank is
Formed = tuple[str, list[Any], dict[int, tuple[str, str | None]], dict[int, RankInfo]]


class Provisioner(ABC):
    """Starts, watches and ends the processes of one world (modelled on torch elastic's agent)."""

    # ranks are started here one by one, each with its environment and GPUs set before it starts
    starts_ranks_here = False
    # restart() cannot start processes: it clears the engines' namespaces instead
    clears_namespaces_on_restart = False

    def __init__(self, config: WorldConfig, private_dir: str) -> None:
        self.config = config
        self.private_dir = private_dir
        self.client: Any = None
        # before any client connects: frames anyone may send the controller's ports stop no stream
        ipp_adapter.drop_malformed_messages()

    @abstractmethod
    def start(self) -> Any:
        """Start the controller and the ranks; return a connected ipyparallel `Client`."""

    def expected_ranks(self) -> int:
        """How many engines make up the world."""
        assert self.config.n_ranks is not None
        return self.config.n_ranks

    def engine_ids(self, wanted: int) -> list[int]:
        """The engines that become ranks, once `wanted` have registered."""
        return sorted(self.client.ids)

    def start_failure(self) -> str | None:
        """Why the start cannot succeed any more (a process exited), or None."""
        return None

    @abstractmethod
    def too_few_message(self, registered: int, wanted: int) -> str:
        """What to say when too few ranks registered in time."""

    def formed(self) -> Formed | None:
        """How a world whose group formed before (a detached world attached again) was formed: its
        backend, placements, routes and rank map; None: the started processes form one now."""
        return None

    def opened(self, world: Any) -> None:
        """The world's group formed (or formed again: a heal, a comeback, a resize) as `world` (a
        `RunningWorld`): a detached world records who its ranks are now, and that this kernel is attached."""
        if self.config.detach:
            detached.record(world)

    def remove_private_dir(self) -> None:
        """Remove the world's private folder, its processes gone (a detached world attached again keeps
        it unless it was ended; one this kernel let go of keeps it)."""
        if not self.let_go_of:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    # another kernel took this detached world: its processes and files are that kernel's now
    let_go_of = False

    def let_go(self) -> None:
        """Another kernel took this detached world (`world.ownership`): close this kernel's connection
        to it and end nothing of it."""
        client, self.client = self.client, None
        self.let_go_of = True
        if client is not None:
            try:
                client.close()
            except Exception:
                log.debug("closing the client failed", exc_info=True)

    def keep_warm(self) -> object:
        """What the next world of a restart may reuse (a warm template), taken out of this one's stop."""
        return None

    # the GPUs CUDA_VISIBLE_DEVICES lists for ranks started here (--gpus, grown by a resize)
    world_gpus: tuple[str, ...] = ()

    # whether `add` can start ranks in a running world (a lost one is then replaced, not shrunk around)
    starts_ranks = False

    def add(
        self,
        slots: Iterable[int],
        staying: Sequence[RankInfo] = (),
        replacing: Mapping[int, tuple[RankInfo, Death]] | None = None,
    ) -> None:
        """Start more rank processes for the given slots (ranks), to join the world; `staying` are
        the ranks that go on running, `replacing` the lost rank each new one replaces, with how
        it was lost (where the provisioner chooses hosts, a lost host takes none)."""
        raise DDPUsageError(f"a world started with --launcher {self.config.launch.launcher} cannot add ranks")

    def end_lost(self, ranks: Iterable[RankInfo]) -> None:
        """End what is left of ranks declared lost, not seen exiting (a stopped or hung process
        that would otherwise wake up later as a rank of no world): by PID on this host; elsewhere
        their launcher ends them when the world stops (their host may not answer now)."""
        here = socket.gethostname()
        processes.kill_survivors([info.pid for info in ranks if info.host == here], wait=0.0)

    def learn(self, identities: Iterable[Any]) -> None:
        """Called with the `EngineIdentity` of every engine that registered (its host and PID)."""
        return None  # only a provisioner that chooses hosts needs to know where each engine runs

    def prepare_gpus(self, size: int, held: Sequence[str]) -> None:
        """Before ranks are added to a world of GPU ranks (`held` are the GPUs its ranks use), let
        the new processes see GPUs for a world of `size`; ranks started elsewhere see their host's."""
        return None  # nothing to choose here: a launcher's new ranks see every GPU of their host

    def remove(self, ranks: Iterable[RankInfo]) -> None:
        """End the processes of `ranks` (a world shrinking); the others keep running."""
        raise DDPUsageError(f"a world started with --launcher {self.config.launch.launcher} cannot remove ranks")

    def dead_ranks(self, ranks: Iterable[RankInfo]) -> dict[int, Death]:
        """Ranks among `ranks` whose process is gone, with how each one ended.

        A rank on this host is checked by its PID; a rank elsewhere is known lost once the
        controller stops hearing its heartbeat (it then unregisters the engine).
        """
        registered = set(self.client.ids) if self.client is not None else set()
        here = socket.gethostname()
        dead = {}
        for info in ranks:
            if info.host == here and not processes.pid_alive(info.pid):
                dead[info.rank] = Death("exited", "exited")  # not our child: its exit status is its parent's
            elif info.engine_id not in registered:
                dead[info.rank] = Death(
                    "lost",
                    f"on {info.host} was lost (it stopped answering the controller: its process, host or network "
                    "went down)",
                )
        return dead

    def signal(self, ranks: Iterable[RankInfo], signum: int) -> None:
        """Send `signum` to `ranks`: directly on this host, through the engine's nanny elsewhere."""
        here = socket.gethostname()
        remote = []
        for info in ranks:
            if info.host == here and processes.pid_alive(info.pid):
                try:
                    os.kill(info.pid, signum)
                except OSError:
                    log.debug("signal to rank %s failed", info.rank, exc_info=True)
            else:
                remote.append(info.engine_id)
        if remote and self.client is not None:
            try:
                self.client.send_signal(signum, targets=remote, block=False)
            except Exception:
                log.debug("signal to engines %s failed", remote, exc_info=True)

    @property
    def pids(self) -> list[int]:
        """PIDs of the processes this world started (the only ones it may ever signal)."""
        return []

    @property
    def controller_pid(self) -> int | None:
        """The controller's PID where it runs here; None when it belongs to someone else."""
        return None

    @property
    def template_pid(self) -> int | None:
        """The PID of the rank template the ranks were forked from; None when they were not."""
        return None

    @abstractmethod
    def stop(self) -> None:
        """End every process this world started (or let go of engines it did not start)."""


def death_of(exit_code: int | None, oom: OomVerdict | None = None) -> Death:
    """A rank process's end as a value, from its exit status and the cgroup's out-of-memory verdict."""
    how = processes.describe_exit(exit_code, oom)
    if exit_code is None or exit_code >= 0:
        return Death("exited", how, exit_code)
    killed_for_memory = exit_code == -signal.SIGKILL and oom is not None and bool(oom.killed)
    return Death("out_of_memory" if killed_for_memory else "signal", how, exit_code)
