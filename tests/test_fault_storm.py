"""The fault storm, short: benchmarks/fault_storm.py as a user runs it, at 2, 3 and 4 ranks.

Each run injects faults of every kind the driver has (a SIGKILLed rank, a rank that raises, a
skipped collective, an interrupt, a rank stopped past the heartbeat limit) into a tracked
training run, goes on after each, and compares every rank's parameters and sample log bitwise
with a fault-free run of the same steps; nothing the world started may be left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# (ranks, seed): each seed draws all five kinds of fault as its first five
STORMS = [pytest.param(2, 4, id="2ranks"), pytest.param(3, 6, id="3ranks"), pytest.param(4, 4, id="4ranks")]
KINDS = {"kill", "raise", "skip", "interrupt", "stop"}


@pytest.mark.parametrize(("ranks", "seed"), STORMS)
def test_a_short_storm_is_survived_and_ends_bitwise_equal(tmp_path: Path, ranks: int, seed: int) -> None:
    out = tmp_path / "storm.json"
    command = [sys.executable, "fault_storm.py", "--ranks", str(ranks), "--seed", str(seed), "--faults", "5"]
    done = subprocess.run(
        [*command, "--minutes", "5", "--samples", "768", "--json", str(out)],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    shown = done.stdout[-4000:] + done.stderr[-4000:]
    assert out.exists(), shown
    storm = json.loads(out.read_text(encoding="utf8"))["storm"]
    faults = storm["faults"]
    assert len(faults) == 5, shown
    assert {fault["kind"] for fault in faults} == KINDS, shown
    assert [f for f in faults if not f["survived"]] == [], shown
    assert storm["equal"] is True, shown
    assert storm["leftovers"] == [], shown
    assert done.returncode == 0, shown
    assert "bitwise equal to the fault-free run" in done.stdout
