"""A torchrun training script in the shape of minGPT's DDP trainer (the DDP series' last lesson).

A character-level GPT, a `Trainer` driven by config dataclasses, AdamW with gradient clipping, a train
and a test loader, and a snapshot dataclass (model, optimizer, finished epoch) that a restarted run
resumes from. Run as `torchrun --nproc-per-node N mingpt_trainer.py --max_epochs E`, or unchanged in a
ddp_notebook world (`%run mingpt_trainer.py --max_epochs E`).
"""

import argparse
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler

TEXT = (
    "It is a truth universally acknowledged, that a single process in possession of a good model, "
    "must be in want of a second one. However little known the feelings or views of such a process "
    "may be on its first entering a world, this truth is so well fixed in the minds of the ranks "
    "around it, that it is considered the rightful owner of some one or other of their gradients. "
) * 4


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1


@dataclass
class TrainerConfig:
    max_epochs: int
    batch_size: int
    save_every: int
    grad_norm_clip: float
    snapshot_path: str


@dataclass
class Snapshot:
    model_state: dict
    optimizer_state: dict
    finished_epoch: int


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[ch] for ch in text])
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[index : index + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.n_embd)
        self.position = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))
        layer = nn.TransformerEncoderLayer(
            config.n_embd, config.n_head, 4 * config.n_embd, config.dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, config.n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(config.block_size))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        steps = idx.size(1)
        x = self.token(idx) + self.position[:, :steps]
        logits = self.head(self.blocks(x, mask=self.mask[:steps, :steps], is_causal=True))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class Trainer:
    def __init__(self, config: TrainerConfig, model, optimizer, train_dataset, test_dataset) -> None:
        self.config = config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")
        self.train_loader = self._prepare_dataloader(train_dataset)
        self.test_loader = self._prepare_dataloader(test_dataset)
        self.epochs_run = 0
        self.model = model.to(self.device)
        self.optimizer = optimizer
        if os.path.exists(config.snapshot_path):
            self._load_snapshot()
        self.model = DDP(self.model, device_ids=[self.local_rank] if cuda else None)

    def _prepare_dataloader(self, dataset: Dataset) -> DataLoader:
        sampler = DistributedSampler(dataset)
        return DataLoader(dataset, batch_size=self.config.batch_size, shuffle=False, sampler=sampler)

    def _load_snapshot(self) -> None:
        snapshot = Snapshot(**torch.load(self.config.snapshot_path, map_location=self.device))
        self.model.load_state_dict(snapshot.model_state)
        self.optimizer.load_state_dict(snapshot.optimizer_state)
        self.epochs_run = snapshot.finished_epoch
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets, train: bool = True) -> float:
        with torch.set_grad_enabled(train):
            _, loss = self.model(source, targets)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
            self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int, dataloader: DataLoader, train: bool = True) -> None:
        dataloader.sampler.set_epoch(epoch)
        self.model.train(train)
        for step, (source, targets) in enumerate(dataloader):
            loss = self._run_batch(source.to(self.device), targets.to(self.device), train)
            if step % 20 == 0:
                kind = "Train" if train else "Eval"
                print(f"[GPU{self.global_rank}] Epoch {epoch} | Iter {step} | {kind} Loss {loss:.5f}")

    def _save_snapshot(self, epoch: int) -> None:
        model = self.model.module if hasattr(self.model, "module") else self.model
        snapshot = Snapshot(model.state_dict(), self.optimizer.state_dict(), epoch)
        torch.save(asdict(snapshot), self.config.snapshot_path)
        print(f"Snapshot saved at epoch {epoch}")

    def train(self) -> None:
        for epoch in range(self.epochs_run, self.config.max_epochs):
            self._run_epoch(epoch, self.train_loader, train=True)
            if self.local_rank == 0 and (epoch + 1) % self.config.save_every == 0:
                self._save_snapshot(epoch + 1)
            self._run_epoch(epoch, self.test_loader, train=False)


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(42)  # minGPT's set_seed: the same weights and dropout on every rank
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    dataset = CharDataset(TEXT, GPTConfig.block_size)
    train_set, test_set = random_split(dataset, [0.9, 0.1], generator=torch.Generator().manual_seed(0))
    model = GPT(GPTConfig(vocab_size=len(dataset.chars)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    config = TrainerConfig(args.max_epochs, args.batch_size, args.save_every, 1.0, args.snapshot_path)
    Trainer(config, model, optimizer, train_set, test_set).train()
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a character-level GPT trained with DDP")
    parser.add_argument("--max_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--save_every", type=int, default=1)
    parser.add_argument("--snapshot_path", default="gpt_snapshot.pt")
    main(parser.parse_args())
