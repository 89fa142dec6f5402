"""Every use of torch's private internals, in one place.

torch offers no public way to do these few things: read the flight recorder as data, move a
DDP model or an FSDP2 model onto another process group, make a one-rank gloo group without a
store rendezvous, give a rebuilt FSDP2 module's state to the user's object. Each function is
exercised by `tests/test_torch_adapter.py` (and the heal, comeback and X-ray tests that rely on
it), which `benchmarks/compat.py` runs on every torch of the range `pyproject.toml` declares
(2.6 to the newest): a torch that moves one of these fails there first. What a release lacks is
found by feature here (`native_flight_recorder`, `fsdp2_on_cpu`, `dcp_from_one_process`), never by
its version string.
Runs on ranks; imported only where torch already is.
"""

from __future__ import annotations

import datetime
import inspect
import json
import re
from typing import Any

import torch
import torch.distributed as dist


def native_flight_recorder() -> bool:
    """Whether this torch keeps a flight recorder for every backend, gloo's included, that
    `flight_recorder` reads (torch 2.9 does; torch 2.6 has only NCCL's, under another name, and
    none for gloo: `rank/collective_record.py` stands in for it there)."""
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


def fsdp2_on_cpu() -> bool:
    """Whether FSDP2's `fully_shard` runs on CPU tensors here: it records events on the current
    stream, which torch 2.6's CPU stream cannot (torch 2.9's can)."""
    return hasattr(torch.cpu.Stream, "record_event")


def dcp_from_one_process() -> bool:
    """Whether torch.distributed.checkpoint saves and loads from one process inside a running world
    (`no_dist`, torch 2.7 on; torch 2.6 would make every rank of the group take part)."""
    import torch.distributed.checkpoint as dcp

    return all("no_dist" in inspect.signature(call).parameters for call in (dcp.save, dcp.load))


DCP_FROM_ONE_PROCESS_LIMIT = (
    "persisted snapshots are written with torch.save here, not torch.distributed.checkpoint "
    "(this torch's checkpoint cannot save from rank 0 alone)"
)


def checkpoint_format() -> str:
    return "dcp" if dcp_from_one_process() else "torch.save"


def save_whole_checkpoint(state: dict[str, Any], path: Any) -> None:
    """Write `state` (string keys: tensors, and one object) from this process alone."""
    if checkpoint_format() == "torch.save":
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state, path / "state.pt")
        return
    import torch.distributed.checkpoint as dcp

    _quiet_single_process_notice()
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _quiet_single_process_notice() -> None:
    """DCP warns at every `no_dist` call that it assumes one process: what is asked here, and a
    rank's stderr is the notebook's. One filter for that message alone."""
    import warnings

    if not any(getattr(f[1], "pattern", None) == _SINGLE_PROCESS_NOTICE for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE, category=UserWarning)


_SINGLE_PROCESS_NOTICE = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent"


def read_whole_checkpoint(path: Any, format: str) -> dict[str, Any]:
    """Everything `save_whole_checkpoint` wrote, without a state dict to load into. DCP reads that
    only privately: its planner that fills an empty dict (`_EmptyStateDictLoadPlanner`) through
    `_load_state_dict` (the public `load` fills a copy of the dict it is given), as torch's own
    `dcp_to_torch_save` does."""
    if format == "torch.save":
        return dict(torch.load(path / "state.pt", weights_only=False))
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


def flight_recorder(entries: bool) -> dict[str, Any]:
    """torch's flight recorder of this process as data: per group its status (`pg_status`: last
    enqueued / completed sequence numbers) and, with `entries`, the recorded collectives."""
    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(entries, False))  # type: ignore[no-any-return]


def move_ddp(wrapper: torch.nn.parallel.DistributedDataParallel, group: dist.ProcessGroup) -> None:
    """Point a DDP model's reducer at `group` (its buckets and hooks are kept)."""
    wrapper._update_process_group(group)


def ddp_bucket_layout(wrapper: torch.nn.parallel.DistributedDataParallel) -> list[list[int]] | None:
    """The parameter indices in each of a DDP model's gradient buckets, as its reducer last rebuilt
    them from the order gradients became ready, or as `fresh_ddp` was given it (None before its first
    rebuild otherwise: the initial layout)."""
    text = wrapper._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not isinstance(text, str) or not text.strip():
        # DDP logs its rebuilt layout one forward after rebuilding, at its third: a reducer
        # `fresh_ddp` made with a layout has that one until then (its rebuild gives the same order)
        return getattr(wrapper, "_ddp_notebook_layout", None)
    return [[int(index) for index in bucket.split()] for bucket in text.split(",")]


