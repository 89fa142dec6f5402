"""Ranks on this machine, one process each, every one started with its own environment."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

from .. import devices, layout, network, processes
from ..entrypoints import SLOT_ENV
from ..results import RankInfo
from .controlled import ControlledProvisioner

log = logging.getLogger("ddp_notebook")


def engine_set_id(slot: int) -> str:
    return f"rank{slot}"


class LocalProvisioner(ControlledProvisioner):
    """One ipyparallel engine set per rank, so that each rank gets an environment of its own
    (threads, GPUs, the slot it was started for) before it imports anything."""

    starts_ranks_here = True

    def start(self) -> Any:
        self.make_cluster(
            # start the ranks together with the controller, not after it: their imports
            # (ipyparallel, then torch) overlap the controller's start-up; they wait for its
            # connection file in the (user-private) profile security directory
            send_engines_connection_env=False,
        )
        self.add(range(self.expected_ranks()))
        self.client = self.cluster.connect_client_sync()
        return self.client

    def add(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.cluster.start_engines_sync(
                n=1,
                engine_set_id=engine_set_id(slot),
                environment=self.rank_environment(slot),
                engine_cmd=self.engine_command(sys.executable),
                engine_args=[
                    f"--IPEngine.wait_for_url_file={self.config.start_timeout:g}",
                    # the nanny is one more Python process per rank, only needed to signal
                    # engines through the controller; we signal the PIDs we started
                    "--IPEngine.enable_nanny=False",
                ],
                delay=0,
            )

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
        visible = layout.gpu_visibility(cfg.gpus, bool(devices.visible_gpus()))
        if visible is not None:
            environment["CUDA_VISIBLE_DEVICES"] = visible
            if cfg.gpus and "CUDA_DEVICE_ORDER" not in os.environ:
                # --gpus numbers GPUs as nvidia-smi does (PCI order); CUDA's default order puts the
                # fastest first, which differs on machines with mixed GPU models
                environment.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        # gloo and NCCL pick their interface from the hostname unless told: pin them to the
        # interface of the address the world listens on
        interface = network.interface_of(cfg.master_addr)
        if interface:
            environment["GLOO_SOCKET_IFNAME"] = environment["NCCL_SOCKET_IFNAME"] = interface
        return environment

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

    def dead_ranks(self, ranks: Iterable[RankInfo]) -> dict[int, str]:
        dead = {}
        for info in ranks:
            found = self.exit_of(engine_set_id(info.rank), info.pid)
            if found is not None:
                dead[info.rank] = processes.describe_exit(found[0])
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
