"""The notebook's side of `%ddp_sync`: the user's files sent to ranks on hosts without them.

Ranks on another host work in the notebook's folder where that path exists there (a shared
filesystem), else in a sync folder of their own (`ddp_notebook.rank.files`). `%ddp_sync [PATHS]`
sends files under the notebook's folder (by default its Python files and packages) to every
such working folder that does not hold the same bytes: one rank per (host, folder) receives them,
only the files whose sha256 differs, over the world's own channel. Before each cell of a world
whose ranks work in a sync folder, the same is done by itself for the default files, so that an
edited `model.py` reaches them and `%ddp_autoreload` reloads it there too.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DDPUsageError
from ..rank import calls as rank_calls

DEFAULT_LIMIT_MB = 20.0
CALL_SECONDS = 30.0  # a rank answering where it works, what it holds, or writing what it got
# folders never walked: caches, version control, environments, build output
SKIPPED_FOLDERS = {"__pycache__", ".git", ".ipynb_checkpoints", "node_modules", "venv", "build", "dist"}

Destination = tuple[str, str]  # (host, working folder) of ranks


@dataclass(frozen=True)
class SyncReport:
    """What a sync sent where."""

    files: int  # files compared
    sent: dict[Destination, tuple[str, ...]] = field(default_factory=dict)
    bytes_sent: int = 0

    def __str__(self) -> str:
        if not self.sent:
            return f"every rank's folder holds these {self.files} files already; nothing sent"
        places = "; ".join(f"{host}:{folder}: {', '.join(paths)}" for (host, folder), paths in self.sent.items())
        count = sum(len(paths) for paths in self.sent.values())
        return f"sent {count} file(s), {_size(self.bytes_sent)}: {places}"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 1024:.1f} KB"


def _walk(folder: str, relative: str = "", python_only: bool = False, packages_only: bool = False) -> list[str]:
    """Files under `folder`/`relative`, relative to `folder`, sorted; hidden and skipped folders left out."""
    found = []
    base = os.path.join(folder, relative)
    for entry in sorted(os.scandir(base), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        path = os.path.join(relative, entry.name)
        if entry.is_dir(follow_symlinks=False):
            if entry.name in SKIPPED_FOLDERS:
                continue
            if packages_only and not os.path.isfile(os.path.join(entry.path, "__init__.py")):
                continue
            found.extend(_walk(folder, path, python_only, packages_only))
        elif entry.is_file() and (not python_only or entry.name.endswith(".py")):
            found.append(path)
    return found


def default_files(folder: str) -> list[str]:
    """The notebook folder's Python modules and packages (the .py files in them)."""
    return _walk(folder, python_only=True, packages_only=True)


def chosen_files(paths: Sequence[str], folder: str) -> list[str]:
    """Each path (a file or a folder, under the notebook's folder) as the files it names."""
    found: list[str] = []
    root = os.path.realpath(folder)
    for path in paths:
        full = os.path.realpath(os.path.join(folder, os.path.expanduser(path)))
        if os.path.commonpath([root, full]) != root:
            raise DDPUsageError(
                f"%ddp_sync sends files under the notebook's folder ({folder}); {path} is outside it: "
                "copy it there, or give its place under the folder"
            )
        if os.path.isdir(full):
            found.extend(_walk(root, os.path.relpath(full, root)))
        elif os.path.isfile(full):
            found.append(os.path.relpath(full, root))
        else:
            raise DDPUsageError(f"%ddp_sync: no file or folder {path} in {folder}")
    return sorted(set(found))


