"""NCCL worlds on the GPUs of this machine (marker `gpu`).

Every test skips, with the reason, where torch has no CUDA or the machine has too few GPUs, so
the CPU suite never depends on a GPU. `bash benchmarks/gpu_suite.sh` runs them with the
throughput benchmark and writes every figure to benchmarks/results/gpu.md; with
DDP_NOTEBOOK_GPU_RESULTS set to a folder, each test leaves its figures there as JSON.

The rule under test: every rank sees the world's GPUs in the same order and uses
`cuda:LOCAL_RANK`, selected before any other CUDA call, so no rank has a CUDA context on
another rank's GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_notebook import DDPCluster, RankDiedError
from ddp_notebook.errors import DDPUsageError
from tests.support import training as correctness
from tests.support.processes import wait_gone

pytestmark = pytest.mark.gpu

RESULTS_ENV = "DDP_NOTEBOOK_GPU_RESULTS"
MAX_RANKS = 8
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# the CPU correctness test's model, data and settings, with helpers the GPU cells use
MODEL_CODE = (
    correctness.MODEL_CODE
    + """
def my_rows(step):
    # this rank's share of the step's global batch: together, the ranks' rows are the whole batch
    start = step * BATCH * world_size + rank * BATCH
    return slice(start, start + BATCH)

def gathered_equal(module):
    # the same parameters on every rank?
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return all(torch.equal(other, everyone[0]) for other in everyone)
"""
)
STEPS, BATCH_PER_RANK, LR = correctness.STEPS, correctness.BATCH_PER_RANK, correctness.LR

# each rank: where it runs, as CUDA and the environment describe it
PLACEMENT_CODE = """
import os
_props = torch.cuda.get_device_properties(device)
placement = dict(
    device=str(device), local_rank=local_rank, current=torch.cuda.current_device(),
    count=torch.cuda.device_count(), visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    uuid=str(getattr(_props, "uuid", "")), name=_props.name, pid=os.getpid(),
)
"""

# each rank: the GPUs on which its process holds an active primary context (CUDA driver API;
# torch and NCCL use primary contexts), in its own CUDA numbering
CONTEXTS_CODE = """
import ctypes
_cuda = ctypes.CDLL("libcuda.so.1")
assert _cuda.cuInit(0) == 0
_count = ctypes.c_int()
assert _cuda.cuDeviceGetCount(ctypes.byref(_count)) == 0
active_contexts = []
for _ordinal in range(_count.value):
    _dev, _flags, _active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert _cuda.cuDeviceGet(ctypes.byref(_dev), _ordinal) == 0
    assert _cuda.cuDevicePrimaryCtxGetState(_dev, ctypes.byref(_flags), ctypes.byref(_active)) == 0
    if _active.value:
        active_contexts.append(_ordinal)
"""

# collectives of every kind NCCL sets up paths for (peer-to-peer / IPC between the ranks' GPUs)
COLLECTIVES_CODE = """
_t = torch.full((1 << 20,), float(rank + 1), device=device)
dist.all_reduce(_t)
_parts = [torch.zeros(1 << 16, device=device) for _ in range(world_size)]
dist.all_gather(_parts, torch.full((1 << 16,), float(rank), device=device))
dist.broadcast(_t, src=world_size - 1)
if world_size > 1:
    _peer = (rank + 1) % world_size
    _ops = [dist.P2POp(dist.isend, _t[:1024], _peer), dist.P2POp(dist.irecv, _t[1024:2048], (rank - 1) % world_size)]
    for _request in dist.batch_isend_irecv(_ops):
        _request.wait()
