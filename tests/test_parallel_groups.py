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


def test_two_workers_keep_groups_and_modules_each_on_one_worker(tmp_path: Path) -> None:
    for name, count in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(TEST_FILE.format(count=count)))
    log = tmp_path / "groups.jsonl"
    env = {
        **os.environ,
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
    entries = [json.loads(line) for line in log.read_text().splitlines()]
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
