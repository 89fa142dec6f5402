"""Everything that runs ON the ranks: the environment contract, process-group set-up and
teardown, and the helpers used inside `%%ddp` cells.

Imports torch and the standard library only (no IPython at import time, no widgets): this
module is loaded by every rank process, usually while the rank registers with the controller.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from . import devices, layout, timing, torch_adapter, xray_rank
from .network import listen
from .wire.join import JoinReport, RankSpec


@dataclass(frozen=True)
class RankContext:
    """Who this process is in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    master_addr: str
    master_port: int


# Process state of this rank (not configuration): set by init_world, cleared by shutdown_world.
_state: dict[str, Any] = {
    "context": None,
    "listener": None,
    "wrappers": weakref.WeakSet(),
    "samplers": weakref.WeakSet(),  # of prepare_loader's loaders: dealt again when the world is resized
}


def open_rendezvous(host: str) -> int:
    """Bind the rendezvous socket on rank 0 and return its port.

    torch's TCPStore, left to itself, listens on every interface; binding the socket here
    (to loopback for a one-machine world) and handing it over keeps it where we chose, and
    port 0 lets the OS pick a free port with no race.
    """
    close_rendezvous()
    listener = _state["listener"] = listen(host, backlog=128)
    return int(listener.getsockname()[1])


def close_rendezvous() -> None:
    listener = _state.get("listener")
    if listener is not None:
        listener.close()
        _state["listener"] = None


def init_world(spec: RankSpec) -> JoinReport:
    """Set the torchrun environment, pick the device and join the default process group.

    A GPU rank (`spec.gpu`: the CUDA_VISIBLE_DEVICES entry of its GPU) uses `cuda:LOCAL_RANK`, and
    selecting it is the first CUDA call this process makes. Publishes rank, world_size,
    local_rank, device, torch and dist into the user namespace.
    """
    rank, world_size = spec.rank, spec.world_size
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "GROUP_RANK": str(spec.group_rank),
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
        "OMP_NUM_THREADS": str(spec.threads),
    }
    if spec.socket_ifname:
        # the interface of the route to rank 0 (gloo and NCCL otherwise pick one from the hostname)
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = spec.socket_ifname
    env.update(_elastic_env(rank, world_size, spec.local_world_size))
    os.environ.update(env)
    torch.set_num_threads(spec.threads)
    _declare_not_interactive()
    sys.path[:] = without_repeats(sys.path)

    device = _choose_device(spec.backend, spec.gpu, spec.local_rank)
    timeout = datetime.timedelta(seconds=spec.timeout)
    _import_dynamo_first()
    if dist.is_initialized():
        dist.destroy_process_group()
    store = _make_store(rank, world_size, spec.master_addr, spec.master_port, timeout)
    init_kwargs: dict[str, Any] = {}
    if device.type == "cuda" and spec.backend == "nccl":
        # binds the communicator to this GPU and forms it now (eagerly), on this GPU only
        init_kwargs["device_id"] = device
    xray_rank.before_group()
    dist.init_process_group(
        spec.backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **init_kwargs
    )
    _share_run_id(store, rank)
    context = RankContext(
        rank=rank,
        world_size=world_size,
        local_rank=spec.local_rank,
        local_world_size=spec.local_world_size,
        device=device,
        backend=spec.backend,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
    )
    _state["context"] = context
    publish_names(context)
    # after a heal: models wrapped by prepare_model move onto the new group
    for wrapper in list(_state["wrappers"]):
        torch_adapter.move_ddp(wrapper, dist.group.WORLD)
    _regroup_sharded(dist.group.WORLD, registered=True)
    for sampler in list(_state["samplers"]):
        if (sampler.num_replicas, sampler.rank) != (world_size, rank):
            sampler.reshard(world_size, rank)
    if spec.check_collectives:
        from .strict import check_collectives

        # every rank of the new group runs this line: the checks' own group is made here, together
        check_collectives()
    if spec.stack_dir and not _state.get("stack_dumps"):
        from .stacks import enable_stack_dumps

        enable_stack_dumps(spec.stack_dir, rank)
        xray_rank.serve(spec.stack_dir, rank)
        _state["stack_dumps"] = True
    xray_address = None
    if spec.xray_key and spec.xray_toward:
        # a rank on another host: the notebook reaches its X-ray over TCP, signed with the world's key
        xray_address = xray_rank.serve_tcp(spec.xray_toward, bytes.fromhex(spec.xray_key))
    return JoinReport(
        device=str(device),
        device_name=_device_name(device),
        backend=spec.backend,
        main_thread=threading.main_thread().ident,
        xray_address=xray_address,
    )


