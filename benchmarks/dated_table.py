"""The table per date of `benchmarks/results/by_date.md`: one row per subject of every run made with
`python benchmarks/run.py SCENARIO --record`, under the day's heading, so a figure can be followed
from day to day (and a regression dated) without digging through JSON files."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

HEADER = (
    "| scenario | subject | figure | per pair or round vs its reference | CPU us/step: training thread, "
    "the tool's threads, launcher side | load (1 min) at start, end | commit | command |\n"
    "|---|---|---|---|---|---|---|---|\n"
)
# each scenario's headline figure in its summary: key, unit
FIGURES = {"ready_s": "s to ready", "ms": "ms a cell", "steps_per_s": "steps/s"}


def _figure(entry: dict[str, Any]) -> str:
    for key, unit in FIGURES.items():
        value = entry.get(key)
        if isinstance(value, dict) and "median" in value:
            return f"{value['median']:.3g} {unit} ({value['min']:.3g}-{value['max']:.3g})"
    return "-"


def _ratio(entry: dict[str, Any]) -> str:
    ratio = entry.get("ratio") or {}
    return f"{ratio['median']:.3f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if "median" in ratio else "-"


def _cost(entry: dict[str, Any]) -> str:
    cost = entry.get("cpu_us_per_step") or {}
    keys = ("main_us_per_step", "tool_threads_us_per_step", "launcher_us_per_step")
    return ", ".join(f"{cost[key]:.0f}" for key in keys if key in cost) or "-"


def rows(
    scenario: str,
    summary: dict[str, Any],
    labels: dict[str, str],
    commit: str,
    command: str,
    load: tuple[float, float],
) -> list[str]:
    """The table rows of one scenario's run; `load`: the machine's load average at its start and end
    (steps/s move with it; a run beside other work is told apart by it). A subject with none of the
    table's figures (a scenario whose figures are of another kind: elastic, failures) gets no row."""
    found = []
    for name, entry in summary.items():
        if not isinstance(entry, dict):
            continue
        figures = (_figure(entry), _ratio(entry), _cost(entry))
        if figures != ("-", "-", "-"):
            found.append(
                f"| {scenario} | {labels.get(name, name)} | {' | '.join(figures)} | "
                f"{load[0]:.1f}, {load[1]:.1f} | `{commit}` | `{command}` |\n"
            )
    return found


def record(path: Path, new_rows: list[str], today: datetime.date | None = None) -> None:
    """Add `new_rows` to today's table in `path` (made with its heading if it is the day's first run)."""
    heading = f"## {(today or datetime.date.today()).isoformat()}\n"
    text = path.read_text(encoding="utf8") if path.exists() else "# Figures by date\n\n" + (__doc__ or "") + "\n"
    if heading not in text:
        text = text.rstrip("\n") + f"\n\n{heading}\n{HEADER}"
    start = text.index(heading)
    following = text.find("\n## ", start + len(heading))
    end = len(text) if following < 0 else following + 1
    section = text[start:end].rstrip("\n") + "\n" + "".join(new_rows)
    path.write_text(text[:start] + section + ("\n" + text[end:] if following >= 0 else ""), encoding="utf8")
