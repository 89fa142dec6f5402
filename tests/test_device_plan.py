"""Which GPU each rank uses, without a GPU: one rule for every launcher, and a start-up whose
first CUDA call is `torch.cuda.set_device(LOCAL_RANK)`.

The rule: every rank on a host sees the same GPUs in the same order (the world's GPUs on this
machine, or all of its host's under another launcher) and uses the one at its LOCAL_RANK, as
CUDA device `cuda:LOCAL_RANK`, as under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_notebook.errors import DDPUsageError
from ddp_notebook.platform import devices
from ddp_notebook.platform.devices import gpu_problem, rank_device
from ddp_notebook.rank import torch_adapter
from ddp_notebook.wire.xray_messages import OWN_RECORD_LIMIT
from ddp_notebook.world import layout
from ddp_notebook.world.layout import EngineIdentity, gpu_visibility, place_ranks

ROOT = Path(__file__).resolve().parent.parent


def described(monkeypatch: pytest.MonkeyPatch, visible: str | None, count: int = 0) -> tuple[str, ...]:
    """The GPUs a rank reports (`rank_calls.describe`) when it starts with this CUDA_VISIBLE_DEVICES."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(devices, "_count_gpus", lambda: count)
    return devices.visible_gpus()


def plan(placements: list[layout.Placement]) -> list[tuple[str, str | None, str]]:
    return [(p.host, p.gpu, rank_device(p.gpu, p.local_rank)) for p in placements]


def test_a_local_world_sees_the_world_gpus_and_uses_cuda_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # `%ddp_start --gpus 2,3` on a machine with 4 GPUs: every rank starts with the same list
    visible = gpu_visibility(("2", "3"), machine_has_gpus=True)
    assert visible == "2,3"
    gpus = described(monkeypatch, visible, count=4)
    assert gpus == ("2", "3")
    engines = [EngineIdentity(engine_id=7, host="h", pid=1, slot=1, gpus=gpus), EngineIdentity(6, "h", 2, 0, gpus=gpus)]
    placements = place_ranks(engines, use_gpus=True)
    assert plan(placements) == [("h", "2", "cuda:0"), ("h", "3", "cuda:1")]
    assert [p.engine_id for p in placements] == [6, 7]  # slots decide ranks
    # each rank checks, from its environment alone, that its GPU is CUDA device LOCAL_RANK there
    assert all(gpu_problem(p.gpu, p.local_rank, devices.listed_gpus()) is None for p in placements if p.gpu)


def test_a_launcher_world_follows_the_same_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # mpiexec / Slurm / SSH: two hosts of 2 GPUs each, CUDA_VISIBLE_DEVICES unset, tasks interleaved
    gpus = described(monkeypatch, None, count=2)
    assert gpus == ("0", "1")
    engines = [EngineIdentity(i, host, 100 + i, launcher_rank=i, gpus=gpus) for i, host in enumerate("abab")]
    placements = place_ranks(engines, use_gpus=True)
    assert plan(placements) == [("a", "0", "cuda:0"), ("a", "1", "cuda:1"), ("b", "0", "cuda:0"), ("b", "1", "cuda:1")]
    assert all(gpu_problem(p.gpu, p.local_rank, devices.listed_gpus()) is None for p in placements if p.gpu)
    # a site that lists its GPUs by UUID: the same positions
    uuids = described(monkeypatch, "GPU-aa,GPU-bb")
    placed = place_ranks([EngineIdentity(i, "c", i, launcher_rank=i, gpus=uuids) for i in range(2)], use_gpus=True)
    assert plan(placed) == [("c", "GPU-aa", "cuda:0"), ("c", "GPU-bb", "cuda:1")]
    assert all(gpu_problem(p.gpu, p.local_rank, devices.listed_gpus()) is None for p in placed if p.gpu)


def test_cpu_ranks_see_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_visibility((), machine_has_gpus=False) is None  # nothing to hide: inherit
    visible = gpu_visibility((), machine_has_gpus=True)
    assert visible == ""  # gloo ranks on a GPU machine stay off the GPUs
    gpus = described(monkeypatch, visible, count=4)
    assert gpus == ()
    placed = place_ranks([EngineIdentity(i, "h", i, slot=i, gpus=gpus) for i in range(3)], use_gpus=False)
    assert plan(placed) == [("h", None, "cpu")] * 3


