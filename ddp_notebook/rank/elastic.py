"""Runs on ranks: the training state a world keeps alive when a rank's process dies.

`track(model=..., optimizer=..., loader=..., step=0)` names the objects that are the training
state. A snapshot is an in-memory copy of them (never written to disk), taken at the end of
every cell that succeeded, every `snapshot_every` batches of a tracked loader and at the end of
each of its passes, every `snapshot_every` steps of the first tracked optimizer where no loader is
tracked (`step_points`), or by `snapshot()`; each rank keeps its last two. When a rank is
replaced, a surviving rank sends its snapshot to every rank (`restore`), so the whole world goes
back to one consistent point.

Tracked state is the world's state, the same on every rank (as DDP keeps it): a module's
parameters and buffers, an optimizer's or scheduler's `state_dict`, a loader's position in its
epoch (one from `prepare_loader`, or a plain DataLoader over a DistributedSampler: `tracked_loaders`),
and plain values (`step=0` tracks the variable `step` of the rank's namespace). A
snapshot also keeps the rank's own random number generators: a survivor goes back to its own,
a new rank takes the sender's (the same stream where the ranks were seeded alike).

A model sharded by `shard_model` (FSDP2) is world state too once gathered: its snapshot holds
the whole model (and a tracked optimizer over it the whole optimizer state, keyed by parameter
name), taken through `torch.distributed.checkpoint.state_dict` and copied to the CPU on every
rank, so any survivor can serve it and it loads on any world size (each rank keeps its slice).
Gathering is a collective, so it happens only where every rank is at the same point: the
tracked loader's every-K-batches hook, `snapshot()` called on every rank, a resize, and the end
of a cell that succeeded on every rank, which the notebook asks all ranks for at once (a rank's
own end-of-cell hook cannot know that the others got there; it publishes that one is owed). A
cell that left the sharded state as it was (no step, no load: the write counts of its tensors
say so) needs no gather: each rank reuses the last gathered copy. A rank that replayed the
setup cells alone (a one-rank mesh) or a world of another size shards the model again over the
world before loading it (`sharding.reshard`), and points the optimizers at its new parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..wire.join import RankSpec
from . import channel, helpers, membership, torch_adapter
from .state import DEFAULT_PERSIST_EVERY, DEFAULT_SNAPSHOT_EVERY, RANK

if TYPE_CHECKING:
    from .tracked_loaders import TrackedDataLoader


@dataclasses.dataclass
class Snapshot:
    seq: int  # how many snapshots this rank took: the same on every rank at the same point
    where: str  # "epoch E, batch B" or "end of a cell", for the message after a comeback
    state: dict[str, Any]
    # this rank's random number generators (torch's CPU one, CUDA's, Python's, NumPy's): its own,
    # not the world's, since ranks may be seeded apart
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = 0  # steps of the first tracked optimizer (where the next step point falls)


_NAMESPACE = object()
CELL_END = "the end of a cell"
# where a new rank's group of its own meets while it replays the setup cells
LOOPBACK = "127.0.0.1"


def track(
    *,
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    persist: str | os.PathLike[str] | bool | None = None,
    persist_every: int = DEFAULT_PERSIST_EVERY,
    **objects: Any,
) -> None:
    """Declare the training state a replacement rank must get back (call it in a `%%ddp --setup` cell).

    Modules (DDP-wrapped or not), optimizers, schedulers (anything with `state_dict` /
    `load_state_dict`), loaders from `prepare_loader` and plain DataLoaders over a
    DistributedSampler are restored in place; any other value names a variable of the rank's
    namespace (`step=step`) restored by that name. A snapshot is taken at the end of every cell
    that succeeds, every `snapshot_every` batches of a tracked loader and at the end of each pass
    over it, and, where no loader is tracked, every `snapshot_every` steps of the first tracked
    optimizer. A model you wrapped in DDP yourself moves onto each new group as one from
    `prepare_model` does.

    A model sharded by `shard_model` (FSDP2) is snapshotted whole (gathered; a CPU copy of the
    full model on every rank), and an optimizer over it must be tracked with it.

    `persist="ckpt/"` also writes every `persist_every`-th snapshot, and each one taken at the end of
    a cell, to that folder (one every host sees), off the training thread (`persisting`):
    `%ddp_resume ckpt/` goes on from the newest whole one after every rank was lost, on this number
    of ranks or another. `persist=False` stops writing; leaving it out keeps what was set.
    """
    if snapshot_every < 1:
        raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
    if persist is True:
        raise ValueError("persist takes a folder, e.g. persist='ckpt/' (or False to stop writing)")
    if persist is False:
        RANK.tracked.persist = None
    elif persist is not None:
        from . import persisting

        settings = persisting.PersistSettings.build(persist, persist_every, guard=_whole_world())
        if membership.context().rank == 0 and RANK.tracked.persist != settings:
            if not torch_adapter.dcp_from_one_process():
                print(f"off here: {torch_adapter.DCP_FROM_ONE_PROCESS_LIMIT}", file=sys.stderr, flush=True)
            if settings.earlier:
                print(settings.earlier_note(), file=sys.stderr, flush=True)
        RANK.tracked.persist = settings
    for name, obj in objects.items():
        if isinstance(obj, helpers.EpochDataLoader) and not isinstance(obj.sampler, helpers.ResumableSampler):
            raise TypeError(f"track a loader made by ddp_notebook.prepare_loader ('{name}' is another DataLoader)")
        if isinstance(obj, torch.utils.data.DataLoader) and not isinstance(obj, helpers.EpochDataLoader):
            from .tracked_loaders import adopt

            adopt(name, obj)  # a plain DataLoader over a DistributedSampler, made trackable in place
        if _is_sharded_module(obj) and not _reshardable(obj):
            raise TypeError(
                f"'{name}' cannot be sharded again on another number of ranks (it was sharded by fully_shard "
                "directly, on a mesh of more than one dimension, or copy.deepcopy cannot copy it): "
                "shard it with ddp_notebook.shard_model to track it"
            )
    owners = _sharded_owners({**RANK.tracked.objects, **objects})
    for name, obj in objects.items():
        RANK.tracked.objects[name] = obj if _restorable(obj) else _NAMESPACE
    RANK.tracked.owners.clear()
    RANK.tracked.owners.update(owners)
    RANK.tracked.every = snapshot_every
    RANK.tracked.collective = any(_is_sharded_module(obj) for obj in RANK.tracked.objects.values())
    for obj in RANK.tracked.objects.values():
        if isinstance(obj, (helpers.EpochDataLoader, _plain())):
            obj.after_batch, obj.after_pass = _after_batch, _after_pass
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel) and obj not in RANK.prepared.wrappers:
            # wrapped by the user's own DDP(...): moved onto each new group as prepare_model's are
            obj._ddp_notebook_kwargs = torch_adapter.ddp_options(obj)
            RANK.prepared.wrappers.add(obj)
    optimizers = [obj for obj in RANK.tracked.objects.values() if isinstance(obj, torch.optim.Optimizer)]
    models = [obj for obj in RANK.tracked.objects.values() if isinstance(obj, torch.nn.Module)]
    from . import step_points

    step_points.watch(optimizers[0] if optimizers else None, models, _take_at_step, _step_points_on)
    RANK.tracked.progress = _progress_mark()  # this cell began before the hook below was there
    if not RANK.tracked.hooked:
        shell = _shell()
        if shell is not None:
            shell.events.register("pre_run_cell", _before_cell)
            shell.events.register("post_run_cell", _after_cell)
        RANK.tracked.hooked = True


def tracked() -> list[str]:
    """The names tracked on this rank."""
    return sorted(RANK.tracked.objects)


def snapshot(where: str = "an explicit snapshot") -> int:
    """Copy the tracked state now (in memory); returns the snapshot's number.

    With a sharded (FSDP2) model tracked this gathers its whole state: a collective, to call on
    every rank at the same point of the code.
    """
    return _take(where, reuse_sharded=False)


def _take(where: str, reuse_sharded: bool, rng: dict[str, Any] | None = None) -> int:
    RANK.tracked.seq += 1
    state = _capture(RANK.tracked.snapshots[-1].state if reuse_sharded else None)
    if rng is None:
        from .generators import capture

        rng = capture()
    RANK.tracked.snapshots.append(Snapshot(RANK.tracked.seq, where, state, rng, RANK.tracked.steps))
    if RANK.tracked.collective:
        RANK.tracked.sharded_mark = _sharded_mark()
    settings = RANK.tracked.persist
    if settings is not None and (RANK.tracked.seq % settings.every == 0 or where == CELL_END) and _whole_world():
        from . import persisting  # loaded by track(persist=...)

        context = membership.context()
        # the buckets go with it: a reducer that sums in other buckets rounds differently past 2 ranks
        job = persisting.Job(
            settings,
            RANK.tracked.seq,
            where,
            state,
            rng,
            RANK.tracked.steps,
            context.rank,
            context.world_size,
            wrapped_models() if context.rank == 0 else {},
        )
        persisting.submit(job)
    return int(RANK.tracked.seq)


def _whole_world() -> bool:
    """This rank is in its world's group (not replaying setup cells in a group of its own)."""
    joined = membership.joined_context()
    return joined is None or not dist.is_initialized() or dist.get_world_size() == joined.world_size


