"""A small model trained the same way in a world and in one process: its code as the cells run it
(`MODEL_CODE`: the model and the data, seeded), the settings (`STEPS`, `BATCH_PER_RANK`, `LR`) and
`train_single_process`, the parameters one process reaches on the combined batch, which DDP's must match
(tests/test_ddp_correctness.py on CPU ranks, tests/test_gpu.py on GPUs, tests/test_jupyterhub.py under a hub)."""

from __future__ import annotations

import torch

STEPS = 5
BATCH_PER_RANK = 8
LR = 0.1

MODEL_CODE = """
import torch
def make_model(seed=1234):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

def make_data(steps, global_batch):
    g = torch.Generator().manual_seed(99)
    return torch.randn(steps * global_batch, 6, generator=g), torch.randint(0, 3, (steps * global_batch,), generator=g)
"""


def train_single_process(steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    scope: dict = {}
    exec(MODEL_CODE, scope)
    model = scope["make_model"]()
    x, y = scope["make_data"](steps, global_batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
