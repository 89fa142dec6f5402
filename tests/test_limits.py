"""The machine's limits: read from sample cgroup trees, applied before a world starts, watched
while it runs; and one real cgroup with a memory limit that a rank runs into."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddp_notebook.cell.relay import OutputSink
from ddp_notebook.errors import DDPUsageError
from ddp_notebook.platform import devices, limits
from ddp_notebook.platform.limits import MIB, Cgroup, GpuInfo, MemoryLimit, OomCounts, Platform
from ddp_notebook.platform.processes import describe_exit
from ddp_notebook.wire.results import MemoryReading, RankInfo, RankStatus
from ddp_notebook.world.config import RANK_MEMORY_BYTES, WorldConfig
from ddp_notebook.world.report import format_status
from ddp_notebook.world.supervision import MemoryWatch
from tests.support import memory_cgroup
from tests.support.processes import owned_pids, wait_gone

GIB = 1 << 30
MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:   12288000 kB\n"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def mountinfo(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"


# ---------------------------------------------------------------------- reading the limits


def test_cgroup_v2_in_a_container_quota_and_memory_limit(tmp_path: Path) -> None:
    # a Kubernetes pod with its own cgroup namespace: it sees its cgroup as the root
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo("22 1 0:21 / / rw - overlay overlay rw", V2_MOUNT),
            "/proc/self/cgroup": "0::/\n",
            "/proc/meminfo": MEMINFO,
            "/sys/fs/cgroup/cpu.max": "150000 100000\n",
            "/sys/fs/cgroup/memory.max": f"{2 * GIB}\n",
            "/sys/fs/cgroup/memory.current": f"{900 * MIB}\n",
            "/sys/fs/cgroup/memory.stat": f"anon 500000000\ninactive_file {100 * MIB}\nactive_file 1000\n",
            "/sys/fs/cgroup/memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        },
    )
    platform = Platform(tmp_path, affinity=8)
    assert platform.cpu_quota() == 1.5
    assert platform.usable_cpus() == 2  # 1.5 cores rounded up, not the node's 8
    limit = platform.memory_limit()
    assert limit is not None and limit.cgroup is not None
    # the inactive page cache is reclaimed before any kill: not counted as used
    assert (limit.limit, limit.used, limit.available) == (2 * GIB, 800 * MIB, 2 * GIB - 800 * MIB)
    assert limit.describe() == "the cgroup memory limit of 2.0 GiB"
    assert platform.oom_counts().cgroups[0][1] == 1


def test_cgroup_v2_on_a_host_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    scope = "/sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope"
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo(V2_MOUNT),
            "/proc/self/cgroup": "0::/user.slice/user-1000.slice/session-3.scope\n",
            "/proc/meminfo": MEMINFO,
            f"{scope}/memory.max": "max\n",
            f"{scope}/memory.current": f"{100 * MIB}\n",
            f"{scope}/cpu.max": "max 100000\n",
            "/sys/fs/cgroup/user.slice/user-1000.slice/memory.max": f"{4 * GIB}\n",
            "/sys/fs/cgroup/user.slice/user-1000.slice/memory.current": f"{3 * GIB}\n",
            "/sys/fs/cgroup/user.slice/user-1000.slice/cpu.max": "200000 100000\n",
            "/sys/fs/cgroup/user.slice/memory.max": f"{8 * GIB}\n",
            "/sys/fs/cgroup/user.slice/memory.current": f"{3 * GIB}\n",
        },
    )
    platform = Platform(tmp_path, affinity=16)
    names = [c.name for c in platform.cgroups("memory")]
    assert names == ["/user.slice/user-1000.slice/session-3.scope", "/user.slice/user-1000.slice", "/user.slice", "/"]
    assert platform.usable_cpus() == 2
    limit = platform.memory_limit()
    assert limit is not None and limit.cgroup is not None
    assert limit.cgroup.name == "/user.slice/user-1000.slice" and limit.available == GIB


def test_cgroup_v1_hybrid_quota_in_cpu_cpuacct_and_no_memory_limit(tmp_path: Path) -> None:
    # as on this project's VMs: v1 controllers, an empty unified hierarchy beside them
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo(
                "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct",
                "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory",
                "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
            ),
            "/proc/self/cgroup": "4:memory:/jobs/abc\n2:cpu,cpuacct:/jobs/abc\n0::/\n",
            "/proc/meminfo": MEMINFO,
            "/proc/vmstat": "pgfault 12\noom_kill 4\n",
            "/sys/fs/cgroup/cpu,cpuacct/jobs/abc/cpu.cfs_quota_us": "50000\n",
            "/sys/fs/cgroup/cpu,cpuacct/jobs/abc/cpu.cfs_period_us": "100000\n",
            "/sys/fs/cgroup/cpu,cpuacct/jobs/cpu.cfs_quota_us": "-1\n",
            "/sys/fs/cgroup/cpu,cpuacct/jobs/cpu.cfs_period_us": "100000\n",
            "/sys/fs/cgroup/memory/jobs/abc/memory.limit_in_bytes": "9223372036854771712\n",
            "/sys/fs/cgroup/memory/jobs/abc/memory.usage_in_bytes": f"{GIB}\n",
            "/sys/fs/cgroup/memory/jobs/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            "/sys/fs/cgroup/unified/cgroup.controllers": "\n",
        },
    )
    platform = Platform(tmp_path, affinity=2)
    assert [c.version for c in platform.cgroups("memory")] == [1, 1, 1]
    assert platform.cpu_quota() == 0.5 and platform.usable_cpus() == 1
    limit = platform.memory_limit()
    # "no limit" (LONG_MAX) leaves the machine's memory as the limit
    assert limit == MemoryLimit(16384000 * 1024, (16384000 - 12288000) * 1024, "this machine")
    assert limit.describe() == "this machine's 15.6 GiB"
    counts = platform.oom_counts()
    assert [n for _, n in counts.cgroups] == [2] and counts.system == 4


def test_cgroup_v1_container_view_of_its_own_cgroup(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc says /docker/ID, the mount shows that cgroup as its root
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo(
                "35 31 0:32 /docker/f00 /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory"
            ),
            "/proc/self/cgroup": "9:memory:/docker/f00\n",
            "/proc/meminfo": MEMINFO,
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GIB}\n",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{300 * MIB}\n",
            "/sys/fs/cgroup/memory/memory.stat": f"inactive_file 1\ntotal_inactive_file {50 * MIB}\n",
        },
    )
    chain = Platform(tmp_path).cgroups("memory")
    assert [(c.directory, c.name) for c in chain] == [(tmp_path / "sys/fs/cgroup/memory", "/docker/f00")]
    limit = Platform(tmp_path).memory_limit()
    assert limit is not None and (limit.limit, limit.used) == (GIB, 250 * MIB)


def test_without_cgroups_or_proc_only_the_affinity_mask_counts(tmp_path: Path) -> None:
    platform = Platform(tmp_path, affinity=3)
    assert platform.cgroups("memory") == [] and platform.cpu_quota() is None
    assert platform.usable_cpus() == 3 and platform.memory_limit() is None
    assert platform.oom_since(platform.oom_counts()).killed is None  # nothing to tell from


def test_mount_points_with_escaped_spaces(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo("30 23 0:26 / /sys/fs/my\\040cgroups rw - cgroup2 cgroup2 rw"),
            "/proc/self/cgroup": "0::/a\n",
            "/sys/fs/my cgroups/a/cpu.max": "100000 100000\n",
        },
    )
    assert Platform(tmp_path, affinity=4).usable_cpus() == 1


def test_out_of_memory_kills_are_told_from_the_counters(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo(V2_MOUNT),
            "/proc/self/cgroup": "0::/pod\n",
            "/proc/vmstat": "oom_kill 7\n",
            "/sys/fs/cgroup/pod/memory.max": f"{GIB + GIB // 2}\n",
            "/sys/fs/cgroup/pod/memory.events": "oom 0\noom_kill 0\n",
        },
    )
    platform = Platform(tmp_path)
    before = platform.oom_counts()
    assert platform.oom_since(before) == limits.OomVerdict(False)
    # someone else's kill on the machine: our cgroup's counter, which counts the machine-wide
    # killer's kills too, did not move (a second test worker's out-of-memory test does this)
    write(tmp_path, {"/proc/vmstat": "oom_kill 8\n"})
    assert platform.oom_since(before) == limits.OomVerdict(False)
    write(tmp_path, {"/sys/fs/cgroup/pod/memory.events": "oom 1\noom_kill 1\n"})
    assert platform.oom_since(before) == limits.OomVerdict(True, "cgroup memory limit 1.5 GiB reached")
    # no cgroup counters at all: the machine's counter is all there is
    assert platform.oom_since(OomCounts((), 7)) == limits.OomVerdict(True, "the machine ran out of memory")
    assert platform.oom_since(OomCounts((), 8)) == limits.OomVerdict(False)
    assert platform.oom_since(OomCounts((), None)) == limits.OomVerdict(None)


def test_a_kill_in_a_sibling_cgroup_is_not_ours(tmp_path: Path) -> None:
    """v2 counts a kill in every ancestor of the victim's cgroup: a sibling's moves the parent's
    counter, never ours."""
    write(
        tmp_path,
        {
            "/proc/self/mountinfo": mountinfo(V2_MOUNT),
            "/proc/self/cgroup": "0::/pod/world\n",
            "/proc/vmstat": "oom_kill 0\n",
            "/sys/fs/cgroup/pod/memory.max": f"{GIB}\n",
            "/sys/fs/cgroup/pod/memory.events": "oom 0\noom_kill 0\n",
            "/sys/fs/cgroup/pod/world/memory.events": "oom 0\noom_kill 0\n",
        },
    )
    platform = Platform(tmp_path)
    before = platform.oom_counts()
    write(tmp_path, {"/sys/fs/cgroup/pod/memory.events": "oom 1\noom_kill 1\n", "/proc/vmstat": "oom_kill 1\n"})
    assert platform.oom_since(before) == limits.OomVerdict(False)
    write(tmp_path, {"/sys/fs/cgroup/pod/world/memory.events": "oom 1\noom_kill 1\n"})
    assert platform.oom_since(before) == limits.OomVerdict(True, "cgroup memory limit 1.0 GiB reached")


def test_a_kill_after_an_out_of_memory_kill_is_named_for_itself(tmp_path: Path) -> None:
    """The fault storm found it: once the killer had struck in the world's cgroup, every later
    SIGKILL (a user's kill -9) was named an out-of-memory kill. Each death is judged on the kills
    since the last one named, and a death named once stays named the same."""
    from ddp_notebook.world.provisioning.local import LocalProvisioner

    files = {
        "/proc/self/mountinfo": mountinfo(V2_MOUNT),
        "/proc/self/cgroup": "0::/pod\n",
        "/proc/vmstat": "oom_kill 0\n",
        "/sys/fs/cgroup/pod/memory.max": f"{GIB}\n",
        "/sys/fs/cgroup/pod/memory.events": "oom 0\noom_kill 0\n",
    }
    write(tmp_path, files)
    provisioner = LocalProvisioner(WorldConfig.build(2, backend="gloo", warm_start=False), "/private")
    provisioner.platform = Platform(tmp_path)
    provisioner.oom_before = provisioner.platform.oom_counts()
    exits: dict[int, int] = {}
    provisioner.exit_of = lambda _set, pid=None: (exits[pid], "") if pid in exits else None  # type: ignore[method-assign]

    def rank(number: int, pid: int) -> RankInfo:
        return RankInfo(rank=number, engine_id=number, host="h", pid=pid, device="cpu", device_name="cpu", gpu=None)

    exits[100] = -signal.SIGKILL  # rank 1 grows into the limit: the killer's
    write(tmp_path, {"/sys/fs/cgroup/pod/memory.events": "oom 1\noom_kill 1\n", "/proc/vmstat": "oom_kill 1\n"})
    first = provisioner.dead_ranks([rank(0, 50), rank(1, 100)])
    assert list(first) == [1] and "out-of-memory killer (cgroup memory limit 1.0 GiB" in first[1].how
    assert provisioner.dead_ranks([rank(1, 100)])[1] == first[1]  # asked again: the same death
    exits[101] = -signal.SIGKILL  # its replacement, then killed from outside: no new kill counted
    assert provisioner.dead_ranks([rank(0, 50), rank(1, 101)])[1].how == "was killed by SIGKILL"


def test_how_a_rank_died_names_the_out_of_memory_killer_only_when_it_struck() -> None:
    kill = -signal.SIGKILL
    assert describe_exit(kill) == "was killed by SIGKILL (often the out-of-memory killer)"  # cannot tell
    assert describe_exit(kill, limits.OomVerdict(False)) == "was killed by SIGKILL"
    oom = limits.OomVerdict(True, "cgroup memory limit 1.0 GiB reached")
    assert describe_exit(kill, oom) == "was killed by the out-of-memory killer (cgroup memory limit 1.0 GiB reached)"
    assert describe_exit(3, oom) == "exited with code 3"


def test_gpu_query_is_parsed_and_matched_to_visible_entries() -> None:
    text = (
        "0, GPU-aaaa1111, NVIDIA H100 80GB HBM3, 81559, 5\n"
        "1, GPU-bbbb2222, NVIDIA H100 80GB HBM3, 81559, 1024\n"
        "2, GPU-cccc3333, NVIDIA H100 80GB HBM3, [N/A], [N/A]\n"
    )
    found = limits.parse_gpu_query(text)
    assert found[1] == GpuInfo("1", "GPU-bbbb2222", "NVIDIA H100 80GB HBM3", 81559.0, 1024.0) and len(found) == 2
    assert [g.index for g in limits.select_gpus(found, ["1", "GPU-aaaa"])] == ["1", "0"]
    assert limits.select_gpus(found, None) == tuple(found)


# ---------------------------------------------------------------------- worlds that fit


@pytest.fixture
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 cores, 3 GiB of which 2 GiB free, no GPU."""
    monkeypatch.setattr(devices, "visible_gpus", lambda: ())
    monkeypatch.setattr(devices, "usable_cpus", lambda: 2)
    monkeypatch.setattr(devices, "memory_limit", lambda: MemoryLimit(3 * GIB, GIB, "this machine"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_a_world_too_big_for_the_memory_is_refused_with_what_fits(small_machine: None) -> None:
    began = time.monotonic()
    with pytest.raises(DDPUsageError) as refused:
        WorldConfig.build(8, backend="gloo")
    assert time.monotonic() - began < 1.0
    message = str(refused.value)
    assert "\n" not in message
    held = 2 * GIB // RANK_MEMORY_BYTES
    assert "8 CPU ranks do not fit here" in message and "2.0 GiB is free of this machine's 3.0 GiB" in message
    assert f"start at most {min(held, 4)} (%ddp_start {min(held, 4)})" in message and "--force" in message
    assert WorldConfig.build(8, backend="gloo", force=True).n_ranks == 8


def test_a_cpu_world_far_above_the_cores_is_refused(small_machine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "memory_limit", lambda: MemoryLimit(64 * GIB, GIB, "this machine"))
    assert WorldConfig.build(4).n_ranks == 4  # twice the cores, as a small test of a larger layout
    with pytest.raises(DDPUsageError, match=r"^5 CPU ranks do not fit here: 2 cores take at most 4 CPU ranks; start"):
        WorldConfig.build(5)
    assert WorldConfig.build(5, force=True).threads_per_rank == 1


def test_defaults_follow_the_cores_and_the_memory(small_machine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = WorldConfig.build()
    assert (cfg.n_ranks, cfg.threads_per_rank) == (2, 1)
    monkeypatch.setattr(devices, "memory_limit", lambda: MemoryLimit(GIB, GIB - RANK_MEMORY_BYTES, "this machine"))
    assert WorldConfig.build().n_ranks == 1  # one rank's worth of memory left


def test_gpus_that_do_not_exist_are_an_error(small_machine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DDPUsageError, match=r"--gpus 0,1: no GPU is visible on this machine; leave out --gpus"):
        WorldConfig.build(2, gpus="0,1", backend="gloo")
    monkeypatch.setattr(devices, "visible_gpus", lambda: ("0", "1"))
    with pytest.raises(DDPUsageError, match=r"GPU\(s\) 5 not visible; visible: 0,1"):
        WorldConfig.build(gpus="0,5")


def test_ranks_elsewhere_are_not_checked_against_this_machine(small_machine: None) -> None:
    assert WorldConfig.build(64, launcher="mpi").n_ranks == 64


# ---------------------------------------------------------------------- watching a running world


class FakePlatform(Platform):
    """A platform whose memory use the test sets."""

    def __init__(self) -> None:
        super().__init__("/nonexistent")
        self.used = 0
        self.resident: dict[int, int] = {}

    def cgroups(self, controller: str, pid: int | str = "self") -> list[Cgroup]:
        return []

    def memory_limit(self, pid: int | str = "self", chain: object = None) -> MemoryLimit:
        return MemoryLimit(1000 * MIB, self.used, "cgroup memory limit", Cgroup(Path("/x"), "/x", 2))

    def resident_bytes(self, pid: int) -> int | None:
        return self.resident.get(pid)


def _ranks() -> list[RankInfo]:
    import socket

    here = socket.gethostname()
    return [RankInfo(r, r, here, 100 + r, "cpu", "cpu", None) for r in (0, 1)]


def test_the_memory_warning_names_the_rank_that_grew_once_per_crossing() -> None:
    platform = FakePlatform()
    watch = MemoryWatch(platform)
    ranks = _ranks()
    steps = [
        (500, {100: 200, 101: 200}, False),
        (800, {100: 210, 101: 450}, False),
        (920, {100: 220, 101: 560}, True),  # crosses 90%: one warning
        (990, {100: 220, 101: 600}, False),  # still above: no second line
        (880, {100: 220, 101: 500}, False),  # between 85% and 90%: not re-armed
        (950, {100: 220, 101: 580}, False),
        (700, {100: 220, 101: 300}, False),  # below 85%: re-armed
        (910, {100: 500, 101: 300}, True),
    ]
    warnings = []
    for used, resident, warns in steps:
        platform.used = used * MIB
        platform.resident = {pid: mib * MIB for pid, mib in resident.items()}
        reading = watch.check(ranks)
        assert reading is not None and (reading.warning is not None) == warns, (used, reading)
        if reading.warning:
            warnings.append(reading.warning)
    assert warnings[0] == (
        "warning: memory is 92% full (920 MiB of the cgroup memory limit of 1,000 MiB); "
        "rank 1 grew most (+360 MiB, now 560 MiB); at 100% the out-of-memory killer ends the largest process"
    )
    assert "rank 0 grew most (+280 MiB, now 500 MiB)" in warnings[1]


def test_the_warning_reaches_stderr_at_once_and_the_reading_the_live_view() -> None:
    out, err = io.StringIO(), io.StringIO()
    seen = []
    sink = OutputSink(out, err, None, None, seen.append)
    quiet = MemoryReading({0: MIB}, 100 * MIB, 1000 * MIB, "this machine's 1,000 MiB")
    loud = MemoryReading({0: MIB}, 950 * MIB, 1000 * MIB, "this machine's 1,000 MiB", warning="warning: memory")
    sink.memory(quiet)
    sink.memory(loud)
    assert err.getvalue() == "warning: memory\n" and out.getvalue() == "" and seen == [quiet, loud]


def test_status_shows_each_rank_against_the_limit() -> None:
    class World:
        world_size, backend, state, broken = 2, "gloo", "healthy", {}

    rows = [
        RankStatus(0, "idle", "h", 10, "cpu", 300.0, None, memory_limit_mb=1500.0),
        RankStatus(1, "busy", "h", 11, "cuda:0", 600.0, 2048.0, memory_limit_mb=1500.0, gpu_memory_total_mb=81559),
    ]
    reading = MemoryReading({0: 300 * MIB, 1: 600 * MIB}, 1200 * MIB, 1500 * MIB, "the cgroup memory limit of 1.5 GiB")
    text = format_status(World(), rows, reading)  # type: ignore[arg-type]
    lines = text.splitlines()
    assert lines[1] == (
        "memory: 1.2 GiB in use of the cgroup memory limit of 1.5 GiB (80%), the ranks here 900 MiB of it"
    )
    assert lines[2].split() == ["rank", "state", "host", "pid", "device", "memory", "of", "limit", "gpu", "memory"]
    assert "300 MiB  20%" in lines[3] and "600 MiB  40%       2,048 MiB of 79.6 GiB" in lines[4]


def test_the_live_status_table_has_a_memory_column() -> None:
    from ddp_notebook.live.feed import Feed, RankRow
    from ddp_notebook.live.widgets import memory_header, status_table

    feed = Feed()
    feed.ranks[0] = RankRow(0)
    assert "memory" not in status_table(feed) and memory_header(feed) == ""
    feed.memory(MemoryReading({0: 300 * MIB}, 950 * MIB, 1000 * MIB, "this machine's 1,000 MiB"))
    assert "<th>memory</th>" in status_table(feed) and "<td>300 MiB (30%)</td>" in status_table(feed)
    assert "memory 95% of this machine&#x27;s 1,000 MiB" in memory_header(feed) and "<b " in memory_header(feed)


@pytest.mark.integration
def test_the_shared_world_reports_its_memory(world: object) -> None:
    reading = world.memory()  # type: ignore[attr-defined]
    assert reading is not None and set(reading.rank_bytes) == {0, 1}
    assert 0 < reading.fraction < 1 and all(b > 10 * MIB for b in reading.rank_bytes.values())
    rows = world.status()  # type: ignore[attr-defined]
    assert all(r.memory_limit_mb and 0 < (r.memory_fraction or 0) < 1 for r in rows)


def test_a_memory_reading_is_cheap() -> None:
    """The running cell reads this once a second: it must cost well under a millisecond."""
    watch = MemoryWatch()
    ranks = [RankInfo(0, 0, __import__("socket").gethostname(), os.getpid(), "cpu", "cpu", None)]
    watch.check(ranks)  # the cgroup path is read once, then cached
    began = time.perf_counter()
    for _ in range(200):
        watch.check(ranks)
    per_check = (time.perf_counter() - began) / 200
    assert per_check < 0.005, f"{per_check * 1e6:.0f} µs per reading"


# ---------------------------------------------------------------------- a real memory limit

CELL_LIMIT = 1536 * MIB

GROW_CELL = textwrap.dedent(
    """
    import time
    from ddp_notebook.platform.limits import Platform
    if rank == 1:
        platform, held = Platform(), []
        while platform.memory_limit().fraction < 0.95:   # up to 95% of the cgroup's limit
            held.append(bytearray(16 << 20))
            time.sleep(0.02)
        time.sleep(1.6)                                  # the notebook side reads it once a second
        while True:                                      # then on, until the killer ends it
            held.append(bytearray(16 << 20))
    dist.barrier()
    """
)

WORLD_SCRIPT = textwrap.dedent(
    """
    import sys
    from ddp_notebook import DDPCluster, RankDiedError
    with DDPCluster(2, backend="gloo", collective_timeout=30) as world:
        print("started", flush=True)
        try:
            world.execute(sys.argv[1])
        except RankDiedError as error:
            print("DIED:", error, flush=True)
    print("stopped", flush=True)
    """
)


def memory_cgroup_for_test(limit: int) -> tuple[Cgroup, str]:
    """A new memory cgroup with `limit`, where this process may put a child: (it, its cgroup.procs)."""
    try:
        cgroup, _ = memory_cgroup.make(f"ddp-notebook-test-{os.getpid()}", limit)
    except memory_cgroup.Unavailable as why:
        pytest.skip(str(why))
    return cgroup, str(cgroup.directory / "cgroup.procs")


@pytest.mark.integration
def test_a_rank_growing_into_a_cgroup_limit_is_warned_about_then_named_out_of_memory(tmp_path: Path) -> None:
    cgroup, procs = memory_cgroup_for_test(CELL_LIMIT)
    script = tmp_path / "world.py"
    script.write_text(WORLD_SCRIPT)

    def enter_cgroup() -> None:  # in the child, before it runs Python: all it starts lands there too
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))

    process = None
    try:
        try:
            process = subprocess.Popen(
                [sys.executable, str(script), GROW_CELL],
                cwd=Path(__file__).resolve().parent.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=enter_cgroup,
                start_new_session=True,
            )
        except subprocess.SubprocessError as failure:
            pytest.skip(f"cannot move a process into {cgroup.directory}: {failure}")
        try:
            out, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate(timeout=10)
            pytest.fail(f"the world did not end within 120 s:\n{out}\n{err}")
        assert process.returncode == 0, f"{out}\n{err}"
        assert "started" in out and "stopped" in out, f"{out}\n{err}"
        warnings = [line for line in err.splitlines() if line.startswith("warning: memory is")]
        assert len(warnings) == 1, err
        assert "of the cgroup memory limit of 1.5 GiB" in warnings[0] and "rank 1 grew most" in warnings[0]
        died = [line for line in out.splitlines() if line.startswith("DIED:")]
        assert died and (
            "rank 1 was killed by the out-of-memory killer (cgroup memory limit 1.5 GiB reached)" in died[0]
        ), f"{out}\n{err}"
        assert (cgroup.oom_kills() or 0) >= 1
    finally:
        if process is not None:
            assert wait_gone(sorted(owned_pids(process.pid))) == [], "processes of the world outlived it"
        memory_cgroup.remove(cgroup.directory)
