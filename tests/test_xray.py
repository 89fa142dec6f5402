"""Collective X-ray: what each rank ran and waits in, and mismatched collectives ended in seconds."""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_notebook import DDPCluster, RankError
from ddp_notebook.cell.xray import CollectiveMismatchError, MismatchWatch, Reach, find_mismatch
from ddp_notebook.live.stragglers import StepTimes, find_straggler
from ddp_notebook.live.xray_readings import Collective, RankCollectives
from ddp_notebook.rank.timing import StepClock
from ddp_notebook.wire import xray as xray_wire
from ddp_notebook.wire.results import RankInfo
from tests.support.worlds import shared_world

# ---------------------------------------------------------------- the wire to other hosts (pure logic)


def test_a_signature_binds_the_key_the_challenge_the_direction_and_every_field() -> None:
    key, challenge = os.urandom(xray_wire.KEY_BYTES), xray_wire.new_challenge()
    request = {"ask": "debug", "line": "p x", "full": False}
    message = xray_wire.signed(key, challenge, xray_wire.ASK, request)
    assert xray_wire.verified(key, challenge, xray_wire.ASK, message) == request
    assert xray_wire.verified(os.urandom(xray_wire.KEY_BYTES), challenge, xray_wire.ASK, message) is None
    assert xray_wire.verified(key, xray_wire.new_challenge(), xray_wire.ASK, message) is None  # a replay
    assert xray_wire.verified(key, challenge, xray_wire.ANSWER, message) is None  # a request is no answer
    assert xray_wire.verified(key, challenge, xray_wire.ASK, {**message, "line": "import os"}) is None
    assert xray_wire.verified(key, challenge, xray_wire.ASK, request) is None  # unsigned
    assert xray_wire.verified(key, challenge, xray_wire.ASK, ["not", "a", "request"]) is None


def test_the_world_key_is_made_once_and_only_its_user_reads_it(tmp_path: Path) -> None:
    key = xray_wire.world_key(str(tmp_path))
    assert len(key) == xray_wire.KEY_BYTES
    assert xray_wire.world_key(str(tmp_path)) == key
    (path,) = tmp_path.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_ranks_here_are_reached_by_their_socket_and_ranks_elsewhere_over_tcp_with_the_key(tmp_path: Path) -> None:
    def info(rank: int, host: str, address: tuple[str, int] | None) -> RankInfo:
        return RankInfo(rank, rank, host, 100 + rank, "cpu", "cpu", None, xray_address=address)

    here = socket.gethostname()
    local = Reach.of(str(tmp_path), [info(0, here, None), info(1, here, None)])
    assert local.remote == {} and local.key == b""
    spread = Reach.of(str(tmp_path), [info(0, here, None), info(1, "node2", ("10.0.0.2", 4000))])
    assert spread.remote == {1: ("10.0.0.2", 4000)}
    assert spread.key == xray_wire.world_key(str(tmp_path))


# a rank process's X-ray server over TCP, as a rank on another host runs it
RANK_SERVER = """
import sys, time
from ddp_notebook.rank import xray
address = xray.serve_tcp("127.0.0.1", bytes.fromhex(sys.argv[1]))
print(address[0], address[1], flush=True)
for line in sys.stdin:  # "release": what a blocked rank does when the notebook releases it
    print(xray.release_connections(), flush=True)
time.sleep(120)
"""


