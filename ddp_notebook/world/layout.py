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


def place_again(kept: Sequence[Placement], new: Sequence[EngineIdentity]) -> list[Placement]:
    """The ranks of a world that lost ranks, shrank or grew: the kept ranks in their old order,
    then the new ones by slot, numbered again host by host (rank 0 on the first host).

    CPU ranks count their local ranks again on each host. A GPU rank that stays keeps its GPU
    and its LOCAL_RANK: its tensors and CUDA context live on that device (LOCAL_RANKs on a host
    may then skip a number). A new GPU rank takes the first GPU it sees that no rank on its
    host holds, as CUDA device LOCAL_RANK = that GPU's place in its CUDA_VISIBLE_DEVICES.
    """
    on_gpus = any(p.gpu is not None for p in kept)
    members: dict[str, list[tuple[int, int, str | None, int]]] = {}  # host -> (engine, pid, gpu, local rank)
    for placement in kept:
        members.setdefault(placement.host, []).append(
            (placement.engine_id, placement.pid, placement.gpu, placement.local_rank)
        )
    for engine in sorted(new, key=lambda e: e.slot if e.slot is not None else 1 << 30):
        held = members.setdefault(engine.host, [])
        if not on_gpus:
            held.append((engine.engine_id, engine.pid, None, 0))
            continue
        taken = {gpu for _, _, gpu, _ in held}
        free = [index for index, gpu in enumerate(engine.gpus) if gpu not in taken]
        if not free:
            raise DDPUsageError(
                f"host {engine.host} has no free GPU for a new rank: its ranks hold "
                f"{', '.join(sorted(str(gpu) for gpu in taken))} of the {len(engine.gpus)} it sees"
            )
        held.append((engine.engine_id, engine.pid, engine.gpus[free[0]], free[0]))
    placements = []
    for group_rank, (host, ranks) in enumerate(members.items()):
        for position, (engine_id, pid, gpu, local_rank) in enumerate(ranks):
            placements.append(
                Placement(
                    rank=len(placements),
                    engine_id=engine_id,
                    host=host,
                    pid=pid,
                    local_rank=local_rank if on_gpus else position,
                    local_world_size=len(ranks),
                    group_rank=group_rank,
                    gpu=gpu,
                )
            )
    return placements


def grown_gpus(size: int, world_gpus: Sequence[str], held: Sequence[str], machine: Sequence[str]) -> tuple[str, ...]:
    """The GPUs the processes of a local world of `size` GPU ranks see: the world's own list,
    then, where its free ones do not suffice, this machine's GPUs the world has not used, in
    the machine's order. Appending keeps every running rank's CUDA device numbers valid (its
    list is a prefix of the new one). One line, with the most it can be, when there are too few.
    """
    wanted = size - len(held)
    free = [gpu for gpu in world_gpus if gpu not in held]
    if wanted <= len(free):
        return tuple(world_gpus)
    others = [gpu for gpu in machine if gpu not in world_gpus]
    missing = wanted - len(free)
    if missing > len(others):
        unused = free + others
        can = len(held) + len(unused)
        return_hint = f"%ddp_resize {can} at most" if can > len(held) else "no rank can be added"
        raise DDPUsageError(
            f"{size} GPU ranks need {wanted} more GPU(s) and this machine has {len(unused)} free "
            f"({', '.join(unused) if unused else 'its ranks hold ' + ', '.join(held)}): {return_hint}"
        )
    return (*world_gpus, *others[:missing])


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
