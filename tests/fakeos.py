"""An in-memory operating system for testing the supervisor's loop in-process.

:class:`FakeOs` implements :class:`~supervisor.osapi.OsApi` without a process, a signal or a
sleep: ``spawn`` records a :class:`FakeChild` (its target never runs), the clock moves only
when the loop "sleeps" or a test calls :meth:`FakeOs.advance`, and a test decides when a child
exits, beats or becomes ready and which signals reach the supervisor::

    system = FakeOs()
    tree = Supervisor([ChildSpec("worker", target, count=2)], system=system)
    tree.turn()                               # both workers started
    system.exit(system.alive("worker")[0].pid, 1)
    tree.turn()                               # reaped; restarted after the slot's backoff

The fake keeps the real system's timing rule: :meth:`FakeOs.wait_for_signals` returns at once
when a signal is pending (a child's exit queues SIGCHLD, as the kernel does) and otherwise
"sleeps" its whole timeout, i.e. moves the clock by it — so each quiet turn of the loop takes
the loop's tick of fake time.
"""

from __future__ import annotations

import contextlib
import signal
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from supervisor.child import ChildContext


@dataclass
class FakeChild:
    """One child the loop started. ``code``: None while it runs, then its exit code (negative:
    the signal that killed it); ``signals``: every signal the loop sent it, in order."""

    pid: int
    ctx: ChildContext
    started_at: float
    signals: list[int] = field(default_factory=list)
    code: int | None = None

    @property
    def name(self) -> str:
        return self.ctx.name

    @property
    def alive(self) -> bool:
        return self.code is None


class FakeOs:
    """See the module docstring. ``exits_on`` maps a signal to the exit code a child exits with
    as soon as it receives it (e.g. ``{signal.SIGTERM: 0}``); any other signal is only recorded,
    except SIGKILL, which always kills (code ``-SIGKILL``). ``watchdog_s``: the interval a
    service manager asks ``WATCHDOG=1`` at (None: no watchdog); every message sent to the
    service manager is in :attr:`notified`, with the fake time it was sent."""

    def __init__(
        self,
        start: float = 1000.0,
        first_pid: int = 100,
        exits_on: Mapping[int, int] | None = None,
        watchdog_s: float | None = None,
    ) -> None:
        self.now = start
        self.watchdog_s = watchdog_s
        self.notified: list[tuple[float, tuple[str, ...]]] = []
        self.children: dict[int, FakeChild] = {}  # every child ever started, by pid
        self.supervised = False  # inside supervising()
        self.exits_on = dict(exits_on or {})
        self._next_pid = first_pid
        self._exited: deque[tuple[int, int]] = deque()
        self._signals: deque[int] = deque()

    # ------------------------------------------------------------------ OsApi

    def monotonic(self) -> float:
        return self.now

    @contextlib.contextmanager
    def supervising(self, handled_signals: Sequence[int]) -> Iterator[None]:
        self.supervised = True
        try:
            yield
        finally:
            self.supervised = False

    def spawn(self, target: Callable[[ChildContext], int], ctx: ChildContext) -> int:
        pid = self._next_pid
        self._next_pid += 1
        self.children[pid] = FakeChild(pid, ctx, self.now)
        return pid

    def reap(self) -> tuple[int, int] | None:
        return self._exited.popleft() if self._exited else None

    def kill(self, pid: int, signum: int) -> None:
        child = self.children.get(pid)
        if child is None or not child.alive:
            return  # ESRCH: already gone
        child.signals.append(signum)
        if signum == signal.SIGKILL:
            self.exit(pid, -signal.SIGKILL)
        elif signum in self.exits_on:
            self.exit(pid, self.exits_on[signum])

    def wait_for_signals(self, timeout_s: float) -> list[int]:
        if not self._signals:
            self.now += timeout_s  # nothing arrived: select slept its whole timeout
        signals = list(self._signals)
        self._signals.clear()
        return signals

    def notify(self, fields: Sequence[str]) -> None:
        self.notified.append((self.now, tuple(fields)))

    def watchdog_interval_s(self) -> float | None:
        return self.watchdog_s

    # ------------------------------------------------------------------ what a test does

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass (the next turn of the loop sees the later time)."""
        self.now += seconds

    def deliver(self, signum: int) -> None:
        """A signal reaches the supervisor (handled on its next turn)."""
        self._signals.append(signum)

    def exit(self, pid: int, code: int) -> None:
        """Child ``pid`` exits with ``code`` (negative: killed by that signal)."""
        child = self.children[pid]
        assert child.alive, f"pid {pid} exited already"
        child.code = code
        self._exited.append((pid, code))
        self._signals.append(signal.SIGCHLD)

    def orphan_exits(self, pid: int, code: int = 0) -> None:
        """A process the loop never started exits (a grandchild reparented to it)."""
        assert pid not in self.children
        self._exited.append((pid, code))
        self._signals.append(signal.SIGCHLD)

    def ready(self, pid: int) -> None:
        """Child ``pid`` reports it is ready (as ``ctx.ready()`` does, without trimming)."""
        child = self.children[pid]
        child.ctx.table.mark_ready(child.ctx.slot)

    def beat(self, pid: int) -> None:
        """Child ``pid`` reports it is alive (``ctx.beat()``)."""
        self.children[pid].ctx.beat()

    def alive(self, name: str | None = None) -> list[FakeChild]:
        """The running children (of spec ``name``), oldest first."""
        return [c for c in self.children.values() if c.alive and name in (None, c.name)]
