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
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from supervisor import notify as sd
from supervisor.child import (
    ChildContext,
    fix_mmap_threshold,
    release_free_memory,
    set_child_subreaper,
    spawn,
)
from supervisor.selfpipe import SignalPipe, signal_pipe


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
        self._signals: SignalPipe | None = None  # while supervising

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
        # Signal handlers do nothing: each signal's number goes to a pipe that
        # wait_for_signals reads (supervisor/selfpipe.py).
        handled = tuple(handled_signals)
        with signal_pipe(handled) as pipe:
            self._signals = pipe
            self._handled = handled
            fix_mmap_threshold()  # before the first fork: every child inherits it
            release_free_memory()  # before the first fork: every child inherits what stays
            try:
                yield
            finally:
                self._signals = None

    def spawn(self, target: Callable[[ChildContext], int], ctx: ChildContext) -> int:
        pipe = self._signals
        inherited = () if pipe is None else (pipe.read_fd, pipe.write_fd)  # the child closes
        return spawn(target, ctx, self._handled, inherited)

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
        if self._signals is None:
            raise RuntimeError("wait_for_signals outside supervising()")
        return self._signals.read(timeout_s) or []