class Syncer:
    """What the ranks' working folders hold, as far as this notebook knows, and sending the rest."""

    def __init__(self, folder: str | None = None, limit_mb: float = DEFAULT_LIMIT_MB) -> None:
        self.folder = os.path.realpath(folder or os.getcwd())
        self.host = socket.gethostname()
        self.limit_mb = limit_mb
        self._digests: dict[str, tuple[tuple[int, int], str]] = {}  # path -> ((mtime, size), sha256)
        self._places: tuple[tuple[int, ...], dict[Destination, int]] | None = None  # engines -> places
        self.held: dict[Destination, dict[str, str | None]] = {}  # what each place holds, last known
        self.auto_refused = False

    # -------------------------------------------------------------- where the ranks work
    def places(self, client: Any, engines: Sequence[int]) -> dict[Destination, int]:
        """(host, folder) -> one engine working there; folders that are this notebook's own left out."""
        key = tuple(sorted(engines))
        if self._places is None or self._places[0] != key:
            pending = {engine: client[engine].apply_async(rank_calls.working_folder) for engine in key}
            found: dict[Destination, int] = {}
            for engine, reply in pending.items():
                host, folder = reply.get(timeout=CALL_SECONDS)
                if (host, os.path.realpath(folder)) == (self.host, self.folder):
                    continue  # a rank here, in this folder: the files are its own
                found.setdefault((host, folder), engine)
            self._places = (key, found)
            self.held = {place: held for place, held in self.held.items() if place in found}
        return self._places[1]

    def needs_auto_sync(self, client: Any, engines: Sequence[int]) -> bool:
        """Whether some rank works in a sync folder (the notebook's folder does not exist on its host)."""
        return any(folder != self.folder for _host, folder in self.places(client, engines))

    # -------------------------------------------------------------- the files here
    def digest(self, relative: str) -> str:
        path = os.path.join(self.folder, relative)
        stat = os.stat(path)
        version = (stat.st_mtime_ns, stat.st_size)
        cached = self._digests.get(relative)
        if cached is None or cached[0] != version:
            with open(path, "rb") as handle:
                cached = (version, hashlib.sha256(handle.read()).hexdigest())
            self._digests[relative] = cached
        return cached[1]

    def check_size(self, files: Iterable[str]) -> int:
        total = sum(os.path.getsize(os.path.join(self.folder, relative)) for relative in files)
        if total > self.limit_mb * 2**20:
            raise DDPUsageError(
                f"%ddp_sync: these files hold {_size(total)}, more than the {self.limit_mb:g} MB a sync sends; "
                "name the folder or files the ranks need (%ddp_sync mypackage) or raise the limit (--max-mb N)"
            )
        return total

    # -------------------------------------------------------------- sending
    def sync(
        self,
        client: Any,
        engines: Sequence[int],
        files: Sequence[str],
        ask: bool = True,
        sync_folders_only: bool = False,
    ) -> SyncReport:
        """Send `files` (relative to the notebook's folder) where they differ. `ask`: ask each place
        what it holds (else trust what was last sent or seen there). `sync_folders_only`: leave
        alone a folder of the notebook's path on another host (a copy of the user's own)."""
        self.check_size(files)
        places = self.places(client, engines)
        if sync_folders_only:
            places = {place: engine for place, engine in places.items() if place[1] != self.folder}
        local = {relative: self.digest(relative) for relative in files}
        if ask:
            asked = list(files)
            pending = {place: client[e].apply_async(rank_calls.file_digests, asked) for place, e in places.items()}
            for place, reply in pending.items():
                self.held.setdefault(place, {}).update(reply.get(timeout=CALL_SECONDS))
        sent: dict[Destination, tuple[str, ...]] = {}
        total = 0
        for place, engine in places.items():
            held = self.held.setdefault(place, {})
            stale = [relative for relative in files if held.get(relative, "?") != local[relative]]
            if not stale:
                continue
            contents = {}
            for relative in stale:
                with open(os.path.join(self.folder, relative), "rb") as handle:
                    contents[relative] = handle.read()
            total += client[engine].apply_async(rank_calls.receive_files, contents).get(timeout=CALL_SECONDS)
            held.update({relative: local[relative] for relative in stale})
            sent[place] = tuple(stale)
        return SyncReport(files=len(files), sent=sent, bytes_sent=total)

    def before_cell(self, client: Any, engines: Sequence[int]) -> SyncReport | None:
        """The default files to ranks working in a sync folder, before a cell; None where none does.
        Asks what they hold the first time only: after that, only what changed here is sent."""
        if self.auto_refused or not self.needs_auto_sync(client, engines):
            return None
        files = default_files(self.folder)
        try:
            self.check_size(files)
        except DDPUsageError as refusal:
            self.auto_refused = True  # said once; %ddp_sync PATHS still sends what is named
            raise DDPUsageError(f"{refusal} (the automatic sync before each cell is off from here)") from None
        first = any(place not in self.held for place in self.places(client, engines) if place[1] != self.folder)
        return self.sync(client, engines, files, ask=first, sync_folders_only=True)
