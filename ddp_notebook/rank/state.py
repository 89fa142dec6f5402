"""A rank process's state, as one typed object: `RANK`.

What this process is and holds between cells, not configuration: set as it joins a world,
read by the helpers its cells call, cleared as it leaves. One per process (as `timing.CLOCK`
is), each part owned by the one module that changes it, named here so that a reader sees all
of a rank's state in one place. Standard library only at run time: every rank module may
import it, and it imports none of them.
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..wire.detached import CellOwner
    from ..wire.profiling import MemorySample
    from .cell_journal import CellJournal
    from .channel import Channel
    from .elastic import Snapshot
    from .reloading import Reloader
    from .sharding import Recipe

# the default of track(snapshot_every=...): a copy of a small model's state every 20 batches (or
# optimizer steps) costs under 1% of its step time (benchmarks/plain_loop_snapshots.py measures it)
DEFAULT_SNAPSHOT_EVERY = 20
DEFAULT_PERSIST_EVERY = 5  # snapshots between two written to disk (track(persist=...))
KEEP_SNAPSHOTS = 2  # the newest one may be half taken on some ranks when a rank dies


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


@dataclass
class Membership:
    """The world this process joined (`group`)."""

    context: RankContext | None = None  # None before the first join, after shutdown, under torchrun
    listener: socket.socket | None = None  # rank 0's rendezvous socket, until its store takes it
    stack_dumps: bool = False  # faulthandler's signal and the X-ray's socket are set up (once a process)
    run_id: str | None = None  # rank 0: the TORCHELASTIC_RUN_ID it shares with the world
    joins: int = 0  # rank 0: groups formed after the first, the world's TORCHELASTIC_RESTART_COUNT
    signed_store: Any = None  # rendezvous.SignedStore of a world across hosts (torch holds only its C++ side)
    told_own_init: bool = False  # a script's own init_process_group was answered with the world's group
    # groups a cell's destroy_process_group() ended, kept until the world lets go of its group
    # after the cell (script_setup.keep_destroyed_groups says why)
    destroyed_groups: list[Any] = field(default_factory=list)


@dataclass
class Prepared:
    """What `prepare_model` and `prepare_loader` made, kept weakly: moved onto each new group."""

    wrappers: weakref.WeakSet[torch.nn.parallel.DistributedDataParallel] = field(default_factory=weakref.WeakSet)
    samplers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # ResumableSamplers, resharded
    # FSDP2 models -> how shard_model sharded them (to shard them again at another world size)
    recipes: weakref.WeakKeyDictionary[torch.nn.Module, Recipe] = field(default_factory=weakref.WeakKeyDictionary)


@dataclass
class Tracked:
    """The training state `track` declared and the snapshots of it (`elastic`)."""

    objects: dict[str, Any] = field(default_factory=dict)  # name -> object, or elastic's NAMESPACE marker
    snapshots: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=KEEP_SNAPSHOTS))
    every: int = DEFAULT_SNAPSHOT_EVERY  # batches of a tracked loader (or optimizer steps) between two snapshots
    seq: int = 0  # snapshots taken: the same on every rank at the same point
    hooked: bool = False  # the end-of-cell snapshot hook is registered
    collective: bool = False  # a tracked model is sharded: a snapshot gathers, every rank at once
    sharded_mark: Any = None  # the sharded state's write mark when it was last copied
    skip_cell: bool = False  # the running cell runs on some ranks only: no snapshot at its end
    # a cell failed here (raised, interrupted, released): the ranks may have stopped at different
    # steps, so no snapshot is taken until every rank goes back to a common one (`restore`)
    diverged: bool = False
    progress: Any = None  # what training moved when the running cell began (`_progress_mark`)
    owners: dict[str, str] = field(default_factory=dict)  # tracked optimizer over a sharded model -> that model
    steps: int = 0  # steps of the first tracked optimizer (`step_points`): the same on every rank
    step_due: dict[str, Any] | None = None  # a step point's generators, until the next step starts
    step_hooks: list[Any] = field(default_factory=list)  # torch's handles of the step points' hooks
    stepping: Any = None  # a weak reference to the optimizer whose steps are counted
    persist: Any = None  # persisting.PersistSettings: every K-th snapshot goes to disk too
    writer: Any = None  # persisting.Writer: this rank's writer thread, made on the first write


@dataclass
class StrictChecks:
    """Strict mode (`strict`): the collectives it wraps and the group its checks run on."""

    originals: dict[str, Any] = field(default_factory=dict)  # name -> torch's function, while checking
    group: Any = None  # the checks' own gloo group, made once per default group
    world: Any = None  # the default group that group was made for
    checking: dict[str, Any] | None = None  # the check in progress (for the X-ray), else None


@dataclass
class XrayServer:
    """The X-ray's serving side (`xray`): its sockets and what it remembers between answers."""

    server: Any = None  # the Unix socket server on the notebook's host
    tcp_server: socket.socket | None = None  # the signed TCP server toward a notebook on another host
    sockets_before: frozenset[tuple[int, int]] = frozenset()  # (fd, inode) open before the group
    group_made_ns: int = 0  # when the current default group was made (flight recorder clock)
    default_pg_id: Any = None  # the flight recorder's id of the current default group
    own_record: bool = False  # no flight recorder in this torch: the rank's own record (`collective_record`)
    pending: tuple[int, float] | None = None  # a collective seen starting: (its count, when)
    # the last light reading of the recorder, reused until its cost is paid back (`xray.READ_SHARE`)
    light: tuple[Any, float] | None = None  # ((entries, last done), when it may be read again)
    watchers: list[socket.socket] = field(default_factory=list)  # held open for the notebook (`watch`)


