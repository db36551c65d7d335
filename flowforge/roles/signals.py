"""Turning SIGTERM/SIGINT into a stop event without doing work inside a signal handler.

The signals go to a pipe (:func:`supervisor.selfpipe.signal_pipe`, the supervisor's own
self-pipe) and a small thread reading that pipe sets the stop event. Setting a
``threading.Event`` from inside a handler could deadlock on the event's own lock.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from supervisor.selfpipe import SignalPipe, signal_pipe

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals(stop: threading.Event, signals: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Set ``stop`` when one of ``signals`` arrives, for the duration of the block. Another
    signal with a Python handler (a handler's own ``SIGALRM``, say) writes its number to the
    same pipe (``signal.set_wakeup_fd`` takes every one): it is not a stop."""
    stopping = frozenset(int(s) for s in signals)

    def watch(pipe: SignalPipe) -> None:
        while (arrived := pipe.read(None)) is not None:  # None: the block was left
            if stopping.intersection(arrived):
                stop.set()

    with signal_pipe(stopping, reader=watch):
        yield