def test_a_per_rank_mask_is_refused_with_its_cause() -> None:
    # the old convention, each rank masked to its own GPU: rank 1 would ask for a cuda:1 it lacks
    problem = gpu_problem("3", 1, ("3",))
    assert problem is not None and problem.startswith("its LOCAL_RANK is 1 but its process sees 1 GPU(s)")
    assert "(CUDA_VISIBLE_DEVICES=3)" in problem and "the same GPUs in the same order" in problem
    # the same GPUs in another order: cuda:1 would be the neighbour's GPU
    swapped = gpu_problem("3", 1, ("3", "2"))
    assert swapped is not None and swapped.startswith("CUDA device 1 of its process is GPU 2, not GPU 3")
    hidden = gpu_problem("0", 0, ())
    assert hidden is not None and "CUDA_VISIBLE_DEVICES hides every GPU" in hidden
    assert gpu_problem("1", 1, None) is None  # unset: CUDA shows the host's GPUs, numbered as described
    # a host whose ranks each see one GPU cannot place two ranks
    masked = [EngineIdentity(i, "h", i, launcher_rank=i, gpus=(str(i),)) for i in range(2)]
    with pytest.raises(DDPUsageError, match="host h runs 2 ranks but its ranks see 1 GPU"):
        place_ranks(masked, use_gpus=True)


def test_mig_instances_cannot_be_ranks_of_one_world() -> None:
    layout.check_world_gpus(("0", "1"))
    layout.check_world_gpus(("MIG-aaaa",))  # one MIG instance: a one-rank world
    with pytest.raises(DDPUsageError, match="a CUDA process can use only one MIG instance"):
        layout.check_world_gpus(("MIG-aaaa", "MIG-bbbb"))
    # a rank given them all would find only the first: refused before its first CUDA call
    problem = gpu_problem("MIG-bbbb", 1, ("MIG-aaaa", "MIG-bbbb"))
    assert problem is not None and problem.startswith("its process is given several MIG instances")
    assert "NCCL does not support MIG" in problem
    assert gpu_problem("MIG-aaaa", 0, ("MIG-aaaa",)) is None


def test_listed_gpus_reads_the_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.listed_gpus() is None
    for value, entries in (("", ()), ("2, 3", ("2", "3")), ("0,-1,2", ("0",)), ("GPU-x", ("GPU-x",))):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert devices.listed_gpus() == entries