@dataclasses.dataclass(frozen=True)
class Resumption:
    said: str  # "snapshot 12 (epoch 1, batch 40) of a world of 4 ranks"
    skipped: tuple[str, ...]  # newer snapshots passed over: "snapshot 13 is damaged (...)"


def resume(folder: str | os.PathLike[str]) -> Resumption:
    """Every rank calls this at once, after the setup cells: the newest whole snapshot written to
    `folder` that checks out loads on every rank, on the world's size or another. Returns what was
    loaded, and which newer ones were damaged."""
    from . import persisting

    written = persisting.read_newest(folder, membership.context().rank)
    missing = sorted(set(written.state) - set(RANK.tracked.objects))
    if missing:
        raise RuntimeError(
            f"the snapshot holds {', '.join(missing)}, which this world does not track: call "
            "ddp_notebook.track(...) with the same names in a %%ddp --setup cell first"
        )
    _apply(written.state)
    # the models' reducers sum in the buckets the written world's had, as after a comeback
    here = wrapped_models()
    rewrap_models({name: layout for name, layout in written.layouts.items() if name in here})
    from . import generators, step_points

    generators.set_back(written.rng)
    RANK.tracked.snapshots.clear()
    RANK.tracked.snapshots.append(Snapshot(written.seq, written.where, written.state, written.rng, written.steps))
    RANK.tracked.seq, RANK.tracked.steps = written.seq, written.steps
    step_points.forget_due()
    RANK.tracked.diverged = False
    RANK.tracked.sharded_mark = _sharded_mark() if RANK.tracked.collective else None
    settings = RANK.tracked.persist
    if settings is not None and settings.folder == Path(folder).expanduser().resolve():
        RANK.tracked.persist = dataclasses.replace(settings, earlier=0)  # this world goes on writing there
    return Resumption(
        f"snapshot {written.seq} ({written.where}) of a world of {written.world_size} ranks", written.skipped
    )


