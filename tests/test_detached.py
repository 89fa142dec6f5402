"""Detached worlds without processes: the registry (private files, stale entries), choosing the world
to attach to, the listing, the settings a detached world refuses, and the idle limit's decisions."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

from ddp_notebook.errors import DDPUsageError
from ddp_notebook.platform.processes import started_at, this_machine
from ddp_notebook.rank import idle_limit
from ddp_notebook.wire import detached as wire
from ddp_notebook.wire.results import RankInfo
from ddp_notebook.world import detached
from ddp_notebook.world.config import DEFAULT_IDLE_LIMIT, AttachTarget, WorldConfig
from ddp_notebook.world.forming import WorldLayout
from ddp_notebook.world.layout import Placement


@pytest.fixture(autouse=True)
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's registry in a folder of this test's own."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return tmp_path / "state" / "ddp_notebook" / "worlds"


def gone_pid() -> int:
    """A PID no process has now."""
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def running_world(tmp_path: Path, world_id: str, size: int = 2, notebook: str = "") -> SimpleNamespace:
    """What `detached.record` reads of a RunningWorld whose controller is this test's process."""
    profile = tmp_path / world_id / "ipython"
    (profile / "security").mkdir(parents=True)
    (profile / "security" / f"ipcontroller-{world_id}-client.json").write_text("{}")
    ranks = {
        rank: RankInfo(rank, rank + 10, "here", 100 + rank, "cpu", "cpu", None, xray_address=None, off_here=("x",))
        for rank in range(size)
    }
    placements = [Placement(rank, rank + 10, "here", 100 + rank, 0, size, 0) for rank in range(size)]
    layout = WorldLayout("gloo", placements, {rank: ("127.0.0.1", "lo") for rank in range(size)})
    config = WorldConfig.build(size, backend="gloo", detach=True, idle_limit=60)
    provisioner = SimpleNamespace(
        config=config,
        cluster=SimpleNamespace(cluster_id=world_id, profile_dir=str(profile)),
        controller_pid=os.getpid(),
        template_pid=None,
    )
    if notebook:
        os.environ["JPY_SESSION_NAME"] = notebook
    try:
        world = SimpleNamespace(
            provisioner=provisioner, ranks=ranks, layout=layout, private_dir=str(tmp_path / world_id)
        )
        detached.record(world)  # type: ignore[arg-type]
    finally:
        os.environ.pop("JPY_SESSION_NAME", None)
    return world


def test_an_entry_is_private_and_gives_back_the_world_it_recorded(tmp_path: Path, registry: Path) -> None:
    world = running_world(tmp_path, "w1", size=3, notebook="train.ipynb")
    path = registry / "w1.json"
    assert stat.S_IMODE(registry.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in registry.iterdir()] == ["w1.json"], "no temporary file is left"
    entry = wire.read_entry(path)
    assert entry is not None
    assert detached.ranks_of(entry) == world.ranks
    assert WorldLayout(*detached.layout_of(entry)) == world.layout
    assert entry["notebook"] == os.path.abspath("train.ipynb")
    assert (entry["attached_pid"], entry["attached_started"]) == (os.getpid(), started_at(os.getpid()))
    assert detached.attached_kernel(entry) == os.getpid()
    # recorded again (a heal): when and where it started stay
    detached.record(world)  # type: ignore[arg-type]
    again = wire.read_entry(path)
    assert again is not None and (again["started"], again["notebook"]) == (entry["started"], entry["notebook"])


def test_a_reused_pid_is_not_an_attached_kernel(tmp_path: Path, registry: Path) -> None:
    running_world(tmp_path, "w1")
    entry = wire.read_entry(registry / "w1.json")
    assert entry is not None
    assert detached.attached_kernel({**entry, "attached_started": "1"}) is None  # type: ignore[typeddict-item]
    assert detached.attached_kernel({**entry, "attached_pid": gone_pid()}) is None  # type: ignore[typeddict-item]


