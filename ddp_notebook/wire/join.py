"""How a rank joins its world: what it says about itself, what it is told, what it reports back.

Sent as they are by ipyparallel (pickled over its authenticated channel) and read on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

# environment variables in which launchers tell a process its place (first one found wins)
LAUNCHER_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


@dataclass(frozen=True)
class Identity:
    """What a rank process says about itself before it gets a rank (no torch needed)."""

    host: str
    pid: int
    slot: int | None  # the rank a local launch started it for
    launcher_rank: int | None  # its MPI / Slurm task rank, where a launcher gave one
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries it sees


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to join the world's process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int
    backend: str
    timeout: float  # seconds a collective may wait
    threads: int
    stack_dir: str | None  # where the rank writes its stack dumps (ranks on this host)
    gpu: str | None  # the CUDA_VISIBLE_DEVICES entry of its GPU, None on CPU
    socket_ifname: str | None  # interface of the route to rank 0, for gloo / NCCL
    check_collectives: bool = False  # strict mode (ddp_notebook.strict), on once the group is up
    # ranks on other hosts: the world's X-ray key (hex) and the notebook's address its X-ray serves toward
    xray_key: str | None = None
    xray_toward: str | None = None
    # the rendezvous: a world on this host only forms in a file of its private folder (no port any
    # other user of the host can reach); a world across hosts, on TCP, signs every value with store_key (hex)
    store_path: str | None = None
    store_key: str | None = None
    # reload edited user modules before each cell (%ddp_autoreload)
    autoreload: bool = True
    # the notebook's host and folder: a rank works there, or in a sync folder where it does not exist
    notebook_host: str | None = None
    notebook_folder: str | None = None
    # a simulated world (scale tests, benchmarks): a fake process group, no communication
    simulated: bool = False


@dataclass(frozen=True)
class JoinReport:
    """What a rank says once it joined the process group."""

    device: str
    device_name: str
    backend: str
    main_thread: int | None
    xray_address: tuple[str, int] | None = None  # where a rank on another host answers X-ray requests
    # what this rank's releases (torch) lack, one line each: %ddp_start says it (`world.capabilities`)
    off_here: tuple[str, ...] = ()