def snapshot_numbers() -> list[int]:
    return [snap.seq for snap in RANK.tracked.snapshots]


def snapshot_bytes() -> int:
    """Memory the kept snapshots take on this rank (tensors only)."""
    seen: set[int] = set()
    return sum(_tensor_bytes(snap.state, seen) for snap in RANK.tracked.snapshots)


def restore(seq: int, source: int) -> str:
    """Every rank calls this at once: `source` sends its snapshot `seq`, every rank loads it.

    Returns where the snapshot was taken.
    """
    me = dist.get_rank()
    found = next((snap for snap in RANK.tracked.snapshots if snap.seq == seq), None)
    if me == source and found is None:
        raise RuntimeError(f"rank {me} holds no snapshot {seq}")
    box = [found if me == source else None]
    dist.broadcast_object_list(box, src=source)
    chosen: Snapshot = box[0]  # type: ignore[assignment]
    missing = sorted(set(chosen.state) - set(RANK.tracked.objects))
    if missing:
        raise RuntimeError(
            f"rank {me} does not track {', '.join(missing)}: call ddp_notebook.track(...) in a %%ddp --setup cell"
        )
    _apply(chosen.state)
    # a rank that holds this snapshot goes back to its own generators; a new rank takes the
    # sender's, which are its own where the ranks were seeded alike (the usual manual_seed(0))
    if found is not None:
        chosen = dataclasses.replace(chosen, rng=found.rng)
    from . import generators, step_points

    generators.set_back(chosen.rng)
    RANK.tracked.snapshots.clear()
    RANK.tracked.snapshots.append(chosen)
    RANK.tracked.seq, RANK.tracked.steps = chosen.seq, chosen.steps
    step_points.forget_due()
    RANK.tracked.diverged = False  # every rank is at this one point again
    RANK.tracked.sharded_mark = _sharded_mark() if RANK.tracked.collective else None
    return chosen.where


