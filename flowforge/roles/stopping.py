"""A role's stop event that ends its blocking waits the moment it is set.

A role waits between passes — the worker for a delivery, the scheduler and the publisher for
a NOTIFY, the api for a connection — and looked at its stop event only when that wait ended:
a SIGTERM'd child lingered up to a wait (a second) before it began to drain, and a tree stops
its groups one after another. :class:`Stop` is a ``threading.Event`` that, when set, also
makes a pipe readable (:meth:`Stop.fileno`, for a wait that selects on descriptors) and calls
the wakers registered with :meth:`Stop.on_set` (for a wait another library owns, woken by
its own thread-safe call: pika's ``add_callback_threadsafe``, waitress's trigger).

Waking changes when a role notices the stop, never what it does then: the loop still checks
the event, and the drain that follows (finish the batch, hand back, serve out) is the same.

:func:`stop_fd` and :func:`on_stop` accept a plain ``threading.Event`` too (tests pass one):
it wakes nothing, and the waits end at their timeouts as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

Waker = Callable[[], None]


class Stop(threading.Event):
    """A stop event whose :meth:`set` wakes the waits that watch it (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._guard = threading.Lock()
        self._wakers: dict[int, Waker] = {}
        self._next = 0
        self._pipe: tuple[int, int] | None = None  # (read, write), made on first fileno()

    def fileno(self) -> int:
        """A descriptor that turns readable once the event is set and stays so (nothing
        reads it): a wait that selects on it ends at the stop. Closed by :meth:`close`."""
        with self._guard:
            if self._pipe is None:
                read, write = os.pipe()  # not inherited by exec'd children (PEP 446)
                os.set_blocking(write, False)
                self._pipe = (read, write)
                if self.is_set():
                    os.write(write, b"!")
            return self._pipe[0]

    def on_set(self, waker: Waker) -> Callable[[], None]:
        """Call ``waker`` (from the thread that sets the event) when it is set — at once if it
        is already. Returns the function that unregisters it. ``waker`` must be thread-safe
        and quick; an exception from it is logged, never raised to the setter."""
        with self._guard:
            key = self._next
            self._next += 1
            self._wakers[key] = waker
            now = self.is_set()
        if now:
            _call(waker)

        def forget() -> None:
            with self._guard:
                self._wakers.pop(key, None)

        return forget

    def set(self) -> None:
        """Set the event, then wake: the pipe, then every registered waker, once."""
        with self._guard:
            first = not self.is_set()
            super().set()
            wakers = list(self._wakers.values()) if first else []
            if first and self._pipe is not None:
                with contextlib.suppress(BlockingIOError):  # full: readable already
                    os.write(self._pipe[1], b"!")
        for waker in wakers:
            _call(waker)

    def close(self) -> None:
        """Close the pipe (the event still works; a later :meth:`fileno` makes a new one)."""
        with self._guard:
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            os.close(pipe[1])
            os.close(pipe[0])


def _call(waker: Waker) -> None:
    try:
        waker()
    except Exception:  # a broken wait must not keep the stop from the others
        logger.debug("a stop waker failed", exc_info=True)


def stop_fd(stop: threading.Event) -> int | None:
    """``stop``'s descriptor (:meth:`Stop.fileno`), or None for a plain event."""
    return stop.fileno() if isinstance(stop, Stop) else None


def on_stop(stop: threading.Event, waker: Waker) -> Callable[[], None]:
    """:meth:`Stop.on_set` for ``stop``; for a plain event, nothing (and a no-op unregister)."""
    if isinstance(stop, Stop):
        return stop.on_set(waker)
    return _nothing


def _nothing() -> None:
    """Unregisters nothing."""


def wait_readable(fds: Sequence[int], timeout_s: float) -> bool:
    """Block until one of ``fds`` is readable (True) or ``timeout_s`` seconds pass (False)."""
    readable, _, _ = select.select(fds, [], [], timeout_s)
    return bool(readable)
