"""The calls the notebook makes on the ranks, one typed function each.

ipyparallel ships a function by reference when its module can be imported on the rank, so
these live in a module that does not import torch: the notebook kernel can name them
without importing torch itself. On the rank each one imports what it needs and calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..wire.join import LAUNCHER_RANK_VARIABLES, Identity, JoinReport, RankSpec

if TYPE_CHECKING:  # a fresh rank loads what it calls, when it calls it
    from ..wire.profiling import ProfileRequest, RankProfile


def describe() -> Identity:
    import os
    import socket

    from ddp_notebook.platform.devices import visible_gpus
    from ddp_notebook.platform.processes import SLOT_ENV

    slot = os.environ.get(SLOT_ENV, "")
    launcher_rank = next(
        (int(os.environ[name]) for name in LAUNCHER_RANK_VARIABLES if os.environ.get(name, "").isdigit()), None
    )
    return Identity(
        host=socket.gethostname(),
        pid=os.getpid(),
        slot=int(slot) if slot.isdigit() else None,
        launcher_rank=launcher_rank,
        gpus=tuple(visible_gpus()),
    )


def open_rendezvous(host: str) -> int:
    from ddp_notebook.rank import membership

    return membership.open_rendezvous(host)


def init_world(spec: RankSpec) -> JoinReport:
    from ddp_notebook.rank import membership

    return membership.init_world(spec)


def release_group() -> None:
    from ddp_notebook.rank import membership

    membership.release_group()


def post_mortem() -> str:
    from ddp_notebook.rank import debugger

    return debugger.post_mortem()


def shutdown_world() -> None:
    from ddp_notebook.rank import membership

    membership.shutdown_world()


def source_address(destination: str) -> str | None:
    from ddp_notebook.platform import network

    return network.source_address(destination)


def open_probe(host: str) -> int:
    from ddp_notebook.platform import network

    return network.open_probe(host)


def close_probe() -> None:
    from ddp_notebook.platform import network

    network.close_probe()


def reach(host: str, port: int) -> dict[str, str | None]:
    from ddp_notebook.platform import network

    return network.reach(host, port)


def pull_names(names: list[str]) -> dict[str, Any]:
    """Values of `names` in the rank's user namespace; a missing name is reported, not raised."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    found = {name: namespace[name] for name in names if name in namespace}
    return {"found": found, "missing": [name for name in names if name not in namespace]}


def begin_replay(spec: RankSpec) -> None:
    """A new rank before its setup cells are replayed: its rank, in a process group of its own."""
    from ddp_notebook.rank import elastic

    elastic.begin_replay(spec)


def snapshot_numbers() -> list[int]:
    """The snapshots of tracked state this rank holds (empty where nothing is tracked)."""
    import sys

    elastic = sys.modules.get("ddp_notebook.rank.elastic")  # never imported: nothing tracked
    return elastic.snapshot_numbers() if elastic is not None else []


def wrapped_models() -> dict[str, list[list[int]] | None]:
    """Names of the rank's namespace that hold a model from prepare_model, with its gradient
    buckets' layout (None before its reducer rebuilt them)."""
    from ddp_notebook.rank import elastic

    return elastic.wrapped_models()


def rewrap_models(layouts: dict[str, list[list[int]] | None]) -> None:
    """Every rank at once after a rank was replaced: fresh DDP reducers over the new group, their
    buckets laid out as a survivor's."""
    from ddp_notebook.rank import elastic

    elastic.rewrap_models(layouts)


def skip_cell_snapshot() -> None:
    """Sent ahead of a cell that runs on some ranks only (it is queued before the cell): that
    cell's end takes no snapshot of the tracked state."""
    import sys

    elastic = sys.modules.get("ddp_notebook.rank.elastic")  # never imported: nothing tracked
    if elastic is not None:
        elastic.skip_cell_snapshot()


def take_snapshot(where: str) -> int | None:
    """A snapshot of the tracked state now; None where nothing is tracked."""
    import sys

    elastic = sys.modules.get("ddp_notebook.rank.elastic")
    if elastic is None or not elastic.tracked():
        return None
    return int(elastic.snapshot(where))


def resume_from_disk(folder: str) -> tuple[str, tuple[str, ...]]:
    """Every rank at once: the newest whole snapshot written to `folder` that checks out loads;
    (which it was, the newer ones passed over as damaged)."""
    from ddp_notebook.rank import elastic

    resumed = elastic.resume(folder)
    return resumed.said, resumed.skipped


def persist_wait(timeout: float) -> dict[str, Any]:
    """Wait for this rank's snapshot writer to be idle; what it wrote, skipped and last failed with."""
    from ddp_notebook.rank.state import RANK

    writer = RANK.tracked.writer
    if writer is None:
        return {"idle": True, "written": [], "skipped": 0, "refused": 0, "error": None}
    idle = writer.wait(timeout)
    return {
        "idle": idle,
        "written": list(writer.written),
        "skipped": writer.skipped,
        "refused": writer.refused,
        "error": writer.last_error,
    }


def restore_snapshot(seq: int, source: int) -> str:
    """Every rank at once: load snapshot `seq` as rank `source` sends it; says where it was taken."""
    from ddp_notebook.rank import elastic

    return elastic.restore(seq, source)


def set_autoreload(enabled: bool) -> None:
    """Reload edited user modules before each cell, or stop doing so (%ddp_autoreload)."""
    from ddp_notebook.rank import reloading

    reloading.set_autoreload(enabled)


def working_folder() -> tuple[str, str]:
    """(host, working folder) of the rank: where %ddp_sync writes."""
    from ddp_notebook.rank import files

    return files.where()


def file_digests(paths: list[str]) -> dict[str, str | None]:
    from ddp_notebook.rank import files

    return files.digests(paths)


def receive_files(contents: dict[str, bytes]) -> int:
    from ddp_notebook.rank import files

    return files.receive(contents)


def start_profiling(request: ProfileRequest) -> None:
    """torch.profiler on this rank's next optimizer steps (%%ddp --profile), before the cell."""
    from ddp_notebook.rank import profiling

    profiling.start(request)


def finish_profiling() -> RankProfile:
    """After a profiled cell: stop the profiler, take its hook out, hand back the trace."""
    from ddp_notebook.rank import profiling

    return profiling.finish()
