"""Records, in order, the CUDA calls a rank's start-up makes, on a machine without a GPU.

Run in a fresh process (`python -m tests.support.cuda_calls --out FILE ...`, from the repository
root). Right after `import torch` it replaces torch's CUDA entry points with recorders that
pretend there are `--gpus` GPUs, then does what a GPU rank does: imports what a rank
imports while it registers (`entrypoints._preload`), joins a one-rank world through
`membership.init_world` (with the spec the notebook sends), heals once (`release_group`, then
`init_world` again) and runs the cell helpers. `init_process_group` is recorded with its
arguments and then called for real on gloo without `device_id` (no NCCL here), so the store,
the group and the heal are the real ones.

Creating a CUDA tensor reaches `torch.cuda._lazy_init` first (torch calls it from C++ by name),
so a tensor made on a GPU is caught as well as an explicit `torch.cuda.*` call.

The result is one JSON object in `--out`: `calls` (every recorded call, in order, as
[name, arguments...]), and what the rank reported, published and handed to DDP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

import torch

CALLS: list[list[str]] = []


def _index(device: Any = None) -> str:
    if device is None:
        return ""
    if isinstance(device, torch.device):
        return "" if device.index is None else str(device.index)
    if isinstance(device, str):
        return device.split(":", 1)[1] if ":" in device else ""
    return str(device)


class FakeCuda:
    """Stand-ins for torch.cuda's entry points, each recording its call before answering."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.current = 0

    def install(self) -> None:
        answers: dict[str, Any] = {
            "is_available": lambda: True,
            "device_count": lambda: self.gpus,
            "set_device": self._set_device,
            "current_device": lambda: self.current,
            "get_device_name": lambda device=None: f"Fake GPU {_index(device) or self.current}",
            "get_device_properties": lambda device=None: SimpleNamespace(
                name="Fake GPU", total_memory=80 << 30, major=9, minor=0, uuid=f"fake-{_index(device)}"
            ),
            "get_device_capability": lambda device=None: (9, 0),
            "mem_get_info": lambda device=None: (80 << 30, 80 << 30),
            "synchronize": lambda device=None: None,
            "init": lambda: None,
            "_lazy_init": lambda: None,
            "current_stream": lambda device=None: None,
            "default_stream": lambda device=None: None,
            "set_stream": lambda stream=None: None,
            "empty_cache": lambda: None,
            "ipc_collect": lambda: None,
            "memory_allocated": lambda device=None: 0,
            "memory_reserved": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
            "is_bf16_supported": lambda *args, **kwargs: True,
        }
        for name, answer in answers.items():
            setattr(torch.cuda, name, self._recorded(f"torch.cuda.{name}", answer))
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            for name, answer in {
                "set_device_index": self._set_device,
                "set_device_idx": self._set_device,
                "current_device_index": lambda: self.current,
                "current_device_idx": lambda: self.current,
                "device_count": lambda: self.gpus,
                "is_available": lambda: True,
                "synchronize": lambda device=None: None,
            }.items():
                if hasattr(accelerator, name):
                    setattr(accelerator, name, self._recorded(f"torch.accelerator.{name}", answer))
        # compile-time facts, not CUDA calls: this torch "has CUDA"
        torch.backends.cuda.is_built = lambda: True

    def _set_device(self, device: Any) -> None:
        self.current = int(_index(device) or 0)

    @staticmethod
    def _recorded(name: str, answer: Any) -> Any:
        shown = _index if name.endswith(("set_device", "set_device_index", "set_device_idx")) else str

        def call(*args: Any, **kwargs: Any) -> Any:
            CALLS.append([name, *(shown(a) for a in args)])
            return answer(*args, **kwargs)

        return call


def _record_process_group() -> None:
    import torch.distributed as dist

    real = dist.init_process_group

    def init_process_group(backend: str, **kwargs: Any) -> None:
        CALLS.append(["dist.init_process_group", backend, str(kwargs.pop("device_id", None))])
        real("gloo", **kwargs)  # the stand-in for NCCL: a real group, no GPU

    dist.init_process_group = init_process_group


