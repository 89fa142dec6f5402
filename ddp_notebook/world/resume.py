"""The kernel's side of `%ddp_resume FOLDER`: every rank of a running world loads the newest whole
snapshot `track(persist=FOLDER)` wrote, after every rank of the world that wrote it was lost (the
machine rebooted, the kernel and its world gone). The ranks read it themselves (`rank/persisting`):
a folder every host sees, on this number of ranks or another."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import DDPError, DDPUsageError, one_line
from ..rank import calls as rank_calls
from .running import RunningWorld


@dataclass(frozen=True)
class Resumed:
    said: str  # "snapshot 12 (epoch 1, batch 40) of a world of 4 ranks"
    seconds: float
    # newer snapshots passed over, one line each: "snapshot 13 is damaged (...): going on from snapshot 12"
    skipped: tuple[str, ...] = ()


def resume_from(running: RunningWorld, folder: str, timeout: float) -> Resumed:
    """Every rank at once loads the newest whole snapshot in `folder` (its setup cells ran first)."""
    if not isinstance(folder, str) or not folder.strip():
        raise DDPUsageError("%ddp_resume takes the folder track(persist=...) wrote to: %ddp_resume ckpt/")
    began = time.perf_counter()
    ranks = sorted(running.ranks)
    engines = running.client[[running.ranks[rank].engine_id for rank in ranks]]
    try:
        said = engines.apply_async(rank_calls.resume_from_disk, folder).get(timeout=timeout)
    except Exception as failure:  # noqa: BLE001  (a rank's own error says what is wrong)
        reason = _first_reason(failure)
        for kind in ("FileNotFoundError: ", "PermissionError: "):  # no snapshot, or none that is the user's own
            if reason.startswith(kind):
                raise DDPUsageError(f"could not resume from {folder}: {reason.removeprefix(kind)}") from None
        raise DDPError(f"could not resume from {folder}: {reason}") from None
    loaded = {what for what, _ in said}
    if len(loaded) != 1:  # a folder that is not the same on every host
        raise DDPError(f"could not resume from {folder}: the ranks loaded different snapshots: {sorted(loaded)}")
    what, skipped = said[0]
    seq = what.split(" ", 2)[1]  # "snapshot 12 (...)"
    notes = tuple(f"{line}: going on from snapshot {seq}" for line in skipped)
    return Resumed(what, time.perf_counter() - began, notes)


def _first_reason(failure: BaseException) -> str:
    """One line: the first rank's error where several failed alike (a folder none can read)."""
    several = getattr(failure, "elist", None)  # ipyparallel's CompositeError: (ename, evalue, ...) each
    if several:
        ename, evalue = several[0][:2]
        return f"{ename}: {evalue}" if evalue else str(ename)
    return one_line(failure)
