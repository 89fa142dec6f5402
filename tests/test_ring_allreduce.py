"""The ring all-reduce of notebooks/10_ring_allreduce.ipynb gives dist.all_reduce's sums on real gloo worlds.

The implementation is read from the notebook's cell tagged `ring-implementation`, so the code a
reader sees is the code tested.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from ddp_notebook import DDPCluster
from tests.support.worlds import shared_world

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "10_ring_allreduce.ipynb"
TAG = "ring-implementation"
CELL_SECONDS = 120  # a ring whose sends and receives do not pair up would wait forever

# sizes N does not divide, sizes below N (some chunks empty), and an even one
SIZES = (1, 2, 3, 5, 7, 10, 1001, 4096)

COMPARE = """
ring = dist.new_group(members)  # every rank creates the group, members or not
results = {}
if rank in members:
    for numel in sizes:
        torch.manual_seed(1000 * rank + numel)
        mine = torch.randn(numel, dtype=torch.float64)
        ours, theirs = mine.clone(), mine.clone()
        sent = ring_all_reduce(ours, group=ring)
        dist.all_reduce(theirs, group=ring)
        results[numel] = (ours, theirs, sent)
    # an integer tensor of another shape: sums must be exact
    counts = torch.arange(15, dtype=torch.int64).reshape(3, 5) * (rank + 1)
    expected = counts.clone()
    ring_all_reduce(counts, group=ring)
    dist.all_reduce(expected, group=ring)
    results["int"] = (counts, expected, None)
dist.destroy_process_group(ring)
"""

pytestmark = pytest.mark.integration  # every test runs on a real world: the shared one or four ranks


def ring_source() -> str:
    """The body of the notebook's %%ddp cell tagged `ring-implementation`."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [cell for cell in notebook.cells if TAG in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{NOTEBOOK.name} should have one cell tagged {TAG}"
    magic, _, body = tagged[0].source.partition("\n")
    assert magic.strip() == "%%ddp", "the ring implementation runs on the ranks"
    return body


@pytest.fixture(scope="module")
def four_ranks() -> Iterator[DDPCluster]:
    yield from shared_world(4)


def compare(world: DDPCluster, members: list[int]) -> None:
    world.execute(ring_source(), stream=False, timeout=CELL_SECONDS)
    world.push({"members": members, "sizes": list(SIZES)})
    world.execute(COMPARE, stream=False, timeout=CELL_SECONDS)
    results = world.pull("results", ranks=members)
    n = len(members)
    for rank in members:
        for numel in SIZES:
            ours, theirs, sent = results[rank][numel]
            assert ours.shape == (numel,)
            assert ours.tolist() == pytest.approx(theirs.tolist(), rel=1e-12, abs=1e-12), (n, numel, rank)
            # 2(N-1) steps, each sending one chunk (tensor_split: sizes differ by at most one)
            chunk = -(-numel // n)
            assert (numel // n) * 8 * 2 * (n - 1) <= sent <= chunk * 8 * 2 * (n - 1)
        counts, expected = results[rank]["int"][:2]
        assert counts.shape == (3, 5) and counts.tolist() == expected.tolist()
    # every rank's result is the same sum
    for numel in SIZES:
        assert len({tuple(results[rank][numel][0].tolist()) for rank in members}) == 1


def test_ring_of_two_equals_all_reduce(world: DDPCluster) -> None:
    compare(world, [0, 1])


def test_ring_of_three_equals_all_reduce(four_ranks: DDPCluster) -> None:
    # ranks 1-3 of a world of 4: the ring's neighbours are global ranks, not group ranks
    compare(four_ranks, [1, 2, 3])


def test_ring_of_four_equals_all_reduce(four_ranks: DDPCluster) -> None:
    compare(four_ranks, [0, 1, 2, 3])


def test_bytes_sent_are_two_n_minus_one_over_n_of_the_tensor(four_ranks: DDPCluster) -> None:
    four_ranks.execute(ring_source(), stream=False, timeout=CELL_SECONDS)
    four_ranks.execute("sent = ring_all_reduce(torch.ones(4000))", stream=False, timeout=CELL_SECONDS)
    assert set(four_ranks.pull("sent").values()) == {4000 * 4 * 2 * 3 // 4}
