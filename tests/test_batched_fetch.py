"""prepare_loader's batched fetch of a TensorDataset (ddp_notebook.rank.batched_fetch): the batches a
DataLoader gives, value for value and in type, one indexing per tensor. One process, no world."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_notebook.rank.batched_fetch import BatchedTensors, batched, collate

# DataLoader's batched fetch (`__getitems__`) is torch's: run on every torch of the range
pytestmark = pytest.mark.core


def _datasets() -> dict[str, TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    return {
        "features and labels": TensorDataset(
            torch.randn(103, 7, generator=generator), torch.randint(0, 10, (103,), generator=generator)
        ),
        "images, half precision": TensorDataset(torch.randn(103, 3, 4, 4, generator=generator).half()),
        "three tensors, one of bools": TensorDataset(
            torch.arange(103), torch.rand(103, 2, generator=generator), torch.rand(103, generator=generator) > 0.5
        ),
    }


def _batches(loader: DataLoader[Any]) -> list[Any]:
    return list(loader)


@pytest.mark.parametrize("name", list(_datasets()))
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_a_dataloaders_own(name: str, drop_last: bool, workers: int) -> None:
    dataset = _datasets()[name]
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        fetched, kwargs = batched(dataset, {"drop_last": drop_last, "num_workers": workers})
        assert isinstance(fetched, BatchedTensors) and kwargs["collate_fn"] is collate
        plain = _batches(DataLoader(dataset, batch_size=10, sampler=sampler, drop_last=drop_last, num_workers=workers))
        fast = _batches(DataLoader(fetched, batch_size=10, sampler=sampler, **kwargs))
        assert len(plain) == len(fast) == (5 if drop_last else 6)  # 52 samples a rank: a short last batch
        for one, other in zip(plain, fast):
            assert type(one) is type(other) is list and len(one) == len(other)
            for a, b in zip(one, other):
                assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
                assert torch.equal(a, b)


def test_only_a_plain_tensor_dataset_without_a_collate_fn_of_its_own_is_batched() -> None:
    dataset = _datasets()["features and labels"]

    class Augmented(TensorDataset):
        def __getitem__(self, index: int) -> Any:
            x, y = super().__getitem__(index)
            return x * 2, y

    mine = {"collate_fn": lambda samples: samples}
    assert batched(dataset, mine) == (dataset, mine)
    augmented = Augmented(*dataset.tensors)
    assert batched(augmented, {}) == (augmented, {})
    assert batched(list(range(5)), {}) == (list(range(5)), {})
    fetched, _ = batched(dataset, {})
    assert all(a is b for a, b in zip(fetched.tensors, dataset.tensors))  # the same tensors, not copies
    assert len(fetched.tensors) == 2 and len(fetched) == len(dataset)
