"""Failures inside cells: dead ranks, hung collectives. Each test has its own world."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ddp_notebook import CellTimeoutError, DDPCluster, RankDiedError, WorldBrokenError
from tests.conftest import wait_gone

pytestmark = pytest.mark.integration


@pytest.fixture
def own_world(no_leaks: None) -> Iterator[DDPCluster]:
    world = DDPCluster(2, backend="gloo", timeout=60).start()
    try:
        yield world
    finally:
        world.stop()


def test_a_dead_rank_is_named_within_seconds_and_restart_brings_a_full_world(own_world: DDPCluster) -> None:
    world = own_world
    world.execute("x = torch.ones(1)")
    old_pids = world.all_pids
    began = time.monotonic()
    with pytest.raises(RankDiedError) as caught:
        # rank 1 dies while rank 0 waits for it inside a collective
        world.execute("import os, time\nif rank == 1:\n    time.sleep(0.3)\n    os._exit(7)\ndist.all_reduce(x)")
    assert time.monotonic() - began < 10
    error = caught.value
    assert error.dead == {1: "exited with code 7"}
    assert "%ddp_restart" in str(error)
    assert [f.rank for f in error.failures] == [0]  # released from the collective, not hung
    assert "Connection closed" in error.failures[0].evalue or "closed" in error.failures[0].evalue.lower()

    with pytest.raises(WorldBrokenError, match="rank 1 exited with code 7"):
        world.execute("1 + 1")

    world.restart()
    assert not world.broken
    assert world.execute("rank * 2", stream=False).values == {0: {"text/plain": "0"}, 1: {"text/plain": "2"}}
    assert set(world.pids).isdisjoint(old_pids)
    assert wait_gone(old_pids) == []


def test_killed_rank_says_how_it_died(own_world: DDPCluster) -> None:
    with pytest.raises(RankDiedError, match=r"rank 0 was killed by SIGKILL \(often the out-of-memory killer\)"):
        own_world.execute("import os, signal\nif rank == 0:\n    os.kill(os.getpid(), signal.SIGKILL)")


def test_timeout_reports_where_each_rank_is(own_world: DDPCluster) -> None:
    world = own_world
    world.execute("x = torch.ones(1)")
    with pytest.raises(CellTimeoutError) as caught:
        # rank 1 never reaches the collective rank 0 waits in
        world.execute(
            "import time\nif rank == 1:\n    while True:\n        time.sleep(0.05)\ndist.all_reduce(x)", timeout=2
        )
    report = str(caught.value)
    assert "rank 0: waiting in torch.distributed.all_reduce (at cell line 5)" in report
    assert "rank 1: running <module> (at cell line 4), never reached the collective" in report
