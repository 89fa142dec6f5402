"""Runs on ranks: tracked snapshots written to disk, so a training outlives every one of its ranks.

`track(..., persist="ckpt/", persist_every=K)` writes every K-th snapshot (`elastic`) to the folder,
on a writer thread: the training thread only hands it the snapshot, which is already a CPU copy of
its own. The world state is the same on every rank, so rank 0 alone writes it (with
torch.distributed.checkpoint where this torch saves from one process, `torch_adapter`), and every
rank writes its own random number generators beside it. The folder holds, per written snapshot:

    snapshot-00000040/          the world state (rank 0)
    snapshot-00000040.ranks/    rank-00001.pt: each rank's generators and step count
    snapshot-00000040.json      written last, by rank 0, once both are whole

A snapshot without its `.json` is never loaded (a half-written one, a writer killed with its
process). Each file reaches the disk (`os.fsync`) before its folder does, the data before the
marker, the marker before its folder: after a power loss or a reboot a marker never stands for data
the disk did not keep. The marker lists every file with its size and CRC-32; `read_newest` checks the
newest snapshot against it and, where it is damaged (a file cut, missing or zero-filled, a marker
whose data is gone, a file that does not load), goes on from the newest one that checks out,
saying which it skipped and why. Rank 0 keeps the newest KEEP_WRITTEN whole ones and removes the
rest. The folder must be one every host of the world sees: rank 0 waits RANK_FILES_SECONDS for
the others' files, says so once if they never appear, and leaves that snapshot incomplete.

`read_newest(folder)` is what `%ddp_resume` loads from on every rank of a new world, of the same size
or another (the world state is whole in each snapshot: `elastic` reshards what is sharded).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from . import torch_adapter

KEEP_WRITTEN = 2  # whole snapshots kept on disk
RANK_FILES_SECONDS = 120.0  # rank 0 waits this long for every rank's generators before giving up on a snapshot
POLL_SECONDS = 0.05
QUEUED = 2  # snapshots waiting for the disk before the training thread waits too
QUEUE_WAIT_SECONDS = 600.0
WRITER_NICENESS = 10
MARKER_VERSION = 2  # 2: the marker lists each file's size and CRC-32 (1: none, loaded unchecked)
CHECKSUM_CHUNK = 4 << 20


@dataclasses.dataclass(frozen=True)
class PersistSettings:
    folder: Path
    every: int  # snapshots between two writes
    # the newest whole snapshot the folder held when this world began writing there (0 after
    # %ddp_resume from it): an earlier run's, which this world's lower numbers must not replace
    earlier: int = 0

    def earlier_note(self) -> str:
        return (
            f"[persist] {self.folder} holds snapshot {self.earlier} of an earlier run: %ddp_resume {self.folder} "
            "goes on from it; until then nothing of this world's is written there (or persist to another folder)"
        )

    @classmethod
    def build(cls, folder: str | os.PathLike[str], every: int, *, guard: bool = True) -> PersistSettings:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"persist_every must be a whole number >= 1, got {every!r}")
        path = Path(folder).expanduser().resolve()
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.mkdir(mode=0o700, exist_ok=True)  # private: what is loaded from it runs in every rank
            probe = path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as failure:
            reason = failure.strerror or failure
            raise ValueError(f"persist folder {str(folder)!r} cannot be written: {reason}") from None
        whole = whole_snapshots(path) if guard else []
        return cls(path, every, whole[-1][0] if whole else 0)


@dataclasses.dataclass(frozen=True)
class Written:
    """A whole snapshot on disk, as `read_newest` found it."""

    seq: int
    where: str
    world_size: int
    written_at: float
    state: dict[str, Any]
    rng: dict[str, Any]  # this rank's generators (rank 0's where the written world had no such rank)
    steps: int
    layouts: dict[str, Any]  # DDP models' gradient buckets (`elastic.wrapped_models`)
    # newer snapshots passed over, one line each: "snapshot 7 is damaged (...)"
    skipped: tuple[str, ...] = ()


class SnapshotDamaged(Exception):
    """A snapshot on disk that does not check out against its marker, or does not load."""


@dataclasses.dataclass
class Job:
    settings: PersistSettings
    seq: int
    where: str
    state: dict[str, Any]
    rng: dict[str, Any]
    steps: int
    rank: int
    world_size: int
    layouts: dict[str, Any] = dataclasses.field(default_factory=dict)


def submit(job: Job) -> bool:
    """Hand a snapshot to this rank's writer; False if the previous one is still being written."""
    from .state import RANK

    if RANK.tracked.writer is None:
        RANK.tracked.writer = Writer()
    return bool(RANK.tracked.writer.submit(job))