torch.cuda.synchronize(device)
collectives_ok = bool(_t[0].item() == world_size * (world_size + 1) / 2) and all(
    bool((part == r).all()) for r, part in enumerate(_parts)
)
"""


# ---------------------------------------------------------------- what this machine has


def gpus_here() -> tuple[int, str]:
    """(GPUs torch sees, why none) without making a CUDA context in this process."""
    if not torch.backends.cuda.is_built():
        return 0, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return 0, "torch has CUDA support but no GPU (or driver) answers here"
    return torch.cuda.device_count(), ""


def need_gpus(wanted: int) -> int:
    """Skip unless this machine has `wanted` GPUs; returns how many ranks to run (one per GPU, up to 8)."""
    count, why = gpus_here()
    if count < wanted:
        pytest.skip(why or f"needs {wanted} GPUs; this machine has {count}")
    return min(count, MAX_RANKS)


def record(name: str, title: str, columns: list[str], rows: list[list[Any]], note: str = "") -> None:
    """Leave a figure for benchmarks/gpu_suite.sh (a table), where DDP_NOTEBOOK_GPU_RESULTS names a folder."""
    folder = os.environ.get(RESULTS_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    figure = {"title": title, "columns": columns, "rows": rows, "note": note}
    (Path(folder) / f"{name}.json").write_text(json.dumps(figure, indent=1, default=str), encoding="utf8")


def normal_uuid(text: str) -> str:
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def nvml_contexts() -> tuple[dict[int, set[str]], str]:
    """NVML's per-process list: {pid: UUIDs of the GPUs it has a context on}, and the source."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        pynvml = None
    found: dict[int, set[str]] = {}
    if pynvml is not None:
        pynvml.nvmlInit()
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    found.setdefault(int(process.pid), set()).add(normal_uuid(uuid))
        finally:
            pynvml.nvmlShutdown()
        return found, "NVML (nvidia-ml-py)"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("neither nvidia-ml-py nor nvidia-smi is installed: no NVML process list")
    listing = subprocess.run(
        [smi, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for line in listing.stdout.splitlines():
        pid, _, uuid = (part.strip() for part in line.partition(","))
        if pid.isdigit():
            found.setdefault(int(pid), set()).add(normal_uuid(uuid))
    return found, "NVML (nvidia-smi --query-compute-apps)"


def start_world(n: int, **options: Any) -> DDPCluster:
    world = DDPCluster(n, backend="nccl", collective_timeout=120, **options)
    world.start()
    return world


def stop_world(world: DDPCluster) -> None:
    pids = world.all_pids
    world.stop()
    assert wait_gone(pids) == [], "processes of the GPU world outlived stop()"


@pytest.fixture(scope="module")
def gpu_world() -> Iterator[DDPCluster]:
    """One rank per GPU (up to 8; one GPU: a world of one rank, still NCCL and the device rule),
    nccl, shared by the tests that need no world of their own."""
    world = start_world(need_gpus(1))
    try:
        world.push({"MODEL_CODE": MODEL_CODE, "STEPS": STEPS, "BATCH": BATCH_PER_RANK, "LR": LR})
        world.execute("exec(MODEL_CODE)", stream=False)
        yield world
    finally:
        stop_world(world)


def rule(world: DDPCluster) -> dict[int, str]:
    """The device each rank must use: cuda:LOCAL_RANK."""
    return {info.rank: f"cuda:{info.local_rank}" for info in world.ranks}


def placements(world: DDPCluster) -> dict[int, dict[str, Any]]:
    world.execute(PLACEMENT_CODE, stream=False)
    return world.pull("placement")


def check_placements(found: dict[int, dict[str, Any]], world_size: int, name: str, title: str) -> None:
    """Each rank on cuda:LOCAL_RANK, the current device; the ranks of a host see the same GPUs."""
    record(
        name,
        title,
        ["rank", "device", "current device", "GPUs seen", "CUDA_VISIBLE_DEVICES", "GPU", "uuid"],
        [
            [r, p["device"], p["current"], p["count"], p["visible"], p["name"], p["uuid"]]
            for r, p in sorted(found.items())
        ],
    )
    assert sorted(found) == list(range(world_size))
    for rank, p in found.items():
        assert p["device"] == f"cuda:{p['local_rank']}", (rank, p)
        assert p["current"] == p["local_rank"], f"rank {rank}: set_device({p['local_rank']}) did not hold: {p}"
        assert p["count"] >= world_size, f"rank {rank} sees {p['count']} GPU(s): the world's GPUs must all be visible"
    assert len({p["visible"] for p in found.values()}) == 1, "ranks of one host see different GPU lists"
    assert len({p["uuid"] for p in found.values()}) == world_size, "two ranks share a GPU"


# ---------------------------------------------------------------- the device rule, on hardware


def test_every_rank_sees_the_world_gpus_and_uses_cuda_local_rank(gpu_world: DDPCluster) -> None:
    check_placements(placements(gpu_world), gpu_world.world_size, "placement", "Device of each rank (local world)")
    assert all(info.device == f"cuda:{info.local_rank}" for info in gpu_world.ranks)


def test_ddp_on_nccl_matches_one_process_on_the_combined_batch(gpu_world: DDPCluster) -> None:
    n = gpu_world.world_size
    gpu_world.execute(
        # ranks start from different weights: wrapping must broadcast rank 0's
        "model = ddp_notebook.prepare_model(make_model(seed=1234 + rank))\n"
        "x, y = make_data(STEPS, BATCH * world_size)\n"
        "loader = ddp_notebook.prepare_loader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=LR)\n"
        "for xb, yb in loader:\n"
        "    optimizer.zero_grad()\n"
        "    torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device)).backward()\n"
        "    optimizer.step()\n"
        "params = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}\n"
        "ddp_param_device = str(next(model.parameters()).device)\n",
        stream=False,
    )
    per_rank = gpu_world.pull("params")
    assert gpu_world.pull("ddp_param_device") == rule(gpu_world)
    expected = reference_parameters(n)
    worst = 0.0
    for name, value in expected.items():
        for rank in range(1, n):
            assert torch.equal(per_rank[0][name], per_rank[rank][name]), f"ranks 0 and {rank} disagree on {name}"
        torch.testing.assert_close(per_rank[0][name], value, rtol=1e-4, atol=1e-5)
        worst = max(worst, float((per_rank[0][name] - value).abs().max()))
    record(
        "ddp_equality",
        "DDP on nccl against one process on the combined batch",
        ["ranks", "steps", "batch per rank", "largest parameter difference", "ranks identical"],
        [[n, STEPS, BATCH_PER_RANK, f"{worst:.2e}", "yes"]],
        "one process trains on the CPU in float32; tolerance rtol 1e-4, atol 1e-5",
    )


def reference_parameters(world_size: int) -> dict[str, torch.Tensor]:
    """One process on the CPU (no CUDA context in the test process), global batch = all ranks' batches."""
    return correctness.train_single_process(STEPS, BATCH_PER_RANK * world_size)


def test_no_rank_holds_a_context_on_another_ranks_gpu(gpu_world: DDPCluster) -> None:
    """Asked of the CUDA driver inside each rank, after collectives of every kind."""
    gpu_world.execute(COLLECTIVES_CODE, stream=False)
    assert set(gpu_world.pull("collectives_ok").values()) == {True}
    gpu_world.execute(CONTEXTS_CODE, stream=False)
    active = gpu_world.pull("active_contexts")
    found = placements(gpu_world)
    record(
        "contexts_driver",
        "Active primary CUDA contexts of each rank's process (CUDA driver API), after the collectives",
        ["rank", "device", "contexts on (CUDA numbering)"],
        [[r, found[r]["device"], ",".join(map(str, active[r]))] for r in sorted(active)],
    )
    for rank, ordinals in active.items():
        assert ordinals == [found[rank]["local_rank"]], f"rank {rank} holds contexts on GPUs {ordinals}"


def test_nvml_lists_each_rank_on_its_own_gpu_only(gpu_world: DDPCluster) -> None:
    """NVML's per-process list, read from outside the ranks."""
    gpu_world.execute(COLLECTIVES_CODE, stream=False)
    found = placements(gpu_world)
    contexts, source = nvml_contexts()
    pids = {rank: p["pid"] for rank, p in found.items()}
    if not any(pid in contexts for pid in pids.values()):
        pytest.skip(f"{source} lists none of the ranks' PIDs (a container's PID namespace?): {sorted(contexts)}")
    record(
        "contexts_nvml",
        f"GPUs on which each rank's process has a context, from {source}",
        ["rank", "pid", "own GPU", "GPUs with a context of this process"],
        [
            [
                r,
                pids[r],
                normal_uuid(found[r]["uuid"])[:13],
                ",".join(u[:13] for u in sorted(contexts.get(pids[r], ()))),
            ]
            for r in sorted(found)
        ],
    )
    for rank, pid in pids.items():
        assert contexts.get(pid) == {normal_uuid(found[rank]["uuid"])}, (
            f"rank {rank} (pid {pid}) has contexts on {contexts.get(pid)}, "
            f"its GPU is {normal_uuid(found[rank]['uuid'])}"
        )


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="Open MPI's mpiexec is not installed")
def test_resize_gives_new_ranks_free_gpus_and_keeps_the_others_on_theirs() -> None:
    count = need_gpus(2)
    world = start_world(1, gpus=[0])
    try:
        world.execute("import os\nkept_pid = os.getpid()\nmarker = torch.full((4,), 7.0, device=device)", stream=False)
        world.resize(count)
        found = placements(world)
        assert [found[r]["device"] for r in sorted(found)] == [f"cuda:{r}" for r in range(count)]
        assert len({p["uuid"] for p in found.values()}) == count, "two ranks share a GPU"
        assert found[0]["visible"] == "0" and found[count - 1]["visible"] == ",".join(map(str, range(count)))
        world.execute(COLLECTIVES_CODE, stream=False)
        assert set(world.pull("collectives_ok").values()) == {True}
        assert world.pull("marker", ranks=[0])[0].tolist() == [7.0] * 4  # rank 0 kept its tensor and GPU
        world.resize(1)
        assert world.config.gpus == ("0",)
        assert placements(world)[0]["device"] == "cuda:0"
    finally:
        stop_world(world)


def test_resize_past_the_gpus_of_the_machine_says_so_and_keeps_the_world() -> None:
    count = need_gpus(1)
    world = start_world(count)
    try:
        with pytest.raises(DDPUsageError, match=f"{count + 1} GPU ranks need 1 more GPU.*no rank can be added"):
            world.resize(count + 1)
        assert world.world_size == count
        world.execute(COLLECTIVES_CODE, stream=False)
        assert set(world.pull("collectives_ok").values()) == {True}
    finally:
        stop_world(world)


# a tracked run on the GPUs: dropout draws from each GPU's generator, Adam keeps GPU state;
# {p} keeps the reference run's names apart from the tracked run's in one world
ELASTIC_BUILD = """
from torch.utils.data import TensorDataset
torch.manual_seed(0)
{p}data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1), torch.arange(96))
{p}model = ddp_notebook.prepare_model(torch.nn.Sequential(
    torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)))
{p}opt = torch.optim.Adam({p}model.parameters(), lr=0.01)
{p}loader = ddp_notebook.prepare_loader({p}data, batch_size=4, seed=1)
{p}step = 0
"""
ELASTIC_TRAIN = """
import os, signal
while {p}loader.epoch < 2:
    for x, y, ids in {p}loader:
        if rank == KILL_RANK and {p}step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss({p}model(x.to(device)), y.to(device))
        {p}opt.zero_grad()
        loss.backward()
        {p}opt.step()
        {p}step += 1
{p}params = [p.detach().cpu().clone() for p in {p}model.parameters()]
{p}where = sorted({{str(p.device) for p in {p}model.parameters()}}
    | {{str(s.device) for st in {p}opt.state.values() for s in st.values() if torch.is_tensor(s) and s.dim()}})
"""


def test_a_killed_gpu_rank_comes_back_on_its_gpu_and_ends_bitwise_equal() -> None:
    """SIGKILL mid-epoch on the last GPU rank: its new process takes the same GPU, gets the
    snapshot (parameters, Adam's state and the GPU generator) back onto it, and the run ends
    bitwise equal to the uninterrupted one in the same world."""
    n = need_gpus(1)
    world = start_world(n, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    try:
        world.push({"KILL_RANK": -1, "KILL_AT": -1})
        world.execute(ELASTIC_BUILD.format(p="ref_") + ELASTIC_TRAIN.format(p="ref_"), stream=False)
        reference = world.pull("ref_params")
        track = "ddp_notebook.track(model=model, opt=opt, loader=loader, step=step, snapshot_every=3)"
        world.execute(ELASTIC_BUILD.format(p="") + track, setup=True, stream=False)
        victim = n - 1
        old_pid = world.ranks[victim].pid
        world.push({"KILL_RANK": victim, "KILL_AT": 96 // (4 * n) + 4})  # epoch 1, after a snapshot
        with pytest.raises(RankDiedError, match=f"Rank {victim} came back in"):
            world.execute(ELASTIC_TRAIN.format(p=""), stream=False)
        assert world.ranks[victim].pid != old_pid and world.state == "healthy"
        assert world.ranks[victim].device == f"cuda:{world.ranks[victim].local_rank}"
        world.push({"KILL_RANK": -1})
        world.execute(ELASTIC_TRAIN.format(p=""), stream=False)
        ours = world.pull("params")
        for rank in range(n):
            assert all(torch.equal(a, b) for a, b in zip(ours[rank], reference[rank])), f"rank {rank} differs"
        assert world.pull("where") == {info.rank: [f"cuda:{info.local_rank}"] for info in world.ranks}
        check_placements(placements(world), n, "placement_comeback", "Device of each rank after a comeback")
        record(
            "comeback",
            "A GPU rank SIGKILLed mid-epoch comes back on its GPU",
            ["ranks", "rank killed", "parameters against the uninterrupted run", "tensors on"],
            [[n, victim, "bitwise equal", f"cuda:{world.ranks[victim].local_rank}"]],
        )
    finally:
        stop_world(world)


def test_a_world_through_the_mpi_launcher_follows_the_same_rule() -> None:
    n = need_gpus(2)
    world = start_world(n, launcher="mpi", mpi_args="--oversubscribe", env=MPI_ENV)
    try:
        check_placements(placements(world), n, "placement_mpi", "Device of each rank (MPI launcher)")
        world.execute(COLLECTIVES_CODE + CONTEXTS_CODE, stream=False)
        found = world.pull("placement")
        assert world.pull("active_contexts") == {r: [p["local_rank"]] for r, p in found.items()}
    finally:
        stop_world(world)


# ---------------------------------------------------------------- frameworks that pick cuda:LOCAL_RANK


def need_package(*names: str) -> str:
    for name in names:
        if importlib.util.find_spec(name) is not None:
            return name
    pytest.skip(f"{' or '.join(names)} is not installed here")


def test_fsdp2_matches_one_process(gpu_world: DDPCluster) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="this torch has no torch.distributed.fsdp")
    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    gpu_world.execute(
        "from torch.distributed.fsdp import fully_shard\n"
        "net = make_model(seed=1234).to(device)\n"
        "for layer in net:\n"
        "    if isinstance(layer, torch.nn.Linear):\n"
        "        fully_shard(layer)\n"
        "fully_shard(net)\n"
        "x, y = make_data(STEPS, BATCH * world_size)\n"
        "optimizer = torch.optim.SGD(net.parameters(), lr=LR)\n"
        "for step in range(STEPS):\n"
        "    optimizer.zero_grad()\n"
        "    rows = my_rows(step)\n"
        "    torch.nn.functional.cross_entropy(net(x[rows].to(device)), y[rows].to(device)).backward()\n"
        "    optimizer.step()\n"
        "fsdp_params = {k: v.full_tensor().detach().cpu() for k, v in net.state_dict().items()}\n"
        "fsdp_device = str(next(net.parameters()).device)\n",
        stream=False,
    )
    assert gpu_world.pull("fsdp_device") == rule(gpu_world)
    expected = reference_parameters(gpu_world.world_size)
    for name, value in expected.items():
        torch.testing.assert_close(gpu_world.pull("fsdp_params", ranks=[0])[0][name], value, rtol=1e-4, atol=1e-5)
    record_framework("fsdp2", "FSDP2 (fully_shard)", gpu_world, "matches one process on the combined batch")


def test_accelerate_picks_cuda_local_rank(gpu_world: DDPCluster) -> None:
    need_package("accelerate")
    gpu_world.execute(
        "from accelerate import Accelerator\n"
        "accelerator = Accelerator()\n"
        "acc_model = make_model(seed=1234 + rank)\n"  # prepare() wraps it in DDP: rank 0's weights everywhere
        "acc_optimizer = torch.optim.SGD(acc_model.parameters(), lr=LR)\n"
        "acc_model, acc_optimizer = accelerator.prepare(acc_model, acc_optimizer)\n"
        "x, y = make_data(STEPS, BATCH * world_size)\n"
        "for step in range(STEPS):\n"
        "    rows = my_rows(step)\n"
        "    xb, yb = x[rows].to(accelerator.device), y[rows].to(accelerator.device)\n"
        "    loss = torch.nn.functional.cross_entropy(acc_model(xb), yb)\n"
        "    accelerator.backward(loss)\n"
        "    acc_optimizer.step()\n"
        "    acc_optimizer.zero_grad()\n"
        "acc_device = str(accelerator.device)\n"
        "acc_kind = (accelerator.distributed_type.name, accelerator.num_processes)\n"
        "acc_params = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(acc_model).state_dict().items()}\n",
        stream=False,
    )
    assert gpu_world.pull("acc_device") == rule(gpu_world)
    assert set(gpu_world.pull("acc_kind").values()) == {("MULTI_GPU", gpu_world.world_size)}
    for name, value in reference_parameters(gpu_world.world_size).items():
        torch.testing.assert_close(gpu_world.pull("acc_params", ranks=[0])[0][name], value, rtol=1e-4, atol=1e-5)
    record_framework("accelerate", "Accelerate (Accelerator.prepare)", gpu_world, "matches one process")


def test_hf_trainer_picks_cuda_local_rank(gpu_world: DDPCluster, tmp_path: Path) -> None:
    need_package("transformers")
    gpu_world.push({"HF_OUT": str(tmp_path / "hf")})
    gpu_world.execute(
        "import transformers\n"
        "class HFNet(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = make_model(seed=1234 + rank)\n"  # equal only once DDP broadcast rank 0's
        "    def forward(self, x, labels):\n"
        "        return {'loss': torch.nn.functional.cross_entropy(self.body(x), labels)}\n"
        "class HFRows(torch.utils.data.Dataset):\n"
        "    def __init__(self):\n"
        "        self.x, self.y = make_data(STEPS, BATCH * world_size)\n"
        "    def __len__(self):\n"
        "        return len(self.y)\n"
        "    def __getitem__(self, i):\n"
        "        return {'x': self.x[i], 'labels': self.y[i]}\n"
        "hf_args = transformers.TrainingArguments(output_dir=HF_OUT, per_device_train_batch_size=BATCH, "
        "max_steps=STEPS, report_to='none', save_strategy='no', logging_strategy='no', disable_tqdm=True)\n"
        "hf_trainer = transformers.Trainer(model=HFNet(), args=hf_args, train_dataset=HFRows())\n"
        "hf_trainer.train()\n"
        "hf_device = str(hf_args.device)\n"
        "hf_param_device = str(next(hf_trainer.model.parameters()).device)\n"
        "hf_same = gathered_equal(hf_trainer.model)\n"
        "hf_kind = (hf_args.parallel_mode.name, hf_args.world_size)\n",
        stream=False,
    )
    expected = rule(gpu_world)
    assert gpu_world.pull("hf_device") == expected
    assert gpu_world.pull("hf_param_device") == expected
    assert set(gpu_world.pull("hf_same").values()) == {True}
    assert set(gpu_world.pull("hf_kind").values()) == {("DISTRIBUTED", gpu_world.world_size)}
    record_framework("hf_trainer", "Hugging Face Trainer", gpu_world, "ranks end with identical parameters")


def test_lightning_picks_cuda_local_rank(tmp_path: Path) -> None:
    package = need_package("lightning", "pytorch_lightning")
    n = need_gpus(2)
    world = start_world(n)  # a world of its own: Lightning tears down what it set up when fit() ends
    try:
        world.push(
            {
                "MODEL_CODE": MODEL_CODE,
                "STEPS": STEPS,
                "BATCH": BATCH_PER_RANK,
                "LR": LR,
                "PL_OUT": str(tmp_path),
                "PL_MODULE": "lightning.pytorch" if package == "lightning" else "pytorch_lightning",
            }
        )
        world.execute(
            "exec(MODEL_CODE)\n"
            "import importlib, os\n"
            "pl = importlib.import_module(PL_MODULE)\n"
            "connector = importlib.import_module(PL_MODULE + '.trainer.connectors.accelerator_connector')\n"
            # Lightning refuses strategy='ddp' where sys.ps1 is set, as in every IPython kernel; a rank
            # is one process of a world started from outside, like a torchrun worker
            "if hasattr(connector, '_IS_INTERACTIVE'):\n"
            "    connector._IS_INTERACTIVE = False\n"
            "class PLNet(pl.LightningModule):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.net = make_model(seed=1234 + rank)\n"  # equal only once DDP broadcast rank 0's
            "    def training_step(self, batch, index):\n"
            "        x, y = batch\n"
            "        return torch.nn.functional.cross_entropy(self.net(x), y)\n"
            "    def configure_optimizers(self):\n"
            "        return torch.optim.SGD(self.parameters(), lr=LR)\n"
            "x, y = make_data(STEPS, BATCH * world_size)\n"
            "pl_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)\n"
            "pl_trainer = pl.Trainer(accelerator='gpu', devices=int(os.environ['LOCAL_WORLD_SIZE']), num_nodes=1, "
            "strategy='ddp', max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False, "
            "enable_model_summary=False, default_root_dir=PL_OUT)\n"
            "pl_module = PLNet()\n"
            "pl_trainer.fit(pl_module, pl_loader)\n"
            "pl_device = str(pl_trainer.strategy.root_device)\n"
            "pl_param_device = str(next(pl_module.parameters()).device)\n"
            "pl_same = gathered_equal(pl_module)\n",
            stream=False,
        )
        expected = rule(world)
        assert world.pull("pl_device") == expected
        assert world.pull("pl_param_device") == expected
        assert set(world.pull("pl_same").values()) == {True}
        record_framework("lightning", f"Lightning ({package}) Trainer(strategy='ddp')", world, "identical parameters")
    finally:
        stop_world(world)


def record_framework(name: str, title: str, world: DDPCluster, outcome: str) -> None:
    record(
        f"framework_{name}",
        title,
        ["ranks", "devices", "outcome"],
        [[world.world_size, ", ".join(f"cuda:{info.local_rank}" for info in world.ranks), outcome]],
    )


# ---------------------------------------------------------------- %%ddp --profile on GPUs

# a launch-heavy MLP on each rank's GPU: the profiled steps run CUDA kernels, and NCCL's where the
# world has more than one rank
PROFILED_GPU_CELL = """
torch.manual_seed(0)
_gnet = ddp_notebook.prepare_model(torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to(device))
_gopt = torch.optim.SGD(_gnet.parameters(), lr=0.01)
_gx = torch.randn(512, 1024, device=device)
for _ in range(6):
    _gopt.zero_grad()
    _gnet(_gx).square().mean().backward()
    _gopt.step()
torch.cuda.synchronize(device)
"""


def test_a_profiled_gpu_cell_has_kernel_lanes_cuda_memory_and_holistic_trace_analysis(
    gpu_world: DDPCluster, tmp_path: Path
) -> None:
    """`--profile` on NCCL ranks: each rank's trace holds kernels of its own GPU only, the timeline
    a GPU lane per rank (compute; communication too past one rank), the memory samples CUDA's
    allocated and reserved bytes, and Holistic Trace Analysis reads the traces where installed."""
    from ddp_notebook import ProfileSettings
    from ddp_notebook.live import hta_analysis

    folder = tmp_path / "profiles"
    gpu_world.execute(PROFILED_GPU_CELL, profile=ProfileSettings(steps=3, folder=folder), stream=False, timeout=300)
    report = gpu_world.last_profile
    assert report is not None and sorted(report.files) == list(range(gpu_world.world_size)), report
    lanes = report.lanes()
    rows = []
    for info in gpu_world.ranks:
        r = report.analysis.ranks[info.rank]
        trace = json.loads(report.files[info.rank].read_text(encoding="utf8"))
        kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
        assert kernels, f"rank {info.rank}: no CUDA kernel in its trace"
        devices = {int(e["args"]["device"]) for e in kernels if "device" in e.get("args", {})}
        assert devices == {info.local_rank}, f"rank {info.rank} ran kernels on {devices}"
        comm = [e["name"] for e in kernels if e["name"].startswith("nccl")]
        assert lanes.get(f"rank {info.rank} GPU"), f"rank {info.rank}: no GPU lane in {sorted(lanes)}"
        kinds = {s.category for s in r.gpu}
        assert "compute" in kinds, kinds
        assert [step.step for step in r.steps] == [2, 3, 4], "3 steps recorded after 1 skipped and 1 warm-up"
        if gpu_world.world_size > 1:
            assert comm and "communication" in kinds, (comm[:3], kinds)
        assert len(r.memory) >= 3, r.memory
        for sample in r.memory:
            allocated, reserved = sample["cuda_allocated"], sample["cuda_reserved"]
            assert allocated and reserved and reserved >= allocated, sample
        rows.append([
            info.rank, f"cuda:{info.local_rank}", len(kernels), len(comm), len(r.steps),
            f"{r.step_seconds * 1000:.2f}", "" if r.gpu_idle is None else f"{r.gpu_idle * 1000:.2f}",
            f"{max(m['cuda_allocated'] or 0 for m in r.memory) / 2**20:.1f}",
        ])  # fmt: skip
    drawn = {trace.name for trace in report.memory_figure().data}
    assert {f"rank {info.rank} CUDA allocated" for info in gpu_world.ranks} <= drawn, drawn
    hta_note = "Holistic Trace Analysis is not installed"
    if hta_analysis.available():
        assert report.hta is not None and report.hta.note == "", report.hta
        assert {row["rank"] for row in report.hta.temporal} == set(range(gpu_world.world_size)), report.hta.temporal
        hta_note = "Holistic Trace Analysis read every rank's trace: " + "; ".join(
            f"rank {row['rank']} idle {row.get('idle_time_pctg', '?')}%" for row in report.hta.temporal
        )
    record(
        "profile",
        "%%ddp --profile on the GPU ranks (3 steps recorded)",
        ["rank", "device", "kernels", "NCCL kernels", "steps", "ms/step", "GPU idle ms/step", "CUDA allocated MiB"],
        rows,
        hta_note,
    )


# ---------------------------------------------------------------- a torchrun script, unchanged, on nccl


def test_a_torchrun_script_runs_unchanged_on_nccl_as_under_torchrun(gpu_world: DDPCluster, tmp_path: Path) -> None:
    """The DDP series' single-node script (`torch.cuda.set_device(LOCAL_RANK)`, its own
    `init_process_group("nccl")`, `DDP(model, device_ids=[LOCAL_RANK])`) through `%run` on every GPU
    rank, against `torchrun --nproc-per-node N` running the same file on the same GPUs."""
    script = Path(__file__).parent / "torchrun_scripts" / "ddp_series_single_node.py"
    size = gpu_world.world_size
    in_world, under_torchrun = tmp_path / "world.pt", tmp_path / "torchrun.pt"
    outcome = gpu_world.run(f"%run {script} 3 1 --snapshot_path {in_world}", timeout=600)
    assert outcome.ok, outcome.raise_for_error()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(size), str(script), "3", "1",
         "--snapshot_path", str(under_torchrun)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    mine, theirs = (torch.load(path, map_location="cpu")["MODEL_STATE"] for path in (in_world, under_torchrun))
    bitwise = all(torch.equal(mine[name], theirs[name]) for name in theirs)
    assert bitwise or all(torch.allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-7) for name in theirs)
    record(
        "torchrun_script",
        "A torchrun script unchanged through %run on nccl, against torchrun",
        ["ranks", "backend", "epochs", "weights against torchrun's"],
        [[size, "nccl", 3, "bitwise equal" if bitwise else "equal within 1e-5"]],
    )
    gpu_world.execute("x = torch.ones(1, device=device)\ndist.all_reduce(x)", stream=False)  # the group is back


# ---------------------------------------------------------------- notebook 04 on GPUs


@pytest.mark.timeout(900)
def test_notebook_04_dataparallel_vs_ddp_on_gpus(tmp_path: Path) -> None:
    need_gpus(2)
    import nbformat
    from nbclient import NotebookClient

    from tests.support.notebooks import STEPS_ROW, check_dataparallel_vs_ddp, outputs_text

    path = Path(__file__).resolve().parent.parent / "notebooks" / "04_dataparallel_vs_ddp.ipynb"
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = outputs_text(notebook)
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == [], f"{errors[0].get('ename')}: {errors[0].get('evalue')}"
    rows = [m.group(0).split() for m in STEPS_ROW.finditer(text)]
    record(
        "notebook_04",
        "Notebook 04: one process, DataParallel and DDP on the same model, data and global batch",
        ["method", "processes", "devices", "threads each", "batch each", "steps/s", "samples/s"],
        [[" ".join(r[:-7]), *r[-7:-6], " ".join(r[-6:-4]), *r[-4:]] for r in rows],
        "\n".join(line for line in text.splitlines() if line.startswith(("DDP, ", "(The published"))),
    )
    check_dataparallel_vs_ddp(notebook, text)
    methods = {m.group(1) for m in STEPS_ROW.finditer(text)}
    assert "DataParallel" in methods, "DataParallel must run with 2+ GPUs"
    assert any(" cuda " in line for line in text.splitlines() if line.startswith("DDP, ")), text
