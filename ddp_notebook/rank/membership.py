"""A rank joins its world: the torchrun environment, its device, the default process group;
it lets go of the group when the world heals, and leaves it when the world stops.

Imports torch and the standard library only (no IPython at import time, no widgets): this
module is loaded by every rank process, usually while the rank registers with the controller.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..platform import devices
from ..platform.network import listen
from ..wire.join import JoinReport, RankSpec
from . import torch_adapter
from . import xray as xray_rank
from .state import RANK, RankContext


def open_rendezvous(host: str) -> int:
    """Bind the rendezvous socket on rank 0 and return its port.

    torch's TCPStore, left to itself, listens on every interface; binding the socket here
    (to loopback for a one-machine world) and handing it over keeps it where we chose, and
    port 0 lets the OS pick a free port with no race.
    """
    close_rendezvous()
    listener = RANK.membership.listener = listen(host, backlog=128)
    return int(listener.getsockname()[1])


def close_rendezvous() -> None:
    listener = RANK.membership.listener
    if listener is not None:
        listener.close()
        RANK.membership.listener = None


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
    _log_warnings_only()
    sys.path[:] = without_repeats(sys.path)

    device = _choose_device(spec.backend, spec.gpu, spec.local_rank)
    timeout = datetime.timedelta(seconds=spec.timeout)
    _import_dynamo_first()
    if dist.is_initialized():
        dist.destroy_process_group()
    if spec.simulated:
        # no rendezvous: a fake group's ranks never talk to each other (their run id is the rank's own)
        store, backend = torch_adapter.fake_group_store(), torch_adapter.FAKE_BACKEND
        close_rendezvous()
    else:
        store, backend = _make_store(spec, timeout), spec.backend
    init_kwargs: dict[str, Any] = {}
    if device.type == "cuda" and spec.backend == "nccl":
        # binds the communicator to this GPU and forms it now (eagerly), on this GPU only
        init_kwargs["device_id"] = device
    xray_rank.before_group()
    from .script_setup import answer_script_calls, torch_init_process_group

    torch_init_process_group()(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **init_kwargs)
    answer_script_calls()  # a torchrun script's own init_process_group gets this group
    _share_run_id(store, 0 if spec.simulated else rank)
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
    RANK.membership.context = context
    publish_names(context)
    # after a heal: models wrapped by prepare_model move onto the new group
    for wrapper in list(RANK.prepared.wrappers):
        torch_adapter.move_ddp(wrapper, dist.group.WORLD)
    _regroup_sharded(dist.group.WORLD, registered=True)
    for sampler in list(RANK.prepared.samplers):
        if (sampler.num_replicas, sampler.rank) != (world_size, rank):
            sampler.reshard(world_size, rank)
    if spec.notebook_host and spec.notebook_folder:
        from .files import enter_working_folder

        enter_working_folder(spec.notebook_host, spec.notebook_folder)
    from .reloading import set_autoreload

    set_autoreload(spec.autoreload)
    if spec.check_collectives:
        from .strict import check_collectives

        # every rank of the new group runs this line: the checks' own group is made here, together
        check_collectives()
    if spec.stack_dir and not RANK.membership.stack_dumps:
        from ..wire.stacks import enable_stack_dumps

        enable_stack_dumps(spec.stack_dir, rank)
        xray_rank.serve(spec.stack_dir, rank)
        RANK.membership.stack_dumps = True
        _keep_cells_if_detached()
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
        off_here=_off_here(device),
    )


def _keep_cells_if_detached() -> None:
    """A detached world's rank keeps its newest cell for a kernel that attaches later (`%ddp_wait`),
    and runs the cells of one kernel at a time."""
    from ..wire.detached import DETACHED_ENV

    if not os.environ.get(DETACHED_ENV):
        return
    from IPython import get_ipython

    from .cell_journal import keep
    from .cell_owner import guard
    from .channel import in_rank

    shell = get_ipython()
    if in_rank(shell):
        keep(shell)
        guard(shell)  # the cells of the kernel attached last only, once one attaches again


# said at %ddp_start where a CPU rank's torch cannot run FSDP2
FSDP2_ON_CPU_LIMIT = (
    "FSDP2 (fully_shard) on CPU ranks: this torch's fully_shard needs a GPU stream (torch 2.9 runs it on CPU)"
)


def _off_here(device: torch.device) -> tuple[str, ...]:
    """What this rank's torch lacks, one line each (`world.capabilities` says them once)."""
    lines = list(xray_rank.off_here())
    if device.type == "cpu" and not torch_adapter.fsdp2_on_cpu():
        lines.append(FSDP2_ON_CPU_LIMIT)
    return tuple(lines)


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
        membership = RANK.membership
        if membership.run_id is None:
            import uuid

            membership.run_id = uuid.uuid4().hex
            membership.joins = 0
        else:
            membership.joins += 1
        store.set(_RUN_ID_KEY, f"{membership.run_id}:{membership.joins}")
    run_id, _, joins = store.get(_RUN_ID_KEY).decode().partition(":")
    os.environ["TORCHELASTIC_RUN_ID"] = run_id
    os.environ["TORCHELASTIC_RESTART_COUNT"] = joins