def _elastic_env(rank: int, world_size: int, local_world_size: int) -> dict[str, str]:
    """The rest of the environment torchrun (torch 2.13's elastic agent) gives its workers.

    Frameworks read it to decide that the processes were started for them: Lightning picks its
    TorchElasticEnvironment (and so launches nothing) when TORCHELASTIC_RUN_ID is set,
    Accelerate and the HF Trainer read RANK / LOCAL_RANK / WORLD_SIZE, torch's own
    `is_torchelastic_launched()` reads TORCHELASTIC_RUN_ID. One role ("default"), as torchrun
    without --role. Left out on purpose: TORCHELASTIC_ERROR_FILE (a file per worker the agent
    reads back; there is no agent) and TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torchrun's default
    tears the process down on an NCCL error; here a rank's Python state outlives a broken group
    and the world heals).
    """
    # torchrun's GROUP_WORLD_SIZE is the number of nodes; every host of a ddp_notebook world runs
    # local_world_size ranks unless a launcher placed them unevenly (then: hosts rounded up)
    groups = -(-world_size // max(local_world_size, 1))
    return {
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(groups),
        "TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # replaced by rank 0's id once the store is up (_share_run_id); set now so nothing sees it unset
        "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID", "ddp_notebook"),
        # the process group is ours: an env:// init must not look for an agent's store
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


_RUN_ID_KEY = "ddp_notebook/run_id"


def _share_run_id(store: dist.Store, rank: int) -> None:
    """One TORCHELASTIC_RUN_ID for the world (rank 0's) and a restart count that a heal raises.

    As under torchrun, where the run id stays and TORCHELASTIC_RESTART_COUNT grows when the
    agent restarts its workers, a heal (a new process group over the same processes) keeps the
    id and counts one more restart.
    """
    if rank == 0:
        if "run_id" not in _state:
            import uuid

            _state["run_id"] = uuid.uuid4().hex
            _state["joins"] = 0
        else:
            _state["joins"] += 1
        store.set(_RUN_ID_KEY, f"{_state['run_id']}:{_state['joins']}")
    run_id, _, joins = store.get(_RUN_ID_KEY).decode().partition(":")
    os.environ["TORCHELASTIC_RUN_ID"] = run_id
    os.environ["TORCHELASTIC_RESTART_COUNT"] = joins


def _declare_not_interactive() -> None:
    """Tell libraries that this process is a worker of a world started from outside, as under torchrun.

    IPython sets `sys.ps1` "so that scripts can decide if they are running interactively", and
    libraries do: Lightning refuses `Trainer(strategy="ddp")` and `Fabric(strategy="ddp")` where
    it is set, because it would have to start the other processes itself. A rank is no such
    place: nobody types at it, its processes and LOCAL_RANK already exist. The prompt strings
    are not used by the kernel the rank runs (ipykernel numbers its prompts in the notebook).
    Done before any cell runs, so a library reading it at import time sees the worker's answer.
    """
    import sys

    for name in ("ps1", "ps2", "ps3"):
        if hasattr(sys, name):
            delattr(sys, name)


def without_repeats(paths: list[str]) -> list[str]:
    """`paths` with every entry after its first occurrence left out, in order.

    A rank's engine start puts the working directory ('') on `sys.path` twice (ipyparallel's
    engine and IPython's shell each insert it). Imports find the same modules without the
    repeat, but every lookup of a module that is not installed searches each entry again:
    accelerate's optimizer wrapper asks for one (`lomo_optim`) twice per training step, the
    Hugging Face `Trainer` through it too, about 4.5 us per repeated entry per lookup here.
    """
    try:
        return list(dict.fromkeys(paths))
    except TypeError:  # an unhashable entry someone put there: leave the path as it is
        return list(paths)


def _import_dynamo_first() -> None:
    """Import torch._dynamo before any process group exists.

    Imported later (DistributedDataParallel imports it), it keeps a reference to the
    default group that outlives `destroy_process_group`, so the group's sockets stay open
    and peers blocked in a collective are never released. Imported first, it holds none.
    """
    import torch._dynamo  # noqa: F401


def release_group() -> None:
    """Let go of the default process group so peers blocked in it fail at once.

    Models from prepare_model first move onto a private one-rank placeholder group (they
    hold the group too); `init_world` moves them onto the next real group.
    """
    wrappers = list(_state["wrappers"])
    if wrappers:
        placeholder = _placeholder_group()
        for wrapper in wrappers:
            torch_adapter.move_ddp(wrapper, placeholder)
    if _user_namespace() and "torch.distributed.fsdp" in sys.modules:
        _regroup_sharded(_placeholder_group(), registered=False)
    close_rendezvous()
    if dist.is_initialized():
        dist.destroy_process_group()
    import gc

    gc.collect()  # the group's sockets close when its last reference goes


def _user_namespace() -> dict[str, Any]:
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    return shell.user_ns if shell is not None else {}


def _regroup_sharded(group: dist.ProcessGroup, registered: bool) -> None:
    """FSDP2 models in the rank's namespace follow the world onto `group` (see sharding.regroup)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return  # nothing can be sharded yet; importing FSDP here would slow every start
    from . import sharding

    modules = sharding.sharded_modules(_user_namespace())
    if not modules:
        return
    skipped = sharding.regroup(modules, group, registered)
    if skipped and registered:
        print(f"ddp_notebook: sharded models on {', '.join(skipped)} keep the old process group; shard them again")


def _placeholder_group() -> dist.ProcessGroup:
    return torch_adapter.lone_gloo_group(datetime.timedelta(seconds=30))


def _choose_device(backend: str, gpu: str | None = None, local_rank: int = 0) -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` for a GPU rank (one given a GPU, or on nccl), else the CPU.

    The same rule for every launcher (`layout.rank_device`): all ranks of a host see the same
    GPUs in the same order, as under torchrun, and rank r uses number LOCAL_RANK among them.
    `torch.cuda.set_device` is the first CUDA call of the process: everything after it, the
    NCCL communicator included, then lives on this rank's GPU, and no rank makes a CUDA context
    on another's, although it could see them (CUDA IPC between the ranks needs them visible).
    """
    if gpu is None and backend != "nccl":
        return torch.device("cpu")
    given = f"GPU {gpu}" if gpu is not None else f"a GPU (backend {backend})"
    if gpu is not None:
        # from the environment alone: nothing here may touch CUDA before set_device
        problem = layout.gpu_problem(gpu, local_rank, devices.listed_gpus())
        if problem is not None:
            raise RuntimeError(f"this rank cannot use {given} as cuda:{local_rank}: {problem}")
    if not torch.backends.cuda.is_built():
        raise RuntimeError(
            f"this rank was given {given} but torch here has no CUDA support (torch {torch.__version__}); "
            "install a CUDA build of torch, or start CPU ranks (--backend gloo, without --gpus)"
        )
    index = local_rank  # layout.rank_device: cuda:LOCAL_RANK, whichever launcher started the rank
    try:
        torch.cuda.set_device(index)
    except Exception as failure:  # noqa: BLE001  (no driver, invalid ordinal, ...: one message with the cause)
        raise RuntimeError(f"this rank could not select cuda:{index} ({given}): {failure}") from None
    return torch.device("cuda", index)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _make_store(rank: int, world_size: int, host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    if rank == 0:
        listener = _state.get("listener")
        if listener is None:
            raise RuntimeError("rendezvous socket missing on rank 0; restart the world")
        _state["listener"] = None
        # the store takes ownership of the listening socket's file descriptor
        return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach(), use_libuv=False)
    return dist.TCPStore(host, port, world_size, False, timeout, use_libuv=False)


def publish_names(context: RankContext) -> None:
    try:
        from IPython import get_ipython
    except ImportError:  # a rank outside an IPython engine (e.g. a plain script under torchrun)
        return
    shell = get_ipython()
    if shell is None:
        return
    ddp_notebook = sys.modules[__package__]  # imported before any of its modules: no import to make

    shell.user_ns.update(
        rank=context.rank,
        world_size=context.world_size,
        local_rank=context.local_rank,
        device=context.device,
        torch=torch,
        dist=dist,
        ddp_notebook=ddp_notebook,
    )
    if _keep_interruptible not in shell.events.callbacks["post_run_cell"]:
        shell.events.register("post_run_cell", _keep_interruptible)


def _keep_interruptible(*_: Any) -> None:
    """After each cell: SIGINT raises KeyboardInterrupt again, whatever the cell did to it.

    Interrupting a cell (the stop button, a timeout) is a SIGINT to the rank. Some libraries
    ignore SIGINT once they have caught one (Lightning's Trainer does, to exit cleanly), which
    would leave every later interrupt of this rank unanswered.
    """
    import signal

    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def shutdown_world() -> None:
    """Leave the process group cleanly (exiting without it can abort the process)."""
    close_rendezvous()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state["context"] = None


def joined_context() -> RankContext | None:
    """The context this rank joined its world with (None before, or under torchrun)."""
    return _state["context"]  # type: ignore[no-any-return]


def become(context: RankContext) -> None:
    """This rank takes `context` (a new rank replaying the setup cells is already the world's rank
    N, in a group of its own) and its cells see the names it gives."""
    _state["context"] = context
    publish_names(context)


def wrappers() -> list[torch.nn.parallel.DistributedDataParallel]:
    """The DDP models `prepare_model` made on this rank that are still alive."""
    return list(_state["wrappers"])


def context() -> RankContext:
    """This rank's context; outside a ddp_notebook world, read from the torchrun environment."""
    current = _state["context"]
    if current is not None:
        return current
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: run this inside a %%ddp cell after %ddp_start, or under torchrun "
            "after torch.distributed.init_process_group()"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        # torchrun's convention, as in our worlds: cuda:LOCAL_RANK. A launcher that masked each
        # process to its own GPU leaves fewer GPUs than that: then the device the script selected
        index = local_rank if local_rank < torch.cuda.device_count() else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return RankContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size()))),
        device=device,
        backend=str(dist.get_backend()),
        master_addr=os.environ.get("MASTER_ADDR", ""),
        master_port=int(os.environ.get("MASTER_PORT", "0") or 0),
    )


