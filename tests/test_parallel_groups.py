"""The suite on two workers (tests/support/parallel.py), run for real: `pytest -n 2` on a few small
test files, with the grouping plugin. What uses what the machine has one of runs on one worker, one
module after another, and every other module on one worker with its module fixture set up once.

The bug this guards: a worker parses the command line afresh, so a `--dist loadgroup` set by a hook
never reached it; pytest-xdist then left the groups out of the test ids and handed the tests out
one by one, and the hub's module fixture was set up on both workers at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parent.parent
# each test writes which worker ran it, and each module fixture when it was set up
TEST_FILE = """
import json, os, time
from pathlib import Path
import pytest

LOG = Path(os.environ["GROUPS_LOG"])

def note(**fields):
    with LOG.open("a") as log:
        log.write(json.dumps({{"worker": os.environ["PYTEST_XDIST_WORKER"], **fields}}) + "\\n")

@pytest.fixture(scope="module")
def module_fixture():
    note(setup=__name__)
    yield

@pytest.mark.parametrize("n", range({count}))
def test_one(module_fixture, n):
    time.sleep(0.05)  # long enough that the other worker would take some, were the module split
    note(test=__name__, n=n)
"""
# two modules of the one-of-a-kind group, two of the hosts', one of the tour's, two of their own
MODULES = {
    "test_jupyterhub.py": 4,
    "test_limits.py": 3,
    "test_jobs.py": 3,
    "test_multinode.py": 3,
    "test_alpha.py": 6,
    "test_beta.py": 6,
    "test_docs_site.py": 2,
}


# as tests/conftest.py says it of the Binder build: the tour waits for a file that never comes here
WAITING_CONFTEST = """
from pathlib import Path
from tests.support.parallel import is_worker, tour_waits_for

def pytest_configure(config):
    if not is_worker(config):  # the controller hands the work out
        tour_waits_for(config, lambda: Path("built.json").exists())
"""


def run_two_workers(tmp_path: Path) -> list[dict]:
    """`pytest -n 2` on MODULES in `tmp_path`: what each test and module fixture noted, in order."""
    for name, count in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(TEST_FILE.format(count=count)))
    log = tmp_path / "groups.jsonl"
    # not a worker's own PYTEST_XDIST_* where this test runs under -n: the pytest started here is a controller
    env = {
        **{name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")},
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "GROUPS_LOG": str(log),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-p", "tests.support.parallel"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_two_workers_keep_groups_and_modules_each_on_one_worker(tmp_path: Path) -> None:
    entries = run_two_workers(tmp_path)
    tests = [entry for entry in entries if "test" in entry]
    assert len(tests) == sum(MODULES.values()), entries
    modules = [name.removesuffix(".py") for name in MODULES]
    workers_of = {module: {entry["worker"] for entry in tests if entry["test"] == module} for module in modules}
    assert all(len(workers) == 1 for workers in workers_of.values()), workers_of
    assert workers_of["test_jupyterhub"] == workers_of["test_limits"], workers_of  # one group, one worker
    assert workers_of["test_jobs"] == workers_of["test_multinode"], workers_of
    setups = sorted(entry["setup"] for entry in entries if "setup" in entry)
    assert setups == sorted(modules), entries  # each once
    ran_on = {worker: [entry["test"] for entry in tests if entry["worker"] == worker] for worker in ("gw0", "gw1")}
    hub_worker, hosts_worker = (next(iter(workers_of[module])) for module in ("test_jupyterhub", "test_jobs"))
    # the two kinds of one-of-a-kind modules, each handed out first, to a worker each
    assert hub_worker != hosts_worker, workers_of
    assert ran_on[hub_worker][:7] == ["test_jupyterhub"] * 4 + ["test_limits"] * 3, ran_on
    assert ran_on[hosts_worker][:6] == ["test_jobs"] * 3 + ["test_multinode"] * 3, ran_on
    # the tour next, to a worker that ran its group: before any module of its own
    tour_worker = next(iter(workers_of["test_docs_site"]))
    before_the_tour = set(ran_on[tour_worker][: ran_on[tour_worker].index("test_docs_site")])
    assert before_the_tour in ({"test_jupyterhub", "test_limits"}, {"test_jobs", "test_multinode"}), ran_on


def test_the_tour_waits_behind_the_other_modules_while_its_environment_builds(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(WAITING_CONFTEST)
    tests = [entry for entry in run_two_workers(tmp_path) if "test" in entry]
    assert len(tests) == sum(MODULES.values()), tests
    order = [entry["test"] for entry in tests]
    first = {module: order.index(module) for module in dict.fromkeys(order)}
    # its build never ends here: every other unit is handed out before it, the tour last of all
    assert first["test_docs_site"] > max(first["test_alpha"], first["test_beta"]), order


def test_the_tour_goes_first_once_built_and_last_while_building() -> None:
    from collections import OrderedDict

    from tests.support.parallel import TOUR, place_tour

    queue = OrderedDict.fromkeys([TOUR, "test_alpha", "test_beta"], {})
    place_tour(queue, ready=False)
    assert list(queue) == ["test_alpha", "test_beta", TOUR]
    place_tour(queue, ready=True)
    assert list(queue) == [TOUR, "test_alpha", "test_beta"]
    alone = OrderedDict.fromkeys([TOUR], {})
    place_tour(alone, ready=False)  # all that is left: handed out, its test waits for the build
    assert list(alone) == [TOUR]
    without = OrderedDict.fromkeys(["test_alpha", "test_beta"], {})
    place_tour(without, ready=True)
    assert list(without) == ["test_alpha", "test_beta"]