@dataclass
class CollectiveRecord:
    """The rank's own record of the collectives it entered (`collective_record`), where torch keeps
    no flight recorder for its backend."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    entries: deque[Any] = field(default_factory=lambda: deque(maxlen=32))  # xray_messages.CollectiveEntry
    entered: int = 0  # sequence number of the last collective entered on the current default group
    on: bool = False
    installed: bool = False  # torch.distributed's entry points wrapped (once per process)


@dataclass
class StepHooks:
    """torch's global optimizer hooks of the step timing (`timing`), installed once."""

    installed: dict[str, Any] = field(default_factory=dict)  # "pre"/"post" -> torch's handle
    ipython_hooked: set[str] = field(default_factory=set)  # the IPython events already hooked


@dataclass
class UserFiles:
    """The user's modules and files on this rank (`reloading`, `files`)."""

    reloader: Reloader | None = None  # made when reloading before each cell is first turned on
    sync_folders: list[str] = field(default_factory=list)  # sync folders made here, removed at the world's end


@dataclass
class Profiling:
    """A profiled cell's torch.profiler (`profiling`): made as the cell starts, dropped after it."""

    profiler: Any = None  # torch.profiler.profile
    hook: Any = None  # the global optimizer post-step hook's handle
    folder: str | None = None  # a temporary folder the trace is written to
    trace: str | None = None  # the trace file, once the profiler wrote it
    done: bool = False  # the last active step was recorded (or the profile was stopped)
    steps: int = 0  # optimizer steps since the profile began
    memory_on: bool = True  # read the memory at each step
    memory: list[MemorySample] = field(default_factory=list)
    quiet: Any = None  # profiling.ChatterFilter: the profiler's routine native lines kept out of the output


@dataclass
class RankState:
    membership: Membership = field(default_factory=Membership)
    prepared: Prepared = field(default_factory=Prepared)
    channel: Channel | None = None  # the live view's channel, made on first log()/progress()
    tracked: Tracked = field(default_factory=Tracked)
    strict: StrictChecks = field(default_factory=StrictChecks)
    xray: XrayServer = field(default_factory=XrayServer)
    collectives: CollectiveRecord = field(default_factory=CollectiveRecord)
    step_hooks: StepHooks = field(default_factory=StepHooks)
    user_files: UserFiles = field(default_factory=UserFiles)
    profiling: Profiling | None = None  # only while a %%ddp --profile cell runs
    journal: CellJournal | None = None  # a detached world's rank's newest cell, for a later kernel (%ddp_wait)
    cell_owner: CellOwner | None = None  # a detached world's: the one kernel whose cells run (None: any)
    breakpoints: int = 0  # breakpoint() calls so far: each one's key in the store


RANK = RankState()
