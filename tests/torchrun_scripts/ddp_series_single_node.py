"""A single-node torchrun training script in the shape of PyTorch's DDP tutorial series.

Run as `torchrun --nproc-per-node N ddp_series_single_node.py TOTAL_EPOCHS SAVE_EVERY`, or unchanged
in a ddp_notebook world (`%%ddp` + `%run ddp_series_single_node.py TOTAL_EPOCHS SAVE_EVERY`). It sets
up its own process group, keeps a snapshot file (model and epochs run) that a restarted run resumes
from, shards its data with a DistributedSampler in a plain DataLoader, and ends its process group.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
    else:
        init_process_group(backend="gloo")


class RandomPairs(Dataset):
    """Inputs and targets drawn once from a fixed seed: the same data in every process."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.inputs = torch.rand(size, 20, generator=generator)
        self.targets = torch.rand(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if cuda else None)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        batch_size = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.local_rank}] Epoch {epoch} | Batchsize: {batch_size} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def load_train_objs():
    train_set = RandomPairs(2048)
    torch.manual_seed(0)  # the same initial weights on every rank and in every launcher
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    sampler = DistributedSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=False, sampler=sampler)


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt") -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where the snapshot file is kept")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
