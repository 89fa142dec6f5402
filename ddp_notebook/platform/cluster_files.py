"""The files one ipyparallel cluster leaves in its profile: where they go, and their removal.

ipyparallel's controller writes its engine registry (`log/engines<cluster id>.json`) at every
registration and never removes it; a launcher removes its process's log only on the stop path
it drives itself. Left alone, a profile gathers thousands of them (a day of tests: 2,750 files).
A world whose processes all run here gets a profile of its own in its private folder, which
goes with the folder; a world whose ranks run elsewhere uses the user's profile (the one
other hosts may see too), and its files are removed when it ends.
"""

from __future__ import annotations

import glob
import os


def cluster_files(profile_dir: str, cluster_id: str) -> list[str]:
    """The files in `profile_dir` that belong to the cluster `cluster_id` (none of another's)."""
    if not profile_dir or not cluster_id:
        return []
    log_dir, security = os.path.join(profile_dir, "log"), os.path.join(profile_dir, "security")
    # glob's metacharacters in an id would widen the match to other clusters' files
    cid = glob.escape(cluster_id)
    patterns = [
        os.path.join(log_dir, f"engines{cid}.json"),
        os.path.join(log_dir, f"ipcontroller-{cid}-*.log"),
        os.path.join(log_dir, f"ipengine-{cid}-*.log"),
        os.path.join(security, f"ipcontroller-{cid}-client.json"),
        os.path.join(security, f"ipcontroller-{cid}-engine.json"),
    ]
    return sorted({path for pattern in patterns for path in glob.glob(pattern)})


def remove_cluster_files(profile_dir: str, cluster_id: str) -> list[str]:
    """Remove the cluster's files; returns those that could not be removed."""
    kept = []
    for path in cluster_files(profile_dir, cluster_id):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError:
            kept.append(path)
    return kept


# a profile's configuration (ipcluster_config.py, ipcontroller_config.py, ipengine_config.py and
# the ipython_config.py they all read), as IPython names it
CONFIG_SUFFIXES = ("_config.py", "_config.json")
PRIVATE_PROFILE = "ipython"


def private_profile(private_dir: str, profile_dir: str) -> str:
    """A profile folder of a world's own, in its private folder (0700): what ipyparallel writes for
    the world (connection files, logs, engine registry) goes with that folder, however the world
    ends. The configuration files of `profile_dir` (the user's profile) are linked in, so that its
    settings apply as they would there."""
    location = os.path.join(private_dir, PRIVATE_PROFILE)
    os.makedirs(location, mode=0o700, exist_ok=True)
    names = os.listdir(profile_dir) if os.path.isdir(profile_dir) else []
    for name in names:
        if name.endswith(CONFIG_SUFFIXES) and not os.path.lexists(os.path.join(location, name)):
            os.symlink(os.path.join(profile_dir, name), os.path.join(location, name))
    return location
