"""What the `frameworks` scenario runs on the ranks: the same training through each framework.

Every framework trains `train_workload`'s MLP (64 -> 512 -> 512 -> 10, batch 64 per rank, SGD) on
the same synthetic rows, the way its user would write it; only the clock is added. The clock
starts when every rank reaches step `warmup` and stops when every rank finished step
`warmup + steps` (a barrier at each end), so rank 0's time covers all ranks' work, and
set-up, imports and the frameworks' first steps are not timed. Over the same span it reads the
CPU time of rank 0's whole process (all its threads), which the load of other work on the
machine moves far less than the wall-clock time.

Under `%%ddp` and under torchrun (`train_workload.py --exec`) alike:

    import framework_workload
    framework_workload.run(["lightning", "accelerate", "hf_trainer", "fsdp2", "ddp"], steps=200, warmup=20)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import train_workload
from torch import nn
from train_workload import BATCH_PER_RANK, CLASSES, DISTINCT_BATCHES, HIDDEN, IN_FEATURES

LR = 0.01


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


class _Classifier(nn.Module):
    """The MLP with a forward that takes named inputs and returns its loss (the HF Trainer's contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.mlp(x), labels)}


class _Rows(torch.utils.data.Dataset):
    """DISTINCT_BATCHES batches per rank of synthetic rows, the same on every rank; frameworks shard them."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        rows = DISTINCT_BATCHES * BATCH_PER_RANK * dist.get_world_size()
        self.x = torch.randn(rows, IN_FEATURES, generator=generator)
        self.labels = torch.randint(0, CLASSES, (rows,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.labels[i]}


# (wall-clock seconds, this rank's process CPU seconds) of the timed steps
Span = tuple[float, float]


class _Clock:
    """Seconds between every rank reaching the first timed step and every rank finishing the last,
    and the CPU seconds this rank's process spent meanwhile."""

    def __init__(self) -> None:
        self.began: Span | None = None
        self.ended: Span | None = None

    def start(self) -> None:
        dist.barrier()
        self.began = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        dist.barrier()
        self.ended = (time.perf_counter(), time.process_time())

    def seconds(self) -> Span:
        if self.began is None or self.ended is None:
            raise RuntimeError("the clock did not run: fewer steps than the warm-up?")
        return self.ended[0] - self.began[0], self.ended[1] - self.began[1]


def _loop(model: Any, optimizer: Any, loader: Any, backward: Callable[[Any], None], steps: int, warmup: int) -> Span:
    """A hand-written loop over `loader` (cycled) for the frameworks that leave the loop to the user."""
    clock, done = _Clock(), 0
    while done < warmup + steps:
        for batch in loader:
            if done == warmup:
                clock.start()
            optimizer.zero_grad(set_to_none=True)
            backward(model(**batch)["loss"])
            optimizer.step()
            done += 1
            if done == warmup + steps:
                break
    clock.stop()
    return clock.seconds()


def lightning(steps: int, warmup: int) -> Span:
    import lightning as L

    clock = _Clock()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Classifier()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == warmup:
                clock.start()

        def on_train_end(self, *_: Any) -> None:
            clock.stop()

    trainer = L.Trainer(
        accelerator="cpu" if dist.get_backend() == "gloo" else "gpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[Timer()],
    )
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=BATCH_PER_RANK, shuffle=True)
    trainer.fit(Module(), loader)
    return clock.seconds()


def accelerate(steps: int, warmup: int) -> Span:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=dist.get_backend() == "gloo")
    net = _Classifier()
    model, optimizer, loader = accelerator.prepare(
        net,
        torch.optim.SGD(net.parameters(), lr=LR),
        torch.utils.data.DataLoader(_Rows(), batch_size=BATCH_PER_RANK, shuffle=True),
    )
    return _loop(model, optimizer, loader, accelerator.backward, steps, warmup)


def hf_trainer(steps: int, warmup: int) -> Span:
    import tempfile

    import transformers

    clock = _Clock()

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step == warmup:
                clock.start()

        def on_train_end(self, *_: Any, **__: Any) -> None:
            clock.stop()

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=BATCH_PER_RANK,
            max_steps=warmup + steps,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            use_cpu=dist.get_backend() == "gloo",
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            ddp_find_unused_parameters=False,
            seed=0,
        )
        trainer = transformers.Trainer(model=_Classifier(), args=args, train_dataset=_Rows(), callbacks=[Timer()])
        # its closing metrics line starts with "{", which the torchrun driver reads as its own result line
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    return clock.seconds()


def fsdp2(steps: int, warmup: int) -> Span:
    import ddp_notebook
    from ddp_notebook.rank.membership import context

    model = ddp_notebook.prepare_model(_Classifier(), shard=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = ddp_notebook.prepare_loader(_Rows(), batch_size=BATCH_PER_RANK)
    device = context().device  # the rank's device, in a world or under torchrun

    def on_device(batches: Any) -> Any:
        for batch in batches:
            yield {k: v.to(device) for k, v in batch.items()}

    class Loader:
        def __iter__(self) -> Any:
            return on_device(loader)

    return _loop(model, optimizer, Loader(), lambda loss: loss.backward(), steps, warmup)


def ddp(steps: int, warmup: int) -> Span:
    result = train_workload.train(steps, warmup)  # the training scenario's plain DDP loop
    return float(result["elapsed_s"]), float(result["process_cpu_s"])


FRAMEWORKS: dict[str, Callable[[int, int], Span]] = {
    "lightning": lightning,
    "accelerate": accelerate,
    "hf_trainer": hf_trainer,
    "fsdp2": fsdp2,
    "ddp": ddp,
}


def run(names: list[str], steps: int, warmup: int) -> dict[str, Any]:
    """steps/s of each framework in `names`, in that order, as rank 0 timed it, and rank 0's
    process CPU milliseconds per step."""
    rates: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for name in names:
        seconds, cpu_seconds = FRAMEWORKS[name](steps, warmup)
        rates[name], cpu[name] = steps / seconds, cpu_seconds / steps * 1e3
    return {
        "steps_per_s": rates,
        "cpu_ms_per_step": cpu,
        "torch_threads": torch.get_num_threads(),
        "world_size": dist.get_world_size(),
    }
