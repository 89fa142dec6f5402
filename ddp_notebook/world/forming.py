"""Forming a world from started processes: which engine is which rank, which addresses and
interfaces they use, and the process group they join.

The same steps for every provisioner; healing repeats the last one (joining a fresh group).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..cell import ipp_adapter
from ..errors import InsecureNetworkWarning, StartError, one_line
from ..platform import network
from ..rank import calls as rank_calls
from ..wire import xray as xray_wire
from ..wire.join import Identity, JoinReport, RankSpec
from ..wire.results import RankInfo
from . import layout
from .config import WorldConfig, is_loopback
from .provisioning import Provisioner


@dataclass
class WorldLayout:
    """Where each rank lives and how the ranks reach rank 0; kept for heals."""

    backend: str
    placements: list[layout.Placement]
    # per rank: (MASTER_ADDR, interface toward it)
    routes: dict[int, tuple[str, str | None]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.placements)


# while ranks are missing, the controller is asked this often which registered
ASK_CONTROLLER_SECONDS = 1.0


def _remaining(deadline: float) -> float:
    return max(1.0, deadline - time.perf_counter())


def wait_for_engines(provisioner: Provisioner, deadline: float) -> list[layout.EngineIdentity]:
    """Wait until every engine registered, then ask each who it is."""
    client = provisioner.client
    wanted = provisioner.expected_ranks()
    ask_at = time.perf_counter() + ASK_CONTROLLER_SECONDS
    while len(client.ids) < wanted:
        failure = provisioner.start_failure()
        if failure is not None:
            raise StartError(failure)
        if time.perf_counter() > deadline:
            raise StartError(provisioner.too_few_message(len(client.ids), wanted))
        if time.perf_counter() > ask_at:
            # a rank that registered while the client connected was never announced to it
            ipp_adapter.learn_registered_engines(client)
            ask_at = time.perf_counter() + ASK_CONTROLLER_SECONDS
        time.sleep(0.02)
    described = client[provisioner.engine_ids(wanted)].apply_async(rank_calls.describe)
    try:
        reports: list[Identity] = described.get(timeout=_remaining(deadline))
    except Exception as failure:  # noqa: BLE001  (any remote failure ends the start)
        raise StartError(f"the ranks did not say who they are: {one_line(failure)}") from None
    identities = [
        layout.EngineIdentity(
            engine_id=engine_id,
            host=report.host,
            pid=report.pid,
            slot=report.slot,
            launcher_rank=report.launcher_rank,
            gpus=report.gpus,
        )
        for engine_id, report in zip(described.engine_id, reports)
    ]
    provisioner.learn(identities)
    return identities


def place(config: WorldConfig, identities: list[layout.EngineIdentity]) -> WorldLayout:
    """Number the engines as ranks and settle the backend: one rule for every provisioner.

    A rank uses a GPU when the world runs nccl, or was given GPUs (`--gpus`): its host's GPU
    number `LOCAL_RANK` among the ones it sees.
    """
    has_gpus = layout.gpus_everywhere(identities)
    if config.backend == "nccl" and not has_gpus:
        raise StartError("backend 'nccl' needs one GPU per rank on every host; use --backend gloo")
    backend = "nccl" if config.backend == "nccl" or (config.backend == "auto" and has_gpus) else "gloo"
    use_gpus = backend == "nccl" or bool(config.gpus)
    return WorldLayout(backend=backend, placements=layout.place_ranks(identities, use_gpus))


def plan_routes(provisioner: Provisioner, world: WorldLayout, deadline: float) -> None:
    """Pick MASTER_ADDR and each rank's interface; across hosts, check every rank reaches rank 0."""
    config = provisioner.config
    placements = world.placements
    if provisioner.starts_ranks_here or not layout.spans_hosts(placements):
        # one host: everything stays on its loopback (or on --ip for a world started here)
        address = config.master_addr if provisioner.starts_ranks_here else "127.0.0.1"
        interface = network.interface_of(address)
        world.routes = {p.rank: (address, interface) for p in placements}
        return
    client = provisioner.client
    # rank 0's address on the route to the controller: the hosts reach the controller, so
    # this is the address of rank 0's host on the network they share
    rank0 = client[placements[0].engine_id]
    destination = config.master_addr if not is_loopback(config.master_addr) else "192.0.2.1"
    address = rank0.apply_async(rank_calls.source_address, destination).get(timeout=_remaining(deadline))
    if not address:
        raise StartError(f"rank 0 on {placements[0].host} has no route to {destination}")
    port = rank0.apply_async(rank_calls.open_probe, address).get(timeout=_remaining(deadline))
    try:
        checks = {p.rank: client[p.engine_id].apply_async(rank_calls.reach, address, port) for p in placements}
        unreachable = []
        for placement in placements:
            result = checks[placement.rank].get(timeout=_remaining(deadline) + 10)
            if result["error"]:
                unreachable.append(f"rank {placement.rank} on {placement.host}: {result['error']}")
            world.routes[placement.rank] = (address, result["interface"])
    finally:
        rank0.apply_async(rank_calls.close_probe).get(timeout=10)
    if unreachable:
        raise StartError(
            f"rank 0 on {placements[0].host} listens at {address}, and {'; '.join(unreachable)}: open TCP between "
            "the hosts (firewall), or start rank 0 on a host the others reach"
        )
    warnings.warn(
        InsecureNetworkWarning(
            f"the ranks span {len({p.host for p in placements})} hosts: gloo/NCCL traffic between them is neither "
            "encrypted nor authenticated, and the rendezvous is not encrypted (its values are signed on gloo); "
            "run this only on a network you trust (ipyparallel's own messages are encrypted with CurveZMQ)"
        ),
        stacklevel=4,
    )


