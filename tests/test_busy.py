"""Ranks left busy after a cell: what they do is said (from their X-ray), grouped, not assumed; the
next cell's refusal says the same, and %ddp_interrupt stops them."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_notebook.cell import busy
from ddp_notebook.live.xray_readings import RankCollectives
from tests.support.docs_pages import documented_magic_lines
from tests.support.kernel import Kernel, kernel_world_pids
from tests.support.processes import wait_gone
from tests.support.readings import waiting_in

NOW = 1_700_000_000.0  # the kernel's clock when the ranks were read
DOCS = Path(__file__).resolve().parent.parent / "docs" / "failures.md"


def test_busy_ranks_are_grouped_by_what_they_do() -> None:
    readings = {rank: waiting_in(rank, None, line=3) for rank in range(1, 128)}
    assert busy.describe(range(1, 128), readings, NOW) == "ranks 1-127 running cell line 3, in no collective"
    readings[5] = waiting_in(5, 40.0, seq=4, line=7)
    readings[6] = waiting_in(6, 42.0, seq=4, line=7)
    readings[9] = RankCollectives(9, (), None, False, 0)
    began = time.strftime("%H:%M:%S", time.localtime(NOW - 42.0))  # the earlier of the two
    assert busy.describe(range(1, 128), readings, NOW) == (
        "ranks 1-4, 7-8, 10-127 running cell line 3, in no collective; "
        f"ranks 5-6 blocked in all_reduce #4 [4] (cell line 7) since {began}; "
        "rank 9 out of the cell's code (finishing it, or a request of the world)"
    )
    # a rank whose X-ray thread does not answer is not guessed at
    assert busy.describe([2], {}, NOW).startswith("rank 2 not answering")
    assert busy.refusal([1, 2], readings, NOW) == (
        "still busy with the last cell (ranks 1-2 running cell line 3, in no collective): "
        "wait for them, stop them with %ddp_interrupt, or %ddp_restart"
    )


CELL = (
    "%%ddp\nimport time\nkept = rank\nif rank == 0:\n    raise ValueError('rank 0 fails on purpose')\ntime.sleep(300)"
)


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    started = Kernel()
    try:
        out, error = started.run("%load_ext ddp_notebook\n%ddp_start 3")
        assert error is None, out
        pids = kernel_world_pids(started)
        yield started
        out, error = started.run("%ddp_stop")
        assert error is None, out
        assert wait_gone(pids) == []
    finally:
        started.close()


@pytest.mark.integration
def test_a_raise_while_others_compute_says_what_they_do_and_the_next_cell_waits_for_them(kernel: Kernel) -> None:
    out, error = kernel.run(CELL, timeout=120)
    assert error == "RankError", out
    # not "blocked in a collective": they sleep, on the cell's last line
    assert "still running when the cell ended: ranks 1-2 running cell line 5, in no collective" in out, out
    assert "the next cell sets the process group up again once ranks 1-2 end" in out, out
    assert "collective timeout" not in out, out
    out, error = kernel.run("%%ddp\nafter = rank", timeout=60)
    assert (  # a UsageError: one line on stderr, no traceback
        "UsageError: still busy with the last cell (ranks 1-2 running cell line 5, in no collective): "
        "wait for them, stop them with %ddp_interrupt, or %ddp_restart"
    ) in out, out
    out, error = kernel.run("%ddp_interrupt --ranks 2", timeout=60)
    assert error is None and "sent KeyboardInterrupt to rank 2" in out, out
    out, error = kernel.run("%ddp_interrupt", timeout=60)
    assert error is None, out
    assert re.search(r"sent KeyboardInterrupt to ranks? 1|no rank is running a cell", out), out
    out, error = kernel.run("%%ddp\nimport torch\nt = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), kept)", timeout=60)
    assert error is None, out
    assert all(f"[rank {rank}] Out: (3.0, {rank})" in out for rank in range(3)), out
    out, error = kernel.run("%ddp_interrupt", timeout=60)
    assert error is None and "no rank is running a cell: nothing to interrupt" in out, out
    # the page's lines, as written there, are those run here
    assert documented_magic_lines(DOCS, "Ranks left running: `%ddp_interrupt`") == ["%ddp_interrupt"]
