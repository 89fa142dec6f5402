"""A profiled cell (`%%ddp --profile`, `world.run(..., profile=...)`), the notebook's side: what to
profile, the folder the traces go to (checked before anything starts), the profiler started on
the cell's ranks ahead of the cell and, after it, each rank's trace written there and analysed.
"""

from __future__ import annotations

import gzip
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DDPError, DDPUsageError, one_line
from ..live import hta_analysis
from ..live.profile_analysis import analyse, read_trace
from ..live.profile_view import ProfileReport
from ..wire.profiling import PROFILE_VERSION, TRACE_SUFFIX, ProfileRequest, RankProfile

DEFAULT_STEPS = 5
DEFAULT_FOLDER = "ddp_profiles"  # in the notebook's folder; one subfolder per profiled cell
START_SECONDS = 60.0  # torch.profiler's first start on a rank imports a good part of torch.profiler
FINISH_SECONDS = 120.0  # the trace is written and compressed on the rank


@dataclass(frozen=True)
class ProfileSettings:
    """What `%%ddp --profile [STEPS] [--profile-dir DIR]` profiles, as a value.

    torch.profiler runs on every rank of the cell over its optimizer steps: `wait` steps left
    alone, `warmup` steps run but discarded, then `steps` steps recorded. `folder` receives one
    Chrome trace per rank, `rank<N>.pt.trace.json` (default: `ddp_profiles/<date-time>` in the
    notebook's folder); `memory` records allocations and reads each rank's memory at each step.
    """

    steps: int = DEFAULT_STEPS
    wait: int = 1
    warmup: int = 1
    folder: str | os.PathLike[str] | None = None
    memory: bool = True
    record_shapes: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        for name, least in (("steps", 1), ("wait", 0), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise DDPUsageError(f"profile {name} must be a whole number >= {least}, got {value!r}")

    @classmethod
    def coerce(cls, value: ProfileSettings | int | bool) -> ProfileSettings:
        """`profile=` as given: settings, a number of steps, or True (the defaults)."""
        if isinstance(value, ProfileSettings):
            return value
        if value is True:
            return cls()
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(steps=value)
        raise DDPUsageError(f"profile= takes a number of steps or ProfileSettings(...), got {value!r}")

    def request(self) -> ProfileRequest:
        return ProfileRequest(
            v=PROFILE_VERSION,
            wait=self.wait,
            warmup=self.warmup,
            active=self.steps,
            memory=self.memory,
            shapes=self.record_shapes,
            stack=self.with_stack,
        )


def parse_steps(text: str) -> int:
    """`--profile STEPS` as the user typed it."""
    if not text.strip().isdigit() or int(text) < 1:
        raise DDPUsageError(
            f"--profile takes the number of steps to record, a whole number of 1 or more (e.g. --profile 5), "
            f"got '{text}'"
        )
    return int(text)


def prepare_folder(folder: str | os.PathLike[str] | None) -> Path:
    """The folder the traces go to, made and checked writable before anything runs."""
    if folder is None:
        base = Path(DEFAULT_FOLDER) / time.strftime("%Y%m%d-%H%M%S")
        target, n = base, 1
        while target.exists():
            n += 1
            target = base.with_name(f"{base.name}-{n}")
    else:
        target = Path(folder).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as problem:
        reason = problem.strerror or type(problem).__name__
        raise DDPUsageError(
            f"cannot write the profiles to {target}: {reason}; name a folder you can write with --profile-dir DIR"
        ) from None
    return target.resolve()


class ProfiledCell:
    """One profiled cell: the profiler started on its ranks, then the traces collected."""

    def __init__(self, settings: ProfileSettings, folder: Path, engines: Mapping[int, Any]) -> None:
        self.settings = settings
        self.folder = folder
        self.engines = dict(engines)  # rank -> its engine's view (client[engine_id])

    @classmethod
    def start(cls, profile: ProfileSettings | int | bool, engines: Mapping[int, Any]) -> ProfiledCell:
        """Check the settings and the folder, then start the profiler on every rank of `engines`."""
        from ..rank import calls as rank_calls

        settings = ProfileSettings.coerce(profile)
        cell = cls(settings, prepare_folder(settings.folder), engines)
        pending = {
            rank: view.apply_async(rank_calls.start_profiling, settings.request()) for rank, view in engines.items()
        }
        for rank, result in pending.items():
            try:
                result.get(timeout=START_SECONDS)
            except Exception as failure:  # noqa: BLE001  (the cell does not run: say which rank and why)
                cell.finish(())
                raise DDPError(f"the profiler did not start on rank {rank}: {one_line(failure)}") from None
        return cell

    def finish(self, skip: Sequence[int]) -> ProfileReport:
        """Stop the profiler on the ranks (but those in `skip`: dead or still running), write each
        rank's trace into the folder and analyse them."""
        from ..rank import calls as rank_calls

        notes: list[str] = [f"rank {rank}: no profile (the rank did not finish the cell)" for rank in sorted(skip)]
        pending = {
            rank: view.apply_async(rank_calls.finish_profiling)
            for rank, view in self.engines.items()
            if rank not in skip
        }
        profiles: dict[int, RankProfile] = {}
        for rank, result in pending.items():
            try:
                reply = result.get(timeout=FINISH_SECONDS)
            except Exception as failure:  # noqa: BLE001  (the other ranks' profiles still count)
                notes.append(f"rank {rank}: no profile ({one_line(failure)})")
                continue
            if reply.get("v") != PROFILE_VERSION:
                notes.append(f"rank {rank}: its profile is of another version ({reply.get('v')})")
                continue
            profiles[rank] = reply
        return self._report(profiles, notes)

    def _report(self, profiles: Mapping[int, RankProfile], notes: list[str]) -> ProfileReport:
        traces: dict[int, dict[str, Any]] = {}
        files: dict[int, Path] = {}
        for rank, profile in sorted(profiles.items()):
            if profile["trace_gz"] is None:
                needed = self.settings.wait + self.settings.warmup + 1
                notes.append(
                    f"rank {rank}: {profile['note']}; the first recorded step is optimizer step {needed} "
                    f"(wait {self.settings.wait}, warm-up {self.settings.warmup})"
                )
                continue
            data = gzip.decompress(profile["trace_gz"])
            path = self.folder / f"rank{rank}{TRACE_SUFFIX}"
            path.write_bytes(data)
            files[rank] = path
            traces[rank] = read_trace(data)
        analysis = analyse(traces, {rank: p["memory"] for rank, p in profiles.items()})
        gpu = hta_analysis.gpu_breakdown(files) if any(r.gpu for r in analysis.ranks.values()) else None
        return ProfileReport(
            folder=self.folder,
            files=files,
            analysis=analysis,
            settings_text=f"wait {self.settings.wait}, warm-up {self.settings.warmup}, {self.settings.steps} recorded",
            notes=notes,
            hta=gpu,
        )
