"""Integration tests on a real 2-rank gloo world (ipyparallel cluster on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import psutil
import pytest

from ddp_notebook import CellTimeoutError, DDPCluster, DDPUsageError, NotRunningError, RankError
from ddp_notebook.cell.syntax import CellSyntaxError

pytestmark = pytest.mark.integration


def test_names_and_torchrun_environment_on_every_rank(world: DDPCluster) -> None:
    world.execute(
        "import os\n"
        "env = {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE',"
        " 'MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS')}\n"
        "names = (rank, world_size, local_rank, str(device), dist.is_initialized(), dist.get_backend(),"
        " torch.get_num_threads())\n"
    )
    envs = world.pull("env")
    names = world.pull("names")
    threads = world.config.threads_per_rank
    for r in (0, 1):
        assert envs[r]["RANK"] == envs[r]["LOCAL_RANK"] == str(r)
        assert envs[r]["WORLD_SIZE"] == envs[r]["LOCAL_WORLD_SIZE"] == "2"
        assert envs[r]["MASTER_ADDR"] == "127.0.0.1"
        assert int(envs[r]["MASTER_PORT"]) > 0
        assert envs[r]["OMP_NUM_THREADS"] == str(threads)
        assert names[r] == (r, 2, r, "cpu", True, "gloo", threads)
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_state_persists_and_collectives_work(world: DDPCluster) -> None:
    world.execute("counter = torch.tensor([float(rank + 1)])")
    world.execute("dist.all_reduce(counter)\ncounter += 1")
    assert {r: v.item() for r, v in world.pull("counter").items()} == {0: 4.0, 1: 4.0}


def test_output_is_streamed_tagged_and_values_shown(world: DDPCluster, capsys: pytest.CaptureFixture[str]) -> None:
    result = world.execute("import sys\nprint('hello from', rank)\nprint('oops', file=sys.stderr)\nrank * 10")
    captured = capsys.readouterr()
    assert sorted(captured.out.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert sorted(captured.err.splitlines()) == ["[rank 0] oops", "[rank 1] oops"]
    assert result.value_text(0) == "0" and result.value_text(1) == "10"


def test_output_arrives_while_the_cell_runs(world: DDPCluster, capsys: pytest.CaptureFixture[str]) -> None:
    class Clock:
        """Records when each line reaches the notebook side."""

        def __init__(self) -> None:
            self.arrivals: list[tuple[float, str]] = []

        def write(self, text: str) -> None:
            self.arrivals.extend((time.monotonic(), line) for line in text.splitlines())

        def flush(self) -> None:
            pass

    clock = Clock()
    streaming = DDPCluster.__new__(DDPCluster)
    streaming.__dict__.update(world.__dict__)
    streaming._stdout = clock  # type: ignore[assignment]
    began = time.monotonic()
    streaming.execute("import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')", ranks=[0])
    first = next(t for t, line in clock.arrivals if line.endswith("first"))
    second = next(t for t, line in clock.arrivals if line.endswith("second"))
    assert first - began < 1.5, "the first line waited for the end of the cell"
    assert second - first > 1.5


def test_many_lines_arrive_complete_and_in_order(world: DDPCluster, capsys: pytest.CaptureFixture[str]) -> None:
    world.execute("for i in range(10_000):\n    print(f'{rank}:{i}')")
    lines = capsys.readouterr().out.splitlines()
    for r in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {r}] ")]
        assert mine == [f"[rank {r}] {r}:{i}" for i in range(10_000)]


def test_unstreamed_output_is_collected(world: DDPCluster, capsys: pytest.CaptureFixture[str]) -> None:
    result = world.execute("print('quiet', rank)", stream=False)
    assert capsys.readouterr().out == ""
    assert result.stdout == {0: "quiet 0\n", 1: "quiet 1\n"}


def test_rank_selection(world: DDPCluster, capsys: pytest.CaptureFixture[str]) -> None:
    world.execute("only_one = True", ranks="1")
    assert world.pull("only_one", ranks=[1]) == {1: True}
    with pytest.raises(DDPUsageError, match=r"'only_one' is not defined on rank 0"):
        world.pull("only_one")
    with pytest.raises(DDPUsageError, match="this world has ranks 0-1"):
        world.execute("x = 1", ranks="7")
    with pytest.raises(DDPUsageError, match="this world has ranks 0-1"):
        world.execute("x = 1", ranks=[0, 5])


def test_a_cell_request_built_once_runs_as_its_code_with_options(
    world: DDPCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    request = world.cell_request("print('built', rank)\nrank + 100", "1", stream=False)
    assert request.ranks == (1,) and request.world_size == 2
    result = world.execute(request)
    assert capsys.readouterr().out == ""
    assert result.stdout == {1: "built 1\n"} and result.value_text(1) == "101"
    assert world.run(request).ok
    with pytest.raises(TypeError, match="give a CellRequest or a cell's code with options, not both"):
        world.execute(request, stream=True)
    stale = dataclasses.replace(request, world_size=4)
    with pytest.raises(DDPUsageError, match="checked against a world of 4 ranks; this world has 2"):
        world.run(stale)
    with pytest.raises(DDPUsageError, match="this world has ranks 0-1"):
        world.cell_request("x = 1", "5")


def test_a_raising_rank_is_named_with_its_traceback(world: DDPCluster) -> None:
    with pytest.raises(RankError) as caught:
        world.execute("def load(batch):\n    raise ValueError(f'bad batch {batch}')\nif rank == 1:\n    load(7)\n")
    error = caught.value
    assert error.root_cause.rank == 1
    assert [f.rank for f in error.failures] == [1]
    assert error.root_cause.ename == "ValueError" and error.root_cause.evalue == "bad batch 7"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error._render_traceback_()))
    assert "rank 1 failed first (root cause)" in text and "load(7)" in text
    # the world is still usable, state included
    world.execute("still_here = rank")
    assert world.pull("still_here") == {0: 0, 1: 1}


def test_all_ranks_failing_are_listed(world: DDPCluster) -> None:
    with pytest.raises(RankError) as caught:
        world.execute("raise RuntimeError(f'rank {rank} failed')")
    assert sorted(f.rank for f in caught.value.failures) == [0, 1]
    assert any(line.startswith("rank ") and "also failed" in line for line in caught.value._render_traceback_())


def test_syntax_error_sends_nothing(world: DDPCluster) -> None:
    world.execute("count_before = get_ipython().execution_count")
    with pytest.raises(CellSyntaxError):
        world.execute("for i in range(3)\n    print(i)")
    world.execute("count_after = get_ipython().execution_count")
    before, after = world.pull("count_before"), world.pull("count_after")
    assert all(after[r] == before[r] + 1 for r in (0, 1))


def test_cell_timeout_interrupts_and_keeps_the_world(world: DDPCluster) -> None:
    world.execute("kept = 41")
    began = time.monotonic()
    with pytest.raises(CellTimeoutError, match="1 s limit"):
        world.execute("import time\nfor _ in range(600):\n    time.sleep(0.05)", timeout=1)
    assert time.monotonic() - began < 5
    world.execute("kept += 1")
    assert world.pull("kept") == {0: 42, 1: 42}


def test_push_and_pull(world: DDPCluster) -> None:
    world.push({"alpha": [1, 2, 3], "beta": {"lr": 0.1}})
    world.execute("gamma = sum(alpha) * beta['lr'] + rank")
    assert world.pull("gamma") == pytest.approx({0: 0.6, 1: 1.6})
    with pytest.raises(DDPUsageError, match="cannot push 'handle'"):
        world.push({"handle": (lambda: None, open(__file__))[1]})
    with pytest.raises(DDPUsageError, match="identifiers"):
        world.push({"not a name": 1})


def test_a_ranks_engine_logs_no_line_per_cell(world: DDPCluster) -> None:
    """Once in the world, a rank's engine makes no record per cell (it made five, and wrote one
    `Handling execute_request` line to its log); its warnings and errors still go to its log (a
    loaded machine may add a warning of its own: it is named if so, and it is not one per cell)."""
    world.execute(
        "import logging\n"
        "_engine_log = get_ipython().kernel.log\n"
        "_records = []\n"
        "class _Count(logging.Handler):\n"
        "    def emit(self, record):\n"
        "        _records.append((record.levelno, record.getMessage()))\n"
        "_counter = _Count(logging.DEBUG)\n"
        "_engine_log.addHandler(_counter)"
    )
    try:
        for _ in range(3):
            world.execute("x = 1")
        world.execute("_engine_log.warning('a warning still logged')\n_level = _engine_log.level")
        records = world.pull("_records")
        for rank in (0, 1):
            assert [r for r in records[rank] if r[0] < logging.WARNING] == [], records  # none per cell
            assert records[rank].count((logging.WARNING, "a warning still logged")) == 1, records
            assert len(records[rank]) <= 2, records  # 4 cells: at most one warning besides ours
        assert world.pull("_level") == {0: logging.WARNING, 1: logging.WARNING}
    finally:
        world.execute("_engine_log.removeHandler(_counter)")


def test_status_shows_every_rank(world: DDPCluster) -> None:
    rows = world.status()
    assert [r.rank for r in rows] == [0, 1]
    assert all(r.state == "idle" and r.device == "cpu" and r.memory_mb and r.memory_mb > 10 for r in rows)
    assert [r.pid for r in rows] == [info.pid for info in world.ranks]


def test_everything_listens_on_loopback_only(world: DDPCluster) -> None:
    listening = []
    for pid in world.pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append(conn.laddr.ip)
    assert listening, "expected the controller, the store and gloo to listen somewhere"
    assert set(listening) <= {"127.0.0.1", "::1"}


def test_calls_on_a_stopped_world_say_how_to_start() -> None:
    idle = DDPCluster(2, backend="gloo")
    with pytest.raises(NotRunningError, match="start one first"):
        idle.execute("x = 1")
    assert idle.stop() is False


def test_a_cell_that_ignores_interrupts_leaves_the_rank_interruptible(world: DDPCluster) -> None:
    # as Lightning's Trainer does once it caught a KeyboardInterrupt
    world.execute("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)")
    handlers = world.execute("signal.getsignal(signal.SIGINT) is signal.default_int_handler", stream=False)
    assert handlers.values == {0: {"text/plain": "True"}, 1: {"text/plain": "True"}}
    began = time.monotonic()
    with pytest.raises(CellTimeoutError):
        world.execute("import time\ntime.sleep(30)", timeout=1)
    assert time.monotonic() - began < 10  # the interrupt reached both ranks
