"""torch.compile in %%ddp cells: a DDP model compiled on 2 gloo ranks trains like one process."""

from __future__ import annotations

import pytest
import torch

from ddp_notebook import DDPCluster

pytestmark = pytest.mark.integration


def test_a_compiled_ddp_model_trains_like_one_process(world: DDPCluster) -> None:
    world.execute(
        "import torch._dynamo.utils\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
        "model = ddp_notebook.prepare_model(net)\n"
        "compiled = torch.compile(model)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "torch.manual_seed(1)\n"
        "global_x = torch.randn(3, 8, 8)\n"
        "for x in global_x:\n"
        "    optimizer.zero_grad()\n"
        "    compiled(x.chunk(world_size)[rank]).square().mean().backward()\n"
        "    optimizer.step()\n"
        "frames_compiled = torch._dynamo.utils.counters['frames']['ok']\n"
        "params = [p.detach().clone() for p in net.parameters()]\n",
        stream=False,
        timeout=240,
    )
    assert all(count > 0 for count in world.pull("frames_compiled").values()), "nothing was compiled"
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(1)
    for x in torch.randn(3, 8, 8):
        optimizer.zero_grad()
        reference(x).square().mean().backward()
        optimizer.step()
    params = world.pull("params")
    for rank in (0, 1):
        for got, want in zip(params[rank], reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
