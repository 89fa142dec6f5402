"""Where the test suite's time goes: a run's JUnit XML as tables by kind of cost, by file, and the
slowest tests; with --before, a second run's figures beside them.

    python3 -m pytest -q -p no:cacheprovider --junitxml=results.xml
    python3 benchmarks/suite_time.py results.xml [--before earlier.xml] [--markdown] [--slowest 25]

The kinds come from tests/support/costs.py, which charges each second of a test (its fixtures'
setup and teardown included) to the innermost of the calls it waited in: a world's or a kernel's
start and stop, a cell that ran into its limit, a sleep, pip and venv builds, the docs build, a
notebook run, another subprocess; the rest is the test's own work. A run's wall time past the sum of
its tests (collection, the session's fixtures' last teardown) is shown as its own row.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

PROPERTY_PREFIX = "cost:"  # tests/support/costs.py's
OWN_WORK = "the tests' own work"
OUTSIDE_TESTS = "outside any test (collection, last teardowns)"


@dataclass
class Case:
    file: str
    name: str
    seconds: float
    outcome: str  # passed, failed, error, skipped
    kinds: dict[str, float] = field(default_factory=dict)

    @property
    def test_id(self) -> str:
        return f"{self.file}::{self.name}"


@dataclass
class Run:
    wall: float  # the run's own time, as pytest reported it
    cases: list[Case]

    @property
    def test_seconds(self) -> float:
        """The seconds the tests took, one after another: more than the wall time where they ran
        in parallel (`pytest -n`)."""
        return sum(case.seconds for case in self.cases)

    @property
    def charged(self) -> float:
        """What the kinds of cost add up to: the wall time, or the tests' seconds of a parallel run."""
        return max(self.wall, self.test_seconds)

    def by_kind(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for case in self.cases:
            for kind, seconds in case.kinds.items():
                totals[kind] += seconds
            totals[OWN_WORK] += max(case.seconds - sum(case.kinds.values()), 0.0)
        totals[OUTSIDE_TESTS] = max(self.wall - sum(case.seconds for case in self.cases), 0.0)
        return dict(totals)

    def by_file(self) -> dict[str, list[Case]]:
        files: dict[str, list[Case]] = defaultdict(list)
        for case in self.cases:
            files[case.file].append(case)
        return dict(files)

    def outcomes(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for case in self.cases:
            counts[case.outcome] += 1
        return dict(counts)


def file_of(classname: str) -> str:
    """tests.test_kernel (or tests.test_x.TestGroup) -> tests/test_kernel.py."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        if parts[end - 1].startswith("test_") or end == 1:
            return "/".join(parts[:end]) + ".py"
    return classname


def test_name(name: str) -> str:
    """A test's name without the group pytest-xdist appends under `--dist loadgroup` (`test_a@tour`)."""
    return name[: name.rindex("@")] if name.rfind("@") > name.rfind("]") else name


def read(path: Path) -> Run:
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases = []
    for suite in suites:
        for testcase in suite.iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if testcase.find(tag) is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
            kinds = {
                prop.get("name", "").removeprefix(PROPERTY_PREFIX): float(prop.get("value", 0))
                for prop in testcase.iter("property")
                if prop.get("name", "").startswith(PROPERTY_PREFIX)
            }
            kinds.pop(OWN_WORK, None)  # the rest of the test's time: computed below, not summed twice
            cases.append(
                Case(
                    file_of(testcase.get("classname", "")),
                    test_name(testcase.get("name", "")),
                    float(testcase.get("time", 0)),
                    outcome,
                    kinds,
                )
            )
    wall = sum(float(suite.get("time", 0)) for suite in suites)
    return Run(wall, cases)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


class Table:
    """Rows printed as aligned text, or as a Markdown table for docs/testing.md."""

    def __init__(self, header: list[str], markdown: bool) -> None:
        self.header, self.rows, self.markdown = header, [], markdown

    def add(self, *cells: object) -> None:
        self.rows.append([str(cell) for cell in cells])

    def render(self) -> str:
        if self.markdown:
            lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
            lines += ["| " + " | ".join(row) + " |" for row in self.rows]
            return "\n".join(lines)
        widths = [max(len(row[i]) for row in [self.header, *self.rows]) for i in range(len(self.header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [self.header, *self.rows]]
        return "\n".join(line.rstrip() for line in lines)


def kinds_table(run: Run, before: Run | None, markdown: bool) -> str:
    now = run.by_kind()
    then = before.by_kind() if before else {}
    header = ["kind of cost", *(["before"] if before else []), "seconds", "share"]
    table = Table(header, markdown)
    for kind in sorted(set(now) | set(then), key=lambda k: -now.get(k, 0.0)):
        was = [minutes(then.get(kind, 0.0))] if before else []
        share = 100 * now.get(kind, 0.0) / max(run.charged, 1e-9)
        table.add(kind, *was, minutes(now.get(kind, 0.0)), f"{share:.0f}%")
    all_label = "**all**" if markdown else "all"
    table.add(all_label, *([minutes(before.charged)] if before else []), minutes(run.charged), "100%")
    return table.render()


def files_table(run: Run, before: Run | None, markdown: bool, top: int) -> str:
    files = run.by_file()
    earlier = before.by_file() if before else {}
    header = ["file", "tests", *(["before"] if before else []), "seconds", "where it goes"]
    table = Table(header, markdown)
    ordered = sorted(files.items(), key=lambda item: -sum(case.seconds for case in item[1]))
    for name, cases in ordered[:top] if top else ordered:
        seconds = sum(case.seconds for case in cases)
        kinds: dict[str, float] = defaultdict(float)
        for case in cases:
            for kind, spent in case.kinds.items():
                kinds[kind] += spent
        kinds[OWN_WORK] = seconds - sum(kinds.values())
        biggest = sorted(kinds.items(), key=lambda item: -item[1])[:2]
        where = ", ".join(f"{kind} {100 * spent / max(seconds, 1e-9):.0f}%" for kind, spent in biggest if spent > 0)
        was = [minutes(sum(case.seconds for case in earlier.get(name, [])))] if before else []
        table.add(f"`{name}`" if markdown else name, len(cases), *was, minutes(seconds), where)
    return table.render()


def slowest_table(run: Run, count: int, markdown: bool) -> str:
    table = Table(["seconds", "test", "most of it"], markdown)
    for case in sorted(run.cases, key=lambda case: -case.seconds)[:count]:
        kinds = dict(case.kinds)
        kinds[OWN_WORK] = case.seconds - sum(kinds.values())
        kind, spent = max(kinds.items(), key=lambda item: item[1])
        table.add(f"{case.seconds:.1f}", f"`{case.test_id}`" if markdown else case.test_id, f"{kind} ({spent:.1f} s)")
    return table.render()


def summary(run: Run, label: str) -> str:
    counts = ", ".join(f"{count} {outcome}" for outcome, count in sorted(run.outcomes().items()))
    parallel = f" ({minutes(run.test_seconds)} of tests, run in parallel)" if run.test_seconds > run.wall else ""
    return f"{label}: {minutes(run.wall)} wall{parallel}, {counts}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a run's JUnit XML (pytest --junitxml=...)")
    parser.add_argument("--before", type=Path, help="an earlier run's JUnit XML, shown beside")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables (docs/testing.md)")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list")
    parser.add_argument("--files", type=int, default=0, help="only the N costliest files (default: all)")
    args = parser.parse_args(argv)
    if not args.results.exists():
        print(f"suite_time: no results file {args.results}: run pytest with --junitxml={args.results}")
        return 2
    run = read(args.results)
    before = read(args.before) if args.before else None
    if before:
        print(summary(before, "before"))
    print(summary(run, "this run"))
    print("\nBy kind of cost\n")
    print(kinds_table(run, before, args.markdown))
    print("\nBy file\n")
    print(files_table(run, before, args.markdown, args.files))
    if args.slowest:
        print(f"\nThe {args.slowest} slowest tests\n")
        print(slowest_table(run, args.slowest, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