def fresh_ddp(
    module: torch.nn.Module, layout: list[list[int]] | None, **ddp_kwargs: Any
) -> torch.nn.parallel.DistributedDataParallel:
    """A new DistributedDataParallel over `module`, its gradient buckets laid out as `layout` (from
    `ddp_bucket_layout`; None: DDP's initial one), which `ddp_bucket_layout` reads back at once.
    Where a bucket holds other parameters, or the same ones in another order, the all-reduce sums
    them in another order across 3+ ranks: not the same bits."""
    compute = dist._compute_bucket_assignment_by_size
    if layout is not None:
        # DDP hands the reducer its buckets reversed (the order gradients usually become ready)
        buckets = [list(bucket) for bucket in reversed(layout)]

        def assign(parameters: Any, limits: list[int], *args: Any) -> tuple[list[list[int]], list[int]]:
            return buckets, [max(limits)] * len(buckets)

        dist._compute_bucket_assignment_by_size = assign
    try:
        fresh = torch.nn.parallel.DistributedDataParallel(module, **ddp_kwargs)
    finally:
        dist._compute_bucket_assignment_by_size = compute
    fresh._ddp_notebook_layout = layout
    return fresh


def ddp_options(wrapper: torch.nn.parallel.DistributedDataParallel) -> dict[str, Any]:
    """The options a DDP model was made with that a fresh wrapper must be given again (those
    that differ from DDP's defaults), read from its attributes: a model the user wrapped."""
    options: dict[str, Any] = {}
    if wrapper.device_ids:
        options["device_ids"] = list(wrapper.device_ids)
        if wrapper.output_device is not None:
            options["output_device"] = wrapper.output_device
    for name in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph"):
        if getattr(wrapper, name, False):
            options[name] = True
    # torch 2.13 keeps broadcast_buffers as forward_sync_buffers (the argument too); older ones as it is
    synced = getattr(wrapper, "forward_sync_buffers", getattr(wrapper, "broadcast_buffers", True))
    if not synced:
        known = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
        options["forward_sync_buffers" if "forward_sync_buffers" in known else "broadcast_buffers"] = False
    return options


def drop_ddp_hooks(wrapper: torch.nn.parallel.DistributedDataParallel) -> None:
    """Unhook a DDP model's reducer from its parameters' gradients, before another reducer replaces it."""
    wrapper.reducer._remove_autograd_hooks()


def lone_gloo_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group of this rank alone on gloo, made without any rendezvous (and no name:
    nothing registers it, so nothing keeps it alive but its holders)."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def write_mark(tensor: torch.Tensor) -> tuple[int, int, int, int]:
    """A tensor's identity, storage and write counts (torch bumps a tensor's version on every
    in-place write): a DTensor counts writes through it (an optimizer's step), its local tensor
    those made to the shard directly (FSDP's own)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return (id(tensor), local.data_ptr(), tensor._version, local._version)


def point_mesh_at(mesh: Any, group: dist.ProcessGroup | None) -> None:
    """Make a one-dimensional DeviceMesh hand out `group` as its process group (None: none at all,
    so it keeps no old group alive)."""
    if group is None:
        mesh._pg_registry = {}
    else:
        mesh._dim_group_names = [group.group_name]
        mesh._pg_registry = {group.group_name: group}


def queue_end_of_backward(callback: Any) -> None:
    """Run `callback` when the autograd engine finishes the backward pass under way."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def fsdp_param_group(module: torch.nn.Module) -> Any:
    """The parameter group FSDP2's `fully_shard` gave `module` (None where it holds no parameters
    of its own): its `mesh_info`, and its `fsdp_params` with theirs."""
    return module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]


def fsdp_is_root(module: torch.nn.Module) -> bool | None:
    """Whether FSDP2 made `module` the root of its sharded tree (None before its first forward)."""
    return module._get_fsdp_state()._is_root  # type: ignore[operator, no-any-return]


def share_fsdp_state(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Make torch find `source`'s FSDP2 state from `target` (torch keys it by the module object)."""
    from torch.distributed import _composable_state

    states = _composable_state._module_state_mapping
    states[target] = states[source]


# gloo raises plain RuntimeErrors (torch 2.13: "[.../gloo/transport/tcp/pair.cc:553] Connection closed
# by peer", "Timed out waiting 3000ms for recv"); a collective on a group released or destroyed meanwhile
# raises ValueError("Default process group has not been initialized"). NCCL raises DistBackendError.
_BROKEN_GROUP_TEXT = re.compile(
    r"/gloo/|\[gloo\]|nccl|Connection closed by peer|Connection reset|ProcessGroup|Timed out|timed out|"
    r"Default process group has not been initialized",
)


def breaks_group(error: BaseException) -> bool:
    """Whether `error` (a cell's) means this rank's process group is unusable and must be set up again.

    By type where torch gives one (`torch.distributed.DistError`: DistBackendError, DistNetworkError,
    DistStoreError); gloo's errors and a released group's have no type of their own, so their text."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, (RuntimeError, ValueError)) and _BROKEN_GROUP_TEXT.search(str(error)) is not None


# the backend of torch's fake process group: a simulated world's (scale tests and benchmarks)
FAKE_BACKEND = "fake"


def fake_group_store() -> dist.Store:
    """A store for a rank of a simulated world: torch registers its fake backend (a process group
    whose collectives return at once, communicating nothing) only in its testing package."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    return dist.HashStore()
