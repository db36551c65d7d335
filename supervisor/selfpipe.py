"""Signals turned into bytes on a pipe (the self-pipe trick), never work in a signal handler.

While :func:`signal_pipe` is active, each of the given signals has a handler that does nothing,
and ``signal.set_wakeup_fd`` makes the interpreter write the number of every signal that arrives
(one byte) to a non-blocking pipe. The code that cares reads the other end outside any handler:
the supervisor's loop polls it (:class:`~supervisor.osapi.RealOs`), a role process runs a reader
thread that sets its stop event (``flowforge/roles/signals.py``). Work inside a Python signal
handler runs at an arbitrary point of the main thread; setting a ``threading.Event`` there could
deadlock on the event's own lock.

On the way out the previous wakeup fd and handlers are put back, then the pipe is closed: the
write end first, so a reader blocked on the read end sees end-of-file and returns; the reader
thread is joined; the read end last, so no reader ever waits on a closed (or reused) descriptor.

Only the main thread may install signal handlers, so only it may enter :func:`signal_pipe`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

__all__ = ["READER_JOIN_TIMEOUT_S", "SignalPipe", "signal_pipe"]

#: How long leaving :func:`signal_pipe` waits for the reader thread to see end-of-file (seconds).
READER_JOIN_TIMEOUT_S = 1.0
_READ_SIZE = 512  # bytes: signal numbers that piled up between two reads


class SignalPipe:
    """The two ends of the pipe (``read_fd``, ``write_fd``: a forked child closes both)."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd

    def read(self, timeout_s: float | None) -> list[int] | None:
        """The signals that arrived, in order, waiting at most ``timeout_s`` seconds for one
        (None: until one arrives or the write end is closed). ``[]`` when none came in time;
        None once the write end is closed (leaving :func:`signal_pipe`)."""
        with contextlib.suppress(InterruptedError):
            select.select([self.read_fd], [], [], timeout_s)
        try:
            data = os.read(self.read_fd, _READ_SIZE)
        except BlockingIOError:
            return []
        return list(data) if data else None


def _ignored(_signum: int, _frame: FrameType | None) -> None:
    """Installed so the default action (terminate, ...) does not run; the wakeup fd has
    already recorded the signal for the pipe's reader."""


@contextlib.contextmanager
def signal_pipe(
    signals: Iterable[int], reader: Callable[[SignalPipe], None] | None = None
) -> Iterator[SignalPipe]:
    """Deliver ``signals`` to the pipe while inside the block (see module docstring).

    ``reader``, if given, runs on a daemon thread named ``signals`` from the start of the
    block; it is joined (at most :data:`READER_JOIN_TIMEOUT_S`) between closing the write end
    and closing the read end, so it should return once :meth:`SignalPipe.read` returns None.
    Everything set up so far is undone if installing a handler fails (e.g. SIGKILL).
    """
    read_fd, write_fd = os.pipe()
    previous: dict[int, Any] = {}
    old_wakeup: int | None = None
    thread: threading.Thread | None = None
    try:
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        for signum in signals:
            previous[signum] = signal.signal(signum, _ignored)
        old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        # whoever started this process may have blocked them until now (``flowforge up`` does,
        # so that a stop before the handlers exist is not lost): one that came meanwhile is
        # pending, and arrives here at once
        signal.pthread_sigmask(signal.SIG_UNBLOCK, previous)
        pipe = SignalPipe(read_fd, write_fd)
        if reader is not None:
            thread = threading.Thread(target=reader, args=(pipe,), name="signals", daemon=True)
            thread.start()
        yield pipe
    finally:
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
        for signum, handler in previous.items():
            # None: the handler was not installed from Python; the default is the best guess
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        os.close(write_fd)
        if thread is not None:
            thread.join(timeout=READER_JOIN_TIMEOUT_S)
        os.close(read_fd)