# ---------------------------------------------------------------- helpers for %%ddp cells


def is_main() -> bool:
    """True on rank 0: the rank that prints summaries and writes files."""
    return context().rank == 0


def barrier() -> None:
    """Wait until every rank of the world reaches this point (bounded by the world's timeout)."""
    current = context()
    if current.backend == "nccl" and current.device.type == "cuda":
        dist.barrier(device_ids=[current.device.index])  # this rank's GPU, not the current default
    else:
        dist.barrier()


def prepare_model(model: torch.nn.Module, *, shard: bool = False, **ddp_kwargs: Any) -> torch.nn.Module:
    """Move `model` to this rank's device and wrap it in DistributedDataParallel (or shard it).

    `shard=True`: shard it with FSDP2 instead (`shard_model`). A model already sharded is
    returned as it is (DDP over FSDP would all-reduce what FSDP already reduces).

    On GPUs that device is `cuda:LOCAL_RANK` (the published `device`), and DDP gets
    `device_ids=[LOCAL_RANK]`. Wrapping broadcasts rank 0's parameters, so every rank starts
    from the same weights. Keyword arguments go to `DistributedDataParallel` (e.g.
    `find_unused_parameters=True`).
    """
    if shard or is_sharded(model):
        if ddp_kwargs:
            raise TypeError(f"DistributedDataParallel options {sorted(ddp_kwargs)} do not apply to a sharded model")
        return shard_model(model)
    current = context()
    model = model.to(current.device)
    if current.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [current.device.index])
    wrapper = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    _state["wrappers"].add(wrapper)  # kept weakly: moved onto a new group if the world heals
    timing.watch_model(wrapper)
    wrapper._ddp_notebook_kwargs = dict(ddp_kwargs)  # to wrap it again when a rank is replaced (elastic)
    return wrapper


