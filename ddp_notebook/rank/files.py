"""A rank's side of `%ddp_sync`: its working directory, what it holds, and the files it receives.

The files come as the arguments of a call over the world's own channel (ipyparallel's signed,
and beyond loopback CurveZMQ-encrypted, messages): no scp, no second authentication. They are
written under the rank's working directory only (a path that leaves it is refused here as well
as in the notebook), each through a temporary file and a rename, so a rank importing a module
while it is written never sees half of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from .state import RANK

# where a rank on another host works when the notebook's folder does not exist there: one folder
# per notebook folder, under the user's cache, filled by %ddp_sync and removed when the world stops
SYNC_ROOT = os.path.join("~", ".cache", "ddp_notebook", "sync")


def sync_folder(kernel_host: str, kernel_folder: str) -> str:
    digest = hashlib.sha256(f"{kernel_host}:{kernel_folder}".encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(SYNC_ROOT), digest)


def enter_working_folder(kernel_host: str, kernel_folder: str) -> str:
    """A rank works where the notebook does: in the notebook's folder if that path exists on its
    host (this host, a shared filesystem), else in its sync folder. Returns the folder."""
    if os.path.isdir(kernel_folder):
        target = kernel_folder
    else:
        target = sync_folder(kernel_host, kernel_folder)
        os.makedirs(target, mode=0o700, exist_ok=True)
        if target not in RANK.user_files.sync_folders:
            RANK.user_files.sync_folders.append(target)
    if os.path.realpath(os.getcwd()) != os.path.realpath(target):
        os.chdir(target)
    return target


def leave_sync_folder() -> None:
    """At the world's end: the sync folder this rank worked in goes with it."""
    while RANK.user_files.sync_folders:
        folder = RANK.user_files.sync_folders.pop()
        if os.path.realpath(os.getcwd()) == os.path.realpath(folder):
            os.chdir(os.path.expanduser("~"))
        shutil.rmtree(folder, ignore_errors=True)


def _inside(root: str, relative: str) -> str:
    if os.path.isabs(relative) or relative.split("/")[0] == ".." or "/../" in f"/{relative}/":
        raise ValueError(f"{relative!r} leaves the working folder")
    return os.path.join(root, relative)


def digests(relative_paths: list[str]) -> dict[str, str | None]:
    """sha256 of each file under the working folder (None where it is missing)."""
    root = os.getcwd()
    found: dict[str, str | None] = {}
    for relative in relative_paths:
        try:
            with open(_inside(root, relative), "rb") as handle:
                found[relative] = hashlib.sha256(handle.read()).hexdigest()
        except OSError:
            found[relative] = None
    return found


def where() -> tuple[str, str]:
    """(host name, working folder) of this rank."""
    import socket

    return socket.gethostname(), os.getcwd()


def receive(files: dict[str, bytes]) -> int:
    """Write `files` (relative path -> content) under the working folder; returns bytes written."""
    root = os.getcwd()
    written = 0
    for relative, content in files.items():
        target = _inside(root, relative)
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".ddp-sync-")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(content)
            os.replace(temporary, target)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        written += len(content)
    return written
