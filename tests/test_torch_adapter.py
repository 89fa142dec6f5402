"""Each use of torch's private internals (ddp_notebook.rank.torch_adapter), on the ranks of a real world.

benchmarks/compat.py runs them on every torch of the supported range (docs/compatibility.md). The heal, comeback and
X-ray tests rely on the same functions (test_elastic, test_sharding, test_xray).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_notebook import DDPCluster

pytestmark = [pytest.mark.integration, pytest.mark.core]


def test_the_flight_recorder_reads_as_data(world: DDPCluster) -> None:
    world.execute("from ddp_notebook.rank import torch_adapter\nnative = torch_adapter.native_flight_recorder()")
    if not all(world.pull("native").values()):
        # torch 2.6: gloo keeps no recorder; the X-ray reads the rank's own record instead
        world.execute(
            "from ddp_notebook.rank import collective_record\n"
            "dist.all_reduce(torch.ones(3, 2))\n"
            "last = collective_record.entries(1)[-1]"
        )
        for last in world.pull("last").values():
            seen = (last["op"], last["shapes"], last["dtypes"], last["retired"])
            assert seen == ("all_reduce", [[3, 2]], ["Float"], True)
        return
    # the recorder retires a gloo collective from its own thread, a moment after the call returned
    world.execute(
        "import time\n"
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
        assert last["input_dtypes"] == ["Float"]  # as the ranks' own record names them
        status = world.pull("status")[rank]
        assert int(status["last_completed_collective"]) == last["collective_seq_id"]


def test_a_ddp_model_follows_the_group_it_is_moved_to(world: DDPCluster) -> None:
    # on a group of its own a rank keeps its own gradient; back on the world's, DDP averages again
    world.execute(
        "import datetime\n"
        "from ddp_notebook.rank import torch_adapter\n"
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
        "from ddp_notebook.rank import torch_adapter\n"
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


def test_a_ddp_models_bucket_layout_is_read_and_given_to_a_fresh_reducer(world: DDPCluster) -> None:
    # a comeback gives the fresh reducers the survivors' layout (on 3+ ranks another one sums in
    # another order); a reducer given one reads it back before DDP's own logging data shows it
    world.execute(
        "from ddp_notebook.rank import torch_adapter\n"
        "two = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))\n"
        "def layouts(model, steps):\n"
        "    seen = [torch_adapter.ddp_bucket_layout(model)]\n"
        "    for _ in range(steps):\n"
        "        model(torch.ones(1, 2)).sum().backward()\n"
        "        seen.append(torch_adapter.ddp_bucket_layout(model))\n"
        "    torch_adapter.drop_ddp_hooks(model)\n"
        "    return seen\n"
        "read = layouts(torch.nn.parallel.DistributedDataParallel(two), 4)\n"
        "kept = layouts(torch_adapter.fresh_ddp(two, read[-1]), 4)\n"
        "initial = layouts(torch_adapter.fresh_ddp(two, None), 1)\n"
        "split = torch_adapter.fresh_ddp(two, [[3, 2], [1, 0]])\n"
        "split_sizes = split._get_ddp_logging_data()['bucket_sizes']\n"
        "split_read = layouts(split, 0)"
    )
    ready_order = [[3, 2, 1, 0]]  # each Linear's bias, then its weight, the last Linear first
    for rank in range(2):
        read = world.pull("read")[rank]
        assert read[0] is None and read[-1] == ready_order, read
        assert world.pull("kept")[rank] == [ready_order] * 5, "given: read back at once, and kept"
        assert world.pull("initial")[rank] == [None, None], "none given: DDP's initial layout, nothing to read"
        # two buckets as given (bytes of float32: bias 1 + weight 3, then bias 3 + weight 6), read back
        assert sorted(int(size) for size in world.pull("split_sizes")[rank].split(",")) == [16, 36]
        assert world.pull("split_read")[rank] == [[[3, 2], [1, 0]]]


def test_a_users_ddp_model_gives_back_the_options_it_was_made_with(world: DDPCluster) -> None:
    # a model the user wrapped (tracked: wrapped again after a comeback) keeps its non-default options
    world.execute(
        "from ddp_notebook.rank import torch_adapter\n"
        "DDP = torch.nn.parallel.DistributedDataParallel\n"
        "plain = torch_adapter.ddp_options(DDP(torch.nn.Linear(2, 1)))\n"
        "made = DDP(torch.nn.Linear(2, 1), find_unused_parameters=True, gradient_as_bucket_view=True,\n"
        "           broadcast_buffers=False)\n"
        "options = torch_adapter.ddp_options(made)\n"
        "again = torch_adapter.ddp_options(DDP(made.module, **options))"
    )
    assert world.pull("plain") == {0: {}, 1: {}}
    options = world.pull("options")[0]
    assert options["find_unused_parameters"] and options["gradient_as_bucket_view"]
    assert False in (options.get("forward_sync_buffers"), options.get("broadcast_buffers"))
    assert world.pull("again")[0] == options


def test_fsdp2_state_is_read_and_shared(world: DDPCluster) -> None:
    world.execute("from ddp_notebook.rank import torch_adapter\non_cpu = torch_adapter.fsdp2_on_cpu()")
    if not all(world.pull("on_cpu").values()):
        pytest.skip("this torch's fully_shard needs a GPU stream (said at %ddp_start); these ranks are on CPU")
    world.execute(
        "from torch.distributed import _composable_state\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from ddp_notebook.rank import torch_adapter\n"
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


# two gloo ranks forked in one subprocess: each case breaks the group as a world's ranks see it
# happen, and rank 0 judges the real exception it got
BROKEN_GROUPS = """
import datetime, json, os, socket, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp
from ddp_notebook.rank import torch_adapter