def test_a_watched_rank_elsewhere_is_named_as_soon_as_its_process_ends(tmp_path: Path) -> None:
    """The rank holds the signed watch connection open for its life; its end closes it."""
    import subprocess
    import sys

    from ddp_notebook.cell.xray import ProcessWatch, _verdict, _watch
    from ddp_notebook.rank.xray import MAX_WATCHERS

    key = xray_wire.world_key(str(tmp_path))
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SERVER, key.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    watch, stranger = ProcessWatch(), ProcessWatch()
    others: list = []
    try:
        addresses = []
        for process in ranks:
            host, port = (process.stdout.readline() if process.stdout else "").split()
            addresses.append((host, int(port)))
        infos = [
            RankInfo(r, r, "node2", process.pid, "cpu", "cpu", None, xray_address=address)
            for r, (process, address) in enumerate(zip(ranks, addresses))
        ]
        reach = Reach(str(tmp_path), dict(enumerate(addresses)), key)
        watch.watch(reach, infos)  # as the world forms
        assert len(watch._held) == 2
        assert watch.ended(reach, infos) == {}
        time.sleep(0.3)
        assert watch.ended(reach, infos) == {}  # alive: the connections stay open and quiet
        # a released rank shuts its group's connections, not the notebook's watch
        assert ranks[0].stdin is not None and ranks[0].stdout is not None
        ranks[0].stdin.write("release\n")
        ranks[0].stdin.flush()
        ranks[0].stdout.readline()
        time.sleep(0.3)
        assert watch.ended(reach, infos) == {}, "releasing a rank closed the notebook's watch"
        # more notebooks watching than a rank holds: it lets go of the oldest, the first notebook's;
        # that one confirms the close with a new connection and watches again, no verdict
        others = [_watch(addresses[0], key) for _ in range(MAX_WATCHERS)]
        assert all(isinstance(other, socket.socket) for other in others)
        time.sleep(0.3)
        assert watch.ended(reach, infos) == {}, "a watcher the rank let go of was taken for the rank's end"
        assert (infos[0].host, infos[0].pid) in watch._held, "the notebook does not watch rank 0 again"
        # a watcher whose notebook closed its end goes before the oldest live one
        others[2].close()
        time.sleep(0.1)
        others.append(_watch(addresses[0], key))
        time.sleep(0.3)
        assert [_verdict(others[i]) for i in (1, 3, 4)] == [None, None, None], "a live watcher was let go"
        assert watch.ended(reach, infos) == {}
        # a notebook without the world's key is refused: nothing is held for it
        assert stranger.ended(Reach(str(tmp_path), dict(enumerate(addresses)), b"k" * xray_wire.KEY_BYTES), infos) == {}
        assert stranger._held == {}
        ranks[1].kill()
        ranks[1].wait(10)
        began, ended = time.monotonic(), {}
        while not ended and time.monotonic() - began < 5:
            ended = watch.ended(reach, infos)
            time.sleep(0.05)
        assert ended == {1: "ended"}, "the end of rank 1's process was not seen"
        assert time.monotonic() - began < 1.0
        assert watch.ended(reach, infos[:1]) == {}  # rank 0 lives on
        # a notebook that had not watched it yet: its host refuses the connection to a closed port
        late = ProcessWatch()
        try:
            assert late.ended(reach, infos) == {1: "ended"}
        finally:
            late.close()
    finally:
        watch.close()
        stranger.close()
        for other in others:
            if isinstance(other, socket.socket):
                other.close()
        for process in ranks:
            process.kill()
            process.wait(10)


# ---------------------------------------------------------------- the verdict (pure logic)


def _rank(rank: int, *entries: tuple[int, str, bool], line: int | None = 3, shape: int = 4) -> RankCollectives:
    history = tuple(Collective(seq, op, ((shape,),), ("Float",), done, 0) for seq, op, done in entries)
    return RankCollectives(rank, history, line, True, 2_000_000_000)


