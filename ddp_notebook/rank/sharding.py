"""FSDP2 on the ranks: sharding a model, sharded checkpoints, and keeping sharded models through a heal.

Runs on ranks (torch + stdlib). `shard_model` applies `torch.distributed.fsdp.fully_shard` per
block, then to the root, on a one-dimensional DeviceMesh over the world. Checkpoints of sharded
models go through `torch.distributed.checkpoint` (DCP): every rank writes its own shard of the
model, and of the optimizer's state when one is given, into one directory, and the directory loads
on another world size (DCP reshards) or into a plain model in one process. A heal makes a new
process group; the sharded models found in the rank's namespace are moved onto it (`regroup`), as
`prepare_model`'s DDP wrappers are.

Only one-dimensional meshes (what `shard_model` makes: FSDP over the whole world) are moved. An
N-dimensional mesh (HSDP, FSDP with tensor parallelism) has a sub-group per slice of each dimension,
and its sub-meshes are held by DTensors, by FSDP's mesh infos and by the user's own parallelize
plans; rebuilding them means a collective `new_group` per slice and finding every holder. One
missed holder leaves a model half on the dead group, which hangs or fails in its next collective,
so such models are named at the heal instead, to be sharded again.

`shard_model` also keeps a recipe of what it did (the unsharded structure on the meta device, the
blocks' names, the options): a tracked model (elastic.py) is sharded again from it when the world
it must span has another size (`reshard`), and its state is gathered and loaded whole through
`torch.distributed.checkpoint.state_dict` (`full_model_state`, `load_full_model_state`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from . import torch_adapter
from .state import RANK


def is_sharded(model: Any) -> bool:
    """True for a module that FSDP2 sharded (itself or any submodule)."""
    return isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


def default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units `shard_model` shards one by one before the root.

    The entries of every `nn.ModuleList` / `nn.Sequential` holding parameters (a transformer's
    layers, a CNN's stages): each becomes one all-gather in forward, so only one block's full
    parameters are materialised at a time. A model without such a list is sharded as one unit.
    """
    blocks: list[torch.nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if module is model or not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        for child in module.children():
            inside = any(id(m) in seen for m in child.modules())
            if not inside and any(True for _ in child.parameters()):
                blocks.append(child)
                seen.add(id(child))
    # keep the outermost lists only: a block inside an already chosen block stays in it
    chosen = []
    for block in blocks:
        if not any(block is not other and any(block is m for m in other.modules()) for other in blocks):
            chosen.append(block)
    return chosen


def world_mesh(device: torch.device) -> DeviceMesh:
    """A one-dimensional DeviceMesh over every rank of the world, on this rank's device type."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_model(
    model: torch.nn.Module,
    device: torch.device,
    *,
    blocks: Iterable[torch.nn.Module] | None = None,
    mesh: DeviceMesh | None = None,
    **fully_shard_kwargs: Any,
) -> torch.nn.Module:
    """Shard `model` with FSDP2 over the world: `fully_shard` per block, then on the root.

    A model the user sharded already is returned as it is. Parameters are moved to `device`
    first; ranks must build the model the same way (fully_shard keeps each rank's own slice of
    each rank's own initial values: seed the same on every rank, or load a checkpoint after).
    """
    if is_sharded(model):
        return model
    model = model.to(device)
    mesh = mesh if mesh is not None else world_mesh(device)
    chosen = list(default_blocks(model) if blocks is None else blocks)
    names = {id(module): name for name, module in model.named_modules()}
    if mesh.ndim == 1 and all(id(block) in names for block in chosen):  # it can be sharded again (reshard)
        _keep_recipe(model, [names[id(b)] for b in chosen], fully_shard_kwargs)
    for block in chosen:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


# ------------------------------------------------------------------------------- checkpoints


def save_sharded(model: torch.nn.Module, path: str | os.PathLike[str], optimizer: Any = None) -> str:
    """Every rank writes its shard of `model` (and of `optimizer`'s state) into the directory `path`.

    A collective: every rank calls it. The optimizer's state goes through
    torch.distributed.checkpoint's `get_state_dict`, keyed by parameter name, so it loads on
    another number of ranks (DCP reshards it with the parameters) or in one process.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    target = os.path.abspath(os.fspath(path))
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=target)
    return target


def load_sharded(model: torch.nn.Module, path: str | os.PathLike[str], optimizer: Any = None) -> torch.nn.Module:
    """Load a DCP checkpoint directory into `model` (and `optimizer`): sharded on any world size, or plain.

    In a world, a sharded model reads the slices it holds (DCP reshards a checkpoint written by
    another number of ranks); a plain model (DDP's or in one process, without a process group)
    reads everything. The optimizer's state follows its parameters the same way.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    source = os.path.abspath(os.fspath(path))
    if optimizer is not None and not _holds_optimizer(source):
        raise ValueError(f"{source} holds no optimizer state (it was saved without optimizer=): load the model alone")
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    if dist.is_initialized() and is_sharded(model):
        dcp.load(state, checkpoint_id=source)
    else:
        # without a process group DCP reads in this process alone (and says so); with one, every rank reads all
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=source, no_dist=not dist.is_initialized())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return model


def _holds_optimizer(source: str) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    return any(key.startswith("optimizer.") for key in FileSystemReader(source).read_metadata().state_dict_metadata)


# ------------------------------------------------------------------------------- heal


def sharded_modules(namespace: dict[str, Any]) -> list[FSDPModule]:
    """Every FSDP2-sharded module reachable from the top-level modules of a namespace."""
    found: dict[int, FSDPModule] = {}
    for value in list(namespace.values()):
        if isinstance(value, torch.nn.Module):
            for module in value.modules():
                if isinstance(module, FSDPModule):
                    found[id(module)] = module
    return list(found.values())


def regroup(modules: Iterable[FSDPModule], group: dist.ProcessGroup, registered: bool) -> list[str]:
    """Point sharded modules at `group` (the world's new group, or a placeholder while released).

    FSDP2 keeps the shard group in its mesh infos and resolves it by name through its
    DeviceMesh; both are moved. `registered` is False for the placeholder, which has no name:
    the meshes then forget the old group's name, so nothing keeps the old group (and its
    sockets) alive. Meshes of more than one dimension (HSDP) cannot be rebuilt here and are
    returned by description, to be reported.
    """
    infos: dict[int, Any] = {}
    meshes: dict[int, DeviceMesh] = {}
    skipped: list[str] = []
    for module in modules:
        param_group = torch_adapter.fsdp_param_group(module)
        if param_group is None:
            continue
        for holder in (param_group, *param_group.fsdp_params):
            for attr in ("mesh_info", "post_forward_mesh_info"):
                info = getattr(holder, attr, None)
                if info is not None:
                    infos[id(info)] = info
                    meshes[id(info.mesh)] = info.mesh
            sharded = getattr(holder, "sharded_param", None)
            if sharded is not None and hasattr(sharded, "device_mesh"):
                meshes[id(sharded.device_mesh)] = sharded.device_mesh
    for mesh in meshes.values():
        if mesh.ndim != 1:
            skipped.append(f"a {mesh.ndim}-dimensional mesh {tuple(mesh.shape)}")
            continue
        torch_adapter.point_mesh_at(mesh, group if registered else None)
    for info in infos.values():
        if info.mesh.ndim != 1:
            continue
        if hasattr(info, "shard_process_group"):
            info.shard_process_group = group
            if getattr(info, "reduce_scatter_process_group", None) is not None:
                info.reduce_scatter_process_group = group
        if hasattr(info, "replicate_process_group"):
            info.replicate_process_group = group
    return skipped


# ------------------------------------------------------------------------------- reshard (elastic)


@dataclasses.dataclass
class Recipe:
    """How `shard_model` sharded a model: enough to shard it again on another mesh."""

    template: torch.nn.Module  # the unsharded model on the meta device (no memory)
    blocks: list[str]  # names of the blocks sharded before the root
    kwargs: dict[str, Any]  # fully_shard's other options


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s structure whose tensors are on the meta device (copying no values)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().to("meta")
    return copy.deepcopy(model, memo)


def _keep_recipe(model: torch.nn.Module, blocks: list[str], kwargs: dict[str, Any]) -> None:
    try:
        template = _meta_copy(model)
    except Exception:  # noqa: BLE001  (a model deepcopy cannot copy shards as before; track() then refuses it)
        return
    RANK.prepared.recipes[model] = Recipe(template, blocks, dict(kwargs))


def can_reshard(model: torch.nn.Module) -> bool:
    """True for a model sharded by `shard_model` on a one-dimensional mesh."""
    return model in RANK.prepared.recipes


def mesh_size(model: torch.nn.Module) -> int:
    """The number of ranks `model`'s parameters are sharded over."""
    for param in model.parameters():
        if isinstance(param, torch.distributed.tensor.DTensor):
            return int(param.device_mesh.size())
    return 1


def reshard(model: torch.nn.Module, device: torch.device) -> dict[int, torch.nn.Parameter]:
    """Shard `model` again, in place, over the current world (whose size its mesh no longer has).

    FSDP2 cannot move a sharded parameter to a mesh of another size, so the model is built
    again from its recipe (on the meta device, then empty on `device`), sharded over the world,
    and `model` takes over the new one's state: the object the user's names hold stays the same.
    Parameter VALUES are left undefined (load a full state dict next); buffers are copied.
    Returns id(old parameter) -> new parameter, to point optimizers at the new ones.
    """
    recipe = RANK.prepared.recipes[model]
    old = dict(model.named_parameters())
    fresh = copy.deepcopy(recipe.template).to_empty(device=device)
    buffers = dict(fresh.named_buffers())
    with torch.no_grad():  # non-persistent buffers are in no state dict: keep this rank's
        for name, buffer in model.named_buffers():
            buffers[name].copy_(buffer)
    blocks = [fresh.get_submodule(name) for name in recipe.blocks]
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)  # no collective: the group exists
    shard_model(fresh, device, blocks=blocks, mesh=mesh, **recipe.kwargs)
    del RANK.prepared.recipes[fresh]
    # the user's object becomes the new model: same class, one shared attribute dict
    model.__class__ = fresh.__class__
    model.__dict__ = fresh.__dict__
    # torch finds a module's FSDP state by the module object: give `model` the new one's
    torch_adapter.share_fsdp_state(model, fresh)
    new = dict(model.named_parameters())
    return {id(param): new[name] for name, param in old.items()}


def repoint(optimizer: torch.optim.Optimizer, moved: dict[int, torch.nn.Parameter]) -> bool:
    """Point `optimizer` at the new parameters of a resharded model; its state for them is dropped
    (it was sharded on the old mesh). Returns whether it held any of them."""
    held = False
    for group in optimizer.param_groups:
        params = group["params"]
        if any(id(p) in moved for p in params):
            held = True
            for param in params:
                optimizer.state.pop(param, None)
            group["params"] = [moved.get(id(p), p) for p in params]
    return held


def full_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The whole (unsharded) state dict of a sharded model, on every rank. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # not cpu_offload: with it only rank 0 gets the state; the caller copies it to the CPU
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole state of an optimizer over a sharded model, keyed by parameter name. A collective.

    An optimizer that has not stepped yet is described by its hyperparameters alone:
    torch would initialise its state with a step at lr=0, which changes Adam's step count.
    """
    if not optimizer.state:
        return {"state": {}, "param_groups": _hyperparameters(optimizer)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def load_full_model_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a whole state dict into a sharded model: each rank keeps its slice (any world size)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # a copy: torch puts the distributed tensors into the dict it is given
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what `full_optimizer_state` took into an optimizer over `model`, sharded on this world."""
    if not state["state"]:
        optimizer.state.clear()
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update(copy.deepcopy(saved))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, copy.deepcopy(state), options=options)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
