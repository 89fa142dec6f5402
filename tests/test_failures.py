"""Failures inside cells: dead ranks, hung collectives. Each test has its own world, of 2, 3 and 4
ranks (tests/test_failures_at_every_size.py varies the failing rank and the collective too)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from ddp_notebook import CellTimeoutError, DDPCluster, RankDiedError, RankError, WorldBrokenError
from ddp_notebook.errors import name_ranks
from ddp_notebook.wire.results import Death
from tests.support.processes import wait_gone

pytestmark = pytest.mark.integration


@pytest.fixture(params=[2, 3, 4], ids=lambda size: f"{size}ranks")
def own_world(no_leaks: None, request: pytest.FixtureRequest) -> Iterator[DDPCluster]:
    # max_restarts=0: a dead rank breaks the world, as it does past max_restarts (test_elastic covers the comeback)
    world = DDPCluster(request.param, backend="gloo", collective_timeout=60, max_restarts=0).start()
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
    assert error.dead == {1: Death("exited", "exited with code 7", 7)}
    assert "%ddp_restart" in str(error)
    others = [rank for rank in range(world.world_size) if rank != 1]
    assert sorted(f.rank for f in error.failures) == others  # released from the collective, not hung
    assert all("closed" in f.evalue.lower() for f in error.failures), error.failures

    with pytest.raises(WorldBrokenError, match="rank 1 exited with code 7"):
        world.execute("1 + 1")

    world.restart()
    assert not world.broken
    everyone = range(world.world_size)
    assert world.execute("rank * 2", stream=False).values == {r: {"text/plain": str(r * 2)} for r in everyone}
    # every process is new but the warm template the ranks are forked from, which a restart keeps
    kept = set(world.pids) & set(old_pids)
    template = getattr(world.provisioner, "template", None)
    assert kept <= ({template.pid} if template is not None else set())
    assert wait_gone(sorted(set(old_pids) - kept)) == []


def test_killed_rank_says_how_it_died(own_world: DDPCluster) -> None:
    with pytest.raises(RankDiedError, match=r"rank 0 was killed by SIGKILL") as caught:
        own_world.execute("import os, signal\nif rank == 0:\n    os.kill(os.getpid(), signal.SIGKILL)")
    # not blamed on the out-of-memory killer: its counters did not move (where they cannot be
    # read, the message says SIGKILL is often the out-of-memory killer)
    assert "killed by the out-of-memory killer" not in str(caught.value)


def test_timeout_reports_where_each_rank_is(own_world: DDPCluster) -> None:
    world = own_world
    world.execute("x = torch.ones(1)")
    with pytest.raises(CellTimeoutError) as caught:
        # rank 1 never reaches the collective rank 0 waits in
        world.execute(
            "import time\nif rank == 1:\n    while True:\n        time.sleep(0.05)\ndist.all_reduce(x)", timeout=2
        )
    report = str(caught.value)
    # the ranks waiting in the same place share a line, as runs, at every size
    waiting = name_ranks(rank for rank in range(world.world_size) if rank != 1)
    assert f"\n{waiting}: waiting in torch.distributed.all_reduce (at cell line 5)" in report, report
    assert "\nrank 1: running <module> (at cell line 4), never reached the collective" in report, report
    assert len(report.splitlines()) == 4, report  # the limit, the two places, the heal


TRAIN = (
    "for i in range(20):\n"
    "    optimizer.zero_grad()\n"
    "    model(torch.randn(8, 4)).sum().backward()\n"
    "    optimizer.step()\n"
    "    step += 1\n"
    "    if rank == 1 and step == 25:\n"
    "        raise ValueError('bad batch at step 25')\n"
)


def test_a_rank_raising_mid_training_releases_the_others_and_the_world_heals(own_world: DDPCluster) -> None:
    world = own_world
    world.execute(
        "torch.manual_seed(rank)\n"
        "model = ddp_notebook.prepare_model(torch.nn.Linear(4, 2))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "step = 0\n"
    )
    world.execute(TRAIN)
    began = time.monotonic()
    with pytest.raises(RankError) as caught:
        world.execute(TRAIN)  # rank 0 waits in backward's all-reduce for a rank that raised
    assert time.monotonic() - began < 10
    error = caught.value
    assert error.root_cause.rank == 1 and error.root_cause.evalue == "bad batch at step 25"
    others = [rank for rank in range(world.world_size) if rank != 1]
    # the others were released, not left hanging
    assert sorted(f.rank for f in error.failures[1:]) == others and error.busy_ranks == ()
    assert "the process group was set up again" in error.note
    assert world.state == "healthy"
    # state kept on every rank, and training goes on in step on the new group
    assert world.pull("step") == {rank: 25 for rank in range(world.world_size)}
    world.execute(
        "optimizer.zero_grad()\n"
        "model(torch.randn(8, 4)).sum().backward()\n"
        "optimizer.step()\n"
        "weights = model.module.weight.detach().clone()\n"
    )
    weights = world.pull("weights")
    assert all(torch.equal(weights[rank], weights[0]) for rank in weights)


def test_a_heal_releases_a_rank_still_blocked_in_a_collective(own_world: DDPCluster) -> None:
    """A rank left waiting in a collective its peers never join (what an interrupted cell can
    leave) does not stop the heal: it is released through the X-ray, its work fails, and the
    group forms again (the fault storm met this after an interrupt)."""
    world = own_world
    last = world.ranks[world.world_size - 1]
    assert world.provisioner is not None and world.provisioner.client is not None
    waiting = world.provisioner.client[last.engine_id].execute("dist.all_reduce(torch.ones(1))", block=False)
    time.sleep(1.0)  # in the all_reduce, alone
    assert not waiting.ready()
    world.heal()
    with pytest.raises(Exception, match=r"(?i)closed"):
        waiting.get(timeout=10)
    check = "t = torch.ones(1); dist.all_reduce(t); t.item()"
    assert world.execute(check, stream=False).value_text(0) == f"{float(world.world_size)}"


def test_a_hung_collective_times_out_and_heals(own_world: DDPCluster) -> None:
    world = own_world
    world.execute("x = torch.ones(1)\nkept = rank")
    began = time.monotonic()
    with pytest.raises(CellTimeoutError) as caught:
        world.execute("import time\nif rank == 1:\n    time.sleep(600)\ndist.all_reduce(x)", timeout=2)
    assert time.monotonic() - began < 2 + 8
    waiting = name_ranks(rank for rank in range(world.world_size) if rank != 1)  # those in one place: one line
    assert f"\n{waiting}: waiting in torch.distributed.all_reduce" in str(caught.value)
    assert "the process group was set up again" in str(caught.value)
    world.execute("y = torch.ones(1) * (rank + 1)\ndist.all_reduce(y)")
    everyone = range(world.world_size)
    total = float(sum(rank + 1 for rank in everyone))
    assert {r: v.item() for r, v in world.pull("y").items()} == {r: total for r in everyone}
    assert world.pull("kept") == {r: r for r in everyone}
