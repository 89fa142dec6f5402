"""The tracked training run of the elastic tests (tests/test_elastic.py, tests/test_persisting.py,
tests/test_multinode.py): its cells (`BUILD`, `TRACK`, `TRAIN`: a model with dropout, SGD with
momentum, a resumable loader, every step's sample ids logged), the same run uninterrupted in the same
world as a reference (`reference`), the checks that a run ends bitwise equal to it, each sample used
once an epoch (`ends_like`), and what one process gets from the same steps (`trained_in_one_process`)."""

from __future__ import annotations

import math

import torch

from ddp_notebook import DDPCluster

SAMPLES, EPOCHS = 64, 2

# the model, data and optimizer of both runs; {p} prefixes the names so that the reference
# run and the tracked run share one world without touching each other's state; {wrap} is
# prepare_model (DDP) or shard_model (FSDP2: the inner Sequential's two Linear layers are
# sharded one by one, then the root); {drop} is the dropout's probability (its masks come from
# torch's generator, which a snapshot keeps)
BUILD = """
import torch
from torch.utils.data import DistributedSampler, TensorDataset
torch.manual_seed(0)
{p}data = TensorDataset(torch.randn({n}, 4), torch.randn({n}, 1), torch.arange({n}))
{p}net = torch.nn.Sequential(
    torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout({drop}), torch.nn.Linear(8, 1))
)
{p}model = ddp_notebook.{wrap}({p}net)
{p}opt = torch.optim.SGD({p}model.parameters(), lr=0.05, momentum=0.9)
{p}loader = ddp_notebook.prepare_loader({p}data, batch_size=4, seed=1)
{p}step = 0
{p}seen = []  # the global sample ids of every step, gathered from all ranks
"""
TRACK = "ddp_notebook.track(model=model, opt=opt, loader=loader, step=step, seen=seen, snapshot_every=3)"
# resumable: the loop runs until the loader started every epoch; a resumed epoch skips what it used
TRAIN = """
import os, signal
while {p}loader.epoch < {epochs}:
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
# the whole parameters (a sharded one is gathered: every rank runs this)
PARAMS = "[getattr(p, 'full_tensor', p.detach)().detach().clone() for p in {p}model.parameters()]"
DDP, FSDP = "prepare_model", "shard_model"
DROP = 0.5  # the comeback tests train with dropout: a rank brought back needs the generator's state too


def train(world: DDPCluster, prefix: str, kill_rank: int = -1, kill_at: int = -1, epochs: int = EPOCHS) -> None:
    world.push({"KILL_RANK": kill_rank, "KILL_AT": kill_at})
    world.execute(TRAIN.format(p=prefix, epochs=epochs))


def params(world: DDPCluster, prefix: str) -> dict[int, list[torch.Tensor]]:
    world.execute(f"params_now = {PARAMS.format(p=prefix)}")
    return world.pull("params_now")


def build(prefix: str, wrap: str, drop: float) -> str:
    return BUILD.format(p=prefix, n=SAMPLES, wrap=wrap, drop=drop)


def reference(world: DDPCluster, wrap: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The same training, uninterrupted, in this world: its final parameters and sample log."""
    world.execute(build("ref_", wrap, DROP))
    train(world, "ref_")
    reference = params(world, "ref_")
    assert all(bitwise_equal(reference[0], reference[rank]) for rank in reference)
    return reference[0], world.pull("ref_seen", ranks=[0])[0]


def ends_like(world: DDPCluster, reference: list[torch.Tensor], reference_seen: list[list[int]]) -> None:
    """Every rank's parameters are bitwise the reference's; each sample was used once an epoch."""
    trained = params(world, "")
    for rank in range(world.world_size):
        assert bitwise_equal(trained[rank], reference), f"rank {rank} differs from the uninterrupted run"
    seen = world.pull("seen")
    assert all(log == reference_seen for log in seen.values())
    each_sample_once_per_epoch(seen[0], world.world_size)


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def steps_per_epoch(size: int) -> int:
    return math.ceil(math.ceil(SAMPLES / size) / 4)  # batches of 4 of each rank's shard


def padded(size: int) -> int:
    """Samples in an epoch: DistributedSampler repeats a few to give every rank as many."""
    return math.ceil(SAMPLES / size) * size


def each_sample_once_per_epoch(seen: list[list[int]], size: int) -> None:
    per_epoch = steps_per_epoch(size)
    assert len(seen) == per_epoch * EPOCHS
    for epoch in range(EPOCHS):
        used = sorted(i for step in seen[epoch * per_epoch : (epoch + 1) * per_epoch] for i in step)
        assert sorted(set(used)) == list(range(SAMPLES)) and len(used) == padded(size), f"epoch {epoch}: {used}"


def trained_in_one_process(seen: list[list[int]]) -> list[torch.Tensor]:
    """The parameters one process gets from the same steps, each on the samples all ranks used in it
    (every rank's batch has as many samples, so the world's mean gradient is this batch's)."""
    torch.manual_seed(0)  # as BUILD does
    x, y = torch.randn(SAMPLES, 4), torch.randn(SAMPLES, 1)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))  # no dropout (0.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for ids in seen:
        loss = torch.nn.functional.mse_loss(net(x[ids]), y[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in net.parameters()]
