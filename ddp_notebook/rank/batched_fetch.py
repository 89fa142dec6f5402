"""Runs on ranks: a TensorDataset's batch fetched with one indexing per tensor, not one per sample.

A DataLoader fetches a batch by calling `dataset[i]` for each of its samples and stacking the rows
(`default_collate`); for tensors already in memory that is most of what the loader costs: about
0.25 ms for a batch of 64 rows of 64 floats on this machine, 8% of a small model's 2.9 ms training
step (docs/performance.md, "What the helpers add"). torch's
DataLoader asks a dataset with `__getitems__` for the whole batch at once; `prepare_loader` hands a
plain TensorDataset to it as `BatchedTensors`, whose `__getitems__` indexes each tensor once. The
batches are the same, value for value and in type (a list, as `default_collate` makes of tuples).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate


class WholeBatch:
    """A batch `BatchedTensors.__getitems__` fetched whole: `collate` passes it through."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors


class BatchedTensors(TensorDataset):
    """The same tensors as a TensorDataset, fetched a batch at a time."""

    def __getitems__(self, indices: list[int]) -> WholeBatch:
        rows = torch.as_tensor(indices)
        return WholeBatch(tuple(tensor[rows] for tensor in self.tensors))


def collate(data: Any) -> Any:
    """The DataLoader's collate_fn beside `BatchedTensors`: its batches as default_collate would
    give them (a list of tensors), anything else to default_collate."""
    if isinstance(data, WholeBatch):
        return list(data.tensors)
    return default_collate(data)


def batched(dataset: Dataset[Any], loader_kwargs: dict[str, Any]) -> tuple[Dataset[Any], dict[str, Any]]:
    """The dataset and keywords a DataLoader over `dataset` gets: a plain TensorDataset (its exact
    type: a subclass may fetch samples its own way) without a collate_fn of the caller's is fetched
    a batch at a time; anything else is left as it is."""
    if type(dataset) is not TensorDataset or "collate_fn" in loader_kwargs:
        return dataset, loader_kwargs
    return BatchedTensors(*dataset.tensors), {**loader_kwargs, "collate_fn": collate}
