"""DDP does what it promises, on a real 2-rank gloo world driven by %%ddp-style cells."""

from __future__ import annotations

import pytest
import torch

from ddp_notebook import DDPCluster
from tests.support.training import BATCH_PER_RANK, LR, MODEL_CODE, STEPS, train_single_process

pytestmark = pytest.mark.integration


@pytest.mark.core
@pytest.mark.fast  # the fast lane's proof of DDP itself, on the shared world
def test_ddp_matches_one_process_on_the_combined_batch(world: DDPCluster) -> None:
    world.push({"MODEL_CODE": MODEL_CODE, "STEPS": STEPS, "BATCH": BATCH_PER_RANK, "LR": LR})
    world.execute(
        "exec(MODEL_CODE)\n"
        # ranks start from different weights: wrapping must broadcast rank 0's
        "model = ddp_notebook.prepare_model(make_model(seed=1234 + rank))\n"
        "x, y = make_data(STEPS, BATCH * world_size)\n"
        "dataset = torch.utils.data.TensorDataset(x, y)\n"
        "loader = ddp_notebook.prepare_loader(dataset, batch_size=BATCH, shuffle=False)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=LR)\n"
        "fetched_as = type(loader.dataset).__name__\n"
    )
    assert world.pull("fetched_as") == {0: "BatchedTensors", 1: "BatchedTensors"}  # a batch at a time
    # unshuffled shards interleave (rank r gets rows r, r + 2, ...), so batch k of the two
    # ranks together is exactly rows [k * 2B, (k + 1) * 2B): the single process's batch k
    world.execute(
        "for xb, yb in loader:\n"
        "    optimizer.zero_grad()\n"
        "    torch.nn.functional.cross_entropy(model(xb), yb).backward()\n"
        "    optimizer.step()\n"
        "params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}\n"
    )
    per_rank = world.pull("params")
    expected = train_single_process(STEPS, BATCH_PER_RANK * 2)
    initial: dict = {}
    exec(MODEL_CODE, initial)
    start = initial["make_model"]().state_dict()
    for name, value in expected.items():
        assert torch.equal(per_rank[0][name], per_rank[1][name]), f"ranks disagree on {name}"
        torch.testing.assert_close(per_rank[0][name], value, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(value, start[name]), f"{name} did not train"


def test_sampler_shards_are_disjoint_and_cover_the_data(world: DDPCluster) -> None:
    world.execute(
        "shard_loader = ddp_notebook.prepare_loader(list(range(101)), batch_size=10)\n"
        "epoch0 = [int(i) for batch in shard_loader for i in batch]\n"
        "epoch1 = [int(i) for batch in shard_loader for i in batch]\n"
    )
    epoch0, epoch1 = world.pull("epoch0"), world.pull("epoch1")
    for epoch in (epoch0, epoch1):
        assert len(epoch[0]) == len(epoch[1]) == 51  # 101 items padded to 102 so shards are equal
        assert set(epoch[0]) | set(epoch[1]) == set(range(101))
        overlap = set(epoch[0]) & set(epoch[1])
        assert len(overlap) <= 1  # only the one padding item repeats
    # the loader advances the sampler's epoch itself: a new shuffle each epoch
    assert epoch0[0] != epoch1[0]


def test_checkpoint_is_written_by_rank_0_only(world: DDPCluster, tmp_path) -> None:
    target = tmp_path / "ckpt" / "model.pt"
    world.push({"target": str(target)})
    world.execute(
        "ckpt_model = ddp_notebook.prepare_model(torch.nn.Linear(3, 2))\n"
        "saved = ddp_notebook.save_checkpoint(ckpt_model, target)\n"
        "main = ddp_notebook.is_main()\n"
        "ddp_notebook.barrier()\n"
    )
    assert world.pull("saved") == {0: str(target), 1: None}
    assert world.pull("main") == {0: True, 1: False}
    state = torch.load(target)
    assert set(state) == {"weight", "bias"}  # a plain state_dict, loadable without DDP
    assert [p.name for p in target.parent.iterdir()] == ["model.pt"]  # no temporary file left
