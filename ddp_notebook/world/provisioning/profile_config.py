"""The user's ipyparallel configuration (`ipcluster_config.py` and the like), read once per kernel.

ipyparallel reads a profile's configuration by making an `IPClusterStart` application, which first
scans every installed package's entry points for launcher classes: 0.1 s of every world's start,
before anything is forked. A world's private profile holds links to the user's configuration files
(`platform/cluster_files.private_profile`), so what it reads is what the user's profile holds: read
once, and again only when one of those files changes.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ...platform.cluster_files import CONFIG_SUFFIXES

_lock = threading.Lock()
_read: dict[str, tuple[tuple[tuple[str, int, int], ...], Any]] = {}  # profile -> (its files, their config)


def _files(profile_dir: str) -> tuple[tuple[str, int, int], ...]:
    """The profile's configuration files, with what tells a changed one (mtime, size)."""
    names = sorted(os.listdir(profile_dir)) if os.path.isdir(profile_dir) else []
    found = []
    for name in names:
        if name.endswith(CONFIG_SUFFIXES):
            try:
                info = os.stat(os.path.join(profile_dir, name))
            except OSError:
                continue
            found.append((name, info.st_mtime_ns, info.st_size))
    return tuple(found)


def _read_profile(profile_dir: str) -> Any:
    """ipyparallel's own reading of a profile's configuration (as `Cluster` does it)."""
    from ipyparallel.cluster.app import IPClusterStart
    from traitlets.config import Config

    if not os.path.isdir(profile_dir):
        return Config()
    config = Config()
    config.ProfileDir.location = profile_dir
    app = IPClusterStart(config=config)
    app.init_profile_dir()
    app.init_config_files()
    app.load_config_file(suppress_errors=False)
    return app.config


def profile_config(user_profile: str, world_profile: str) -> Any:
    """The configuration a world whose profile is `world_profile` (linking the files of
    `user_profile`) reads, for `ipyparallel.Cluster(profile_config=...)`."""
    from traitlets.config import Config

    config = Config()
    config.merge(_current(user_profile))
    config.ProfileDir.location = world_profile  # as ipyparallel reads it from the world's profile
    return config


def _current(user_profile: str) -> Any:
    """The user's configuration as its files hold it now: read again only when one of them changed."""
    files = _files(user_profile)
    with _lock:
        known = _read.get(user_profile)
        if known is None or known[0] != files:
            known = _read[user_profile] = (files, _read_profile(user_profile))
    return known[1]


def read_ahead(user_profile: str) -> None:
    """Read the user's configuration now (at `%load_ext`), so the first `%ddp_start` need not."""
    try:
        _current(user_profile)
    except Exception:  # noqa: BLE001  (a broken file is reported, in one line, by the start that reads it)
        return