def begin_replay(spec: RankSpec) -> None:
    """Before the setup cells are replayed on a new rank: it is rank `spec.rank` of the world,
    in a process group of its own (collectives in setup cells see one rank); joining the
    world's group later moves models from `prepare_model` onto it."""
    # its own group's rendezvous is on its own host: MASTER_ADDR is rank 0's, maybe elsewhere
    port = membership.open_rendezvous(LOOPBACK)
    alone = dataclasses.replace(
        spec,
        rank=0,
        world_size=1,
        local_world_size=1,
        stack_dir=None,
        master_addr=LOOPBACK,
        master_port=port,
        store_path=f"{spec.store_path}-alone{spec.rank}" if spec.store_path else None,
    )
    membership.init_world(alone)
    joined = membership.joined_context()
    assert joined is not None  # init_world just set it
    context = dataclasses.replace(
        joined,
        rank=spec.rank,
        world_size=spec.world_size,
        local_rank=spec.local_rank,
        local_world_size=spec.local_world_size,
    )
    membership.become(context)


def wrapped_models() -> dict[str, list[list[int]] | None]:
    """Names in the rank's namespace that hold a model from `prepare_model`, each with its gradient
    buckets' layout (None where the reducer has not rebuilt them yet)."""
    wrappers = {id(wrapper): wrapper for wrapper in membership.wrappers()}
    return {
        name: torch_adapter.ddp_bucket_layout(wrappers[id(value)])
        for name, value in sorted(_namespace().items())
        if id(value) in wrappers
    }


def rewrap_models(layouts: dict[str, list[list[int]] | None]) -> None:
    """Every rank at once, after a rank was replaced: the models these names hold (every rank has
    them: the setup cells made them) get a fresh DDP reducer over the new group, in place, with
    the gradient buckets laid out as given (a survivor's, so the next step sums as it would have).

    A survivor's reducer has rebuilt its gradient buckets long ago, a new rank's has not, and
    the rebuild is a collective: left as they are, the two would pair different collectives.
    """
    namespace = _namespace()
    for name, layout in layouts.items():
        wrapper = namespace[name]
        kwargs = getattr(wrapper, "_ddp_notebook_kwargs", {})
        torch_adapter.drop_ddp_hooks(wrapper)
        fresh = torch_adapter.fresh_ddp(wrapper.module, layout, **kwargs)
        wrapper.__dict__.update(fresh.__dict__)


# ---------------------------------------------------------------- inside


def _plain() -> type[TrackedDataLoader]:
    """The plain loaders' type: its module is loaded by the first `track`, not at a rank's start."""
    from .tracked_loaders import TrackedDataLoader

    return TrackedDataLoader


def _restorable(obj: Any) -> bool:
    return isinstance(obj, (helpers.EpochDataLoader, _plain())) or (
        callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    )


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _namespace() -> dict[str, Any]:
    shell = _shell()
    return shell.user_ns if shell is not None else {}


def skip_cell_snapshot() -> None:
    """The next cell runs on some ranks only: its end is no point of the whole world, so it takes
    no snapshot there (a snapshot's number must mean the same point on every rank, or survivors
    of a later death hold none in common)."""
    RANK.tracked.skip_cell = True


def _before_cell(*_info: Any) -> None:
    _cell_over()
    RANK.tracked.progress = _progress_mark()


def _cell_over() -> None:
    """Plain loaders count the next cell's passes from 0; a step point not taken yet is dropped
    (the end-of-cell snapshot, or the next cell's first one, serves)."""
    for obj in RANK.tracked.objects.values():
        if isinstance(obj, _plain()):
            obj.cell_ended()
    from . import step_points  # loaded by track(), which registered the hooks that call this

    step_points.forget_due()