def test_context_outside_a_world_uses_cuda_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun (no ddp_notebook world), the helpers follow the same rule."""
    from ddp_notebook.rank import membership
    from ddp_notebook.rank.state import RANK

    monkeypatch.setattr(RANK.membership, "context", None)
    monkeypatch.setattr(membership.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(membership.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(membership.dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(membership.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert membership.context().device == torch.device("cuda", 1)
    # a launcher that masked each process to its one GPU: the device the script selected
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert membership.context().device == torch.device("cuda", 0)


# ---------------------------------------------------------------- the start-up's CUDA calls, in order


def record_startup(tmp_path: Path, visible: str | None, *args: str) -> dict[str, Any]:
    """Run a rank's start-up in a fresh process with torch's CUDA entry points recorded
    (tests/support/cuda_calls.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK")}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / f"calls-{len(list(tmp_path.iterdir()))}.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.cuda_calls", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.exists(), f"the recorder wrote nothing (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(out.read_text(encoding="utf8"))


def cuda_calls(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[0].startswith(("torch.cuda.", "torch.accelerator."))]


def assert_set_device_first(result: dict[str, Any], local_rank: int) -> None:
    assert "error" not in result, result.get("traceback")
    calls = result["calls"]
    first = cuda_calls(calls)[0]
    assert first in (
        ["torch.cuda.set_device", str(local_rank)],
        ["torch.accelerator.set_device_index", str(local_rank)],
    ), f"the first CUDA call of the start-up must select cuda:{local_rank}; it was {first}"
    # every (re)selection picks the same GPU; the group is formed after it, bound to that GPU
    selections = [c for c in calls if c[0].endswith(("set_device", "set_device_index"))]
    assert {c[1] for c in selections} == {str(local_rank)}
    groups = [i for i, c in enumerate(calls) if c[0] == "dist.init_process_group"]
    assert len(groups) == 2  # the start and the heal
    for index in groups:
        assert calls[index][1:] == ["nccl", f"cuda:{local_rank}"]
        assert any(c[0].endswith("set_device") for c in calls[:index]), "group formed before set_device"
    heal = calls.index(["heal"])
    after_heal = cuda_calls(calls[heal:])
    assert after_heal and after_heal[0][0].endswith("set_device")
    # no call names another GPU
    for call in cuda_calls(calls):
        assert all(arg in ("", str(local_rank), f"cuda:{local_rank}") for arg in call[1:]), call


def test_a_gpu_rank_selects_its_gpu_before_any_other_cuda_call(tmp_path: Path) -> None:
    # a local world's rank 1 on GPUs 4,5: it sees both and must pick cuda:1 (GPU 5), on rank 0 of
    # a one-rank group so that the device follows LOCAL_RANK, not RANK
    result = record_startup(tmp_path, "4,5", "--gpu", "5", "--local-rank", "1")
    assert_set_device_first(result, 1)
    # (a rank on the notebook's host serves no X-ray over TCP)
    expected = {"device": "cuda:1", "device_name": "Fake GPU 1", "backend": "nccl", "xray_address": None}
    # what this torch lacks, said at %ddp_start: only the X-ray's own record on a GPU rank (no CPU FSDP2 line)
    own_record = not torch_adapter.native_flight_recorder()
    assert result["info"] == {**expected, "off_here": [OWN_RECORD_LIMIT] if own_record else []}
    assert result["published"] == {"rank": "0", "world_size": "1", "local_rank": "1", "device": "cuda:1"}
    assert result["helpers"] == {
        "model_to": "cuda:1",
        "ddp_device_ids": [1],
        "barrier_device_ids": [1],
        "loader_pin_memory": True,
        "context_device": "cuda:1",
    }


def test_a_launcher_rank_takes_the_same_path(tmp_path: Path) -> None:
    # CUDA_VISIBLE_DEVICES unset (every GPU of the host), as under mpiexec or Slurm
    result = record_startup(tmp_path, None, "--gpu", "1", "--local-rank", "1", "--gpus", "4")
    assert_set_device_first(result, 1)
    assert result["published"]["device"] == "cuda:1"


@pytest.mark.parametrize("inject", ["device-count-at-import", "tensor-before-set-device"])
def test_the_recorder_catches_a_cuda_call_before_set_device(tmp_path: Path, inject: str) -> None:
    """The order check is not vacuous: a CUDA call moved before set_device fails it."""
    if inject == "tensor-before-set-device" and torch.backends.cuda.is_built():
        pytest.skip("makes a real CUDA tensor where torch has CUDA; the CPU build runs it")
    result = record_startup(tmp_path, "4,5", "--gpu", "5", "--local-rank", "1", "--inject", inject)
    with pytest.raises(AssertionError, match="the first CUDA call of the start-up must select cuda:1"):
        assert_set_device_first(result, 1)


def test_a_masked_rank_fails_before_touching_cuda(tmp_path: Path) -> None:
    result = record_startup(tmp_path, "5", "--gpu", "5", "--local-rank", "1")
    assert result["error"].startswith("RuntimeError: this rank cannot use GPU 5 as cuda:1: its LOCAL_RANK is 1")
    assert cuda_calls(result["calls"]) == []


def test_a_cpu_rank_never_touches_cuda(tmp_path: Path) -> None:
    result = record_startup(tmp_path, "", "--backend", "gloo")
    assert "error" not in result, result.get("traceback")
    assert cuda_calls(result["calls"]) == []
    assert result["published"]["device"] == "cpu"
    assert result["helpers"]["ddp_device_ids"] is None and result["helpers"]["loader_pin_memory"] is False


# ---------------------------------------------------------------- a world that shrank or grew


def test_a_gpu_survivor_of_a_shrink_keeps_its_gpu_and_local_rank() -> None:
    """Its tensors and CUDA context are on its GPU: renumbering it on its host would tell it another."""
    seen = ("0", "1", "2", "3")
    four = place_ranks([EngineIdentity(i, "h", 100 + i, slot=i, gpus=seen) for i in range(4)], use_gpus=True)
    after = layout.place_again([p for p in four if p.rank not in (0, 2)], [])  # ranks 0 and 2 lost
    assert [(p.rank, p.gpu, p.local_rank, p.local_world_size) for p in after] == [(0, "1", 1, 2), (1, "3", 3, 2)]
    assert [(p.engine_id, p.pid) for p in after] == [(1, 101), (3, 103)]
    assert all(gpu_problem(p.gpu, p.local_rank, seen) is None for p in after if p.gpu)
    # two launcher hosts, the first one lost: the second's ranks become 0 and 1 on group 0
    hosts = place_ranks([EngineIdentity(i, h, i, launcher_rank=i, gpus=("0", "1")) for i, h in enumerate("aabb")], True)
    kept = layout.place_again([p for p in hosts if p.host == "b"], [])
    assert [(p.rank, p.host, p.gpu, p.local_rank, p.group_rank) for p in kept] == [
        (0, "b", "0", 0, 0),
        (1, "b", "1", 1, 0),
    ]
    # CPU ranks count their local ranks again
    cpu = place_ranks([EngineIdentity(i, "h", i, slot=i) for i in range(3)], use_gpus=False)
    assert [(p.rank, p.local_rank, p.gpu) for p in layout.place_again(cpu[1:], [])] == [(0, 0, None), (1, 1, None)]


def test_a_grown_gpu_world_gives_new_ranks_free_gpus_under_the_device_rule() -> None:
    machine = ("0", "1", "2", "3")
    two = place_ranks([EngineIdentity(i, "h", i, slot=i, gpus=("0", "1")) for i in range(2)], use_gpus=True)
    # %ddp_resize 3: the new process sees the world's list with one free GPU of the machine appended
    seen = layout.grown_gpus(3, ("0", "1"), ("0", "1"), machine)
    assert seen == ("0", "1", "2")
    grown = layout.place_again(two, [EngineIdentity(9, "h", 9, slot=2, gpus=seen)])
    assert [(p.rank, p.gpu, p.local_rank, p.local_world_size) for p in grown] == [
        (0, "0", 0, 3),
        (1, "1", 1, 3),
        (2, "2", 2, 3),
    ]
    # the running ranks keep their shorter list: theirs is a prefix, so cuda:LOCAL_RANK is still their GPU
    assert all(gpu_problem(p.gpu, p.local_rank, ("0", "1")) is None for p in grown[:2] if p.gpu)
    assert gpu_problem("2", 2, seen) is None
    # a world on --gpus 2,3 takes the machine's others in its order; a shrunk one reuses its own first
    assert layout.grown_gpus(4, ("2", "3"), ("2", "3"), machine) == ("2", "3", "0", "1")
    assert layout.grown_gpus(4, machine, ("1", "2", "3"), machine) == machine
    refilled = layout.place_again(
        layout.place_again([p for p in grown if p.rank != 0], []), [EngineIdentity(8, "h", 8, slot=3, gpus=machine)]
    )
    assert [(p.gpu, p.local_rank) for p in refilled] == [("1", 1), ("2", 2), ("0", 0)]
    # too few: one line with the most it can be
    with pytest.raises(
        DDPUsageError, match=r"5 GPU ranks need 1 more GPU\(s\) and this machine has 0 free .*no rank can"
    ):
        layout.grown_gpus(5, machine, machine, machine)
    with pytest.raises(DDPUsageError, match=r"6 GPU ranks need 4 more .* has 2 free \(2, 3\): %ddp_resize 4 at most"):
        layout.grown_gpus(6, ("0", "1"), ("0", "1"), machine)
    with pytest.raises(DDPUsageError, match="host h has no free GPU for a new rank: its ranks hold 0, 1"):
        layout.place_again(two, [EngineIdentity(9, "h", 9, slot=2, gpus=("0", "1"))])


def test_a_rank_added_by_a_resize_selects_its_gpu_first(tmp_path: Path) -> None:
    # the third rank of a world grown from GPUs 0,1: it sees 0,1,2 and must pick cuda:2
    result = record_startup(tmp_path, "0,1,2", "--gpu", "2", "--local-rank", "2", "--gpus", "4")
    assert_set_device_first(result, 2)
    assert result["published"]["device"] == "cuda:2"


def test_a_survivor_with_a_gap_below_it_stays_on_its_gpu(tmp_path: Path) -> None:
    # after a shrink: LOCAL_RANK 3 on a host of 2 ranks (0 and 2 lost); its group is formed again
    result = record_startup(
        tmp_path, "0,1,2,3", "--gpu", "3", "--local-rank", "3", "--local-world-size", "2", "--gpus", "4"
    )
    assert_set_device_first(result, 3)
    assert result["published"] == {"rank": "0", "world_size": "1", "local_rank": "3", "device": "cuda:3"}