def _log_warnings_only() -> None:
    """From here on the rank's engine logs warnings and errors only.

    Its logger stood at DEBUG behind an INFO handler: every cell made five records only to drop
    them, and wrote a `Handling execute_request` line to the rank's log (a line per rank per cell,
    for the world's life). What the start reads from a rank's log (its registration, a fatal
    line) is written before this, or is an error.
    """
    import logging

    from IPython import get_ipython

    shell = get_ipython()
    engine_log = getattr(getattr(shell, "kernel", None), "log", None)
    if not isinstance(engine_log, logging.Logger):
        return
    handler_levels = [handler.level for handler in engine_log.handlers]
    if handler_levels and min(handler_levels) > logging.DEBUG:  # nobody asked for the engine's DEBUG lines
        engine_log.setLevel(logging.WARNING)


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
    wrappers = list(RANK.prepared.wrappers)
    if wrappers:
        placeholder = _placeholder_group()
        for wrapper in wrappers:
            torch_adapter.move_ddp(wrapper, placeholder)
    if _user_namespace() and "torch.distributed.fsdp" in sys.modules:
        _regroup_sharded(_placeholder_group(), registered=False)
    close_rendezvous()
    if dist.is_initialized():
        dist.destroy_process_group()
    # groups a cell ended itself, kept until now (script_setup.keep_destroyed_groups): their
    # workers are idle since the cell ended, so freeing them here cannot wait on the GIL
    RANK.membership.destroyed_groups.clear()
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

    The same rule for every launcher (`devices.rank_device`): all ranks of a host see the same
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
        problem = devices.gpu_problem(gpu, local_rank, devices.listed_gpus())
        if problem is not None:
            raise RuntimeError(f"this rank cannot use {given} as cuda:{local_rank}: {problem}")
    if not torch.backends.cuda.is_built():
        raise RuntimeError(
            f"this rank was given {given} but torch here has no CUDA support (torch {torch.__version__}); "
            "install a CUDA build of torch, or start CPU ranks (--backend gloo, without --gpus)"
        )
    index = local_rank  # devices.rank_device: cuda:LOCAL_RANK, whichever launcher started the rank
    try:
        torch.cuda.set_device(index)
    except Exception as failure:  # noqa: BLE001  (no driver, invalid ordinal, ...: one message with the cause)
        raise RuntimeError(f"this rank could not select cuda:{index} ({given}): {failure}") from None
    return torch.device("cuda", index)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _make_store(spec: RankSpec, timeout: datetime.timedelta) -> dist.Store:
    """The world's rendezvous: a file in its private folder (every rank on this host), or rank 0's
    TCPStore, its values signed where the spec says (see rank/rendezvous.py)."""
    if spec.store_path:
        close_rendezvous()  # unused: MASTER_PORT stays free, as under torchrun, for an init of the user's own
        return dist.FileStore(spec.store_path, spec.world_size)
    store: dist.Store = _tcp_store(spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout)
    if spec.store_key:
        from .rendezvous import SignedStore  # a world across hosts only: no import at a rank's start

        # torch keeps only the C++ side of a store written in Python: the rank holds the Python one
        store = RANK.membership.signed_store = SignedStore(store, bytes.fromhex(spec.store_key))
    return store


def _tcp_store(rank: int, world_size: int, host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    if rank == 0:
        listener = RANK.membership.listener
        if listener is None:
            raise RuntimeError("rendezvous socket missing on rank 0; restart the world")
        RANK.membership.listener = None
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
    ddp_notebook = sys.modules[__name__.partition(".")[0]]  # the package root, imported before any of its modules

    shell.user_ns.update(
        rank=context.rank,
        world_size=context.world_size,
        local_rank=context.local_rank,
        device=context.device,
        torch=torch,
        dist=dist,
        ddp_notebook=ddp_notebook,
    )
    for hook in (_keep_interruptible, _report_broken_group):
        if hook not in shell.events.callbacks["post_run_cell"]:
            shell.events.register("post_run_cell", hook)


def _report_broken_group(result: Any) -> None:
    """After a cell: tell the notebook when a failure broke this rank's process group (judged here,
    by the exception's type, where the exception is; the notebook sees its text only), or when the
    cell ended the group itself: a script's last line `dist.destroy_process_group()`, or a
    framework's (Accelerate's `end_training()`), would leave the next cell without one."""
    error = getattr(result, "error_in_exec", None)
    broken = error is not None and torch_adapter.breaks_group(error)
    if broken or (joined_context() is not None and not dist.is_initialized()):
        from ..wire.results import GROUP_BROKEN_KEY
        from .channel import tell_notebook

        tell_notebook(GROUP_BROKEN_KEY)


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
    RANK.membership.context = None
    from .files import leave_sync_folder

    leave_sync_folder()


def joined_context() -> RankContext | None:
    """The context this rank joined its world with (None before, or under torchrun)."""
    return RANK.membership.context


def become(context: RankContext) -> None:
    """This rank takes `context` (a new rank replaying the setup cells is already the world's rank
    N, in a group of its own) and its cells see the names it gives."""
    RANK.membership.context = context
    publish_names(context)


def wrappers() -> list[torch.nn.parallel.DistributedDataParallel]:
    """The DDP models `prepare_model` made on this rank that are still alive."""
    return list(RANK.prepared.wrappers)


def context() -> RankContext:
    """This rank's context; outside a ddp_notebook world, read from the torchrun environment."""
    current = RANK.membership.context
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