def test_a_costly_light_reading_of_the_recorder_is_reused_until_its_cost_is_paid_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 light reports a second must not slow training: a reading that took c seconds is reused
    for c / READ_SHARE; a full report always reads afresh; a new group forgets the reading."""
    from ddp_notebook.rank import xray as rank_xray
    from ddp_notebook.rank.state import RANK

    readings: list[bool] = []

    def slow_read(full: bool) -> tuple[list[object], int]:
        time.sleep(0.02)  # what a reading on NCCL can cost mid-training
        readings.append(full)
        return [], len(readings)

    monkeypatch.setattr(rank_xray, "_read_collectives", slow_read)
    monkeypatch.setattr(rank_xray, "READ_SHARE", 0.1)  # reused for about 0.2 s
    monkeypatch.setattr(RANK.xray, "light", None)
    assert rank_xray._collectives(False) == ([], 1)
    assert rank_xray._collectives(False) == ([], 1)  # reused: no second reading
    assert rank_xray._collectives(True) == ([], 2)  # a full report reads
    assert rank_xray._collectives(False) == ([], 1) and readings == [False, True]
    time.sleep(0.25)
    assert rank_xray._collectives(False) == ([], 3)  # paid back: read again
    monkeypatch.setattr(rank_xray, "READ_SHARE", 1e9)  # a cheap reading: every report reads
    time.sleep(0.25)
    assert [rank_xray._collectives(False)[1] for _ in range(3)] == [4, 5, 6]
    monkeypatch.setattr(rank_xray, "_open_sockets", dict)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", rank_xray.FLIGHT_RECORDER_SIZE)
    for name in ("sockets_before", "group_made_ns", "default_pg_id", "pending"):
        monkeypatch.setattr(RANK.xray, name, getattr(RANK.xray, name))  # put back afterwards
    rank_xray.before_group()
    assert RANK.xray.light is None


def test_ranks_in_the_same_collective_are_no_mismatch() -> None:
    readings = {0: _rank(0, (1, "all_reduce", True), (2, "all_reduce", False)), 1: _rank(1, (2, "all_reduce", False))}
    assert find_mismatch(readings, finished=()) is None


def test_a_rank_still_computing_is_no_mismatch() -> None:
    readings = {0: _rank(0, (2, "all_reduce", False)), 1: _rank(1, (1, "all_reduce", True))}
    assert find_mismatch(readings, finished=()) is None


def test_different_ops_with_every_rank_blocked_are_named_with_their_lines() -> None:
    readings = {0: _rank(0, (2, "all_reduce", False), line=3), 1: _rank(1, (2, "broadcast", False), line=5)}
    found = find_mismatch(readings, finished=())
    assert found is not None and found.blocked == (0, 1)
    assert "different ops" in found.summary
    assert found.details == (
        "rank 0 waits in all_reduce #2 [4], cell line 3 (2.0 s)",
        "rank 1 waits in broadcast #2 [4], cell line 5 (2.0 s)",
    )


def test_different_sequence_numbers_and_shapes_are_named() -> None:
    seq = find_mismatch({0: _rank(0, (3, "all_reduce", False)), 1: _rank(1, (4, "all_reduce", False))}, ())
    shape = find_mismatch({0: _rank(0, (3, "all_reduce", False)), 1: _rank(1, (3, "all_reduce", False), shape=5)}, ())
    assert seq is not None and "different sequence numbers" in seq.summary
    assert shape is not None and "different shapes" in shape.summary


def test_a_finished_rank_that_skipped_the_collective_is_named() -> None:
    readings = {0: _rank(0, (1, "all_reduce", True), (2, "all_reduce", False)), 1: _rank(1, (1, "all_reduce", True))}
    found = find_mismatch(readings, finished=(1,))
    assert found is not None and found.blocked == (0,)
    assert "rank 1 finished the cell after collective #1: it never ran #2" in found.details


def test_a_mismatch_is_confirmed_only_by_the_same_picture_a_second_later() -> None:
    watch = MismatchWatch(confirm_seconds=1.0)
    stuck = {0: _rank(0, (2, "all_reduce", False)), 1: _rank(1, (2, "broadcast", False))}
    moved = {0: _rank(0, (3, "all_reduce", False)), 1: _rank(1, (3, "broadcast", False))}
    assert watch.check(stuck, (), now=10.0) is None
    assert watch.check(stuck, (), now=10.5) is None  # not yet a second
    assert watch.check(moved, (), now=11.2) is None  # the ranks moved on: start again
    assert watch.check(moved, (), now=12.3) is not None


# ---------------------------------------------------------------- a real world


@pytest.fixture(scope="module")
def world3() -> Iterator[DDPCluster]:
    yield from shared_world(3)


MISMATCHES = {
    # rank 2 calls broadcast where the others all-reduce: every rank blocks
    "ops": (
        "if rank == 2:\n    dist.broadcast(torch.ones(5), 0)\nelse:\n    dist.all_reduce(torch.ones(5))\n",
        "different ops",
        {0: "all_reduce #{1} [5], cell line 4", 2: "broadcast #{1} [5], cell line 2"},
    ),
    # rank 1 skips one of two all-reduces and goes on to the barrier: every rank blocks
    "skipped, then blocked": (
        "dist.all_reduce(torch.ones(3))\nif rank != 1:\n    dist.all_reduce(torch.ones(3))\ndist.barrier()\n",
        "different ops",
        {0: "all_reduce #{2} [3], cell line 3", 1: "barrier #{2}", 2: "all_reduce #{2} [3], cell line 3"},
    ),
    # rank 0 alone calls a collective and the others finish the cell
    "skipped, others finished": (
        "if rank == 0:\n    dist.all_reduce(torch.ones(2))\n",
        "finished the cell without a collective",
        {
            0: "all_reduce #{1} [2], cell line 2",
            1: "ranks 1-2 finished the cell after collective #{0}: they never ran #{1}",
        },
    ),
}


# a torch whose gloo keeps no flight recorder (2.6), on any torch: its detection answers no, as there
OWN_RECORD = (
    "from ddp_notebook.rank import collective_record, torch_adapter\n"
    "from ddp_notebook.rank.state import RANK\n"
    "torch_adapter.native_flight_recorder = lambda: False\n"
    "RANK.xray.own_record = True\n"
    "collective_record.start()\n"
)


@pytest.fixture(scope="module")
def world3_own_record() -> Iterator[DDPCluster]:
    """3 ranks whose X-ray reads their own record of the collectives they enter (`rank.collective_record`)."""
    worlds = shared_world(3)
    world = next(worlds)
    world.execute(OWN_RECORD)
    yield world
    worlds.close()


@pytest.mark.integration
@pytest.mark.core
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_a_mismatch_ends_the_cell_within_5_s_naming_ranks_and_lines_and_keeps_state(
    world3: DDPCluster, kind: str
) -> None:
    _mismatch_is_named(world3, kind)


@pytest.mark.integration
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_a_mismatch_is_named_from_the_ranks_own_record_where_torch_keeps_no_flight_recorder(
    world3_own_record: DDPCluster, kind: str
) -> None:
    _mismatch_is_named(world3_own_record, kind)
    # the heal made a new group: the ranks still read their own record, numbered afresh
    world3_own_record.execute("own = RANK.xray.own_record")
    assert world3_own_record.pull("own") == {0: True, 1: True, 2: True}


def _mismatch_is_named(world3: DDPCluster, kind: str) -> None:
    code, summary, expected = MISMATCHES[kind]
    world3.execute("kept = rank * 10\ndist.all_reduce(torch.ones(1))")
    # sequence numbers from here on (a heal starts a new group, whose own set-up may count some)
    base = {reading.last_seq for reading in world3.collectives().values()}
    assert len(base) == 1, base
    first = base.pop()
    seq = [first + n for n in range(3)]
    began = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as caught:
        world3.execute(code, timeout=60)
    assert caught.value.mismatch.waited < 5, "the mismatch was not caught within 5 s"
    assert time.monotonic() - began < 15  # caught, released and the group set up again, on a busy machine
    text = "\n".join(caught.value._render_traceback_())
    assert summary in caught.value.mismatch.summary
    for rank, where in expected.items():
        where = where.format(*seq)
        assert where in text, f"rank {rank}: {where!r} not in\n{text}"
    assert "the process group was set up again" in text
    assert world3.state == "healthy"
    assert world3.pull("kept") == {0: 0, 1: 10, 2: 20}
    world3.execute("y = torch.ones(1) * (rank + 1)\ndist.all_reduce(y)")
    assert {r: v.item() for r, v in world3.pull("y").items()} == {0: 6.0, 1: 6.0, 2: 6.0}


@pytest.mark.integration
def test_the_xray_shows_each_ranks_collectives_with_shapes(world3: DDPCluster) -> None:
    world3.execute("dist.all_reduce(torch.ones(1))")  # after a heal the group may be fresh: start from a known point
    before = {rank: reading.last_seq for rank, reading in world3.collectives().items()}
    world3.execute("dist.all_reduce(torch.ones(3, 2))\ndist.broadcast(torch.zeros(7), 0)")
    readings = world3.collectives()
    assert sorted(readings) == [0, 1, 2]
    for rank, reading in readings.items():
        last_two = [(c.seq - before[rank], c.op, c.shapes, c.done) for c in reading.history[-2:]]
        assert last_two == [(1, "all_reduce", ((3, 2),), True), (2, "broadcast", ((7,),), True)]
        assert reading.current is None and not reading.in_cell
        assert "idle; last:" in reading.describe() and "broadcast" in reading.describe()


@pytest.mark.integration
def test_no_false_alarm_over_1000_healthy_steps(world3: DDPCluster) -> None:
    # uneven ranks (rank 1 sleeps now and then) so ranks often wait for each other in a collective
    outcome = world3.run(
        "import time\n"
        "torch.manual_seed(0)\n"
        "net = ddp_notebook.prepare_model(torch.nn.Linear(16, 4))\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.01)\n"
        "for step in range(1000):\n"
        "    opt.zero_grad()\n"
        "    net(torch.randn(8, 16)).sum().backward()\n"
        "    opt.step()\n"
        "    if rank == 1 and step % 50 == 0:\n"
        "        time.sleep(0.05)\n"
        "healthy_steps = step + 1\n",
        timeout=300,
    )
    assert outcome.ok and outcome.mismatch is None, outcome.error()
    assert outcome.result.elapsed > 2  # long enough for the watch to have read the ranks several times
    assert world3.pull("healthy_steps") == {0: 1000, 1: 1000, 2: 1000}


# ---------------------------------------------------------------- stragglers


def _times(data: float = 0.001, compute: float = 0.004, comm: float = 0.0, optimizer: float = 0.001) -> StepTimes:
    return StepTimes(20, data + compute + comm + optimizer, data, compute, comm, optimizer)


def test_the_slow_rank_is_named_with_its_phase_though_every_rank_takes_as_long() -> None:
    # rank 1 computes 50 ms longer; its peers spend those 50 ms waiting for it in the all-reduce
    times = {0: _times(comm=0.05), 1: _times(compute=0.054), 2: _times(comm=0.05)}
    found = find_straggler(times)
    assert found is not None and (found.rank, found.phase) == (1, "compute")
    assert "rank 1 is the straggler: 56.0 ms per step outside communication vs 6.0 ms" in found.describe()
    slow_data = find_straggler({0: _times(comm=0.03), 1: _times(data=0.031)})
    assert slow_data is not None and (slow_data.rank, slow_data.phase) == (1, "data")


def test_the_live_panel_and_the_profiler_name_a_straggler_in_one_sentence() -> None:
    from ddp_notebook.live.durations import milliseconds
    from ddp_notebook.live.profile_analysis import TraceStraggler
    from ddp_notebook.live.stragglers import Straggler

    live = Straggler(rank=3, phase="compute", busy=0.0561, peers_busy=0.006).describe()
    traced = TraceStraggler(rank=3, phase="compute", where="aten::mm", busy=0.0561, peers_busy=0.006).describe()
    said = "rank 3 is the straggler: 56.1 ms per step outside communication vs 6.0 ms on the others (+50.1 ms, 9.3x)"
    assert live == f"{said}, mostly in compute"
    assert traced == f"{said}, mostly compute: aten::mm"
    assert (milliseconds(0.0123), milliseconds(0.0123, unit=False), milliseconds(2e-5, digits=2)) == (
        "12.3 ms",
        "12.3",
        "0.02 ms",
    )


def test_step_means_are_kept_in_constant_time_and_equal_the_windows_mean() -> None:
    clock = StepClock(window=5)
    steps = [{"total": 0.1 * n, "data": 0.01 * n, "compute": 0.02, "comm": 0.03 * (n % 3), "optimizer": 0.001}
             for n in range(1, 24)]  # fmt: skip
    for step in steps:
        clock._add_step(step)
        window = steps[: steps.index(step) + 1][-5:]
        summary = clock.summary()
        assert summary is not None and summary["steps"] == steps.index(step) + 1
        for key in ("total", "data", "compute", "comm", "optimizer"):
            assert summary[key] == pytest.approx(sum(s[key] for s in window) / len(window), abs=1e-12)
    assert StepClock().summary() is None


def test_even_ranks_name_no_straggler() -> None:
    assert find_straggler({0: _times(), 1: _times(compute=0.0042), 2: _times()}) is None
    assert find_straggler({0: _times()}) is None


SLOW_RANK_SETUP = (
    "import time\n"
    "torch.manual_seed(0)\n"
    "net = ddp_notebook.prepare_model(torch.nn.Linear(16, 4))\n"
    "opt = torch.optim.SGD(net.parameters(), lr=0.01)\n"
    "class Slow(torch.utils.data.Dataset):\n"
    "    def __len__(self):\n"
    "        return 960\n"
    "    def __getitem__(self, i):\n"
    "        if rank == 1 and slow_data:\n"
    "            time.sleep(0.05 / 8)  # 50 ms per batch of 8\n"
    "        return torch.randn(16)\n"
    "loader = ddp_notebook.prepare_loader(Slow(), batch_size=8)\n"
)
SLOW_RANK_STEPS = (
    "for step, batch in zip(range(20), loader):\n"
    "    opt.zero_grad()\n"
    "    net(batch).sum().backward()\n"
    "    if rank == 1 and not slow_data:\n"
    "        time.sleep(0.05)\n"
    "    opt.step()\n"
)


@pytest.mark.integration
@pytest.mark.parametrize(("slow_data", "phase"), [(False, "compute"), (True, "data")])
def test_a_rank_50_ms_slower_is_named_with_its_phase_within_20_steps(
    world3: DDPCluster, slow_data: bool, phase: str
) -> None:
    world3.execute(f"slow_data = {slow_data}\n" + SLOW_RANK_SETUP)
    world3.execute(SLOW_RANK_STEPS)
    straggler = world3.straggler()
    assert straggler is not None and (straggler.rank, straggler.phase) == (1, phase), straggler
    assert straggler.busy - straggler.peers_busy > 0.04  # about the 50 ms it sleeps
    readings = world3.collectives()
    for rank in (0, 2):  # its peers wait for it in communication
        steps = readings[rank].steps
        assert steps is not None and steps.comm > 0.03, steps


@pytest.mark.integration
def test_strict_mode_names_each_ranks_call_and_the_group_stays_whole(world3: DDPCluster) -> None:
    world3.execute("ddp_notebook.check_collectives()\nx = torch.ones(3)\ndist.all_reduce(x)")
    try:
        with pytest.raises(RankError) as caught:
            world3.execute("if rank == 2:\n    dist.broadcast(x, 0)\nelse:\n    dist.all_reduce(x)")
        assert sorted(f.rank for f in caught.value.failures) == [0, 1, 2]
        assert {f.ename for f in caught.value.failures} == {"CollectiveMismatch"}
        said = caught.value.root_cause.evalue
        assert "ranks 0-1 call all_reduce(float32[3]); rank 2 calls broadcast(float32[3], src=0)" in said
        assert "set up again" not in caught.value.note and world3.state == "healthy"
        world3.execute("dist.all_reduce(x)")
        assert {r: v.tolist() for r, v in world3.pull("x").items()} == {r: [9.0] * 3 for r in range(3)}
    finally:
        world3.execute("ddp_notebook.check_collectives(False)")


@pytest.mark.integration
def test_in_strict_mode_a_rank_waiting_in_its_check_for_a_skipped_collective_is_named_within_5_s(
    world3: DDPCluster,
) -> None:
    # the check runs on a group of its own; a peer that finished without the collective would
    # leave rank 0 waiting there until the collective timeout, unseen by the X-ray
    world3.execute("ddp_notebook.check_collectives()\nkept = rank + 1\ndist.all_reduce(torch.ones(1))")
    try:
        first = {reading.last_seq for reading in world3.collectives().values()}
        assert len(first) == 1, first
        seq = first.pop() + 1
        with pytest.raises(CollectiveMismatchError) as caught:
            world3.execute("if rank == 0:\n    dist.all_reduce(torch.ones(2))\n", timeout=60)
        assert caught.value.mismatch.waited < 5, "the mismatch was not caught within 5 s"
        text = "\n".join(caught.value._render_traceback_())
        assert "finished the cell without a collective" in caught.value.mismatch.summary
        assert f"rank 0 waits in all_reduce #{seq} [2], cell line 2" in text
        assert f"ranks 1-2 finished the cell after collective #{seq - 1}: they never ran #{seq}" in text
        assert world3.state == "healthy" and world3.pull("kept") == {0: 1, 1: 2, 2: 3}
        # still strict on the new group: a checked all-reduce works, a mismatched one is caught
        world3.execute("y = torch.ones(1)\ndist.all_reduce(y)")
        assert {r: v.item() for r, v in world3.pull("y").items()} == {0: 3.0, 1: 3.0, 2: 3.0}
        with pytest.raises(RankError) as mismatched:
            world3.execute("if rank == 2:\n    dist.broadcast(y, 0)\nelse:\n    dist.all_reduce(y)")
        assert {f.ename for f in mismatched.value.failures} == {"CollectiveMismatch"}
    finally:
        world3.execute("ddp_notebook.check_collectives(False)")


@pytest.mark.integration
def test_strict_mode_from_the_api_holds_from_the_start_after_a_heal_and_a_restart(no_leaks: None) -> None:
    mismatched = "x = torch.ones(3)\nif rank == 1:\n    dist.broadcast(x, 0)\nelse:\n    dist.all_reduce(x)"
    with DDPCluster(2, backend="gloo", collective_timeout=60, check_collectives=True) as world:
        for moment in ("started", "healed", "restarted"):
            if moment == "healed":
                world.heal()  # a new default group: the checks get a new group of their own
            elif moment == "restarted":
                world.restart()  # new processes: strict from their start
            with pytest.raises(RankError) as caught:
                world.execute(mismatched)
            assert {f.ename for f in caught.value.failures} == {"CollectiveMismatch"}, moment
            assert "rank 1 calls broadcast(float32[3], src=0)" in caught.value.root_cause.evalue
            assert world.state == "healthy", moment  # caught before anything was sent
            world.execute("dist.all_reduce(x)")
            assert {r: v.tolist() for r, v in world.pull("x").items()} == {0: [2.0] * 3, 1: [2.0] * 3}
