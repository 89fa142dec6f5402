"""The table per date the benchmarks keep (`benchmarks/run.py --record`): rows land under their
day's heading, a new day gets its own table, and an earlier day's table is kept as it was."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import dated_table

SUMMARY = {
    "ddp_kernel": {
        "steps_per_s": {"median": 129.26, "min": 119.4, "max": 152.4},
        "ratio": {"median": 0.99, "min": 0.94, "max": 1.04},
        "cpu_us_per_step": {
            "main_us_per_step": 3759.0,
            "tool_threads_us_per_step": 49.2,
            "launcher_us_per_step": 207.0,
        },
    },
    "torchrun": {"steps_per_s": {"median": 127.2, "min": 123.8, "max": 148.8}},
}


def test_runs_are_kept_in_one_table_per_day(tmp_path: Path) -> None:
    path = tmp_path / "by_date.md"
    command = "python benchmarks/run.py training"
    rows = dated_table.rows("training", SUMMARY, {"ddp_kernel": "%%ddp"}, "abc1234", command, (1.04, 2.51))
    assert rows[0] == (
        "| training | %%ddp | 129 steps/s (119-152) | 0.990x (0.94-1.04) | 3759, 49, 207 | 1.0, 2.5 | `abc1234` | "
        "`python benchmarks/run.py training` |\n"
    )
    assert rows[1].startswith("| training | torchrun | 127 steps/s (124-149) | - | - |")
    first, second = datetime.date(2026, 11, 27), datetime.date(2026, 11, 28)
    dated_table.record(path, rows[:1], first)
    dated_table.record(path, rows[1:], second)
    dated_table.record(path, ["| start | x | 0.5 s to ready |\n"], second)
    text = path.read_text()
    assert text.startswith("# Figures by date\n")
    day1, day2 = text.split("## 2026-11-27\n")[1].split("## 2026-11-28\n")
    assert day1.count("| training |") == 1 and "%%ddp" in day1 and "| start |" not in day1
    assert day2.count(dated_table.HEADER) == 1 and day2.index("| training | torchrun") < day2.index("| start | x")
    # a later run of the first day goes to that day's table, the second day's stays whole
    dated_table.record(path, ["| roundtrip | y |\n"], first)
    day1, day2 = path.read_text().split("## 2026-11-27\n")[1].split("## 2026-11-28\n")
    assert "| roundtrip | y |" in day1 and "| roundtrip" not in day2 and "| start | x" in day2


def test_a_subject_without_the_tables_figures_gets_no_row() -> None:
    # the elastic scenario's summary: seconds and percentages of its own, none of the table's columns
    elastic = {"ddp_notebook": {"death_to_ready_s": 0.79, "comeback_s": 0.5, "snapshot_ms": 0.67}}
    command = "python benchmarks/run.py elastic"
    assert dated_table.rows("elastic", elastic, {}, "abc1234", command, (1.0, 1.1)) == []
    mixed = dated_table.rows("training", SUMMARY | elastic, {}, "abc1234", command, (1.0, 1.1))
    assert [row.split(" | ")[1] for row in mixed] == ["ddp_kernel", "torchrun"]
