"""Starting and stopping worlds: failures are clean, and no process outlives its owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster, StartError
from ddp_notebook.platform.cluster_files import cluster_files
from tests.support.processes import owned_pids, pid_alive, wait_gone

pytestmark = pytest.mark.integration


def test_context_manager_starts_and_stops(no_leaks: None) -> None:
    with DDPCluster(1, backend="gloo") as world:
        assert world.running and world.start_seconds is not None
        assert world.execute("rank + world_size").value_text(0) == "1"
        assert len(world.pids) == 3  # controller, the warm template, one rank
        pids = world.all_pids  # with the controller's helper processes
    assert not world.running
    assert wait_gone(pids) == []
    assert world.stop() is False  # stopping again is harmless


def test_start_timeout_leaves_nothing_behind(no_leaks: None) -> None:
    world = DDPCluster(2, backend="gloo", start_timeout=0.2)
    with pytest.raises(StartError, match=r"ranks registered within 0.2 s"):
        world.start()
    assert not world.running


def test_a_rank_that_cannot_import_torch_fails_the_start_clearly(tmp_path: Path, no_leaks: None) -> None:
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    world = DDPCluster(2, backend="gloo", env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(
        StartError, match=r"could not set up torch\.distributed: ImportError: this torch is broken on purpose"
    ):
        world.start()
    assert not world.running


OWNER_SCRIPT = """
import json, sys, time
from ddp_notebook import DDPCluster
world = DDPCluster(2, backend="gloo").start()
cluster = world.provisioner.cluster
template = getattr(world.provisioner, "template", None)
folders = [world.private_dir] + ([template.directory] if template is not None else [])
print(json.dumps([world.all_pids, cluster.profile_dir, cluster.cluster_id, folders]), flush=True)
time.sleep(600)
"""


def test_ranks_and_controller_exit_when_their_kernel_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(OWNER_SCRIPT))
    owner = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=os.environ.copy()
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        pids, profile_dir, cluster_id, folders = json.loads(line)
        assert len(pids) > 3 and all(pid_alive(p) for p in pids)  # controller helpers included
        # the world's private folder (its key, the X-ray's sockets, the rendezvous file) and the template's
        assert len(folders) == 2 and all(os.path.isdir(folder) for folder in folders), folders
    finally:
        owner.send_signal(signal.SIGKILL)  # no atexit, no clean-up: only the rank-side watch can help
        owner.wait(10)
    leftover = wait_gone(sorted(set(pids) | owned_pids(owner.pid)), seconds=30)
    if leftover:  # never leave them to the next test, but fail loudly
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
    assert leftover == []
    # its connection files (which hold the cluster's key), its logs and its engine registry went with it
    assert cluster_files(profile_dir, cluster_id) == []
    assert [folder for folder in folders if os.path.exists(folder)] == [], "the world's folders outlived the kernel"


def test_key_material_is_private_and_removed_on_stop(no_leaks: None) -> None:
    world = DDPCluster(1, backend="gloo").start()
    try:
        security = Path(world.provisioner.cluster.profile_dir) / "security"
        cluster_id = world.provisioner.cluster.cluster_id
        files = [p for p in security.iterdir() if cluster_id in p.name]
        assert any(p.name.endswith("-client.json") for p in files)  # holds the message-signing key
        assert all(p.stat().st_mode & 0o077 == 0 for p in files), [oct(p.stat().st_mode) for p in files]
        private = Path(world.private_dir)
        assert private.stat().st_mode & 0o077 == 0
    finally:
        world.stop()
    # a world of ranks on this machine has a profile of its own, in its private folder: gone with it
    assert security.is_relative_to(private) and not security.exists()
    assert not private.exists()


def test_a_stopped_world_leaves_no_file_in_its_profile(no_leaks: None) -> None:
    world = DDPCluster(2, backend="gloo").start()
    try:
        cluster = world.provisioner.cluster
        profile_dir, cluster_id = cluster.profile_dir, cluster.cluster_id
        world.resize(1)  # ipyparallel removes the log of a rank stopped through it, not the rest
        names = {Path(p).name for p in cluster_files(profile_dir, cluster_id)}
        # the controller's engine registry and the processes' logs: what used to pile up
        assert f"engines{cluster_id}.json" in names, names
        assert any(name.startswith(f"ipcontroller-{cluster_id}-") for name in names), names
        assert any(name.startswith(f"ipengine-{cluster_id}-") for name in names), names
    finally:
        world.stop()
    assert cluster_files(profile_dir, cluster_id) == []
    # stopped for good: ipyparallel does not stop it again at exit (over ssh configs gone by then)
    assert cluster.shutdown_atexit is False


def test_curve_encryption_on_request(no_leaks: None, capsys: pytest.CaptureFixture[str]) -> None:
    with DDPCluster(2, backend="gloo", curve=True) as world:
        security = Path(world.provisioner.cluster.profile_dir) / "security"
        client_file = security / f"ipcontroller-{world.provisioner.cluster.cluster_id}-client.json"
        assert json.loads(client_file.read_text())["curve_serverkey"]  # clients and ranks must use it
        assert world.execute("rank + 1", stream=False).values == {0: {"text/plain": "1"}, 1: {"text/plain": "2"}}
        from ddp_notebook.world.report import format_start_summary

        assert "encrypted (CurveZMQ)" in format_start_summary(world)
