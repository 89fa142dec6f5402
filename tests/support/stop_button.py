"""The notebook's stop button, pressed from a test: `_thread.interrupt_main` after a delay.

interrupt_main only simulates a SIGINT that Python handles: in a process that inherited SIGINT
ignored (a job started in the background, `nohup python3 -m pytest ... &`) it does nothing, and a
test waiting for the interrupt would wait out its whole limit instead. So Python's own handler is put
in place while the button may be pressed, and the one found is put back afterwards.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def pressed_after(seconds: float | None) -> Iterator[None]:
    """Within the block, KeyboardInterrupt reaches the main thread `seconds` in (None: never)."""
    if seconds is None:
        yield
        return
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a press in flight lands now, inside the block's handler, not after it
        signal.signal(signal.SIGINT, found)
