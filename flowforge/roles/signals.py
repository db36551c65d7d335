"""Turning SIGTERM/SIGINT into a stop event without doing work inside a signal handler.

The Python-level handler does nothing; ``signal.set_wakeup_fd`` makes the interpreter write the
signal number to a pipe, and a small thread reading that pipe sets the stop event. Setting a
``threading.Event`` from inside a handler could deadlock on the event's own lock.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _record(_signum: int, _frame: FrameType | None) -> None:
    """Installed so the default action (terminate) does not run; the wakeup fd does the rest."""


@contextmanager
def stop_on_signals(stop: threading.Event, signals: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Set ``stop`` when one of ``signals`` arrives, for the duration of the block."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = {s: signal.signal(s, _record) for s in signals}
    old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while os.read(read_fd, 64):
            stop.set()

    watcher = threading.Thread(target=watch, name="signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_fd)
        watcher.join(timeout=1.0)
        os.close(read_fd)