class Writer:
    """One writer thread per rank. Every rank writes every due snapshot (a rank that skipped one
    would leave it incomplete for all): when the disk falls QUEUED snapshots behind, the training
    thread waits for it, up to QUEUE_WAIT_SECONDS, then that snapshot is skipped and said."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=QUEUED)
        self._thread: threading.Thread | None = None
        self._pending = 0  # submitted, not yet written
        self._lock = threading.Lock()
        self.written: list[int] = []  # seqs this rank wrote its part of
        self.skipped = 0
        self.refused = 0  # snapshots not written over an earlier run's (`PersistSettings.earlier`)
        self.last_error: str | None = None
        self._said: set[str] = set()

    def submit(self, job: Job) -> bool:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ddp-notebook-persist", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending += 1
        try:
            self._jobs.put(job, timeout=QUEUE_WAIT_SECONDS)
        except queue.Full:
            with self._lock:
                self._pending -= 1
            self.skipped += 1
            self._say_once("slow", f"[persist] the disk is {QUEUED} snapshots behind: snapshot {job.seq} is skipped")
            return False
        return True

    def wait(self, timeout: float) -> bool:
        """Whether every submitted snapshot was written within `timeout` seconds (a cell's end, a test)."""
        deadline = time.monotonic() + timeout
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def _run(self) -> None:
        _yield_to_training()
        while True:
            job = self._jobs.get()
            try:
                write(job)
                self.written.append(job.seq)
            except FolderHoldsNewer:
                self.refused += 1  # said once, by track()
            except Exception as failure:  # noqa: BLE001  (said once; training goes on)
                self.last_error = f"{type(failure).__name__}: {failure}"
                self._say_once("error", f"[persist] snapshot {job.seq} was not written: {self.last_error}")
            finally:
                with self._lock:
                    self._pending -= 1

    def _say_once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            print(line, file=sys.stderr, flush=True)


class FolderHoldsNewer(RuntimeError):
    """The folder holds a later snapshot of an earlier run: writing below it would lose the new ones."""


def _yield_to_training() -> None:
    """The writer runs at a lower priority than the training thread (Linux gives each thread its
    own nice value): on a machine whose cores the ranks fill, it writes while they wait."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICENESS))
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the writer runs at the training thread's priority


def write(job: Job) -> None:
    """This rank's part of snapshot `job.seq`; rank 0's also the world state and the marker."""
    if job.seq <= job.settings.earlier:
        raise FolderHoldsNewer(job.settings.earlier_note())
    base = job.settings.folder / _name(job.seq)
    # a snapshot of this number written before the world went back to an older one (a comeback)
    # stops being whole before it is written again
    base.with_name(base.name + ".json").unlink(missing_ok=True)
    ranks_dir = base.with_name(base.name + ".ranks")
    ranks_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _atomic_torch_save(
        {"rng": _portable_generators(job.rng), "steps": job.steps, "rank": job.rank, "world_size": job.world_size},
        ranks_dir / _rank_file(job.rank),
    )
    if job.rank != 0:
        return
    partial = base.with_name(base.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)  # a previous world's same-numbered snapshot, never whole
    skeleton, tensors = _split(job.state)
    torch_adapter.save_whole_checkpoint({"structure": _Structure(skeleton, job.layouts), **tensors}, partial)
    _sync_tree(partial)  # private, then its files and the folder on the disk before the name says it is whole
    os.replace(partial, base)
    _sync_folder(job.settings.folder)
    if not _wait_for_ranks(ranks_dir, job.world_size):
        missing = [r for r in range(job.world_size) if not (ranks_dir / _rank_file(r)).exists()]
        raise TimeoutError(
            f"ranks {missing} never wrote their files to {job.settings.folder} within {RANK_FILES_SECONDS:g} s: "
            "persist to a folder every host of the world sees"
        )
    marker = {
        "version": MARKER_VERSION,
        "seq": job.seq,
        "where": job.where,
        "world_size": job.world_size,
        "written_at": time.time(),
        "torch": torch.__version__,
        "format": torch_adapter.checkpoint_format(),
        # every rank synced its own file and the folder of them before it counted as written
        "files": _file_table(job.settings.folder, [base, ranks_dir]),
    }
    temporary = base.with_name(base.name + ".json.tmp")
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf8") as handle:
        handle.write(json.dumps(marker))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, base.with_name(base.name + ".json"))
    _sync_folder(job.settings.folder)  # the marker's name on the disk: the snapshot counts as whole
    _prune(job.settings.folder, keep=KEEP_WRITTEN)


def whole_snapshots(folder: Path) -> list[tuple[int, dict[str, Any]]]:
    """(seq, marker) of every snapshot in `folder` with a readable marker and its data folder,
    oldest first (whether each file checks out, `damage` says)."""
    return [(seq, marker) for seq, marker in _markers(folder) if marker is not None and (folder / _name(seq)).is_dir()]


def read_newest(folder: str | os.PathLike[str], rank: int) -> Written:
    """The newest whole snapshot in `folder` that checks out against its marker and loads, with
    `rank`'s own generators where it had that rank; the newer ones passed over in `skipped`. Every
    rank checks every file, so all ranks of a world pass over the same ones."""
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"no folder {str(folder)!r}: give the folder track(persist=...) wrote to")
    markers = _markers(path)
    if not markers:
        raise FileNotFoundError(f"no whole snapshot in {str(folder)!r} (none was written, or none finished)")
    refuse_unless_private(path, path)
    skipped: list[str] = []
    for seq, marker in reversed(markers):
        try:
            if marker is None:
                raise SnapshotDamaged("its marker does not read")
            _refuse_foreign_files(path, seq)
            written = _load(path, seq, marker, rank)
        except SnapshotDamaged as damage:
            skipped.append(f"snapshot {seq} is damaged ({damage})")
            continue
        return dataclasses.replace(written, skipped=tuple(skipped))
    raise FileNotFoundError(f"no whole snapshot in {str(folder)!r}: every one is damaged ({'; '.join(skipped)})")


def refuse_unless_private(folder: Path, path: Path) -> None:
    """PermissionError, in one line saying what to fix, unless `path` is this user's and only they
    can write it: loading a snapshot unpickles it, so a file another user could write would run
    their code in every rank."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return  # what is missing, the snapshot's check says
    shown = folder.name + "/" + str(path.relative_to(folder)) if path != folder else str(folder)
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{shown} is owned by {_user_name(info.st_uid)}, not by you: resume only from your own files"
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            f"{shown} is writable by group or others, who could put code there that every rank would run: "
            f"chmod -R go-w {folder} (or resume from a folder only you can write)"
        )