def test_a_stale_entry_is_removed_with_its_private_folder(tmp_path: Path, registry: Path) -> None:
    running_world(tmp_path, "alive")
    running_world(tmp_path, "stale")
    path = registry / "stale.json"
    entry = wire.read_entry(path)
    assert entry is not None
    folder = Path(tempfile.gettempdir()) / f"ddp-notebook-test-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    wire.write_private(path, {**entry, "controller_pid": gone_pid(), "rank_pids": [], "private_dir": str(folder)})
    assert [entry["id"] for entry in detached.worlds()] == ["alive"]
    assert not path.exists() and not folder.exists()


def test_a_world_of_another_machine_sharing_the_home_is_listed_never_removed(tmp_path: Path, registry: Path) -> None:
    """A home shared between machines (NFS on a cluster's login nodes) shares the registry: only the
    machine a world runs on may declare it gone; the others list it with its host."""
    running_world(tmp_path, "here")
    entry = wire.read_entry(registry / "here.json")
    assert entry is not None and (entry["host"], entry["boot"]) == this_machine()
    # another machine's world: PIDs that mean nothing here, a folder that is not here
    other = {**entry, "id": "there", "host": "login2", "controller_pid": gone_pid(), "rank_pids": [gone_pid()]}
    wire.write_private(registry / "there.json", other)
    assert [e["id"] for e in detached.worlds()] == ["here", "there"]
    assert (registry / "there.json").exists()
    table = detached.describe(detached.worlds())
    row = next(line for line in table.splitlines() if line.startswith("there"))
    assert "on login2" in row, table
    assert table.splitlines()[-1] == "a world on login2 is attached to from a kernel on that machine"
    with pytest.raises(DDPUsageError) as refused:
        detached.choose("there")
    assert str(refused.value) == (
        f"detached world there runs on login2, not on this machine ({this_machine()[0]}): "
        "attach to it from a kernel on login2"
    )
    assert detached.choose(None)["id"] == "here", "only this machine's worlds are chosen"
    (registry / "here.json").unlink()
    with pytest.raises(DDPUsageError, match=r"running on this machine .*; on other machines: .*there \(2 ranks, from "):
        detached.choose(None)


def test_an_entry_from_before_this_machines_last_boot_is_stale_whatever_its_pids(
    tmp_path: Path, registry: Path
) -> None:
    running_world(tmp_path, "before-boot")
    path = registry / "before-boot.json"
    entry = wire.read_entry(path)
    assert entry is not None and detached.alive(entry), "its controller (this process) runs"
    # the same PIDs, alive now, but written before a boot: another process has them
    wire.write_private(path, {**entry, "boot": "0" * 32, "rank_pids": [os.getpid()]})
    assert detached.worlds() == [] and not path.exists()
    # an entry written before hosts were recorded is this machine's, judged by its PIDs
    running_world(tmp_path, "old-entry")
    old = wire.read_entry(registry / "old-entry.json")
    assert old is not None
    wire.write_private(registry / "old-entry.json", {k: v for k, v in old.items() if k not in ("host", "boot")})
    assert [e["id"] for e in detached.worlds()] == ["old-entry"]


def test_the_world_to_attach_to_is_chosen_or_named_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DDPUsageError, match="no detached world of yours is running"):
        detached.choose(None)
    running_world(tmp_path, "1700000000-aaaa", notebook="a.ipynb")
    assert detached.choose(None)["id"] == "1700000000-aaaa", "the user's only one, from any notebook"
    time.sleep(0.01)
    running_world(tmp_path, "1700000001-bbbb", notebook="b.ipynb")
    with pytest.raises(DDPUsageError) as many:
        detached.choose(None)
    said = str(many.value)
    assert "2 detached worlds of yours run, none from this notebook" in said and "--world ID" in said
    assert "1700000000-aaaa (2 ranks, from a.ipynb)" in said and "\n" not in said
    monkeypatch.setenv("JPY_SESSION_NAME", "a.ipynb")
    assert detached.choose(None)["id"] == "1700000000-aaaa", "this notebook's own"
    assert detached.choose("1700000001-bbbb")["id"] == "1700000001-bbbb"
    assert detached.choose("1700000001")["id"] == "1700000001-bbbb", "a unique start of the id"
    with pytest.raises(DDPUsageError, match="2 detached worlds of yours has the id '17000'"):
        detached.choose("17000")
    with pytest.raises(DDPUsageError, match="no detached world of yours has the id 'nope'; pick one"):
        detached.choose("nope")