def _after_cell(result: Any) -> None:
    skip, RANK.tracked.skip_cell = RANK.tracked.skip_cell, False
    failed = RANK.tracked.objects and not getattr(result, "success", False) and not skip
    if failed and _progress_mark() != RANK.tracked.progress:
        # it failed after training moved on (a step, a batch): the other ranks may have stopped
        # elsewhere; a cell that failed before (a typo) leaves every rank where it was
        RANK.tracked.diverged = True
    _cell_over()
    if skip or RANK.tracked.diverged or not (RANK.tracked.objects and getattr(result, "success", False)):
        return
    if not RANK.tracked.collective:
        snapshot(CELL_END)
    elif RANK.tracked.snapshots and _sharded_mark() == RANK.tracked.sharded_mark:
        # the sharded state is as the last snapshot gathered it (a cell that did not train):
        # that copy serves again, with fresh copies of the rest, and no collective is needed
        _take(CELL_END, reuse_sharded=True)
    else:
        # gathering is a collective, and another rank may have failed or still be in the cell:
        # the notebook, which knows, has every rank take it at once
        from ..wire.results import SNAPSHOT_OWED_KEY

        channel.tell_notebook(SNAPSHOT_OWED_KEY)


def _after_batch(loader: helpers.EpochDataLoader | TrackedDataLoader) -> None:
    if RANK.tracked.objects and not RANK.tracked.diverged and loader.batches_done % RANK.tracked.every == 0:
        snapshot(f"epoch {_epoch_of(loader)}, batch {loader.batches_done}")


def _after_pass(loader: helpers.EpochDataLoader | TrackedDataLoader) -> None:
    """The end of an epoch is a point too: an epoch shorter than `snapshot_every` has no other."""
    done = loader.batches_done
    if RANK.tracked.objects and not RANK.tracked.diverged and done and done % RANK.tracked.every:
        snapshot(f"the end of epoch {_epoch_of(loader)}")


def _epoch_of(loader: helpers.EpochDataLoader | TrackedDataLoader) -> int:
    return loader.epoch_label if isinstance(loader, _plain()) else loader.epoch - 1


def _step_points_on() -> bool:
    """Optimizer steps are points where something is tracked, no loader is (its batches are the
    points), the ranks have not stopped apart, and a snapshot needs no collective."""
    objects = RANK.tracked.objects.values()
    return bool(
        RANK.tracked.objects
        and not RANK.tracked.diverged
        and not RANK.tracked.collective
        and not any(isinstance(obj, (helpers.EpochDataLoader, _plain())) for obj in objects)
    )


def _take_at_step(where: str, rng: dict[str, Any]) -> None:
    _take(where, reuse_sharded=False, rng=rng)


def _module(obj: torch.nn.Module) -> torch.nn.Module:
    return obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj


def _capture(last: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of the tracked state; the sharded parts come from `last` where given (unchanged)."""
    namespace = _namespace()
    state: dict[str, Any] = {}
    for name, obj in RANK.tracked.objects.items():
        if last is not None and name in last and last[name][0] in ("sharded_module", "sharded_optimizer"):
            state[name] = last[name]
        elif obj is _NAMESPACE:
            if name in namespace:
                state[name] = ("value", copy.deepcopy(namespace[name]))
        elif isinstance(obj, helpers.EpochDataLoader):
            state[name] = ("loader", obj.position_state())
        elif isinstance(obj, _plain()):
            state[name] = ("plain_loader", obj.place())
        elif _is_sharded_module(obj):
            state[name] = ("sharded_module", _copied(_sharding().full_model_state(obj)))
        elif isinstance(obj, torch.nn.Module):
            state[name] = ("module", _copied(_module(obj).state_dict()))
        elif name in RANK.tracked.owners:
            model = RANK.tracked.objects[RANK.tracked.owners[name]]
            state[name] = ("sharded_optimizer", _copied(_sharding().full_optimizer_state(model, obj)))
        else:
            state[name] = ("state_dict", _copied(obj.state_dict()))
    return state


def _apply(state: dict[str, Any]) -> None:
    namespace = _namespace()
    # sharded models first: sharding one again on this world gives it new parameters, which
    # the optimizers must point at before they load their state
    ordered = sorted(state.items(), key=lambda item: item[1][0] != "sharded_module")
    for name, (kind, value) in ordered:
        obj = RANK.tracked.objects[name]
        if kind == "sharded_module":
            _reshard_if_needed(obj)
            _sharding().load_full_model_state(obj, value)
        elif kind == "sharded_optimizer":
            _sharding().load_full_optimizer_state(RANK.tracked.objects[RANK.tracked.owners[name]], obj, value)
        elif kind == "value":
            namespace[name] = copy.deepcopy(value)
        elif kind == "loader":
            obj.resume_from(value)
        elif kind == "plain_loader":
            obj.go_to(value)
        elif kind == "module":
            _module(obj).load_state_dict(value)
        else:
            obj.load_state_dict(copy.deepcopy(value))


def _sharding() -> Any:
    from . import sharding

    return sharding


def _is_sharded_module(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and helpers.is_sharded(obj)


def _reshardable(model: torch.nn.Module) -> bool:
    return bool(_sharding().can_reshard(model))


def _sharded_owners(objects: dict[str, Any]) -> dict[str, str]:
    """Optimizer name -> the name of the tracked sharded model it optimizes; its state is saved
    whole (gathered) and loaded by parameter name, which needs the model."""
    from torch.distributed.tensor import DTensor

    models = {name: obj for name, obj in objects.items() if _is_sharded_module(obj)}
    owners = {}
    for name, obj in objects.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = {id(p) for group in obj.param_groups for p in group["params"]}
        if not any(isinstance(p, DTensor) for group in obj.param_groups for p in group["params"]):
            continue
        owner = next((model for model, m in models.items() if params & {id(p) for p in m.parameters()}), None)
        if owner is None:
            raise TypeError(f"'{name}' optimizes a sharded model: track that model too (track(model=..., {name}=...))")
        owners[name] = owner
    return owners


def _progress_mark() -> list[Any]:
    """What training moves: the tracked models' parameters (their write counts), the tracked
    loaders' positions and the tracked plain values (a step counter)."""
    namespace = _namespace()
    mark: list[Any] = []
    for name, obj in RANK.tracked.objects.items():
        if obj is _NAMESPACE:
            value = namespace.get(name)
            mark.append(
                value
                if isinstance(value, (int, float, str))
                else len(value)
                if hasattr(value, "__len__")
                else id(value)
            )
        elif isinstance(obj, helpers.EpochDataLoader):
            mark.append((obj.epoch, obj.batches_done))
        elif isinstance(obj, _plain()):
            mark.append(obj.position)  # a pass begun and left at its first batch moved nothing
        elif isinstance(obj, torch.nn.Module):
            mark.append([torch_adapter.write_mark(p) for p in obj.parameters()])
    return mark


def _sharded_mark() -> list[Any]:
    """What changes when a tracked sharded model or its optimizer does: their tensors' identities,
    storages and write counts (torch bumps them on every in-place write: a step, a load) and the
    optimizers' hyperparameters. Comparing it costs no collective."""
    mark: list[Any] = []
    for name, obj in RANK.tracked.objects.items():
        if _is_sharded_module(obj):
            tensors = [*obj.parameters(), *obj.buffers()]
            mark.append([torch_adapter.write_mark(t) for t in tensors])
        elif name in RANK.tracked.owners:
            mark.append([_versions(state) for state in obj.state.values()])
            mark.append([_versions(_hyperparameters(group)) for group in obj.param_groups])
    return mark


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _versions(value: dict[str, Any]) -> list[Any]:
    """A dict's values, with each tensor as its identity and write counts: cheap to compare, no copy."""
    return [
        (key, torch_adapter.write_mark(item) if isinstance(item, torch.Tensor) else item) for key, item in value.items()
    ]


def _reshard_if_needed(model: torch.nn.Module) -> None:
    """A model sharded on another number of ranks (the world was resized, or this rank replayed the
    setup cells alone) is sharded again over the world; every optimizer that held its old
    parameters is pointed at the new ones (their state comes with the snapshot, or is lost)."""
    sharding = _sharding()
    if sharding.mesh_size(model) == dist.get_world_size():
        # a survivor's model may have been mid-step when the peer died: torch's recovery for that
        # (on the root FSDP module; a tracked submodule of another sharded model has none to run)
        if torch_adapter.fsdp_is_root(model) is not False:
            model.reset_iter_state()
        return
    moved = sharding.reshard(model, membership.context().device)
    candidates = [obj for obj in RANK.tracked.objects.values() if isinstance(obj, torch.optim.Optimizer)]
    candidates += [value for value in _namespace().values() if isinstance(value, torch.optim.Optimizer)]
    for optimizer in {id(o): o for o in candidates}.values():
        sharding.repoint(optimizer, moved)


def _copied(value: Any) -> Any:
    """A deep copy whose tensors live on the CPU (a snapshot must not take device memory)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return copy.deepcopy(value)


def _tensor_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensors in `value`, each counted once (snapshots share unchanged sharded parts)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item, seen) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item, seen) for item in value)
    return 0
