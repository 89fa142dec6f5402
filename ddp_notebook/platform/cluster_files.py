"""The files one ipyparallel cluster leaves in its profile, and their removal when the world ends.

ipyparallel's controller writes its engine registry (`log/engines<cluster id>.json`) at every
registration and never removes it; a launcher removes its process's log only on the stop path
it drives itself. Left alone, a profile gathers thousands of them (a day of tests: 2,750 files).
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
