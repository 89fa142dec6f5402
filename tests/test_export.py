"""%ddp_export: the cells a world ran, as a torchrun script that ends with the same parameters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_notebook import DDPCluster, RankError
from ddp_notebook.errors import DDPUsageError
from ddp_notebook.world.export import CellRecord, choose, export_script, listing, parse_selection, render

CELLS = [
    "import os\n"
    "torch.manual_seed(0)\n"
    "data = torch.utils.data.TensorDataset(torch.randn(64, 5), torch.randn(64, 1))\n"
    "model = ddp_notebook.prepare_model(torch.nn.Linear(5, 1))\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)\n"
    "loader = ddp_notebook.prepare_loader(data, batch_size=8)\n",
    "raise ValueError('a cell that failed: left out of the script')\n",
    "for epoch in range(2):\n"
    "    for x, y in loader:\n"
    "        optimizer.zero_grad()\n"
    "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
    "        optimizer.step()\n",
    "ddp_notebook.save_checkpoint(model, os.environ.get('EXPORT_OUT', {cells_out!r}))\n",
]


def test_selection_and_rendering_without_a_world() -> None:
    assert parse_selection("1,3-5") == [1, 3, 4, 5] and parse_selection(None) is None
    with pytest.raises(DDPUsageError):
        parse_selection("1,x")
    history = [
        CellRecord(1, "a = 1", (0, 1), True, 2),
        CellRecord(2, "raise ValueError", (0, 1), False, 2),
        CellRecord(3, "print(a)", (0,), True, 2),
    ]
    assert [c.number for c in choose(history, None)] == [1, 3]
    with pytest.raises(DDPUsageError, match="cell 2 failed"):
        choose(history, [2])
    assert "  2  FAILED  ranks 0-1" in listing(history)
    text = render(choose(history, None), "train.py")
    assert "torchrun --nproc-per-node 2 train.py" in text
    assert "if rank in (0,):\n    print(a)" in text and "raise ValueError" not in text
    compile(text, "train.py", "exec")


def test_a_cell_with_ipython_syntax_is_refused_in_one_line(tmp_path: Path) -> None:
    history = [CellRecord(1, "a = 1", (0, 1), True, 2), CellRecord(2, "a += 1\n!nvidia-smi", (0, 1), True, 2)]
    with pytest.raises(DDPUsageError, match=r"^cell 2 is not plain Python \(line 2: !nvidia-smi\): .* --cells"):
        export_script(history, tmp_path / "train.py")
    assert not (tmp_path / "train.py").exists()
    assert export_script(history, tmp_path / "train.py", [1]) == str(tmp_path / "train.py")


@pytest.mark.integration
@pytest.mark.core
def test_an_exported_script_under_torchrun_ends_like_the_cells(world: DDPCluster, tmp_path: Path) -> None:
    first = len(world.cell_history) + 1
    cells_out = tmp_path / "cells.pt"
    for code in CELLS:
        if "raise" in code:
            with pytest.raises(RankError):
                world.execute(code, stream=False)
        else:
            world.execute(code.replace("{cells_out!r}", repr(str(cells_out))), stream=False)
    world.execute("print('rank 0 only')", ranks=[0], stream=False)
    numbers = list(range(first, len(world.cell_history) + 1))
    assert [c.ok for c in world.cell_history[first - 1 :]] == [True, False, True, True, True]

    script = tmp_path / "train.py"
    assert world.export_script(script, None if first == 1 else [n for n in numbers if n != first + 1]) == str(script)
    text = script.read_text()
    assert "a cell that failed" not in text and "if rank in (0,):" in text
    with pytest.raises(DDPUsageError, match="exists"):
        world.export_script(script, [first])

    script_out = tmp_path / "script.pt"
    env = {**os.environ, "EXPORT_OUT": str(script_out), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rank 0 only" in run.stdout
    from_cells = torch.load(cells_out, weights_only=True)
    from_script = torch.load(script_out, weights_only=True)
    assert from_cells.keys() == from_script.keys()
    for name, value in from_cells.items():
        torch.testing.assert_close(from_script[name], value, rtol=1e-6, atol=1e-7)