def is_sharded(model: Any) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from .sharding import is_sharded

    return is_sharded(model)


def shard_model(
    model: torch.nn.Module, *, blocks: Any = None, mesh: Any = None, **fully_shard_kwargs: Any
) -> torch.nn.Module:
    """Shard `model` with FSDP2 (`fully_shard`) over the world, on this rank's device.

    Each block (the entries of the model's `ModuleList`s / `Sequential`s, e.g. a transformer's
    layers; or `blocks=[...]`) is sharded on its own, then the root: in forward, one block's
    parameters are gathered at a time. The mesh is one-dimensional over every rank (`mesh=` to
    give your own); other keyword arguments go to `fully_shard` (`mp_policy`,
    `reshard_after_forward`, ...). A model you sharded yourself is returned as it is. Save and
    load it with `save_checkpoint` / `load_checkpoint` (every rank writes its own shard).
    """
    from .sharding import shard_model as shard

    return shard(model, context().device, blocks=blocks, mesh=mesh, **fully_shard_kwargs)


class EpochDataLoader(DataLoader):
    """A DataLoader over a DistributedSampler that advances the sampler's epoch itself.

    Forgetting `sampler.set_epoch(epoch)` gives every epoch the same order; here each new
    iteration over the loader starts the next epoch's shuffle. It also knows how far the
    world got in the epoch's global order, so a tracked loader (`ddp_notebook.track`) resumes
    mid-epoch after a rank came back or the world was resized:
    `while loader.epoch < EPOCHS: for batch in loader: ...`
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0  # epochs started
        self.position = 0  # batches of this iteration whose step finished
        self.in_epoch = False
        self.after_batch: Any = None  # called with the loader after each finished step (tracking)
        self._start = 0  # samples of the epoch's global order used before this iteration began
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self.epoch)
        self._start, self._resume_at = self._resume_at, 0
        if isinstance(sampler, ResumableSampler):
            sampler.skip = self._start
        self.epoch += 1
        self.position, self.in_epoch = 0, True
        if not self._start:
            return self._counted(timing.TimedBatches(super().__iter__()))
        # a resumed epoch: its first start drew the workers' base seed from torch's generator
        # already, before the snapshot that brought the world back; drawing again would shift
        # every random number after it (dropout masks) against an uninterrupted run
        with torch.random.fork_rng(devices=[]):
            batches = super().__iter__()
        return self._counted(timing.TimedBatches(batches))

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            yield batch
            self.position += 1  # asked for the next batch: the step on this one finished
            if self.after_batch is not None:
                self.after_batch(self)
        self.in_epoch = False

    @property
    def used(self) -> int:
        """Samples of the epoch's global order the world used so far (every rank's batches)."""
        replicas = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return self._start + self.position * int(self.batch_size or 1) * replicas

    @property
    def batches_done(self) -> int:
        """Steps of the epoch in progress, counted at the current world size."""
        replicas = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return self.used // (int(self.batch_size or 1) * replicas)

    def position_state(self) -> tuple[int, int, bool]:
        """(epochs started, samples of the last one's global order used, whether it is in progress)."""
        return (self.epoch, self.used, self.in_epoch)

    def resume_from(self, state: tuple[int, int, bool]) -> None:
        """The next iteration continues the epoch `state` was taken in, after the samples it used."""
        epoch, used, in_epoch = state
        self.epoch, self._resume_at = (epoch - 1, used) if in_epoch else (epoch, 0)
        self.position, self.in_epoch, self._start = 0, False, 0


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler that can start an epoch after the first `skip` samples of its global
    order (a resumed epoch), and be dealt again over another number of ranks (`reshard`).

    The global order is DistributedSampler's (shuffled by seed + epoch, padded to a multiple of
    the ranks); rank r takes every num_replicas-th sample of what is left, from position r.
    With skip=0, or skip a multiple of the ranks at an unchanged size, the shard is exactly
    DistributedSampler's. What is left is padded (or, with drop_last, cut) so every rank
    gets as many samples.
    """

    skip = 0

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Deal the data over `num_replicas` ranks from now on (the world was resized)."""
        self.num_replicas, self.rank = num_replicas, rank
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and size % num_replicas != 0:
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        if skip == 0:
            return super().__iter__()
        whole = self._global_order()
        rest = whole[skip:]
        extra = -len(rest) % self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) - (len(rest) % self.num_replicas)]
        elif extra:
            rest += (whole * math.ceil(extra / len(whole)))[:extra]
        return iter(rest[self.rank :: self.num_replicas])

    def _global_order(self) -> list[int]:
        """Every rank's samples of this epoch, in DistributedSampler's order, before dealing."""
        rank, replicas = self.rank, self.num_replicas
        self.rank, self.num_replicas, total = 0, 1, self.total_size
        try:
            self.total_size = self.num_samples = len(self.dataset)  # type: ignore[arg-type]
            order = list(super().__iter__())
        finally:
            self.rank, self.num_replicas = rank, replicas
            self.reshard(replicas, rank)
        if self.drop_last:
            return order[:total]
        return order + (order * math.ceil(total / len(order)))[: total - len(order)]


