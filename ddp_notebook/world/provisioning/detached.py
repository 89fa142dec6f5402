"""A detached world attached again from a new kernel: nothing to start, its group already formed.

The world's entry in the user's registry (`world.detached`) says where its controller's connection
file is and who each rank is: attaching is connecting a client and reading the rank map, without a
word to the ranks through ipyparallel (a rank running a cell would answer only once the cell ends);
what the ranks are doing is read from their journals (`earlier_cell`), which a thread of theirs
answers at once. `stop()` ends the
world for real, as `%ddp_stop` in the kernel that started it would; a kernel that merely exits or
dies leaves it running. It cannot start processes: a lost rank is not replaced (the world shrinks
to the survivors) and the world cannot grow or restart; it can shrink.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Iterable
from typing import Any

from ...errors import DDPUsageError, StartError, one_line
from ...platform import processes
from ...platform.cluster_files import remove_cluster_files
from ...wire import detached as wire
from ...wire.results import RankInfo
from .. import detached, ownership
from .base import Formed, Provisioner
from .controlled import STOP_SECONDS

log = logging.getLogger("ddp_notebook")


class DetachedProvisioner(Provisioner):
    """Connects to a detached world's controller; `stop()` ends the world, files and all."""

    def __init__(self, config: Any, private_dir: str) -> None:
        target = config.launch.attach
        assert target is not None and target.world is not None
        found = wire.read_entry(wire.entry_path(target.world))
        if found is not None and os.path.isdir(private_dir) and not os.listdir(private_dir):
            os.rmdir(private_dir)  # made for a world that starts here; this one has its own
        super().__init__(config, found["private_dir"] if found is not None else private_dir)
        self.found = found
        self.ended = False  # stop() ended the world (its private folder goes too), or only let go
        # what the ranks were doing when this kernel attached: the cell an earlier kernel sent last
        self.earlier_cell: Any = None

    @property
    def entry(self) -> wire.Entry:
        assert self.found is not None, "start() checks that the world is there"
        return self.found

    def start(self) -> Any:
        import ipyparallel as ipp

        target = self.config.launch.attach
        if self.found is None or not detached.alive(self.found):
            raise DDPUsageError(f"{target.describe()} is not running any more (%ddp_worlds lists those that are)")
        ownership.claim(self.found, target.take_over)
        try:
            self.client = ipp.Client(self.entry["connection_file"], timeout=min(10.0, self.config.start_timeout))
        except (OSError, TimeoutError, ValueError, KeyError) as failure:
            raise StartError(f"could not connect to {target.describe()}: {one_line(failure)}") from None
        return self.client

    def formed(self) -> Formed | None:
        # a rank that died meanwhile is found by the supervision, as any lost rank
        return (*detached.layout_of(self.entry), detached.ranks_of(self.entry))

    def keep_warm(self) -> object:
        """A restart would end the world and find nothing to attach to: refused, before anything ends."""
        raise DDPUsageError(
            f"{self.config.launch.attach.describe()} cannot restart from here: %ddp_stop ends it, and "
            "%ddp_start N --detach starts a new one"
        )

    def too_few_message(self, registered: int, wanted: int) -> str:
        return f"only {registered} of the {wanted} ranks of {self.config.launch.attach.describe()} are registered"

    def remove(self, ranks: Iterable[RankInfo]) -> None:
        """End the processes of `ranks` (the world shrinking): they are the world's own."""
        infos = list(ranks)
        if self.client is not None:
            try:
                self.client.shutdown(targets=[info.engine_id for info in infos], block=False)
            except Exception:
                log.debug("asking ranks to shut down failed", exc_info=True)
        processes.kill_survivors([info.pid for info in infos])

    @property
    def pids(self) -> list[int]:
        if self.found is None:
            return []
        template = [self.template_pid] if self.template_pid else []
        return [self.entry["controller_pid"], *self.entry["rank_pids"], *template]

    @property
    def controller_pid(self) -> int | None:
        return self.found["controller_pid"] if self.found is not None else None

    @property
    def template_pid(self) -> int | None:
        return (self.found.get("template_pid") or None) if self.found is not None else None

    attached = False  # the world runs in this kernel: stop() ends it

    def opened(self, world: Any) -> None:
        first = not self.attached
        super().opened(world)  # its entry names this kernel, and the rank map as it is now
        self.found = wire.read_entry(wire.entry_path(self.entry["id"])) or self.found
        self.attached = True
        if first:  # as the kernel attaches: the ranks' journals answer from a thread of their own, at once
            from ..earlier_cell import earlier_cell

            ownership.tell_ranks(world)  # from now on they run this kernel's cells only
            self.earlier_cell = earlier_cell(world)
            # a cell sent now would queue behind one still running: each cell looks until it ended
            world.earlier_cell_checked = self.earlier_cell is None or not self.earlier_cell.running

    def stop(self) -> None:
        client, self.client = self.client, None
        if not self.attached or self.let_go_of:  # the attach failed midway: the world goes on as it was
            if client is not None:
                client.close()
            return
        entry, self.ended = self.entry, True
        ranks = [pid for pid in entry["rank_pids"] if processes.pid_alive(pid)]
        controller = entry["controller_pid"]
        # a rank's DataLoader workers, the controller's helpers: all of it ends here
        family = [*ranks, controller, *processes.descendants([*ranks, controller])]
        # the ranks' template ends by itself after the last of them; waited for (and killed past the wait)
        family += [self.template_pid] if self.template_pid else []
        if client is not None:
            try:
                client.shutdown(targets="all", block=False)  # the ranks exit cleanly first
                processes.wait_gone(ranks, STOP_SECONDS / 3)
            except Exception:
                log.debug("asking the ranks to shut down failed", exc_info=True)
            client.close()
        if processes.pid_alive(controller):
            try:
                os.kill(controller, signal.SIGTERM)  # not our child: ended by its PID, as ipyparallel's stop does
            except OSError:
                pass
        processes.kill_survivors(family, wait=STOP_SECONDS / 3)
        profile = os.path.dirname(os.path.dirname(entry["connection_file"]))
        remove_cluster_files(profile, entry["id"])
        detached.forget(entry["id"])

    def remove_private_dir(self) -> None:
        if self.ended or self.found is None:  # (without an entry: the empty folder made for it)
            shutil.rmtree(self.private_dir, ignore_errors=True)