def _inject(kind: str) -> None:
    """A deliberate CUDA call before set_device, to show this recorder catches it."""
    if kind == "device-count-at-import":
        torch.cuda.device_count()
    elif kind == "tensor-before-set-device":
        real = torch.set_num_threads  # init_world's call just before it picks the device

        def set_num_threads(threads: int) -> None:
            try:
                torch.empty(0, device="cuda")  # reaches torch.cuda._lazy_init, then fails on a CPU build
            except Exception:  # noqa: BLE001
                pass
            real(threads)

        torch.set_num_threads = set_num_threads


def _helpers(membership: Any) -> dict[str, Any]:
    """What the cell helpers hand to torch: the model's device, DDP's device_ids, the barrier's."""
    import torch.distributed as dist

    seen: dict[str, Any] = {}

    class Model(torch.nn.Module):  # no parameters: moving it touches no device
        def to(self, *args: Any, **kwargs: Any) -> Model:  # type: ignore[override]
            seen["model_to"] = str(args[0] if args else kwargs.get("device"))
            return self

    class Wrapper(torch.nn.Module):  # DDP's stand-in (a Module, as DDP is): DDP would broadcast over NCCL
        def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
            super().__init__()
            self.module = module
            seen["ddp_device_ids"] = kwargs.get("device_ids")

    def barrier(*args: Any, **kwargs: Any) -> None:
        seen["barrier_device_ids"] = kwargs.get("device_ids")

    real_ddp, real_barrier = torch.nn.parallel.DistributedDataParallel, dist.barrier
    torch.nn.parallel.DistributedDataParallel, dist.barrier = Wrapper, barrier  # type: ignore[assignment, misc]
    try:
        from ddp_notebook.rank import helpers

        helpers.prepare_model(Model())
        helpers.barrier()
        seen["loader_pin_memory"] = helpers.prepare_loader(list(range(8)), batch_size=2).pin_memory
        seen["context_device"] = str(membership.context().device)
    finally:
        torch.nn.parallel.DistributedDataParallel, dist.barrier = real_ddp, real_barrier  # type: ignore[misc]
    return seen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs the stand-ins pretend to have")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--local-rank", type=int, default=1)
    parser.add_argument("--gpu", default=None, help="the spec's gpu entry (omit: a CPU rank)")
    parser.add_argument("--local-world-size", type=int, default=None, help="ranks on its host (default LOCAL_RANK + 1)")
    parser.add_argument(
        "--inject", default="none", choices=["none", "device-count-at-import", "tensor-before-set-device"]
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"calls": CALLS}
    FakeCuda(args.gpus).install()
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        quiet = Config()
        quiet.HistoryManager.enabled = False
        shell = InteractiveShell.instance(config=quiet)  # the rank's user namespace

        if args.inject == "device-count-at-import":
            _inject(args.inject)
        from ddp_notebook.rank import entrypoints

        entrypoints._preload()  # what a rank imports while it registers
        from ddp_notebook.rank import membership
        from ddp_notebook.wire.join import RankSpec

        _record_process_group()
        _inject(args.inject if args.inject != "device-count-at-import" else "none")
        spec = RankSpec(
            rank=0,  # rank 0 of a one-rank world, LOCAL_RANK given apart: the device must follow LOCAL_RANK
            world_size=1,
            local_rank=args.local_rank,
            local_world_size=args.local_world_size or args.local_rank + 1,
            group_rank=0,
            master_addr="127.0.0.1",
            master_port=membership.open_rendezvous("127.0.0.1"),
            backend=args.backend,
            timeout=30.0,
            threads=1,
            stack_dir=None,
            gpu=args.gpu,
            socket_ifname=None,
        )
        joined = dataclasses.asdict(membership.init_world(spec))
        result["info"] = {k: v for k, v in joined.items() if k != "main_thread"}
        result["published"] = {
            name: str(shell.user_ns.get(name)) for name in ("rank", "world_size", "local_rank", "device")
        }
        CALLS.append(["heal"])
        membership.release_group()
        membership.init_world(dataclasses.replace(spec, master_port=membership.open_rendezvous("127.0.0.1")))
        result["helpers"] = _helpers(membership)
        membership.shutdown_world()
    except Exception as failure:  # noqa: BLE001  (the test reads the error from the result)
        result["error"] = f"{type(failure).__name__}: {failure}"
        result["traceback"] = traceback.format_exc()
    with open(args.out, "w", encoding="utf8") as handle:
        json.dump(result, handle)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: the stand-ins must not meet torch's atexit hooks


if __name__ == "__main__":
    main()
