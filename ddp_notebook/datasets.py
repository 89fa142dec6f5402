"""Small real datasets that ship inside installed packages, for notebooks and tests.

Nothing is downloaded at run time: the data come from the CSV files plotly ships, read
with the standard library (no pandas needed).
"""

from __future__ import annotations

import csv
import gzip
import io
from importlib import resources

IRIS_FEATURES = ("sepal_length", "sepal_width", "petal_length", "petal_width")
IRIS_SPECIES = ("setosa", "versicolor", "virginica")


def _plotly_csv(name: str) -> list[dict[str, str]]:
    data = resources.files("plotly.package_data.datasets").joinpath(f"{name}.csv.gz").read_bytes()
    with io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(data)), encoding="utf8") as text:
        return list(csv.DictReader(text))


def iris_rows() -> tuple[list[list[float]], list[int]]:
    """Fisher's iris measurements (150 flowers, 4 features) and species labels 0-2."""
    rows = _plotly_csv("iris")
    features = [[float(row[name]) for name in IRIS_FEATURES] for row in rows]
    labels = [IRIS_SPECIES.index(row["species"]) for row in rows]
    return features, labels


def iris_dataset(standardize: bool = True):  # -> torch.utils.data.TensorDataset (torch imported lazily)
    """The iris data as a TensorDataset of (float32 features, int64 labels).

    With `standardize`, each feature is scaled to zero mean and unit variance, which lets a
    small network train in a few epochs.
    """
    import torch
    from torch.utils.data import TensorDataset

    features, labels = iris_rows()
    x = torch.tensor(features, dtype=torch.float32)
    if standardize:
        x = (x - x.mean(dim=0)) / x.std(dim=0)
    return TensorDataset(x, torch.tensor(labels, dtype=torch.int64))


def train_test_split(dataset, test_fraction: float = 0.2, seed: int = 0):
    """Split a dataset the same way on every rank (a fixed-seed permutation)."""
    import torch
    from torch.utils.data import Subset

    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = round(len(dataset) * test_fraction)
    return Subset(dataset, order[n_test:]), Subset(dataset, order[:n_test])
