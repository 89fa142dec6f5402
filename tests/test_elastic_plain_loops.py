"""The tutorial's own loop, tracked: a plain DataLoader over a DistributedSampler (with and without
`set_epoch`), a model wrapped in DDP by hand, and optimizer steps as snapshot points where no loader
is tracked. Real gloo worlds of 2, 3 and 4 ranks, real SIGKILLs mid-epoch, bitwise equal at the end
to an uninterrupted run; the pure rules of a plain loader's place without a world."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from ddp_notebook import DDPCluster, RankDiedError, RankError
from ddp_notebook.rank.tracked_loaders import TrackedDataLoader, adopt
from tests.support.processes import wait_gone

SAMPLES, BATCH, EPOCHS, EVERY = 96, 4, 3, 3

# ---------------------------------------------------------------- the pure rules, one process


def _plain(data: TensorDataset, replicas: int, rank: int) -> tuple[DataLoader, DistributedSampler]:  # type: ignore[type-arg]
    sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, seed=3)
    return DataLoader(data, batch_size=3, sampler=sampler), sampler


def _passes(
    loader: DataLoader,  # type: ignore[type-arg]
    sampler: DistributedSampler,  # type: ignore[type-arg]
    set_epoch: bool,
    stop: tuple[int, int] | None = None,
) -> list[list[int]]:
    """The batches of 3 passes (the tutorial's loop), stopping before the step on batch `stop`."""
    batches = []
    for epoch in range(3):
        if set_epoch:
            sampler.set_epoch(epoch)
        for index, (ids,) in enumerate(loader):
            if (epoch, index) == stop:
                return batches
            batches.append(ids.tolist())
    return batches


@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_a_plain_loader_brought_back_skips_the_passes_done_and_resumes_the_one_it_was_in(set_epoch: bool) -> None:
    data = TensorDataset(torch.arange(20))
    whole = _passes(*_plain(data, 2, 1), set_epoch=set_epoch)
    loader, sampler = _plain(data, 2, 1)
    tracked = adopt("loader", loader)
    assert tracked is loader and isinstance(loader, TrackedDataLoader) and isinstance(sampler, DistributedSampler)
    before = _passes(loader, sampler, set_epoch, stop=(1, 2))  # stopped in the 2nd pass, 2 steps done
    place = tracked.place()
    assert (place.passes, place.used, place.in_pass, place.epoch_set) == (2, 2 * 3 * 2, True, set_epoch)
    tracked.cell_ended()  # the cell failed; the world went back to that place
    tracked.go_to(place)
    assert tracked.place() == place  # held until the next cell's loop reaches it
    rng = torch.get_rng_state()
    after = _passes(loader, sampler, set_epoch)
    assert before + after == whole
    # the finished pass and the resumed one drew nothing from torch's generator (their starts did,
    # before the snapshot); the third pass drew its workers' seed as any DataLoader does
    assert len(after) == len(whole) - len(before)
    assert not torch.equal(torch.get_rng_state(), rng)
    tracked.cell_ended()
    assert _passes(loader, sampler, set_epoch) == whole  # the next cell's loop is whole again


def test_a_plain_loader_brought_back_to_an_epochs_end_starts_the_next_epoch_whole() -> None:
    data = TensorDataset(torch.arange(20))
    whole = _passes(*_plain(data, 2, 0), set_epoch=True)
    loader, sampler = _plain(data, 2, 0)
    tracked = adopt("loader", loader)
    sampler.set_epoch(0)
    first = [ids.tolist() for (ids,) in loader]  # the whole first epoch: its end is a snapshot point
    place = tracked.place()
    assert (place.passes, place.in_pass) == (1, False)
    tracked.cell_ended()
    tracked.go_to(place)
    assert first + _passes(loader, sampler, True) == whole


def test_a_step_point_is_taken_at_the_next_forward_with_the_generators_of_right_after_the_step() -> None:
    """Every 2nd optimizer step is a point; the copy waits for the loop to count the step, and keeps
    the generators as the step left them (the next batch's random data is drawn again on resuming)."""
    from ddp_notebook.rank import step_points
    from ddp_notebook.rank.state import RANK

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken: list[tuple[str, int, torch.Tensor]] = []
    counter = {"step": 0}
    every = RANK.tracked.every
    RANK.tracked.every = 2
    try:
        step_points.watch(
            opt, [model], lambda where, rng: taken.append((where, counter["step"], rng["torch"])), lambda: True
        )
        after_step = []
        for _ in range(5):
            x = torch.randn(3, 2)
            model(x).sum().backward()
            opt.step()
            after_step.append(torch.get_rng_state())
            counter["step"] += 1
        assert [(where, step) for where, step, _ in taken] == [("optimizer step 2", 2), ("optimizer step 4", 4)]
        assert torch.equal(taken[0][2], after_step[1]) and torch.equal(taken[1][2], after_step[3])
    finally:
        step_points.watch(None, [], None, None)  # type: ignore[arg-type]
        RANK.tracked.every = every


def test_a_resumed_pass_draws_nothing_from_torchs_generator() -> None:
    loader, sampler = _plain(TensorDataset(torch.arange(20)), 1, 0)
    tracked = adopt("loader", loader)
    _passes(loader, sampler, True, stop=(0, 2))
    place = tracked.place()
    tracked.cell_ended()
    tracked.go_to(place)
    before = torch.get_rng_state()
    iter(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_plain_loader_resumed_on_more_ranks_deals_the_rest_of_the_pass_over_them() -> None:
    data = TensorDataset(torch.arange(20))
    two = [adopt("loader", _plain(data, 2, rank)[0]) for rank in range(2)]
    used = [i for loader in two for batch, _ in zip(loader, range(2)) for i in batch[0].tolist()]
    for loader in two:
        loader.position = 2
    place = two[0].place()
    three = [adopt("loader", _plain(data, 3, rank)[0]) for rank in range(3)]
    for loader in three:
        loader.go_to(place)
        used += [i for (batch,) in loader for i in batch.tolist()]
    assert sorted(set(used)) == list(range(20))  # nothing skipped (a few repeated: equal shares)


def test_a_loader_that_cannot_be_followed_is_refused_in_one_line() -> None:
    data = TensorDataset(torch.arange(8))
    cases = [
        (DataLoader(data, batch_size=2, sampler=RandomSampler(data)), "draws its samples with a RandomSampler"),
        (DataLoader(data, batch_size=2, shuffle=True), "draws its samples with a RandomSampler"),
        (type("Mine", (DataLoader,), {})(data, batch_size=2), "'loader' is a Mine"),
        (DataLoader(data, batch_sampler=BatchSampler(DistributedSampler(data, 2, 0), 2, False)), "has no batch_size"),
    ]
    for loader, says in cases:
        with pytest.raises(TypeError, match=says) as caught:
            adopt("loader", loader)
        assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- real worlds

# the tutorial's set-up: {p} prefixes the names so that the reference run and the tracked run share
# one world; the model is wrapped in DDP by hand; dropout draws from torch's generator
BUILD = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
torch.manual_seed(0)
{p}data = TensorDataset(torch.randn({n}, 4), torch.randn({n}, 1), torch.arange({n}))
{p}sampler = DistributedSampler({p}data, seed=1)
{p}loader = DataLoader({p}data, batch_size={batch}, sampler={p}sampler)
{p}net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
{p}model = DDP({p}net)
{p}opt = torch.optim.SGD({p}model.parameters(), lr=0.05, momentum=0.9)
{p}step = 0
{p}seen = []  # the global sample ids of every step, gathered from all ranks
"""
TRACK = f"ddp_notebook.track(model=model, opt=opt, loader=loader, step=step, seen=seen, snapshot_every={EVERY})"
# the tutorial's loop, unchanged but for the log and the kill; {set_epoch} is the line or nothing
TRAIN = """
import os, signal
for epoch in range({epochs}):
    {set_epoch}
    for x, y, ids in {p}loader:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, ids.tolist())
        {p}seen.append(sum(gathered, []))
        if rank == KILL_RANK and {p}step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # the others are then in the step's first collective
        loss = torch.nn.functional.mse_loss({p}model(x), y)
        {p}opt.zero_grad()
        loss.backward()
        {p}opt.step()
        {p}step += 1
"""
# no loader: each rank draws its own random batch; the optimizer's steps are the snapshot points
BUILD_STEPS = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
{p}net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
{p}model = DDP({p}net)
{p}opt = torch.optim.SGD({p}model.parameters(), lr=0.05, momentum=0.9)
{p}step = 0
"""
TRACK_STEPS = f"ddp_notebook.track(model=model, opt=opt, step=step, snapshot_every={EVERY})"
TRAIN_STEPS = """
import os, signal
while {p}step < {steps}:
    x = torch.randn(4, 4) + rank
    if rank == KILL_RANK and {p}step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = torch.nn.functional.mse_loss({p}model(x), x.sum(1, keepdim=True))
    {p}opt.zero_grad()
    loss.backward()
    {p}opt.step()
    {p}step += 1
"""
STEPS = 20
# (world size, the rank killed): the last, the middle, the last
SIZES = [(2, 1), (3, 1), (4, 3)]


@pytest.fixture(scope="module", params=SIZES, ids=[f"{size}ranks" for size, _ in SIZES])
def world(request: pytest.FixtureRequest) -> Iterator[tuple[DDPCluster, int]]:
    """One world per size for the module; each test starts from nothing tracked."""
    size, victim = request.param
    with DDPCluster(size, backend="gloo", collective_timeout=60, max_restarts=10) as cluster:
        pids = cluster.all_pids
        yield cluster, victim
        pids += cluster.all_pids
    assert wait_gone(pids) == []


def _forget_tracking(world: DDPCluster) -> None:
    """The previous test's tracked state and setup cells are gone (a fresh world, for less time)."""
    world.setup_cells.clear()
    world.execute(
        "from ddp_notebook.rank import elastic, step_points\nfrom ddp_notebook.rank.state import RANK\n"
        "step_points.watch(None, [], None, None)\nRANK.tracked.objects.clear()\nRANK.tracked.snapshots.clear()",
        stream=False,
    )


def _params(world: DDPCluster, prefix: str) -> dict[int, list[torch.Tensor]]:
    world.execute(f"params_now = [p.detach().clone() for p in {prefix}model.parameters()]", stream=False)
    return world.pull("params_now")


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _run(world: DDPCluster, code: str, kill_rank: int = -1, kill_at: int = -1) -> None:
    world.push({"KILL_RANK": kill_rank, "KILL_AT": kill_at})
    world.execute(code, stream=False)


def _steps_per_epoch(size: int) -> int:
    return math.ceil(math.ceil(SAMPLES / size) / BATCH)


@pytest.mark.integration
@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_the_tutorial_loop_tracked_resumes_mid_epoch_after_a_kill_and_ends_bitwise_equal(
    world: tuple[DDPCluster, int], set_epoch: bool
) -> None:
    cluster, victim = world
    size = cluster.world_size
    _forget_tracking(cluster)
    line = "{p}sampler.set_epoch(epoch)" if set_epoch else "pass"
    train = TRAIN.replace("{set_epoch}", line).replace("{epochs}", str(EPOCHS))
    # the same loop, uninterrupted
    cluster.execute(BUILD.format(p="ref_", n=SAMPLES, batch=BATCH), stream=False)
    _run(cluster, train.format(p="ref_"))
    reference, reference_seen = _params(cluster, "ref_")[0], cluster.pull("ref_seen", ranks=[0])[0]

    cluster.execute(BUILD.format(p="", n=SAMPLES, batch=BATCH) + TRACK, setup=True, stream=False)
    survivor = cluster.ranks[0].pid
    kill_at = _steps_per_epoch(size) + EVERY + 1  # epoch 1, one step after the snapshot at its batch 3
    with pytest.raises(RankDiedError) as caught:
        _run(cluster, train.format(p=""), kill_rank=victim, kill_at=kill_at)
    message = str(caught.value)
    assert message.startswith(f"rank {victim} was killed by SIGKILL. Rank {victim} came back in "), message
    assert f"the snapshot taken at epoch 1, batch {EVERY}" in message, message
    assert cluster.ranks[0].pid == survivor and cluster.world_size == size
    assert cluster.pull("step") == {rank: kill_at - 1 for rank in range(size)}  # one step lost

    _run(cluster, train.format(p=""))  # the same cell again: epoch 0 is skipped, epoch 1 goes on
    params = _params(cluster, "")
    for rank in range(size):
        assert _bitwise_equal(params[rank], reference), f"rank {rank} differs from the uninterrupted run"
    seen = cluster.pull("seen")
    assert all(log == reference_seen for log in seen.values())
    per_epoch = _steps_per_epoch(size)
    for epoch in range(EPOCHS):
        used = {i for step in seen[0][epoch * per_epoch : (epoch + 1) * per_epoch] for i in step}
        assert used == set(range(SAMPLES)), f"epoch {epoch} skipped samples"


@pytest.mark.integration
def test_the_tutorial_loop_that_raised_midway_is_rolled_back_and_ends_bitwise_equal(
    world: tuple[DDPCluster, int],
) -> None:
    """A rank raises mid-epoch while the others wait in a collective: `rollback()` brings every rank
    to the newest snapshot (the model wrapped by hand gets a fresh reducer), and the same cell run
    again ends as the uninterrupted run."""
    cluster, victim = world
    size = cluster.world_size
    _forget_tracking(cluster)
    train = TRAIN.replace("{set_epoch}", "{p}sampler.set_epoch(epoch)").replace("{epochs}", str(EPOCHS))
    cluster.execute(BUILD.format(p="ref_", n=SAMPLES, batch=BATCH), stream=False)
    _run(cluster, train.format(p="ref_"))
    reference = _params(cluster, "ref_")[0]

    cluster.execute(BUILD.format(p="", n=SAMPLES, batch=BATCH) + TRACK, setup=True, stream=False)
    raising = train.replace("os.kill(os.getpid(), signal.SIGKILL)", "raise RuntimeError('stopped midway')")
    fail_at = _steps_per_epoch(size) + EVERY + 1
    with pytest.raises(RankError, match="stopped midway"):
        _run(cluster, raising.format(p=""), kill_rank=victim, kill_at=fail_at)
    assert cluster.rollback() == f"epoch 1, batch {EVERY}"
    _run(cluster, train.format(p=""))
    params = _params(cluster, "")
    for rank in range(size):
        assert _bitwise_equal(params[rank], reference), f"rank {rank} differs from the uninterrupted run"


@pytest.mark.integration
def test_optimizer_steps_are_snapshot_points_where_no_loader_is_tracked(world: tuple[DDPCluster, int]) -> None:
    cluster, victim = world
    size = cluster.world_size
    _forget_tracking(cluster)
    cluster.execute(BUILD_STEPS.format(p="ref_"), stream=False)
    _run(cluster, TRAIN_STEPS.format(p="ref_", steps=STEPS))
    reference = _params(cluster, "ref_")

    cluster.execute(BUILD_STEPS.format(p="") + TRACK_STEPS, setup=True, stream=False)
    kill_at = 3 * EVERY + 1  # one step after the point at step 9
    with pytest.raises(RankDiedError) as caught:
        _run(cluster, TRAIN_STEPS.format(p="", steps=STEPS), kill_rank=victim, kill_at=kill_at)
    assert f"the snapshot taken at optimizer step {3 * EVERY}" in str(caught.value), str(caught.value)
    # the point is the start of the next step: the loop's counter had moved on with the weights
    assert cluster.pull("step") == {rank: 3 * EVERY for rank in range(size)}

    _run(cluster, TRAIN_STEPS.format(p="", steps=STEPS))
    params = _params(cluster, "")
    for rank in range(size):
        assert _bitwise_equal(params[rank], reference[rank]), f"rank {rank} differs from the uninterrupted run"


@pytest.mark.integration
def test_a_world_that_goes_on_without_a_lost_rank_deals_the_rest_of_the_epoch_over_the_survivors() -> None:
    """`--on-loss shrink` (what an SSH world does when a host is lost): the survivors go on at one
    rank fewer from the snapshot mid-epoch; the plain sampler is dealt again over them, so the same
    cell run again uses every sample of that epoch (the rest padded, as DistributedSampler pads)."""
    with DDPCluster(3, backend="gloo", collective_timeout=60, on_loss="shrink") as cluster:
        pids = cluster.all_pids
        cluster.execute(BUILD.format(p="", n=SAMPLES, batch=BATCH) + TRACK, setup=True, stream=False)
        train = TRAIN.replace("{set_epoch}", "sampler.set_epoch(epoch)").replace("{epochs}", str(EPOCHS))
        kill_at = _steps_per_epoch(3) + EVERY + 1
        with pytest.raises(RankDiedError, match=rf"went on without rank 1 .* snapshot taken at epoch 1, batch {EVERY}"):
            _run(cluster, train.format(p=""), kill_rank=1, kill_at=kill_at)
        assert cluster.world_size == 2 and cluster.pull("step") == {0: kill_at - 1, 1: kill_at - 1}
        _run(cluster, train.format(p=""))
        seen = cluster.pull("seen")
        assert seen[0] == seen[1]
        left = SAMPLES - EVERY * BATCH * 3  # epoch 1 after the snapshot, dealt over 2 ranks
        epochs = [_steps_per_epoch(3), EVERY + math.ceil(left / (BATCH * 2)), _steps_per_epoch(2)]
        assert len(seen[0]) == sum(epochs)
        for epoch, steps in enumerate(epochs):
            begin = sum(epochs[:epoch])
            used = {i for step in seen[0][begin : begin + steps] for i in step}
            assert used == set(range(SAMPLES)), f"epoch {epoch} skipped samples"
        pids += cluster.all_pids
    assert wait_gone(pids) == []
