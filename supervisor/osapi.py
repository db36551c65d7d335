"""The operating system as the supervisor's loop sees it: one small seam.

The loop (``tree.py``) never calls ``os.fork``, ``os.waitpid``, ``os.kill``, ``select`` or
the clock itself; it calls an :class:`OsApi`. :class:`RealOs` is the system (the default);
``tests/fakeos.py`` is an in-memory stand-in with a clock that tests move, children that
exit when a test says so and signals a test delivers, so the loop is tested in-process without
processes or sleeps (tests/unit/test_supervisor_loop.py), in the way gunicorn's tests drive its
``Arbiter`` with ``os.waitpid`` mocked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from supervisor import notify as sd
from supervisor.child import ChildContext, release_free_memory, set_child_subreaper, spawn


class OsApi(Protocol):
    """What the supervisor's loop asks of the operating system. Times are seconds on one
    monotonic clock; an exit code is ``os.waitstatus_to_exitcode``'s (negative: the signal that
    killed the child)."""

    def monotonic(self) -> float:
        """Now, on the monotonic clock (seconds)."""
        ...

    def supervising(self, handled_signals: Sequence[int]) -> AbstractContextManager[None]:
        """While inside: this process reaps orphans, ``handled_signals`` are queued for
        :meth:`wait_for_signals` (their handlers do nothing else), and the C heap was trimmed
        before the first child is started. Everything is put back on the way out — except the
        service manager's variables (``NOTIFY_SOCKET``, ``WATCHDOG_*``): taken out of the
        environment on the way in, for good, so that no child inherits them."""
        ...

    def spawn(self, target: Callable[[ChildContext], int], ctx: ChildContext) -> int:
        """Start a child that runs ``target(ctx)`` and exits with its return value; its pid."""
        ...

    def reap(self) -> tuple[int, int] | None:
        """One exited child, any child (``waitpid(-1, WNOHANG)``): (pid, exit code); None when
        no child has exited (or there is no child at all)."""
        ...

    def kill(self, pid: int, signum: int) -> None:
        """Send ``signum`` to ``pid``; a pid that is already gone is no error."""
        ...

    def wait_for_signals(self, timeout_s: float) -> list[int]:
        """The handled signals that arrived, in order; waits at most ``timeout_s`` for one."""
        ...

    def notify(self, fields: Sequence[str]) -> None:
        """Tell the service manager that started this process (systemd's ``$NOTIFY_SOCKET``)
        the ``KEY=value`` ``fields`` in one message; nothing when there is none. Never raises."""
        ...

    def watchdog_interval_s(self) -> float | None:
        """How often the service manager wants ``WATCHDOG=1`` from this process (seconds: half
        its ``WATCHDOG_USEC``); None when it watches nothing."""
        ...


class RealOs:
    """The operating system itself (Linux; works without ``prctl`` elsewhere)."""

    def __init__(self) -> None:
        self._notifier = sd.Notifier()  # nowhere, until supervising() reads the environment
        self._handled: tuple[int, ...] = ()
        self._pipe: tuple[int, int] = (-1, -1)

    def monotonic(self) -> float:
        return time.monotonic()

    def notify(self, fields: Sequence[str]) -> None:
        self._notifier.send(fields)

    def watchdog_interval_s(self) -> float | None:
        return self._notifier.watchdog_interval_s()

    @contextlib.contextmanager
    def supervising(self, handled_signals: Sequence[int]) -> Iterator[None]:
        self._notifier = sd.Notifier.from_environment()  # before the first fork
        set_child_subreaper()
        # Signal handlers do nothing: set_wakeup_fd writes each signal's number to this pipe,
        # which wait_for_signals reads.
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._handled = tuple(handled_signals)
        previous = {s: signal.signal(s, _queued) for s in self._handled}
        old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        release_free_memory()  # before the first fork: every child inherits what stays resident
        try:
            yield
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(read_fd)
            os.close(write_fd)
            self._pipe = (-1, -1)

    def spawn(self, target: Callable[[ChildContext], int], ctx: ChildContext) -> int:
        return spawn(target, ctx, self._handled, self._pipe)

    def reap(self) -> tuple[int, int] | None:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        return pid, os.waitstatus_to_exitcode(status)

    def kill(self, pid: int, signum: int) -> None:
        try:
            os.kill(pid, signum)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise

    def wait_for_signals(self, timeout_s: float) -> list[int]:
        read_fd = self._pipe[0]
        with contextlib.suppress(InterruptedError):
            select.select([read_fd], [], [], timeout_s)
        try:
            return list(os.read(read_fd, 512))
        except BlockingIOError:
            return []


def _queued(_signum: int, _frame: object) -> None:
    """Does nothing: the wakeup fd already queued the signal number for the main loop."""
