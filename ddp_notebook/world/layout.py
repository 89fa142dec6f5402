"""Which engine becomes which rank, and which GPU each rank uses: torchrun's rules.

Pure logic, no processes: the engines describe themselves (host, PID, the rank their
launcher gave them, the GPUs they see) and this module decides the world's layout.

The device rule is one for every launcher: every rank on a host sees the same GPUs in the
same order (the world's GPUs on this machine, all of its host's under another launcher),
and rank r uses the one at its LOCAL_RANK, as CUDA device `cuda:LOCAL_RANK`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import DDPUsageError
from ..platform.devices import MIG_LIMIT


@dataclass(frozen=True)
class EngineIdentity:
    """What an engine says about itself before it becomes a rank."""

    engine_id: int
    host: str
    pid: int
    slot: int | None = None  # the rank a local launch started it for
    launcher_rank: int | None = None  # its MPI / Slurm task rank, where a launcher gave one
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES entries it sees


@dataclass(frozen=True)
class Placement:
    """Where one rank lives in the world."""

    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int
    local_world_size: int
    group_rank: int  # index of its host, as torchrun's GROUP_RANK
    gpu: str | None = None


def place_ranks(engines: Sequence[EngineIdentity], use_gpus: bool) -> list[Placement]:
    """Number the engines as ranks, contiguous per host (rank 0 on the first host).

    Engines started for a given rank (`slot`) keep it. Otherwise the launcher's own order
    decides (MPI or Slurm task rank), then the engine id; hosts come in the order of their
    lowest-ranked engine. On GPUs, each rank gets its host's GPU number `local_rank`.
    """
    if not engines:
        raise DDPUsageError("no engines to build a world from")
    if all(e.slot is not None for e in engines):
        ordered = sorted(engines, key=lambda e: e.slot if e.slot is not None else 0)
    else:
        ordered = sorted(engines, key=_launcher_order)
    hosts: list[str] = []
    by_host: dict[str, list[EngineIdentity]] = {}
    for engine in ordered:
        if engine.host not in by_host:
            hosts.append(engine.host)
            by_host[engine.host] = []
        by_host[engine.host].append(engine)
    placements = []
    rank = 0
    for group_rank, host in enumerate(hosts):
        members = by_host[host]
        for local_rank, engine in enumerate(members):
            gpu = None
            if use_gpus:
                if local_rank >= len(engine.gpus):
                    raise DDPUsageError(
                        f"host {host} runs {len(members)} ranks but its ranks see {len(engine.gpus)} GPU(s): "
                        "start one rank per GPU there, or use --backend gloo"
                    )
                gpu = engine.gpus[local_rank]
            placements.append(
                Placement(
                    rank=rank,
                    engine_id=engine.engine_id,
                    host=host,
                    pid=engine.pid,
                    local_rank=local_rank,
                    local_world_size=len(members),
                    group_rank=group_rank,
                    gpu=gpu,
                )
            )
            rank += 1
    return placements


def _launcher_order(engine: EngineIdentity) -> tuple[int, int]:
    launcher_rank = engine.launcher_rank if engine.launcher_rank is not None else 1 << 30
    return (launcher_rank, engine.engine_id)


def gpus_everywhere(engines: Sequence[EngineIdentity]) -> bool:
    """True when every host has at least one GPU per rank it runs (nccl then works)."""
    counts: dict[str, int] = {}
    for engine in engines:
        counts[engine.host] = counts.get(engine.host, 0) + 1
    return all(len(engine.gpus) >= counts[engine.host] for engine in engines)


def spans_hosts(placements: Sequence[Placement]) -> bool:
    return len({p.host for p in placements}) > 1


def gpu_visibility(world_gpus: Sequence[str], machine_has_gpus: bool) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for every rank this machine starts (None: leave it as inherited).

    Every rank sees all of the world's GPUs, in the same order, and uses the one at its
    `LOCAL_RANK` (as under torchrun): one rule for every launcher. Masking each rank to its
    own GPU breaks CUDA IPC between ranks and NCCL features that rely on it. CPU ranks on a
    GPU machine see no GPU at all.
    """
    if world_gpus:
        return ",".join(world_gpus)
    return "" if machine_has_gpus else None


def check_world_gpus(gpus: Sequence[str]) -> None:
    """Refuse GPU lists one world cannot use; today: several MIG instances.

    A CUDA process enumerates one MIG instance at most, whatever CUDA_VISIBLE_DEVICES lists,
    and NCCL does not support MIG (NVIDIA/nccl#1716), so MIG slices cannot be a world's ranks.
    """
    mig = [g for g in gpus if g.startswith("MIG-")]
    if len(mig) > 1:
        raise DDPUsageError(f"{len(mig)} MIG instances given ({','.join(mig)}): {MIG_LIMIT}")
