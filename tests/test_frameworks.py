"""Lightning, Fabric, Accelerate and the Hugging Face Trainer, unchanged, in %%ddp cells of a real kernel.

Each framework trains the same small regression on 2 gloo ranks and must behave as under
torchrun: the world it sees (size, ranks), its own data sharding (each rank sees half the rows,
together all of them), parameters equal on every rank afterwards, and the world still usable
by the next cell (no framework tears the process group down). The frameworks come from the
`test` extra (CPU builds); a missing one skips its test with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.kernel import Kernel
from tests.support.processes import owned_pids, wait_gone

pytestmark = pytest.mark.integration

ROWS = 256
PER_RANK_BATCH = 16

# the task every framework trains: y = x @ w on random rows, an index per row to check sharding
DATA_CELL = f"""%%ddp
import os
import torch
from torch.utils.data import Dataset

class Rows(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn({ROWS}, 8, generator=generator)
        self.y = self.x @ torch.arange(8.0).unsqueeze(1)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {{"idx": i, "x": self.x[i], "labels": self.y[i]}}

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(rank)  # different on each rank: the framework must make them equal
        self.linear = torch.nn.Linear(8, 1)
        self.seen = []
    def forward(self, idx, x, labels):
        self.seen.extend(int(i) for i in idx)
        return {{"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}}

rows = Rows()
elastic_env = {{name: os.environ.get(name) for name in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT")}}
elastic_launched = torch.distributed.is_torchelastic_launched()
"""

LIGHTNING_CELL = f"""%%ddp
import lightning as L

class LitNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()
    def training_step(self, batch, batch_idx):
        loss = self.net(**batch)["loss"]
        self.log("loss", loss, prog_bar=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

lit = LitNet()
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp",
                    max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False)
trainer.fit(lit, torch.utils.data.DataLoader(rows, batch_size={PER_RANK_BATCH}))
result = {{
    "world": (trainer.world_size, trainer.global_rank, trainer.local_rank),
    "environment": type(trainer.strategy.cluster_environment).__name__,
    "seen": lit.net.seen,
    "params": [p.detach().tolist() for p in lit.net.parameters()],
}}
"""

FABRIC_CELL = f"""%%ddp
import lightning as L

fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
fabric.launch()
net = Net()
fabric_model, fabric_opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(rows, batch_size={PER_RANK_BATCH}, shuffle=True))
for batch in loader:
    fabric_opt.zero_grad()
    fabric.backward(fabric_model(**batch)["loss"])
    fabric_opt.step()
result = {{
    "world": (fabric.world_size, fabric.global_rank, fabric.local_rank),
    "environment": type(fabric.strategy.cluster_environment).__name__,
    "seen": net.seen,
    "params": [p.detach().tolist() for p in net.parameters()],
}}
"""

ACCELERATE_CELL = f"""%%ddp
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
net = Net()
acc_model, acc_opt, loader = accelerator.prepare(
    net, torch.optim.SGD(net.parameters(), lr=0.01),
    torch.utils.data.DataLoader(rows, batch_size={PER_RANK_BATCH}, shuffle=True))
for batch in loader:
    acc_opt.zero_grad()
    accelerator.backward(acc_model(**batch)["loss"])
    acc_opt.step()
accelerator.print("accelerate done")
result = {{
    "world": (accelerator.num_processes, accelerator.process_index, accelerator.local_process_index),
    "environment": str(accelerator.distributed_type),
    "seen": net.seen,
    "params": [p.detach().tolist() for p in net.parameters()],
}}
"""

HF_TRAINER_CELL = f"""%%ddp
import transformers

hf_args = transformers.TrainingArguments(
    output_dir=HF_OUT, per_device_train_batch_size={PER_RANK_BATCH}, num_train_epochs=1, learning_rate=0.01,
    use_cpu=True, report_to=[], save_strategy="no", logging_steps=4, seed=0, dataloader_drop_last=False)
net = Net()
hf_trainer = transformers.Trainer(model=net, args=hf_args, train_dataset=rows)
hf_trainer.train()
result = {{
    "world": (hf_args.world_size, hf_args.process_index, hf_args.local_process_index),
    "environment": str(hf_args.parallel_mode),
    "seen": net.seen,
    "params": [p.detach().tolist() for p in net.parameters()],
}}
"""

NEXT_CELL = """%%ddp
check = torch.tensor([float(rank + 1)])
dist.all_reduce(check)
group_still_up = (dist.is_initialized(), check.item())
"""


def need(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def framework_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """One kernel and one 2-rank world for every framework (each test runs its cells in it)."""
    kernel = Kernel()
    try:
        out, error = kernel.run(
            "%load_ext ddp_notebook\n%ddp_start 2 --backend gloo --collective-timeout 120", timeout=180
        )
        assert error is None, out
        pids = json.loads(pull(kernel, "__import__('os').getpid()", raw=True))
        out, error = kernel.run(DATA_CELL)
        assert error is None, out
        hf_out = str(tmp_path_factory.mktemp("hf"))
        out, error = kernel.run(f"%%ddp\nHF_OUT = {hf_out!r}")
        assert error is None, out
        yield kernel
        out, error = kernel.run("%ddp_stop", timeout=60)
        assert error is None, out
        assert wait_gone(list(pids.values())) == [], "ranks outlived %ddp_stop"
    finally:
        kernel.close()
    assert wait_gone(sorted(owned_pids(kernel.manager.provisioner.pid))) == []


def pull(kernel: Kernel, expression: str, raw: bool = False) -> dict[str, object] | str:
    """Evaluate `expression` on every rank (through the kernel's world) and return {rank: value}."""
    out, error = kernel.run(
        "import json as _json\n"
        "_world = get_ipython().magics_manager.registry['DDPMagics'].world\n"
        f"_world.execute('_pulled = ' + {expression!r}, stream=False)\n"
        "print('PULLED' + _json.dumps({str(r): v for r, v in _world.pull('_pulled').items()}))"
    )
    assert error is None, out
    text = out.split("PULLED", 1)[1].strip()
    return text if raw else json.loads(text)


def check_like_torchrun(kernel: Kernel, environment: str) -> dict[str, dict]:
    results = pull(kernel, "result")
    assert sorted(results) == ["0", "1"]
    for rank, result in results.items():
        assert tuple(result["world"]) == (2, int(rank), int(rank)), result["world"]
        assert environment in result["environment"]
    seen = [set(results[r]["seen"]) for r in ("0", "1")]
    assert all(len(s) == ROWS // 2 for s in seen), "each rank must see its own half of the rows"
    assert seen[0] | seen[1] == set(range(ROWS)) and not seen[0] & seen[1]
    assert results["0"]["params"] == results["1"]["params"], "parameters differ between ranks"
    out, error = kernel.run(NEXT_CELL)
    assert error is None, out
    assert pull(kernel, "group_still_up") == {"0": [True, 3.0], "1": [True, 3.0]}
    return results


def test_ranks_carry_torchruns_environment(framework_kernel: Kernel) -> None:
    env = pull(framework_kernel, "elastic_env")
    for rank in ("0", "1"):
        e = env[rank]
        assert (e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"]) == (rank, rank, rank)
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["ROLE_WORLD_SIZE"]) == ("2", "2", "2")
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"]) == ("0", "1", "default")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False" and e["TORCHELASTIC_MAX_RESTARTS"] == "0"
    assert env["0"]["TORCHELASTIC_RUN_ID"] == env["1"]["TORCHELASTIC_RUN_ID"] not in (None, "")
    assert pull(framework_kernel, "elastic_launched") == {"0": True, "1": True}
    assert pull(framework_kernel, "hasattr(__import__('sys'), 'ps1')") == {"0": False, "1": False}
    # the working directory importable once, as a script's own directory is under torchrun
    paths = pull(framework_kernel, "__import__('sys').path")
    for rank in ("0", "1"):
        assert paths[rank].count("") == 1 and len(set(paths[rank])) == len(paths[rank]), paths[rank]


def test_lightning_trainer_strategy_ddp(framework_kernel: Kernel) -> None:
    need("lightning")
    out, error = framework_kernel.run(LIGHTNING_CELL, timeout=240)
    assert error is None, out
    assert "not compatible with an interactive" not in out
    check_like_torchrun(framework_kernel, "TorchElasticEnvironment")


def test_lightning_fabric_strategy_ddp(framework_kernel: Kernel) -> None:
    need("lightning")
    out, error = framework_kernel.run(FABRIC_CELL, timeout=240)
    assert error is None, out
    check_like_torchrun(framework_kernel, "TorchElasticEnvironment")


def test_accelerate(framework_kernel: Kernel) -> None:
    need("accelerate")
    out, error = framework_kernel.run(ACCELERATE_CELL, timeout=240)
    assert error is None, out
    # accelerator.print: the main process only
    assert "[rank 0] accelerate done" in out and "[rank 1] accelerate done" not in out
    check_like_torchrun(framework_kernel, "MULTI_CPU")


def test_hf_trainer(framework_kernel: Kernel) -> None:
    need("transformers", "accelerate")
    out, error = framework_kernel.run(HF_TRAINER_CELL, timeout=300)
    assert error is None, out
    # the Trainer reports from the main process only (in a notebook: its HTML progress table)
    assert "[rank 1]" not in out, out
    check_like_torchrun(framework_kernel, "DISTRIBUTED")


def test_a_ranks_redrawn_display_updates_in_place(framework_kernel: Kernel) -> None:
    """clear_output + display on a rank (how rich, and so Lightning, redraws a live bar) replaces
    that rank's display instead of clearing the cell or stacking one display per redraw; a display
    a rank updates by id is updated here too."""
    code = (
        "%%ddp\n"
        "from IPython.display import clear_output, display\n"
        "print('kept: printed before the redraws')\n"
        "for step in range(4):\n"
        "    clear_output(wait=True)\n"
        "    display({'text/plain': f'bar rank {rank} step {step}'}, raw=True)\n"
        "handle = display({'text/plain': f'status rank {rank}: running'}, raw=True, display_id=True)\n"
        "handle.update({'text/plain': f'status rank {rank}: done'}, raw=True)\n"
    )
    msg_id = framework_kernel.client.execute(code)
    shown: dict[str, str] = {}  # display id (or a new slot) -> what it shows now
    printed = []
    while True:
        msg = framework_kernel.client.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            printed.append(content["text"])
        elif kind == "clear_output":
            shown.clear()
        elif kind in ("display_data", "update_display_data"):
            slot = (content.get("transient") or {}).get("display_id") or f"plain-{len(shown)}"
            if kind == "display_data" or slot in shown:
                shown[slot] = content["data"]["text/plain"]
        elif kind == "status" and content["execution_state"] == "idle":
            break
    assert sorted(shown.values()) == [
        "bar rank 0 step 3",
        "bar rank 1 step 3",
        "status rank 0: done",
        "status rank 1: done",
    ], shown
    assert "kept: printed before the redraws" in "".join(printed)


EXPORT_CELLS = (
    "%%ddp\n"
    "torch.manual_seed(0)\n"
    "import os\n"
    "export_data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
    "export_model = ddp_notebook.prepare_model(torch.nn.Linear(4, 1))\n"
    "export_optimizer = torch.optim.SGD(export_model.parameters(), lr=0.05)\n"
    "export_loader = ddp_notebook.prepare_loader(export_data, batch_size=4)\n",
    "%%ddp\n"
    "for x, y in export_loader:\n"
    "    export_optimizer.zero_grad()\n"
    "    torch.nn.functional.mse_loss(export_model(x), y).backward()\n"
    "    export_optimizer.step()\n",
    # the script runs without the notebook's names: it gets its path from the environment
    "%%ddp\nddp_notebook.save_checkpoint(export_model, os.environ['EXPORT_OUT'] if 'EXPORT_OUT' in os.environ else "
    "EXPORT_CELLS_OUT)\n",
)


def test_ddp_export_in_a_kernel_writes_a_script_that_ends_like_the_cells(
    framework_kernel: Kernel, tmp_path: Path
) -> None:
    cells_out, script, script_out = tmp_path / "cells.pt", tmp_path / "train.py", tmp_path / "script.pt"
    out, error = framework_kernel.run(f"%%ddp\nEXPORT_CELLS_OUT = {str(cells_out)!r}")
    assert error is None, out
    for code in EXPORT_CELLS:
        out, error = framework_kernel.run(code)
        assert error is None, out
    out, error = framework_kernel.run("%ddp_export --list")
    assert error is None, out
    listed = re.findall(r"^\s*(\d+)  ok      ranks 0-1\s+(.*)$", out, re.MULTILINE)
    ours = [number for number, first in listed if first.startswith(("torch.manual_seed(0)", "for x, y in export_"))]
    ours += [number for number, first in listed if first.startswith("ddp_notebook.save_checkpoint(export_model")]
    assert len(ours) == 3, out
    out, error = framework_kernel.run(f"%ddp_export {script} --cells {','.join(ours)}")
    assert error is None and f"wrote {script}; run it with: torchrun --nproc-per-node 2" in out, out
    out, error = framework_kernel.run(f"%ddp_export {script} --cells {ours[0]}")
    assert "exists; pass --force" in out, (error, out)

    env = {**os.environ, "EXPORT_OUT": str(script_out), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    from_cells = torch.load(cells_out, weights_only=True)
    from_script = torch.load(script_out, weights_only=True)
    assert from_cells.keys() == from_script.keys()
    for name, value in from_cells.items():
        torch.testing.assert_close(from_script[name], value, rtol=1e-6, atol=1e-7)


def test_a_plain_tqdm_bar_moves_while_the_cell_runs(framework_kernel: Kernel) -> None:
    """A text bar (plain tqdm, as a framework draws it without widgets) is redrawn in place while
    it runs, not shown only when it ends; other ranks' lines still come through whole."""
    code = (
        "%%ddp\n"
        "import sys, time\n"
        "from tqdm import tqdm\n"
        "for i in tqdm(range(8), desc='plain', file=sys.stderr, disable=rank != 0, mininterval=0, ncols=60):\n"
        "    if rank == 1 and i == 3:\n"
        "        print('rank 1 warns', file=sys.stderr, flush=True)\n"
        "    time.sleep(0.4)\n"
    )
    msg_id = framework_kernel.client.execute(code)
    chunks = []
    while True:
        msg = framework_kernel.client.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stderr":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    text = "".join(chunks)
    # drawings of the unfinished bar arrived while it ran, each over the last one
    moving = re.findall(r"\r\[rank 0\] plain: +\d+%\|[^\r\n]*\| (\d)/8", text)
    assert len(set(moving)) >= 2 and min(int(n) for n in moving) < 8, repr(text)
    # what a notebook shows: each line as its last drawing after '\r'
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n") if line.rsplit("\r", 1)[-1].strip()]
    bars = [line for line in shown if "plain:" in line]
    assert len(bars) == 1 and bars[0].startswith("[rank 0] plain: 100%") and "8/8" in bars[0], shown
    assert shown.count("[rank 1] rank 1 warns") == 1, shown
