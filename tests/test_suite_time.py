"""benchmarks/suite_time.py reads where a run's time went from its JUnit XML, and the costs plugin
(tests/support/costs.py) puts it there: a real pytest run of a small test file, read back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import suite_time  # noqa: E402

RESULTS = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="100.0">
<testcase classname="tests.test_kernel" name="test_a[2ranks]" time="40.0">
  <properties><property name="cost:kernel starts" value="5.0"/><property name="cost:world starts" value="20.0"/>
  </properties></testcase>
<testcase classname="tests.test_kernel" name="test_b" time="10.0"><failure message="no"/></testcase>
<testcase classname="tests.test_world.TestGroup" name="test_c" time="30.0">
  <properties><property name="cost:sleeps" value="12.0"/></properties></testcase>
<testcase classname="tests.test_world" name="test_d@tour" time="0.0"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def results(tmp_path: Path) -> Path:
    path = tmp_path / "results.xml"
    path.write_text(RESULTS)
    return path


def test_a_runs_time_is_read_by_kind_by_file_and_outcome(results: Path) -> None:
    run = suite_time.read(results)
    assert run.wall == 100.0 and run.outcomes() == {"passed": 2, "failed": 1, "skipped": 1}
    assert run.by_kind() == {
        "kernel starts": 5.0,
        "world starts": 20.0,
        "sleeps": 12.0,
        suite_time.OWN_WORK: 15.0 + 10.0 + 18.0,  # each test's time past its charged kinds
        suite_time.OUTSIDE_TESTS: 20.0,  # the run's wall past the sum of its tests
    }
    files = run.by_file()
    assert sorted(files) == ["tests/test_kernel.py", "tests/test_world.py"]  # a class's tests count to its file
    # a group pytest-xdist appends under --dist loadgroup is not part of the name
    assert [case.name for case in files["tests/test_world.py"]] == ["test_c", "test_d"]
    assert suite_time.test_name("test_e[a@b]") == "test_e[a@b]"


def test_the_tables_rank_the_costliest_first_and_show_the_earlier_run_beside(results: Path, capsys) -> None:
    assert suite_time.main([str(results), "--before", str(results), "--slowest", "2", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert "before: 1.7 min wall, 1 failed, 2 passed, 1 skipped" in printed
    assert "| kind of cost | before | seconds | share |" in printed
    kinds = printed.split("By kind of cost")[1].split("By file")[0]
    assert kinds.index("the tests' own work") < kinds.index("world starts") < kinds.index("sleeps")
    assert "| `tests/test_kernel.py` | 2 | 50.0 s | 50.0 s | the tests' own work 50%, world starts 40% |" in printed
    slowest = printed.split("slowest tests")[1].strip().splitlines()
    assert slowest[2:] == [
        "| 40.0 | `tests/test_kernel.py::test_a[2ranks]` | world starts (20.0 s) |",
        "| 30.0 | `tests/test_world.py::test_c` | the tests' own work (18.0 s) |",
    ]


def test_a_missing_results_file_is_one_line_saying_how_to_make_it(tmp_path: Path, capsys) -> None:
    assert suite_time.main([str(tmp_path / "none.xml")]) == 2
    assert capsys.readouterr().out.strip().endswith(f"--junitxml={tmp_path / 'none.xml'}")


def test_the_plugin_charges_a_tests_time_to_what_it_waited_in(tmp_path: Path) -> None:
    (tmp_path / "test_waits.py").write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            import pytest

            @pytest.fixture
            def slow_fixture():
                time.sleep(0.3)  # setup counts with the test
                yield

            def test_sleeps_and_a_subprocess(slow_fixture):
                time.sleep(0.2)
                subprocess.run([sys.executable, "-c", "import time; time.sleep(0.4)"], check=True)
                deadline = time.monotonic() + 0.3
                while time.monotonic() < deadline:  # its own work
                    pass
            """
        )
    )
    xml = tmp_path / "results.xml"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.support.costs",
            f"--junitxml={xml}",
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    [case] = suite_time.read(xml).cases
    assert case.outcome == "passed"
    assert 0.5 <= case.kinds["sleeps"] < 0.5 + 0.3, case.kinds  # both sleeps, nothing else
    assert 0.4 <= case.kinds["other subprocesses"] < 0.4 + 2.0, case.kinds  # the child's own start: up to 2 s
    assert case.seconds - sum(case.kinds.values()) >= 0.3  # the busy loop: the test's own work