def test_the_listing_says_state_idle_time_and_notebook(tmp_path: Path) -> None:
    assert "no detached world of yours is running" in detached.describe([])
    world = running_world(tmp_path, "w1", notebook="/home/u/train.ipynb")
    (entry,) = detached.worlds()
    assert "attached" in detached.describe([entry]), "this process is the kernel attached"
    now = time.time()
    wire.write_private(
        Path(world.private_dir) / wire.STATUS_FILE, {"busy": False, "attached": False, "idle_since": now - 20}
    )
    gone = {**entry, "attached_pid": 0}
    table = detached.describe([gone], now=now)  # type: ignore[list-item]
    header, row, hint = table.splitlines()
    assert header.split() == ["world", "ranks", "state", "started", "idle", "for", "notebook"]
    assert row.split()[:4] == ["w1", "2", "gloo", "idle"]
    assert "20 s (ends in 40 s)" in row and row.endswith("train.ipynb")
    assert "%ddp_attach --world ID" in hint
    wire.write_private(Path(world.private_dir) / wire.STATUS_FILE, {"busy": True, "attached": False, "idle_since": now})
    assert detached.state_of(gone, now) == ("running a cell", "-")  # type: ignore[arg-type]


def test_attaching_again_keeps_the_worlds_settings(tmp_path: Path) -> None:
    running_world(tmp_path, "w1", size=3)
    (entry,) = detached.worlds()
    settings = detached.attach_config(entry)
    assert settings.launch.attach == AttachTarget(url_file=entry["connection_file"], world="w1")
    assert (settings.n_ranks, settings.backend, settings.detach, settings.idle_limit) == (3, "gloo", True, 60)
    assert settings.timeout == WorldConfig.build(3, backend="gloo").timeout


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"launcher": "mpi"}, "--detach keeps ranks started on this machine (--launcher local)"),
        ({"launcher": "ssh", "hosts": "a:2"}, "ranks started with --launcher ssh belong to that launcher's job"),
        ({"attach": AttachTarget(profile="p")}, "an attached cluster's engines outlive it already"),
        ({"idle_limit": 0}, "idle limit must be a number of seconds > 0"),
    ],
)
def test_a_world_that_cannot_be_detached_is_one_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DDPUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WorldConfig.build(2, detach=True, **options)


def test_a_detached_world_forks_its_ranks_warm_and_waits_an_hour_by_default() -> None:
    settings = WorldConfig.build(2, backend="gloo", detach=True)
    assert settings.detach and settings.warm_start and settings.idle_limit == DEFAULT_IDLE_LIMIT == 3600
    assert not WorldConfig.build(2, backend="gloo", detach=True, warm_start=False).warm_start
    assert not WorldConfig.build(2, backend="gloo").detach


def test_magic_misuse_of_detached_worlds_is_one_line() -> None:
    from ddp_notebook.magics.core import DDPMagics

    magics = DDPMagics(start_ipython())
    for line, message in [
        ("--world nope", "no detached world of yours has the id 'nope'"),
        ("", "no detached world of yours is running (start one with %ddp_start N --detach"),
    ]:
        with pytest.raises(UsageError, match=message.replace("(", r"\(")):
            magics.ddp_attach(line)
    with pytest.raises(UsageError, match="--detach keeps ranks started on this machine"):
        magics.ddp_start("2 --detach --launcher mpi")
    assert magics.world is None


class FakeHub:
    """What the idle watch asks of the hub: queue_status, as ipyparallel answers it."""

    def __init__(self) -> None:
        self.pending = 0

    def queue_status(self) -> dict[Any, Any]:
        return {0: {"queue": self.pending, "completed": 3, "tasks": 0}, 1: {"queue": 0, "completed": 3, "tasks": 0}}


