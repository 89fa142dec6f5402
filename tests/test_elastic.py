"""A dead rank comes back with the tracked state: real gloo worlds of 2, 3 and 4 ranks, real SIGKILLs."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddp_notebook import DDPCluster, DDPUsageError, RankDiedError, RankError, WorldBrokenError
from ddp_notebook.rank.helpers import EpochDataLoader, ResumableSampler
from ddp_notebook.world.provisioning import controlled
from tests.support import elastic_training
from tests.support.elastic_training import DDP, DROP, EPOCHS, FSDP, SAMPLES, TRACK, TRAIN
from tests.support.processes import wait_gone

pytestmark = pytest.mark.integration

KILL = "import os, signal\nif rank == {rank}:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()"


def _everyone(world: DDPCluster, value: object) -> dict[int, object]:
    return {rank: value for rank in range(world.world_size)}


# (world size, the rank killed mid-epoch): the middle or the last; rank 0 is killed after
COMEBACKS = [
    pytest.param(2, 1, id="2ranks-last"),
    pytest.param(3, 1, id="3ranks-middle", marks=pytest.mark.core),
    pytest.param(4, 3, id="4ranks-last"),
]
SHARDED_COMEBACKS = [
    pytest.param(2, 1, id="2ranks-last"),
    pytest.param(3, 2, id="3ranks-last"),
    pytest.param(4, 2, id="4ranks-middle"),
]


@pytest.mark.parametrize(("size", "victim"), COMEBACKS)
def test_a_killed_rank_comes_back_and_training_ends_bitwise_equal(no_leaks: None, size: int, victim: int) -> None:
    kill_at = elastic_training.steps_per_epoch(size) + 3  # epoch 1, its 4th step: just after the snapshot at batch 3
    with DDPCluster(size, backend="gloo", collective_timeout=60, max_restarts=2) as world:
        reference, reference_seen = elastic_training.reference(world, DDP)
        world.execute(elastic_training.build("", DDP, DROP) + TRACK, setup=True)
        world.execute("untracked = 'kept'")
        # a cell on some ranks only is no point of the whole world: it takes no snapshot, so a
        # snapshot's number means the same point on every rank (survivors must share one)
        world.execute("alone = True", ranks=[0])
        numbers = world.execute("from ddp_notebook.rank import elastic\nelastic.snapshot_numbers()", stream=False)
        assert len({numbers.value_text(rank) for rank in range(size)}) == 1
        survivor_pid = world.ranks[0].pid
        # the victim dies mid-epoch (epoch 1); the world is back without any call
        with pytest.raises(RankDiedError) as caught:
            elastic_training.train(world, "", kill_rank=victim, kill_at=kill_at)
        message = str(caught.value)
        assert message.startswith(f"rank {victim} was killed by SIGKILL. Rank {victim} came back in ")
        assert "the snapshot taken at epoch 1, batch 3" in message  # snapshot_every=3
        assert world.state == "healthy" and not world.broken and world.restarts == 1
        assert world.ranks[0].pid == survivor_pid and world.last_comeback_seconds is not None
        assert world.pull("step") == _everyone(world, kill_at)  # the snapshot after that step, taken before the death
        assert world.pull("untracked", ranks=[0]) == {0: "kept"}  # the survivors keep their other variables...
        with pytest.raises(Exception, match="'untracked' is not defined on rank"):
            world.pull("untracked", ranks=[victim])  # ...the new rank has what the setup cells made
        assert world.pull("data", ranks=[victim])[victim] is not None

        elastic_training.train(world, "")  # the same cell again continues from the snapshot
        elastic_training.ends_like(world, reference, reference_seen)
        params = elastic_training.params(world, "")

        # rank 0 holds the rendezvous: it comes back too, and the end-of-cell snapshot is restored
        with pytest.raises(
            RankDiedError, match=r"^rank 0 was killed by SIGKILL\. Rank 0 came back in .* end of a cell"
        ):
            world.execute(KILL.format(rank=0))
        after = elastic_training.params(world, "")
        assert all(elastic_training.bitwise_equal(after[rank], params[0]) for rank in range(size))
        assert world.execute("dist.get_world_size()", stream=False).value_text(0) == str(size)

        # past max_restarts a death ends as it did before: the world is broken, nothing outlives stop
        last = size - 1
        with pytest.raises(RankDiedError, match=rf"rank {last} was killed by SIGKILL\. .*max_restarts=2.*%ddp_restart"):
            world.execute(KILL.format(rank=last))
        assert world.state == "broken"
        with pytest.raises(WorldBrokenError):
            world.execute("1")
        pids = world.all_pids
    assert wait_gone(pids) == []


@pytest.mark.parametrize(("size", "victim"), SHARDED_COMEBACKS)
def test_a_killed_rank_of_a_sharded_model_comes_back_and_training_ends_bitwise_equal(
    no_leaks: None, size: int, victim: int
) -> None:
    """The same for an FSDP2 model: the new rank replays the setup cells alone (a one-rank mesh),
    is sharded again over the world, and every rank loads the gathered snapshot."""
    kill_at = elastic_training.steps_per_epoch(size) + 3
    with DDPCluster(size, backend="gloo", collective_timeout=60, max_restarts=2) as world:
        reference, reference_seen = elastic_training.reference(world, FSDP)
        world.execute(elastic_training.build("", FSDP, DROP) + TRACK, setup=True)
        # the end of the setup cell was snapshotted on every rank at once, by the notebook
        world.execute(
            "from ddp_notebook.rank import elastic\nfrom ddp_notebook.rank.state import RANK\n"
            "kept = [s.where for s in RANK.tracked.snapshots]"
        )
        assert world.pull("kept") == _everyone(world, ["the end of a cell"])
        # a cell that left the model and optimizer as they were: each rank snapshots alone, reusing the gathered copy
        world.execute("reused = RANK.tracked.snapshots[-1].state['model'] is RANK.tracked.snapshots[-2].state['model']")
        assert world.pull("reused") == _everyone(world, True)
        numbers = world.execute("elastic.snapshot_numbers()", stream=False)
        assert {numbers.value_text(rank) for rank in range(size)} == {"[2, 3]"}
        back = rf"^rank {victim} was killed by SIGKILL\. Rank {victim} came back in "
        back += ".*the snapshot taken at epoch 1, batch 3"
        with pytest.raises(RankDiedError, match=back):
            elastic_training.train(world, "", kill_rank=victim, kill_at=kill_at)
        assert world.state == "healthy" and world.pull("step") == _everyone(world, kill_at)
        _spans_the_world(world, FSDP)

        elastic_training.train(world, "")  # the same cell again continues from the snapshot
        elastic_training.ends_like(world, reference, reference_seen)
        params = elastic_training.params(world, "")

        # rank 0 comes back too, to the snapshot the notebook took at the end of the last cell
        back = r"^rank 0 was killed by SIGKILL\. Rank 0 came back in .* end of a cell"
        with pytest.raises(RankDiedError, match=back):
            world.execute(KILL.format(rank=0))
        after = elastic_training.params(world, "")
        assert all(elastic_training.bitwise_equal(after[rank], params[0]) for rank in range(size))
        _spans_the_world(world, FSDP)
        pids = world.all_pids
    assert wait_gone(pids) == []


# the training cell, with a rank that raises midway instead of dying
TRAIN_RAISING = TRAIN.replace(
    "os.kill(os.getpid(), signal.SIGKILL)  # the others are then in the step's first collective",
    "raise RuntimeError('stopped midway')",
)
SNAPSHOTS = "from ddp_notebook.rank import elastic\nelastic.snapshot_numbers()"


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_training_cell_that_failed_midway_is_rolled_back_and_ends_bitwise_equal(no_leaks: None, size: int) -> None:
    """A rank raises mid-epoch; the cells after it take no snapshot of that midway point (a typo's
    failure, which trained nothing, does not stop them); `rollback()` brings every rank to the
    newest snapshot they share, and the run ends as the uninterrupted one."""
    assert TRAIN_RAISING != TRAIN
    fail_at = elastic_training.steps_per_epoch(size) + 3  # epoch 1, the step after the snapshot at its batch 3
    with DDPCluster(size, backend="gloo", collective_timeout=60) as world:
        reference, reference_seen = elastic_training.reference(world, DDP)
        world.execute(elastic_training.build("", DDP, DROP) + TRACK, setup=True)
        with pytest.raises(RankError, match="is not defined"):
            world.execute("a_typo")
        before = world.execute(SNAPSHOTS, stream=False).value_text(0)
        after = world.execute(SNAPSHOTS, stream=False).value_text(0)
        assert before != after, "a failed cell that trained nothing stopped the end-of-cell snapshots"
        world.push({"KILL_RANK": size - 1, "KILL_AT": fail_at})
        with pytest.raises(RankError, match="stopped midway"):
            world.execute(TRAIN_RAISING.format(p="", epochs=EPOCHS))
        held = world.execute(SNAPSHOTS, stream=False).value_text(0)
        assert world.execute(SNAPSHOTS, stream=False).value_text(0) == held  # no snapshot of the midway point
        # a collective left half-done on the group (what an interrupt in DDP's backward leaves):
        # the rollback's own collectives still meet, on a fresh group
        world.execute("if rank == 0:\n    _pending = dist.all_reduce(torch.ones(1), async_op=True)")
        assert world.rollback() == "epoch 1, batch 3"
        assert world.pull("step") == _everyone(world, elastic_training.steps_per_epoch(size) + 3)
        elastic_training.train(world, "")  # the training cell again goes on from there
        elastic_training.ends_like(world, reference, reference_seen)
        pids = world.all_pids
    assert wait_gone(pids) == []


def _stop_until_dropped(world: DDPCluster, rank: int) -> None:
    """SIGSTOP `rank`'s process while the world is idle, until the controller drops its engine."""
    engine = world.ranks[rank].engine_id
    assert world.provisioner is not None and world.provisioner.client is not None
    client = world.provisioner.client
    os.kill(world.ranks[rank].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while engine in client.ids and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine not in client.ids, f"the controller still lists rank {rank}'s stopped engine"


@pytest.mark.parametrize("size", [2, 3, 4], ids=lambda size: f"{size}ranks")
def test_a_rank_dropped_while_the_world_was_idle_is_named_at_the_next_push_or_pull(
    no_leaks: None, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank stopped between cells past the controller's heartbeat: the next push (or pull) names
    it, the world comes back at the snapshot, sends nothing, and the same push works again. A rank
    killed while a push or a pull is on its way to it is named within a second the same way."""
    # the controller drops a silent rank after 4 s instead of 10: the same path, twice, 12 s sooner
    monkeypatch.setattr(controlled, "HEARTBEAT_LIMIT_MS", 4_000)
    with DDPCluster(size, backend="gloo", collective_timeout=60, max_restarts=4) as world:  # 4 losses here
        world.execute("kept = rank * 10\nstep = 0\nddp_notebook.track(step=step)", setup=True)
        world.execute("step = 5")  # the end-of-cell snapshot holds step 5
        _stop_until_dropped(world, size - 1)
        with pytest.raises(RankDiedError) as caught:
            world.push({"lr": 0.1})
        message = str(caught.value)
        assert message.startswith(f"rank {size - 1} ") and "stopped answering the controller" in message, message
        assert f"Rank {size - 1} came back" in message and message.endswith("nothing was sent: push again"), message
        assert world.state == "healthy"
        with pytest.raises(DDPUsageError, match="'lr' is not defined"):
            world.pull("lr")
        world.push({"lr": 0.1})
        assert world.pull("lr") == _everyone(world, 0.1)
        assert world.pull("step") == _everyone(world, 5)

        _stop_until_dropped(world, 0)
        with pytest.raises(RankDiedError, match="nothing was sent: pull again"):
            world.pull("kept", ranks=[0])
        assert world.state == "healthy"
        # rank 0's new process replayed the setup cell; the others kept their variables
        assert world.pull("kept") == {rank: rank * 10 for rank in range(size)}
        assert world.pull("step") == _everyone(world, 5)

        for doing, call in (("push", lambda: world.push({"lr": 0.2})), ("pull", lambda: world.pull("kept"))):
            message, seconds = _killed_on_the_way(world, size - 1, call)
            assert message.startswith(f"rank {size - 1} was killed by SIGKILL"), message
            assert f"Rank {size - 1} came back" in message and message.endswith(f"{doing} again"), message
            # named within a second of the death (the supervisor looks every 0.5 s), then the comeback
            assert seconds < 1.0 + world.last_comeback_seconds + 1.5, (seconds, world.last_comeback_seconds)
            assert world.state == "healthy"
        world.push({"lr": 0.2})
        assert world.pull("lr") == _everyone(world, 0.2)
        assert world.pull("kept") == {rank: rank * 10 for rank in range(size)}
        pids = world.all_pids
    assert wait_gone(pids) == []


def _killed_on_the_way(world: DDPCluster, rank: int, call: Callable[[], object]) -> tuple[str, float]:
    """`call` (a push or a pull) with `rank` stopped, so that it waits for the rank, which is
    killed a second in: (the RankDiedError's message, the seconds from the kill to it)."""
    victim = world.ranks[rank].pid
    os.kill(victim, signal.SIGSTOP)
    killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    killer.start()
    began = time.monotonic()
    try:
        with pytest.raises(RankDiedError) as caught:
            call()
    finally:
        killer.join()
    return str(caught.value), time.monotonic() - began - 1.0


@pytest.mark.parametrize("size", [2, 3, 4], ids=lambda size: f"{size}ranks")
def test_a_death_while_setup_cells_are_replayed_breaks_the_world_with_a_clear_message(
    no_leaks: None, tmp_path: Path, size: int
) -> None:
    trap = tmp_path / "die-on-replay"
    setup = f"import os, signal\nif os.path.exists({str(trap)!r}):\n    os.kill(os.getpid(), signal.SIGKILL)"
    last = size - 1
    with DDPCluster(size, backend="gloo", collective_timeout=60) as world:
        world.execute(setup, setup=True)
        # survivors still running their cell are interrupted: the comeback does not wait for them to end
        began = time.monotonic()
        with pytest.raises(RankDiedError, match=f"Rank {last} came back in"):
            world.execute(f"import os, time\nif rank == {last}:\n    os.kill(os.getpid(), 9)\ntime.sleep(99)")
        assert time.monotonic() - began < 60 and world.state == "healthy"
        trap.write_text("")
        with pytest.raises(RankDiedError) as caught:
            world.execute(KILL.format(rank=last))
        assert str(caught.value) == (
            f"rank {last} was killed by SIGKILL. bringing it back failed: the new rank {last} was killed by SIGKILL "
            "in setup cell 1 of 1; its state is lost; %ddp_restart (or restart()) starts a full world again"
        )
        assert world.state == "broken"
        pids = world.all_pids
    assert wait_gone(pids) == []


# how the model spans the world on a rank: the group (DDP) or mesh (FSDP2) size, its FSDP units,
# and whether the optimizer holds the model's parameter objects
SPAN = """
from torch.distributed.fsdp import FSDPModule
units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
span = {p.device_mesh.size() for p in model.parameters()}.pop() if units else model.process_group.size()
optimizes_model = [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
"""


def _spans_the_world(world: DDPCluster, wrap: str) -> None:
    world.execute(SPAN)
    everyone = range(world.world_size)
    assert world.pull("span") == {rank: world.world_size for rank in everyone}
    assert world.pull("units") == {rank: ["", "0.0", "0.3"] if wrap == FSDP else [] for rank in everyone}
    assert world.pull("optimizes_model") == {rank: True for rank in everyone}


# (from, to): each world size grows by one rank and goes back; 4 ranks (this machine's most
# without force) shrinks by one and grows back
RESIZES = [pytest.param(2, 3, id="2-3-2"), pytest.param(3, 4, id="3-4-3"), pytest.param(4, 3, id="4-3-4")]


@pytest.mark.parametrize("wrap", [DDP, FSDP])
@pytest.mark.parametrize(("size", "other"), RESIZES)
def test_a_world_resized_and_back_keeps_training_as_one_process_would(
    no_leaks: None, wrap: str, size: int, other: int
) -> None:
    with DDPCluster(size, backend="gloo", collective_timeout=60) as world:
        world.execute(elastic_training.build("", wrap, 0.0) + TRACK, setup=True)
        world.execute("untracked = rank * 10")
        elastic_training.train(world, "")  # two epochs at `size` ranks
        before = elastic_training.params(world, "")
        trained = EPOCHS * elastic_training.steps_per_epoch(size)
        assert world.pull("step") == _everyone(world, trained)
        kept = min(size, other)
        survivors = [info.pid for info in world.ranks][:kept]
        leaving = [info.pid for info in world.ranks][other:]

        assert world.resize(other) > 0
        assert world.world_size == other and world.config.n_ranks == other
        assert [info.pid for info in world.ranks][:kept] == survivors and wait_gone(leaving) == []
        assert world.pull("world_size") == _everyone(world, other)
        # the ranks that stay keep their variables
        assert world.pull("untracked", ranks=range(kept)) == {rank: rank * 10 for rank in range(kept)}
        assert world.pull("step") == _everyone(world, trained)  # a new rank got the tracked state...
        grown = elastic_training.params(world, "")
        for rank in range(other):
            assert elastic_training.bitwise_equal(grown[rank], before[0])  # ...and the model, from rank 0
        _spans_the_world(world, wrap)

        # a third epoch at `other` ranks: every sample once (a few repeated to even the shards)
        elastic_training.train(world, "", epochs=3)
        seen = world.pull("seen")
        assert all(seen[rank] == seen[0] for rank in range(other))
        third = [i for step in seen[0][trained:] for i in step]
        assert sorted(set(third)) == list(range(SAMPLES)) and len(third) == elastic_training.padded(other)
        resized = elastic_training.params(world, "")
        assert all(elastic_training.bitwise_equal(resized[rank], resized[0]) for rank in range(other))
        assert not elastic_training.bitwise_equal(resized[0], before[0])  # it trained

        leaving = [info.pid for info in world.ranks][size:]
        assert world.resize(size) > 0
        assert world.world_size == size and wait_gone(leaving) == []
        assert world.pull("world_size") == _everyone(world, size)
        elastic_training.train(world, "", epochs=4)
        seen = world.pull("seen")
        fourth = [i for step in seen[0][trained + elastic_training.steps_per_epoch(other) :] for i in step]
        assert sorted(set(fourth)) == list(range(SAMPLES)) and len(fourth) == elastic_training.padded(size)
        after = elastic_training.params(world, "")
        assert all(elastic_training.bitwise_equal(after[rank], after[0]) for rank in range(size))
        assert not elastic_training.bitwise_equal(after[0], resized[0])
        _spans_the_world(world, wrap)
        # momentum and position carried through both resizes: as one process on the same samples
        for got, expected in zip(after[0], elastic_training.trained_in_one_process(seen[0])):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        pids = world.all_pids
    assert wait_gone(pids) == []


# (world size, the rank lost mid-epoch): rank 0 (the rendezvous moves), the middle, the last
SHRINKS = [
    pytest.param(2, 1, id="2ranks-last"),
    pytest.param(3, 0, id="3ranks-first"),
    pytest.param(4, 2, id="4ranks-middle"),
]


@pytest.mark.parametrize(("size", "victim"), SHRINKS)
def test_a_world_that_shrinks_around_a_lost_rank_trains_on_as_one_process_would(
    no_leaks: None, size: int, victim: int
) -> None:
    """on_loss='shrink' (what launcher worlds do by default): no new process; the survivors go on
    at one rank fewer, renumbered, from the snapshot, and the loader deals the rest of the epoch
    over them."""
    kill_at = elastic_training.steps_per_epoch(size) + 3  # epoch 1, its 4th step: just after the snapshot at batch 3
    with DDPCluster(size, backend="gloo", collective_timeout=60, on_loss="shrink") as world:
        world.execute(elastic_training.build("", DDP, 0.0) + TRACK, setup=True)
        world.execute("untracked = rank * 10")
        survivors = [info.pid for info in world.ranks if info.rank != victim]
        with pytest.raises(RankDiedError) as caught:
            elastic_training.train(world, "", kill_rank=victim, kill_at=kill_at)
        message = str(caught.value)
        assert message.startswith(f"rank {victim} was killed by SIGKILL. The world went on without rank {victim} in ")
        assert f"{size - 1} rank(s) now (was {size})" in message
        assert "the snapshot taken at epoch 1, batch 3" in message
        now = size - 1
        assert world.state == "healthy" and world.world_size == now
        assert world.config.n_ranks == size  # the size asked for: restart() starts the full world
        assert [info.pid for info in world.ranks] == survivors  # the same processes, renumbered in order
        assert world.pull("world_size") == _everyone(world, now)
        assert world.pull("rank") == {r: r for r in range(now)}
        # their other variables are kept (made under their old numbers)
        old_numbers = [rank for rank in range(size) if rank != victim]
        assert world.pull("untracked") == {new: old * 10 for new, old in enumerate(old_numbers)}
        assert world.pull("step") == _everyone(world, kill_at)

        elastic_training.train(world, "")  # the rest of epoch 1 over the survivors, then the last epochs
        seen = world.pull("seen")
        assert all(seen[rank] == seen[0] for rank in range(now))
        first = elastic_training.steps_per_epoch(size)
        assert sorted({i for step in seen[0][:first] for i in step}) == list(range(SAMPLES))  # epoch 0, all ranks
        assert sorted({i for step in seen[0][first:] for i in step}) == list(range(SAMPLES))  # and after the loss
        params = elastic_training.params(world, "")
        assert all(elastic_training.bitwise_equal(params[rank], params[0]) for rank in range(now))
        # momentum and position carried through the shrink: as one process on the same samples
        for got, expected in zip(params[0], elastic_training.trained_in_one_process(seen[0])):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        pids = world.all_pids
    assert wait_gone(pids) == []


def test_a_setup_cell_runs_on_every_rank(world: DDPCluster) -> None:
    with pytest.raises(Exception, match="a setup cell runs on every rank"):
        world.execute("x = 1", ranks=[0], setup=True)


def test_what_cannot_be_tracked_is_refused_with_one_line(world: DDPCluster) -> None:
    # a sharded model is tracked when shard_model made it (it can be sharded again on another
    # world size: test_a_killed_rank_of_a_sharded_model...); fully_shard called directly is not
    direct = "from torch.distributed.fsdp import fully_shard\ndirect = fully_shard(torch.nn.Linear(2, 2))"
    sharded = "sharded = ddp_notebook.shard_model(torch.nn.Linear(2, 2))\nopt = torch.optim.SGD(sharded.parameters())"
    try:
        refused = r"'direct' cannot be sharded again .*fully_shard directly.*: shard it with ddp_notebook\.shard_model"
        with pytest.raises(RankError, match=refused):
            world.execute(f"{direct}\nddp_notebook.track(direct=direct)")
        with pytest.raises(RankError, match=r"'opt' optimizes a sharded model: track that model too"):
            world.execute(f"{sharded}\nddp_notebook.track(opt=opt)")
        plain = "plain = torch.utils.data.DataLoader(list(range(4)))\nddp_notebook.track(plain=plain)"
        # a DataLoader over a DistributedSampler is tracked as it is (tests/test_elastic_plain_loops.py)
        refused = r"'plain' draws its samples with a SequentialSampler: track a DataLoader over a DistributedSampler"
        with pytest.raises(RankError, match=refused):
            world.execute(plain)
    finally:
        world.execute("direct = sharded = opt = plain = None")  # the shared world's later heals need not move them
    assert world.execute("from ddp_notebook.rank import elastic\nelastic.tracked()", stream=False).value_text(0) == "[]"


def _loaders(data: TensorDataset, replicas: int) -> list[EpochDataLoader]:
    return [
        EpochDataLoader(data, batch_size=3, sampler=ResumableSampler(data, num_replicas=replicas, rank=r, seed=5))
        for r in range(replicas)
    ]


def _use(loaders: list[EpochDataLoader], batches: int | None, used: list[int]) -> None:
    for loader in loaders:
        for number, (batch,) in enumerate(loader):
            if number == batches:
                break  # the rank died while on this batch: the ones before it were used
            used.extend(batch.tolist())


def test_a_resumed_loader_uses_each_sample_once_in_the_epoch() -> None:
    # one process, every shard of a 2-rank sampler: the loader's own bookkeeping, no world needed
    data = TensorDataset(torch.arange(20))
    loaders = _loaders(data, 2)
    used: list[int] = []
    _use(loaders, 2, used)
    states = [loader.position_state() for loader in loaders]
    assert states == [(1, 12, True), (1, 12, True)]  # epoch 1 begun, 2 batches of 3 on 2 ranks used
    for loader, state in zip(loaders, states):
        loader.resume_from(state)
    _use(loaders, None, used)
    assert all(loader.epoch == 1 and not loader.in_epoch for loader in loaders)
    assert sorted(used) == list(range(20))
    # the next epoch is whole again, and the same as a plain DistributedSampler's
    reference = [list(DistributedSampler(data, num_replicas=2, rank=r, seed=5)) for r in range(2)]
    for sampler in (loader.sampler for loader in loaders):
        sampler.set_epoch(0)
    assert [list(loader.sampler) for loader in loaders] == reference


def test_a_loader_brought_back_keeps_its_place_until_it_is_iterated() -> None:
    """A snapshot taken between a restore and the loader's next iteration (a cell after a
    comeback that does not train, or a training loop stopped mid-epoch with
    `loader.resume_from(loader.position_state())`) holds the place it was brought back to: a
    second loss restored from it goes on in the same epoch, after the same samples."""
    data = TensorDataset(torch.arange(20))
    loaders = _loaders(data, 2)
    used: list[int] = []
    _use(loaders, 2, used)
    state = loaders[0].position_state()
    for loader in loaders:
        loader.resume_from(state)
    assert [loader.position_state() for loader in loaders] == [state, state]  # not yet iterated
    again = _loaders(data, 2)
    for loader in again:
        loader.resume_from(loaders[0].position_state())  # what the second restore does
    _use(again, None, used)
    assert sorted(used) == list(range(20)) and all(loader.epoch == 1 for loader in again)


def test_a_resumed_epoch_draws_nothing_from_torchs_generator() -> None:
    # an epoch's start draws the workers' base seed; a resumed one drew it before its snapshot
    (loader,) = _loaders(TensorDataset(torch.arange(20)), 1)
    _use([loader], 2, [])
    loader.resume_from(loader.position_state())
    before = torch.get_rng_state()
    iter(loader)
    assert torch.equal(torch.get_rng_state(), before)
    iter(loader)  # the next epoch, from its start, draws as any DataLoader does
    assert not torch.equal(torch.get_rng_state(), before)


def test_a_resized_world_deals_the_rest_of_the_epoch_over_the_new_ranks() -> None:
    data = TensorDataset(torch.arange(20))
    two = _loaders(data, 2)
    used: list[int] = []
    _use(two, 2, used)
    state = two[0].position_state()
    three = _loaders(data, 3)  # the survivors' samplers, dealt again, and a new rank's
    for loader in three:
        loader.resume_from(state)
    _use(three, None, used)
    assert sorted(set(used)) == list(range(20))  # nothing skipped
    # 8 samples left for 3 ranks: one repeated so each rank takes as many steps
    assert len(used) == 12 + 9
    sampler = two[0].sampler
    sampler.reshard(3, 2)
    assert (sampler.num_replicas, sampler.rank, sampler.num_samples, sampler.total_size) == (3, 2, 7, 21)
