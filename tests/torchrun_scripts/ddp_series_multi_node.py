"""A multi-node torchrun training script in the shape of PyTorch's DDP tutorial series.

Run as `torchrun --nnodes M --nproc-per-node N ... ddp_series_multi_node.py TOTAL_EPOCHS SAVE_EVERY` (or
on one node), or unchanged in a ddp_notebook world (`%run ddp_series_multi_node.py TOTAL_EPOCHS SAVE_EVERY`).
Unlike the single-node shape it tells LOCAL_RANK (its device) from RANK (who saves, who prints), keeps
the optimizer's momentum in its snapshot, and trains a classifier with batch norm (DDP broadcasts its
buffers from rank 0 before every forward).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> torch.device:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group(backend="gloo")
    return torch.device("cpu")


def blobs(size: int) -> TensorDataset:
    """Three gaussian blobs in 8 dimensions, drawn from a fixed seed: the same data in every process."""
    generator = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 3, (size,), generator=generator)
    centers = torch.randn(3, 8, generator=generator) * 3
    return TensorDataset(centers[labels] + torch.randn(size, 8, generator=generator), labels)


class Trainer:
    def __init__(self, model, train_data, optimizer, device, save_every, snapshot_path) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, map_location=device)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            print(f"[RANK{self.global_rank}] resuming from snapshot at epoch {self.epochs_run}")
        device_ids = [self.local_rank] if device.type == "cuda" else None
        self.model = DistributedDataParallel(self.model, device_ids=device_ids)

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)
        total = 0.0
        for inputs, labels in self.train_data:
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(inputs), labels)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        return total / len(self.train_data)

    def _save_snapshot(self, epochs_run: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epochs_run,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"[RANK{self.global_rank}] epoch {epochs_run} | snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            print(f"[RANK{self.global_rank}] epoch {epoch} | local rank {self.local_rank} | loss {loss:.4f}")
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main(total_epochs: int, save_every: int, batch_size: int, snapshot_path: str) -> None:
    device = ddp_setup()
    dataset = blobs(1536)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset, seed=3))
    Trainer(model, loader, optimizer, device, save_every, snapshot_path).train(total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="multi-node distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=24, type=int, help="Input batch size on each device (default: 24)")
    parser.add_argument("--snapshot_path", default="multinode_snapshot.pt", help="Where the snapshot file is kept")
    args = parser.parse_args()
    main(args.total_epochs, args.save_every, args.batch_size, args.snapshot_path)