def test_the_idle_limit_counts_from_the_last_cell_or_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    running_world(tmp_path, "w1")
    entry_file = wire.entry_path("w1")
    watch = idle_limit.IdleWatch(entry_file, limit=0.6, private_dir=str(tmp_path / "w1"))
    hub = watch.client = FakeHub()
    ended: list[float] = []
    monkeypatch.setattr(watch, "end", lambda entry: ended.append(time.time()))
    began = time.time()
    # this process is the attached kernel: the world is never idle while it lives
    entry = wire.read_entry(entry_file)
    assert entry is not None and idle_limit.kernel_attached(entry)
    wire.write_private(entry_file, {**entry, "attached_pid": gone_pid()})
    hub.pending = 1  # a cell runs on rank 0
    monkeypatch.setattr(idle_limit, "CHECK_SECONDS", 0.2)

    def cell_ends_after_a_second() -> None:
        time.sleep(1.0)
        hub.pending = 0

    import threading

    threading.Thread(target=cell_ends_after_a_second, daemon=True).start()
    watch.run()
    assert ended and ended[0] - began >= 1.0 + 0.6 - 0.25, "the limit counts from the cell's end"
    status = wire.read_status(str(tmp_path / "w1"))
    assert status is not None and not status["busy"] and not status["attached"]


def test_on_jupyterhub_the_world_ends_with_the_users_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp_notebook.world.detached import environment

    monkeypatch.delenv("JUPYTERHUB_USER", raising=False)
    assert wire.SERVER_ENV not in environment("w1", 60)
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    monkeypatch.setenv("JPY_PARENT_PID", str(os.getppid()))  # what jupyter_client tells a kernel it starts
    told = environment("w1", 60)
    assert told[wire.SERVER_ENV] == f"{os.getppid()}:{started_at(os.getppid())}", "the kernel's launcher: the server"
    assert (told[wire.DETACHED_ENV], told[wire.IDLE_LIMIT_ENV]) == (str(wire.entry_path("w1")), "60")
    running_world(tmp_path, "w1")  # attached (this process): it would never be idle
    watch = idle_limit.IdleWatch(wire.entry_path("w1"), limit=3600, private_dir=None)
    watch.client = FakeHub()
    ended: list[object] = []
    monkeypatch.setattr(watch, "end", ended.append)
    watch.server = (os.getpid(), started_at(os.getpid()))
    monkeypatch.setattr(idle_limit.time, "sleep", lambda seconds: watch.__dict__.update(server=(gone_pid(), "1")))
    began = time.monotonic()
    watch.run()
    assert len(ended) == 1 and time.monotonic() - began < 1.0


def test_the_users_server_is_the_kernels_launcher_among_its_ancestors(monkeypatch: pytest.MonkeyPatch) -> None:
    """JPY_PARENT_PID names the server where it is an ancestor (a wrapper shell between them too);
    else a parent running a Jupyter server; else none, and the note says what that means."""
    from ddp_notebook.platform.processes import ancestors
    from ddp_notebook.world import users_server
    from ddp_notebook.world.users_server import UsersServer, find_users_server

    above = ancestors(os.getpid())
    assert above[0] == os.getppid() and len(above) >= 2
    monkeypatch.setenv("JPY_PARENT_PID", str(above[1]))  # the grandparent: a shell runs between
    assert find_users_server() == UsersServer(above[1])
    assert find_users_server().ends_the_world() == f", or when your server stops (PID {above[1]})"
    monkeypatch.setenv("JPY_PARENT_PID", str(gone_pid()))  # not an ancestor: another process's word
    lookup = find_users_server()
    assert lookup.pid is None and lookup.parent.startswith(f"PID {os.getppid()}, "), lookup
    assert lookup.ends_the_world().startswith("; your server's stop does not end it: the Jupyter server was not")
    monkeypatch.delenv("JPY_PARENT_PID")
    monkeypatch.setattr(
        users_server,
        "command_line",
        lambda pid: "/opt/conda/bin/python3 /opt/conda/bin/jupyterhub-singleuser --ip=0.0.0.0",
    )
    assert find_users_server() == UsersServer(os.getppid())  # a parent that is a Jupyter server
    long_wrapper = "/bin/bash " + "/opt/site/kernels/" * 10 + "start.sh"
    monkeypatch.setattr(users_server, "command_line", lambda pid: long_wrapper)
    shown = find_users_server().parent
    assert len(shown) <= len(f"PID {os.getppid()}, ") + users_server.SHOWN_COMMAND and shown.endswith("..."), shown