def run(rank, port, case, answers):
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        if case == "peer died":
            time.sleep(0.3)
            os._exit(3)
        if case == "peer never came":
            time.sleep(5)
            os._exit(0)
    try:
        if case == "group released":
            dist.barrier()
            dist.destroy_process_group()
        elif case == "the user's own error":
            raise ValueError("bad batch")
        dist.all_reduce(torch.ones(1))
        answer = (case, None, None)
    except Exception as error:
        answer = (case, type(error).__name__, torch_adapter.breaks_group(error))
    if rank == 0:  # the judge; rank 1 is the peer that breaks the group
        answers.put(answer)
    os._exit(0)

if __name__ == "__main__":
    answers = mp.get_context("fork").SimpleQueue()
    for case in ("peer died", "peer never came", "group released", "the user's own error"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        context = mp.start_processes(run, args=(port, case, answers), nprocs=2, join=False, start_method="fork")
        print(json.dumps(answers.get()), flush=True)
        for process in context.processes:
            process.join(10)
"""


def test_a_broken_group_is_told_by_the_exception_torch_raises(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    script = tmp_path / "broken_groups.py"
    script.write_text(BROKEN_GROUPS)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # the answers, one JSON line each (torch 2.9's gloo prints "[Gloo] Rank 0 is connected to ..." there too)
    answers = [line for line in run.stdout.splitlines() if line.startswith('["')]
    seen = {case: (kind, broken) for case, kind, broken in map(json.loads, answers)}
    assert seen == {
        "peer died": ("RuntimeError", True),  # gloo: "Connection closed by peer"
        "peer never came": ("RuntimeError", True),  # gloo: "Timed out waiting ... for recv"
        "group released": ("ValueError", True),  # "Default process group has not been initialized"
        "the user's own error": ("ValueError", False),
    }


def test_torchs_own_distributed_errors_break_the_group_by_type() -> None:
    import torch.distributed as dist

    from ddp_notebook.rank.torch_adapter import breaks_group

    assert breaks_group(dist.DistBackendError("NCCL communicator was aborted"))
    assert breaks_group(dist.DistNetworkError("anything at all"))  # the type decides, not the words
    assert not breaks_group(KeyError("nccl"))  # neither a RuntimeError nor torch's: the user's


def test_a_whole_checkpoint_is_written_and_read_from_one_rank_of_a_running_world(
    world: DDPCluster, tmp_path: Path
) -> None:
    # inside a group (where DCP would otherwise make every rank take part), from rank 0 alone
    folder = tmp_path / "ckpt"
    world.execute(
        "from pathlib import Path\n"
        "from ddp_notebook.rank import persisting, torch_adapter\n"
        "written = {'w': torch.arange(4.0), 'structure': persisting._Structure({'opt': {0: (1, 'a')}}, {})}\n"
        "if rank == 0:\n"
        f"    torch_adapter.save_whole_checkpoint(written, Path({str(folder)!r}))\n"
        "dist.barrier()\n"
        "fmt = torch_adapter.checkpoint_format()\n"
        f"back = torch_adapter.read_whole_checkpoint(Path({str(folder)!r}), fmt)\n"
        "same = torch.equal(back['w'], written['w']) and back['structure'] == written['structure']",
        stream=False,
    )
    assert world.pull("same") == {0: True, 1: True}
    fmt = world.pull("fmt")[0]
    # torch.distributed.checkpoint's own files, or (torch 2.6: it saves from one process only with
    # every rank taking part) one torch.save file
    assert (folder / ".metadata").is_file() if fmt == "dcp" else (folder / "state.pt").is_file()