def prepare_loader(
    dataset: Dataset[Any],
    batch_size: int,
    shuffle: bool = True,
    *,
    seed: int = 0,
    **loader_kwargs: Any,
) -> EpochDataLoader:
    """A DataLoader over this rank's DistributedSampler shard of `dataset`.

    Shards are disjoint and together cover the dataset (padded to equal length unless
    `drop_last=True`). `batch_size` is per rank: the global batch is batch_size * world_size.
    """
    current = context()
    sampler = ResumableSampler(
        dataset,
        num_replicas=current.world_size,
        rank=current.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=bool(loader_kwargs.get("drop_last", False)),
    )
    _state["samplers"].add(sampler)
    if current.device.type == "cuda":
        loader_kwargs.setdefault("pin_memory", True)
    return EpochDataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)


def save_checkpoint(obj: Any, path: str | os.PathLike[str], *, optimizer: Any = None) -> str | None:
    """Save `obj` with torch.save on rank 0 only; returns the path there, None elsewhere.

    A model (DDP-wrapped or not) is saved as its plain state_dict, loadable without DDP; with
    `optimizer=`, the file holds {"model": ..., "optimizer": optimizer.state_dict()}.
    The file is written to a temporary name and renamed, so a reader never sees half a file.
    Other ranks do not wait: call `ddp_notebook.barrier()` after it if they read the file.

    A model sharded with FSDP2 is saved with torch.distributed.checkpoint instead: `path` is a
    directory, every rank writes its own shard of the model and of the optimizer's state (call
    it on every rank), and every rank gets the path back. `load_checkpoint` reads it on any
    number of ranks, or in one process.
    """
    if is_sharded(obj):
        from .sharding import save_sharded

        return save_sharded(obj, path, optimizer)
    if context().rank != 0:
        return None
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if optimizer is not None:
        obj = {"model": obj, "optimizer": optimizer.state_dict()}
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pt")
    os.close(handle)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike[str], *, optimizer: Any = None) -> torch.nn.Module:
    """Load a checkpoint written by `save_checkpoint` into `model` (on every rank, or in one process).

    A directory is a torch.distributed.checkpoint written by sharded models: a sharded model
    reads its own slices whatever the number of ranks that wrote it; a plain model (DDP-wrapped
    or not, in a world or in a process without one) reads all of it. A file is a torch.save'd
    state_dict. With `optimizer=`, its state is loaded too (the checkpoint must hold it).
    Returns `model`.
    """
    target = os.fspath(path)
    plain = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if os.path.isdir(target):
        from .sharding import load_sharded

        load_sharded(plain, target, optimizer)
        return model
    state = torch.load(target, map_location="cpu", weights_only=True)
    both = isinstance(state, dict) and set(state) == {"model", "optimizer"} and isinstance(state["model"], dict)
    if optimizer is not None:
        if not both:
            raise ValueError(f"{target} holds no optimizer state (saved without optimizer=): load the model alone")
        optimizer.load_state_dict(state["optimizer"])
    plain.load_state_dict(state["model"] if both else state)
    return model