def _refuse_foreign_files(folder: Path, seq: int) -> None:
    base = folder / _name(seq)
    ranks_dir = base.with_name(base.name + ".ranks")
    for path in (base.with_name(base.name + ".json"), base, ranks_dir):
        refuse_unless_private(folder, path)
    for part in (base, ranks_dir):
        if part.is_dir():
            for path in sorted(part.rglob("*")):
                refuse_unless_private(folder, path)


def _user_name(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def damage(folder: Path, seq: int, marker: dict[str, Any]) -> str | None:
    """What is wrong with snapshot `seq` by its marker's list of files (None: nothing found)."""
    base = folder / _name(seq)
    if not base.is_dir():
        return f"{base.name}/ is missing: the marker has no data"
    for relative, (size, checksum) in sorted(marker.get("files", {}).items()):
        file = folder / relative
        try:
            found = file.stat().st_size
        except OSError:
            return f"{relative} is missing"
        if found != size:
            return f"{relative}: {_size(found)} of {_size(size)}"
        if _checksum(file) != checksum:
            return f"{relative} does not match its checksum (zero-filled or overwritten)"
    return None


def _load(folder: Path, seq: int, marker: dict[str, Any], rank: int) -> Written:
    found = damage(folder, seq, marker)
    if found is not None:
        raise SnapshotDamaged(found)
    base = folder / _name(seq)
    ranks_dir = base.with_name(base.name + ".ranks")
    own = ranks_dir / _rank_file(rank)
    # a rank the written world did not have takes rank 0's generators, as a new rank takes its
    # sender's after a comeback
    try:
        loaded = torch_adapter.read_whole_checkpoint(base, marker.get("format", "dcp"))
        structure = loaded.pop("structure")
        state = _join(structure.value, loaded)
        mine = _load_rank_file(own if own.exists() else ranks_dir / _rank_file(0))
        return Written(
            seq=seq,
            where=str(marker.get("where", "")),
            world_size=int(marker["world_size"]),
            written_at=float(marker.get("written_at", 0.0)),
            state=state,
            rng=mine["rng"],
            steps=int(mine["steps"]),
            layouts=dict(structure.layouts),
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as failure:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        # a file torn in a way no size or checksum shows (a marker of the first format lists none)
        raise SnapshotDamaged(f"it does not load: {_why(failure)}") from None


def _why(failure: BaseException) -> str:
    """One line of why a load failed: DCP's CheckpointException holds each process's own error."""
    inner = getattr(failure, "failures", None)
    if isinstance(inner, dict) and inner:
        failure = next(iter(inner.values()))
    text = next((line for line in str(failure).splitlines() if line.strip()), "")
    return f"{type(failure).__name__}: {text[:120]}" if text else type(failure).__name__


def _markers(folder: Path) -> list[tuple[int, dict[str, Any] | None]]:
    """(seq, marker) of every snapshot with a marker, oldest first (None: a marker that does not read)."""
    found: list[tuple[int, dict[str, Any] | None]] = []
    for path in folder.glob("snapshot-*.json"):
        seq = _seq_of(path.name)
        if seq is None:
            continue
        try:
            data = json.loads(path.read_text())
            found.append(
                (int(data["seq"]), data) if isinstance(data, dict) and int(data["seq"]) == seq else (seq, None)
            )
        except (OSError, ValueError, KeyError, TypeError):
            found.append((seq, None))
    return sorted(found, key=lambda item: item[0])


# ---------------------------------------------------------------- the state as DCP keeps it


@dataclasses.dataclass(frozen=True)
class _TensorAt:
    """Where a tensor sat in the snapshot: DCP keeps tensors under string keys, the structure
    (tuples, integer keys of an optimizer's state) goes beside them as one object."""

    key: str


@dataclasses.dataclass(frozen=True)
class _Structure:
    """The snapshot without its tensors, kept by DCP as one object (a dict would be flattened), and
    the DDP models' gradient buckets: a reducer summing in other buckets rounds otherwise."""

    value: Any
    layouts: dict[str, Any]


def _split(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"tensor{len(tensors):06d}"
            tensors[key] = value
            return _TensorAt(key)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return value

    return walk(state), tensors


def _join(skeleton: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(skeleton, _TensorAt):
        return tensors[skeleton.key]
    if isinstance(skeleton, dict):
        return {k: _join(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)) and type(skeleton) in (list, tuple):
        return type(skeleton)(_join(v, tensors) for v in skeleton)
    return skeleton


# ---------------------------------------------------------------- a rank's own file


def _portable_generators(rng: dict[str, Any]) -> dict[str, Any]:
    """The generators with numpy's key as a tensor: the rank's file then loads with
    `weights_only=True` (tensors, numbers, strings and containers only; nothing is unpickled)."""
    numpy_state = rng.get("numpy")
    if numpy_state is None:
        return rng
    kind, key, position, has_gauss, cached = numpy_state
    return {
        **rng,
        "numpy": (str(kind), torch.from_numpy(key.astype("int64")), int(position), int(has_gauss), float(cached)),
    }


def _load_rank_file(path: Path) -> dict[str, Any]:
    mine = torch.load(path, weights_only=True)
    numpy_state = mine["rng"].get("numpy")
    if numpy_state is not None:
        kind, key, position, has_gauss, cached = numpy_state
        mine["rng"]["numpy"] = (kind, key.numpy().astype("uint32"), position, has_gauss, cached)
    return mine


# ---------------------------------------------------------------- files


def _name(seq: int) -> str:
    return f"snapshot-{seq:08d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _atomic_torch_save(value: Any, path: Path) -> None:
    """`value` at `path`, whole or not at all, on the disk before its name appears."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """The folder's entries (names made, replaced, removed) on the disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_tree(folder: Path) -> None:
    """Every file under `folder` made private (whatever the umask: only the user's own files are
    loaded), then it and each folder of them on the disk."""
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o700)
        for name in files:
            with open(os.path.join(root, name), "rb+") as handle:
                os.fchmod(handle.fileno(), 0o600)
                os.fsync(handle.fileno())
        _sync_folder(Path(root))


def _file_table(folder: Path, parts: list[Path]) -> dict[str, list[int]]:
    """{path relative to `folder`: [size, CRC-32]} of every file under `parts`."""
    table = {}
    for part in parts:
        for file in sorted(p for p in part.rglob("*") if p.is_file()):
            table[str(file.relative_to(folder))] = [file.stat().st_size, _checksum(file)]
    return table


def _checksum(file: Path) -> int:
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(CHECKSUM_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL on large chunks: training goes on
    return crc


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def _wait_for_ranks(ranks_dir: Path, world_size: int) -> bool:
    deadline = time.monotonic() + RANK_FILES_SECONDS
    while not all((ranks_dir / _rank_file(r)).exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _prune(folder: Path, keep: int) -> None:
    """Only the newest `keep` whole snapshots stay, and nothing older than the oldest of them."""
    whole = [seq for seq, _ in whole_snapshots(folder)]
    if not whole:
        return
    kept = set(whole[-keep:])
    oldest_kept = min(kept)
    for entry in folder.glob("snapshot-*"):
        seq = _seq_of(entry.name)
        if seq is None or seq in kept or seq > oldest_kept:
            continue  # a newer snapshot still being written is not ours to remove
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _seq_of(name: str) -> int | None:
    digits = name.removeprefix("snapshot-")[:8]
    return int(digits) if digits.isdigit() else None
