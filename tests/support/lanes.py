"""The fast lane: `python3 -m pytest -q -p no:cacheprovider -m fast`, a change checked in minutes.

It holds every unit test (no process of its own: a test without the markers of the real parts,
using none of the fixtures that start them) and the tests marked `fast` by hand: one real world per
size, 2, 3 and 4 ranks, through its failures. The full suite runs them all as before.

A test counted as a unit test that starts a world or a kernel all the same fails, saying so: the
lane stays fast because the classification stays true.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import costs

# markers of the tests that start real parts (processes, a browser, a hub, hosts)
PROCESS_MARKERS = frozenset({"integration", "notebook", "browser", "binder", "multihost", "jupyterhub", "gpu"})
# the shared fixtures that are real parts: a test asking for one is not a unit test
PROCESS_FIXTURES = frozenset({"world", "no_leaks", "executed_notebooks", "kernel"})
# what a unit test may not spend time in
STARTS = (costs.WORLD_START, costs.KERNEL_START, costs.NOTEBOOKS, costs.PIP, costs.DOCS)
UNIT = pytest.StashKey[bool]()


def is_unit(item: pytest.Item) -> bool:
    if PROCESS_MARKERS & {marker.name for marker in item.iter_markers()}:
        return False
    return not PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.stash[UNIT] = is_unit(item)
        if item.stash[UNIT]:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def _unit_tests_start_nothing(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not request.node.stash.get(UNIT, False):
        return
    started = {kind: seconds for kind, seconds in costs.LEDGER.seconds.items() if kind in STARTS and seconds > 0}
    if started:
        spent = ", ".join(f"{kind} ({seconds:.1f} s)" for kind, seconds in started.items())
        pytest.fail(
            f"this test has no marker of the real parts but spent time in {spent}: mark it (or its module) "
            "`integration`, so that the fast lane (-m fast) leaves it out",
            pytrace=False,
        )
