"""Each use of torch's private internals (ddp_notebook.torch_adapter), on the ranks of a real world.

torch is bounded in pyproject.toml to the versions these tests pass on. The heal, comeback and
X-ray tests rely on the same functions (test_elastic, test_sharding, test_xray).
"""

from __future__ import annotations

import pytest

from ddp_notebook import DDPCluster

pytestmark = pytest.mark.integration


def test_the_flight_recorder_reads_as_data(world: DDPCluster) -> None:
    # the recorder retires a gloo collective from its own thread, a moment after the call returned
    world.execute(
        "import time\n"
        "from ddp_notebook import torch_adapter\n"
        "dist.all_reduce(torch.ones(3, 2))\n"
        "deadline = time.monotonic() + 10\n"
        "while True:\n"
        "    recorded = torch_adapter.flight_recorder(entries=True)\n"
        "    last = [e for e in recorded['entries'] if 'default_pg' in e['process_group']][-1]\n"
        "    if last['retired'] or time.monotonic() > deadline:\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "status = torch_adapter.flight_recorder(entries=False)['pg_status'][str(last['pg_id'])]"
    )
    for rank, last in world.pull("last").items():
        assert (last["profiling_name"], last["input_sizes"], last["retired"]) == ("gloo:all_reduce", [[3, 2]], True)
        status = world.pull("status")[rank]
        assert int(status["last_completed_collective"]) == last["collective_seq_id"]


def test_a_ddp_model_follows_the_group_it_is_moved_to(world: DDPCluster) -> None:
    # on a group of its own a rank keeps its own gradient; back on the world's, DDP averages again
    world.execute(
        "import datetime\n"
        "from ddp_notebook import torch_adapter\n"
        "torch.manual_seed(0)\n"
        "moved = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))\n"
        "def grad():\n"
        "    moved.zero_grad()\n"
        "    moved(torch.full((1, 2), rank + 1.0)).sum().backward()\n"
        "    return moved.module.weight.grad.clone()\n"
        "alone = torch_adapter.lone_gloo_group(datetime.timedelta(seconds=30))\n"
        "torch_adapter.move_ddp(moved, alone)\n"
        "own = grad()\n"
        "torch_adapter.move_ddp(moved, dist.group.WORLD)\n"
        "averaged = grad()"
    )
    own, averaged = world.pull("own"), world.pull("averaged")
    assert own[0].tolist() == [[1.0, 1.0]] and own[1].tolist() == [[2.0, 2.0]]
    assert averaged[0].tolist() == averaged[1].tolist() == [[1.5, 1.5]]


def test_a_ddp_model_unhooked_lets_a_new_reducer_take_over(world: DDPCluster) -> None:
    world.execute(
        "from ddp_notebook import torch_adapter\n"
        "torch.manual_seed(0)\n"
        "old = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))\n"
        "old(torch.ones(1, 2)).sum().backward()\n"
        "torch_adapter.drop_ddp_hooks(old)\n"
        "new = torch.nn.parallel.DistributedDataParallel(old.module)\n"
        "old.module.zero_grad()\n"
        "new(torch.full((1, 2), rank + 1.0)).sum().backward()\n"
        "taken_over = old.module.weight.grad.clone()"
    )
    assert {rank: g.tolist() for rank, g in world.pull("taken_over").items()} == {0: [[1.5, 1.5]], 1: [[1.5, 1.5]]}


def test_fsdp2_state_is_read_and_shared(world: DDPCluster) -> None:
    world.execute(
        "from torch.distributed import _composable_state\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from ddp_notebook import torch_adapter\n"
        "torch.manual_seed(0)\n"
        "sharded = fully_shard(torch.nn.Linear(4, 4))\n"
        "root_before = torch_adapter.fsdp_is_root(sharded)\n"
        "sharded(torch.ones(1, 4)).sum().backward()\n"
        "root_after = torch_adapter.fsdp_is_root(sharded)\n"
        "group = torch_adapter.fsdp_param_group(sharded)\n"
        "mesh_size = group.mesh_info.mesh.size()\n"
        "held = len(group.fsdp_params)\n"
        "stand_in = torch.nn.Linear(4, 4)\n"
        "torch_adapter.share_fsdp_state(stand_in, sharded)\n"
        "shared = _composable_state._get_module_state(stand_in) is _composable_state._get_module_state(sharded)"
    )
    for name, expected in {
        "root_before": None,
        "root_after": True,
        "mesh_size": 2,
        "held": 2,
        "shared": True,
    }.items():
        assert world.pull(name) == {0: expected, 1: expected}, name
