"""FSDP2 through ddp_notebook: shard_model's policy, equality with one process, DCP checkpoints
saved on 2 ranks and loaded on 3 and on 1, and sharded models kept working through a heal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddp_notebook import DDPCluster, RankError
from tests.support.worlds import shared_world

pytestmark = pytest.mark.integration

MODEL = (
    "import torch\n"
    "class Blocks(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))\n"
    "        self.head = torch.nn.Linear(6, 2)\n"
    "    def forward(self, x):\n"
    "        for layer in self.layers:\n"
    "            x = torch.tanh(layer(x))\n"
    "        return self.head(x)\n"
)
BATCH = "torch.manual_seed(123)\nglobal_x = torch.randn(12, 6)\n"


def blocks_model(seed: int) -> torch.nn.Module:
    namespace: dict[str, object] = {}
    exec(MODEL, namespace)
    torch.manual_seed(seed)
    return namespace["Blocks"]()  # type: ignore[operator]


FULL = "full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}\n"


def test_shard_model_shards_each_block_then_the_root_and_matches_one_process(world: DDPCluster) -> None:
    world.execute(
        MODEL + BATCH + "torch.manual_seed(0)\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "model = ddp_notebook.prepare_model(Blocks(), shard=True)\n"
        "units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))\n"
        "again = ddp_notebook.prepare_model(model, shard=True) is model and ddp_notebook.shard_model(model) is model\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    optimizer.zero_grad()\n"
        "    x = global_x.chunk(world_size)[rank]\n"
        "    model(x).square().mean().backward()\n"
        "    optimizer.step()\n" + FULL,
        stream=False,
    )
    assert world.pull("units") == {r: ["", "layers.0", "layers.1", "layers.2"] for r in (0, 1)}
    assert world.pull("again") == {0: True, 1: True}
    reference = blocks_model(0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(123)
    global_x = torch.randn(12, 6)
    for _ in range(3):
        optimizer.zero_grad()
        reference(global_x).square().mean().backward()
        optimizer.step()
    full = world.pull("full", ranks=[0])[0]
    for name, value in reference.named_parameters():
        torch.testing.assert_close(full[name], value.detach(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def three_ranks() -> Iterator[DDPCluster]:
    yield from shared_world(3)


def test_a_checkpoint_saved_on_2_ranks_loads_on_3_and_in_one_process(
    world: DDPCluster, three_ranks: DDPCluster, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    world.push({"ckpt": str(directory)})
    world.execute(
        MODEL + "torch.manual_seed(7)\n"
        "model = ddp_notebook.shard_model(Blocks())\n"
        "written = ddp_notebook.save_checkpoint(model, ckpt)\n" + FULL,
        stream=False,
    )
    saved = world.pull("full", ranks=[0])[0]
    assert set(world.pull("written").values()) == {str(directory)}
    assert len(list(directory.glob("*.distcp"))) == 2  # one shard file per rank

    three_ranks.push({"ckpt": str(directory)})
    three_ranks.execute(
        MODEL + "torch.manual_seed(99)\n"  # other values: the checkpoint must replace them
        "model = ddp_notebook.shard_model(Blocks())\n"
        "ddp_notebook.load_checkpoint(model, ckpt)\n" + FULL,
        stream=False,
    )
    on_three = three_ranks.pull("full")
    for rank in range(3):
        for name, value in saved.items():
            torch.testing.assert_close(on_three[rank][name], value)

    plain = blocks_model(99)
    from ddp_notebook import load_checkpoint

    load_checkpoint(plain, directory)  # this process: no process group at all
    for name, value in plain.named_parameters():
        torch.testing.assert_close(value.detach(), saved[name])


TRAIN = (
    "for i in range(5):\n"
    "    optimizer.zero_grad()\n"
    "    model(torch.randn(4, 6)).sum().backward()\n"
    "    optimizer.step()\n"
    "    step += 1\n"
    "    if rank == 1 and step == 7:\n"
    "        raise ValueError('bad batch at step 7')\n"
)


def test_sharded_models_keep_working_after_a_heal(three_ranks: DDPCluster) -> None:
    world = three_ranks
    world.execute(
        MODEL + "torch.manual_seed(0)\n"
        "model = ddp_notebook.shard_model(Blocks())\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "step = 0\n",
        stream=False,
    )
    world.execute(TRAIN, stream=False)
    with pytest.raises(RankError) as caught:
        world.execute(TRAIN, stream=False)  # the others wait in FSDP's collectives for rank 1
    assert caught.value.root_cause.rank == 1
    assert world.state == "healthy", f"{caught.value}\n{world.collectives()}"
    world.execute(
        "import os\nrestarts = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "optimizer.zero_grad()\n"
        "model(torch.randn(4, 6)).sum().backward()\n"
        "optimizer.step()\n" + FULL,
        stream=False,
    )
    assert set(world.pull("restarts").values()) == {"1"}  # rank 0's count: one heal
    full = world.pull("full")
    for name, value in full[0].items():
        for rank in (1, 2):
            torch.testing.assert_close(full[rank][name], value)


MOMENTUM_STEP = (
    "def momentum_step(model, optimizer):\n"
    "    optimizer.zero_grad()\n"
    "    model(global_x.chunk(world_size)[rank]).square().mean().backward()\n"
    "    optimizer.step()\n"
)


def test_the_optimizers_state_is_saved_with_the_shards_and_loads_on_3_ranks_and_in_one_process(
    world: DDPCluster, three_ranks: DDPCluster, tmp_path: Path
) -> None:
    """Momentum saved on 2 ranks, loaded on 3 and in one process: the next step is the same everywhere."""
    directory = tmp_path / "with_optimizer"
    world.push({"ckpt": str(directory)})
    world.execute(
        MODEL + BATCH + MOMENTUM_STEP + "torch.manual_seed(5)\n"
        "model = ddp_notebook.shard_model(Blocks())\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "for _ in range(3):\n"
        "    momentum_step(model, optimizer)\n"
        "ddp_notebook.save_checkpoint(model, ckpt, optimizer=optimizer)\n"
        "momentum_step(model, optimizer)\n" + FULL,
        stream=False,
    )
    after = world.pull("full", ranks=[0])[0]  # one step past the checkpoint, on 2 ranks

    three_ranks.push({"ckpt": str(directory)})
    three_ranks.execute(
        MODEL + BATCH + MOMENTUM_STEP + "torch.manual_seed(99)\n"
        "model = ddp_notebook.shard_model(Blocks())\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "ddp_notebook.load_checkpoint(model, ckpt, optimizer=optimizer)\n"
        "momentum_step(model, optimizer)\n" + FULL,
        stream=False,
    )
    on_three = three_ranks.pull("full")
    for rank in range(3):
        for name, value in after.items():
            torch.testing.assert_close(on_three[rank][name], value, rtol=1e-5, atol=1e-6)

    from ddp_notebook import load_checkpoint

    plain = blocks_model(99)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(plain, directory, optimizer=optimizer)  # this process: no process group at all
    torch.manual_seed(123)
    global_x = torch.randn(12, 6)
    optimizer.zero_grad()
    plain(global_x).square().mean().backward()
    optimizer.step()
    for name, value in plain.named_parameters():
        torch.testing.assert_close(value.detach(), after[name], rtol=1e-5, atol=1e-6)

    # without the momentum the step would differ: the check above can fail
    bare = blocks_model(99)
    load_checkpoint(bare, directory)
    fresh = torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9)
    fresh.zero_grad()
    bare(global_x).square().mean().backward()
    fresh.step()
    assert not all(torch.allclose(p.detach(), after[n], rtol=1e-5, atol=1e-6) for n, p in bare.named_parameters())


def test_a_ddp_checkpoint_file_carries_the_optimizers_state(world: DDPCluster, tmp_path: Path) -> None:
    target = tmp_path / "ddp.pt"
    world.push({"target": str(target)})
    world.execute(
        MODEL + "torch.manual_seed(3)\n"
        "model = ddp_notebook.prepare_model(Blocks())\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "optimizer.zero_grad()\n"
        "model(torch.ones(4, 6)).sum().backward()\n"
        "optimizer.step()\n"
        "ddp_notebook.save_checkpoint(model, target, optimizer=optimizer)\n"
        "momentum = [optimizer.state[p]['momentum_buffer'].tolist() for p in model.parameters()]\n",
        stream=False,
    )
    from ddp_notebook import load_checkpoint

    plain = blocks_model(0)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(plain, target, optimizer=optimizer)
    saved = world.pull("momentum", ranks=[0])[0]
    for parameter, expected in zip(plain.parameters(), saved):
        torch.testing.assert_close(optimizer.state[parameter]["momentum_buffer"], torch.tensor(expected))


def test_a_checkpoint_without_optimizer_state_says_so(tmp_path: Path) -> None:
    from ddp_notebook import load_checkpoint

    model = blocks_model(0)
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(model, tmp_path / "plain.pt", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