def join_process_group(
    client: Any, config: WorldConfig, world: WorldLayout, stack_dir: str | None, deadline: float
) -> dict[int, RankInfo]:
    """Every rank joins one new default process group, on a fresh rendezvous port; returns the rank map."""
    placements = world.placements
    try:
        port = (
            client[placements[0].engine_id]
            .apply_async(rank_calls.open_rendezvous, world.routes[0][0])
            .get(timeout=_remaining(deadline))
        )
    except Exception as failure:  # noqa: BLE001  (any remote failure ends the start)
        raise StartError(f"rank 0 could not set up torch.distributed: {one_line(failure)}") from None
    pending = {}
    store_path = private_store_path(world, stack_dir, port)
    for placement in placements:
        spec = rank_spec(config, world, placement, port, stack_dir, store_path)
        pending[placement.rank] = client[placement.engine_id].apply_async(rank_calls.init_world, spec)
    ranks = {}
    for placement in placements:
        try:
            joined: JoinReport = pending[placement.rank].get(timeout=_remaining(deadline))
        except Exception as failure:  # noqa: BLE001  (any remote failure ends the start)
            raise StartError(
                f"rank {placement.rank} on {placement.host} could not set up torch.distributed: {one_line(failure)}"
            ) from None
        ranks[placement.rank] = RankInfo(
            rank=placement.rank,
            engine_id=placement.engine_id,
            host=placement.host,
            pid=placement.pid,
            device=joined.device,
            device_name=joined.device_name,
            gpu=placement.gpu,
            main_thread=joined.main_thread,
            xray_address=joined.xray_address,
            off_here=joined.off_here,
            local_rank=placement.local_rank,
            local_world_size=placement.local_world_size,
            group_rank=placement.group_rank,
        )
    return ranks


def private_store_path(world: WorldLayout, stack_dir: str | None, port: int) -> str | None:
    """Where a world whose ranks all run on this host forms its group: a file in the world's private
    folder, which only this user can open (torch's TCPStore would take anyone on the host who
    connects to its port). None for a world across hosts. A new name at every forming."""
    if stack_dir is None or any(p.host != socket.gethostname() for p in world.placements):
        return None
    return os.path.join(stack_dir, f"rendezvous-{port}-{secrets.token_hex(4)}")


def rank_spec(
    config: WorldConfig,
    world: WorldLayout,
    placement: layout.Placement,
    port: int,
    stack_dir: str | None,
    store_path: str | None = None,
) -> RankSpec:
    """What rank `placement.rank` needs to join the group whose rendezvous is at rank 0's `port`
    (or in the file `store_path`, for a world on this host only)."""
    address, interface = world.routes[placement.rank]
    here = placement.host == socket.gethostname()
    return RankSpec(
        rank=placement.rank,
        world_size=len(world.placements),
        local_rank=placement.local_rank,
        local_world_size=placement.local_world_size,
        group_rank=placement.group_rank,
        master_addr=address,
        master_port=port,
        backend=world.backend,
        timeout=config.timeout,
        threads=config.threads_per_rank,
        stack_dir=stack_dir if here else None,
        gpu=placement.gpu,
        # a user's own GLOO/NCCL_SOCKET_IFNAME (env=...) wins over the route's
        socket_ifname=None if "GLOO_SOCKET_IFNAME" in config.env else interface,
        check_collectives=config.check_collectives,
        xray_key=xray_wire.world_key(stack_dir).hex() if stack_dir and not here else None,
        xray_toward=None if here else _notebook_address(config),
        store_path=store_path,
        # NCCL's group splits clone the store, which torch's bridge to a store written in Python lacks
        store_key=(
            xray_wire.rendezvous_key(stack_dir).hex()
            if stack_dir and store_path is None and world.backend == "gloo"
            else None
        ),
        autoreload=config.autoreload,
        notebook_host=socket.gethostname(),
        notebook_folder=os.getcwd(),
        simulated=config.simulated,
    )


def _notebook_address(config: WorldConfig) -> str | None:
    """Where ranks on other hosts reach this host: the controller's address, which they reach
    already (or, for a world attached to a controller on loopback, this host's primary address)."""
    return config.master_addr if not is_loopback(config.master_addr) else network.primary_address()


def form(
    provisioner: Provisioner, private_dir: str, deadline: float, clear_namespaces: bool
) -> tuple[WorldLayout, dict[int, RankInfo]]:
    """The started processes of `provisioner` as ranks of one new process group: (layout, rank map);
    a world formed before (a detached world attached again) as it was formed.
    `clear_namespaces`: a restart of a world that cannot start processes clears its engines instead."""
    earlier = provisioner.formed()
    if earlier is not None:
        backend, placements, routes, ranks = earlier
        return WorldLayout(backend, placements, routes), ranks
    config, client = provisioner.config, provisioner.client
    identities = wait_for_engines(provisioner, deadline)
    if clear_namespaces and provisioner.clears_namespaces_on_restart:
        client.clear(targets=[i.engine_id for i in identities], block=True)
    world = place(config, identities)
    plan_routes(provisioner, world, deadline)
    return world, join_process_group(client, config, world, private_dir, deadline)
