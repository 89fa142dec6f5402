"""The rows of `%ddp_status` (`DDPCluster.status`): each rank's state, host, pid, device, memory
against its limit, as `RankStatus` values (`report.format_status` draws them). Notebook side."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from ..errors import DDPError
from ..platform import devices, limits
from ..wire.results import Death, RankStatus
from .controller import QUERY_SECONDS
from .running import RunningWorld


def rank_status(world: RunningWorld, broken: Mapping[int, Death]) -> list[RankStatus]:
    """State (idle/busy/gone), host, pid, device, memory (against its limit) of every rank; a rank
    in `broken` (its process died) is gone."""
    try:
        queues = world.controller.settled_queue_status()
    except TimeoutError:
        raise DDPError(
            f"the controller did not answer within {QUERY_SECONDS:g} s: is its host reachable? %ddp_restart"
        ) from None
    infos = [world.ranks[rank] for rank in sorted(world.ranks)]
    gpu_memory = devices.gpu_memory_by_pid() if any(info.gpu for info in infos) else {}
    # a rank's GPU is a CUDA_VISIBLE_DEVICES entry: an index (nvidia-smi's order) or a UUID
    gpu_totals = {key: g.memory_total_mb for g in limits.gpus() for key in (g.index, g.uuid)} if gpu_memory else {}
    reading = world.supervisor.memory.read(infos)
    limit_mb = reading.limit / 2**20 if reading is not None else None
    here = socket.gethostname()
    rows = []
    for info in infos:
        entry = queues.get(info.engine_id)
        if entry is None or info.rank in broken:
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
                memory_mb=devices.resident_memory_mb(info.pid) if info.host == here else None,
                gpu_memory_mb=gpu_memory.get(info.pid),
                memory_limit_mb=limit_mb if info.host == here else None,
                gpu_memory_total_mb=gpu_totals.get(info.gpu or "") if info.host == here else None,
            )
        )
    return rows
