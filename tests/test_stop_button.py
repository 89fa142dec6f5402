"""The tests' stop button (tests/support/stop_button.py) interrupts the main thread even in a run
started in the background, where SIGINT is inherited ignored."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest

from tests.support import stop_button


def _wait_between_statements(seconds: float) -> None:
    """Wait as a cell's wait loop does: interrupt_main is seen between statements, not in a sleep."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def sigint_ignored() -> object:
    """SIGINT as a job started with `nohup ... &` inherits it."""
    found = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, found)


def test_where_sigint_is_ignored_a_bare_interrupt_main_does_nothing(sigint_ignored: None) -> None:
    timer = threading.Timer(0.05, _thread.interrupt_main)
    timer.start()
    _wait_between_statements(0.3)  # no KeyboardInterrupt: what made the interrupt tests wait out their limits
    timer.join()


def test_the_button_interrupts_where_sigint_is_ignored_and_puts_the_handler_back(sigint_ignored: None) -> None:
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt), stop_button.pressed_after(0.05):
        _wait_between_statements(5)
    assert time.monotonic() - began < 2
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_a_button_never_pressed_changes_nothing() -> None:
    found = signal.getsignal(signal.SIGINT)
    with stop_button.pressed_after(None):
        time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) == found
