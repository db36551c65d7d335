"""The supervisor's main loop: one thread, signals queued, children reaped and brought back.

Signal handlers do nothing: ``signal.set_wakeup_fd`` writes each signal's number to a pipe,
and the main loop — sleeping in ``select`` on that pipe — reads the numbers and acts on them.
Every turn of the loop reaps with ``waitpid(-1, WNOHANG)`` until nothing is left (unknown pids
too, so the supervisor is a correct PID 1) and starts whatever the desired set is missing,
after each slot's backoff.

Every system call and every reading of the clock goes through ``Supervisor.system`` (an
:class:`~supervisor.osapi.OsApi`): the real one by default, an in-memory fake in the tests of
this loop, which call :meth:`Supervisor.turn` one turn at a time. What the tree tells a service
manager (systemd's ``Type=notify``: ready, status, watchdog, stopping) goes through the same
seam (supervisor/service.py).
"""

from __future__ import annotations

import logging
import signal
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from supervisor import exitcodes
from supervisor.child import ChildContext
from supervisor.osapi import OsApi, RealOs
from supervisor.restart import IntensityLimit, SlotBackoff
from supervisor.service import ServiceNotifications
from supervisor.slots import SlotTable
from supervisor.spec import ChildSpec, Restart

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (
    signal.SIGCHLD,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGUSR1,
)
#: Longest sleep of the main loop (seconds): liveness and deadlines are checked this often.
TICK_S = 0.2
#: A hung child gets SIGABRT (a traceback, if it enabled faulthandler), then SIGKILL after this.
ABORT_GRACE_S = 2.0
DEFAULT_DRAIN_TIMEOUT_S = 25.0  # under a container runtime's usual 30 s grace period
SlotKey = tuple[int, int]  # (spec index, instance)


class Mode(Enum):
    RUNNING = "running"
    DRAINING = "draining"
    FAST_STOP = "fast stop"


@dataclass
class Child:
    spec_index: int
    instance: int
    slot: int
    pid: int
    started_at: float
    retiring: bool = False
    term_sent_at: float | None = None
    killed: bool = False
    abort_sent_at: float | None = None


@dataclass
class _Slot:
    backoff: SlotBackoff
    not_before: float = 0.0
    restarts: int = 0
    finished: bool = False  # a temporary/transient child that is not to be restarted


@dataclass
class Supervisor:
    """Runs ``specs`` as one process tree until told to stop (see the module docstring).

    ``child_setup(label)`` runs first in every child (e.g. logging with the child's label).
    ``on_ready`` is called once each time every spec has its desired number of ready children.
    ``system``: the operating system as the loop sees it (a fake in tests).
    """

    specs: Sequence[ChildSpec]
    title_prefix: str = "supervisor"
    intensity: IntensityLimit = field(default_factory=IntensityLimit)
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    healthy_after_s: float = 10.0
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    capacity: int = 256
    child_setup: Callable[[str], None] = lambda _label: None
    on_ready: Callable[[dict[str, tuple[int, int]]], None] = lambda _readiness: None
    system: OsApi = field(default_factory=RealOs)

    def __post_init__(self) -> None:
        self._desired = [s.count for s in self.specs]
        self._table = SlotTable(self.capacity, len(self.specs), self.system.monotonic)
        for index, count in enumerate(self._desired):
            self._table.set_desired(index, count)
        self._children: dict[int, Child] = {}
        self._slots: dict[SlotKey, _Slot] = {}
        self._mode = Mode.RUNNING
        self._exit_code = exitcodes.CLEAN
        self._deadline = 0.0
        self._rolling: deque[int] = deque()  # pids still to replace, in order
        self._surge: int | None = None  # the replacement booting now ...
        self._surge_for: int | None = None  # ... and the pid it replaces
        self._rolled: int | None = None  # replaced so far by the rolling restart under way
        self._ready = False
        self._service = ServiceNotifications(self.system)

    # ------------------------------------------------------------------ the main loop

    def run(self) -> int:
        """Start the tree and supervise it; return the supervisor's exit code."""
        with self.system.supervising(HANDLED_SIGNALS):
            while (code := self.turn()) is None:
                pass
            return code

    def turn(self) -> int | None:
        """One turn of the main loop: start what is missing, wait (at most :data:`TICK_S`) for
        signals and act on them, reap, then check liveness and rolling restarts — or, once
        stopping, drive the stop. The exit code once every child has stopped, else None."""
        now = self.system.monotonic()
        if self._mode is Mode.RUNNING:
            self._reconcile(now)
        for signum in self.system.wait_for_signals(TICK_S):
            self._on_signal(signum)
        now = self.system.monotonic()
        self._reap(now)
        if self._mode is Mode.RUNNING:
            self._check_liveness(now)
            self._advance_rolling()
            self._report_readiness()
        else:
            self._drive_stop(now)
            if not self._children:
                logger.info("all children stopped; exiting with %d", self._exit_code)
                return self._exit_code
            self._service.stopping(len(self._children))
        self._enforce_shutdown_timeouts(now)
        self._service.tick(now)  # the watchdog hears from a loop that completes its turns
        return None

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum: int) -> None:
        now = self.system.monotonic()
        if signum in (signal.SIGTERM, signal.SIGINT):
            if self._mode is Mode.RUNNING:
                self._begin_drain(exitcodes.CLEAN, now, f"received {signal.Signals(signum).name}")
            else:
                self._fast_stop(f"received {signal.Signals(signum).name} while draining")
        elif signum == signal.SIGQUIT:
            self._fast_stop("received SIGQUIT")
        elif signum in (signal.SIGTTIN, signal.SIGTTOU) and self._mode is Mode.RUNNING:
            self._scale(+1 if signum == signal.SIGTTIN else -1)
        elif signum == signal.SIGHUP and self._mode is Mode.RUNNING:
            self._start_rolling_restart()
        elif signum == signal.SIGUSR1:
            self._log_status(now)

    def _scale(self, delta: int) -> None:
        for index, spec in enumerate(self.specs):
            if spec.scalable:
                self._desired[index] = max(1, self._desired[index] + delta)
                self._table.set_desired(index, self._desired[index])
                self._ready = False
                logger.info(
                    "%s: now %d wanted", spec.name, self._desired[index], extra={"action": "scaled"}
                )

    def _start_rolling_restart(self) -> None:
        """Queue every rolling child for replacement, lower ``roll_order`` first, then oldest
        first. A SIGHUP during a rolling restart starts it over (what is on disk now is what
        the tree is to run); a replacement already booting goes on replacing its child."""
        self._rolling = deque(
            pid
            for pid, c in sorted(
                self._children.items(),
                key=lambda item: (self.specs[item[1].spec_index].roll_order, item[0]),
            )
            if self.specs[c.spec_index].rolling and not c.retiring and pid != self._surge_for
        )
        self._rolled = 0
        logger.info(
            "rolling restart of %d child(ren)", self._roll_left(), extra={"action": "rolling"}
        )
        self._service.reloading(self._roll_left())

    def _roll_left(self) -> int:
        return len(self._rolling) + (self._surge is not None)

    # ------------------------------------------------------------------ starting

    def _reconcile(self, now: float) -> None:
        """Start missing children (after their backoff); retire those above the desired count."""
        running = {(c.spec_index, c.instance) for c in self._children.values() if not c.retiring}
        for index in range(len(self.specs)):
            for instance in range(1, self._desired[index] + 1):
                key = (index, instance)
                slot = self._slot(key)
                if key not in running and not slot.finished and now >= slot.not_before:
                    self._start(index, instance, now)
            for child in list(self._children.values()):
                if child.spec_index == index and child.instance > self._desired[index]:
                    self._retire(child, now)

    def _slot(self, key: SlotKey) -> _Slot:
        if key not in self._slots:
            self._slots[key] = _Slot(
                SlotBackoff(self.backoff_base_s, self.backoff_cap_s, self.healthy_after_s)
            )
        return self._slots[key]

    def _start(self, index: int, instance: int, now: float) -> int:
        spec = self.specs[index]
        slot = self._table.allocate(index)
        ctx = ChildContext(
            spec.name,
            instance,
            self._desired[index],
            slot,
            self._table,
            tuple(s.name for s in self.specs),
        )
        label = spec.name if spec.count == 1 and not spec.scalable else f"{spec.name}-{instance}"
        title = f"{self.title_prefix}: {spec.name}"
        if spec.count != 1 or spec.scalable:
            title += f" {instance}/{self._desired[index]}"

        def target(context: ChildContext) -> int:
            from supervisor.titles import set_title

            set_title(title)
            self.child_setup(label)
            return spec.target(context)

        pid = self.system.spawn(target, ctx)
        self._table.assign_pid(slot, pid)
        self._children[pid] = Child(index, instance, slot, pid, now)
        logger.info("started %s (pid %d)", label, pid, extra={"action": "child_started"})
        return pid

    # ------------------------------------------------------------------ exits

    def _reap(self, now: float) -> None:
        while (exited := self.system.reap()) is not None:
            pid, code = exited
            child = self._children.pop(pid, None)
            if child is None:
                logger.debug(
                    "reaped pid %d, not one of ours", pid, extra={"action": "reaped_orphan"}
                )
                continue
            was_ready = self._table.is_ready(child.slot)
            self._table.release(child.slot)
            self._ready = False if self._mode is Mode.RUNNING else self._ready
            self._on_exit(child, code, was_ready, now)

    def _on_exit(self, child: Child, code: int, was_ready: bool, now: float) -> None:
        spec = self.specs[child.spec_index]
        label = f"{spec.name}-{child.instance} (pid {child.pid})"
        if self._surge == child.pid:
            self._surge = self._surge_for = None
            if self._mode is Mode.RUNNING and not child.retiring:
                self._abandon_roll(label, code)
                return
        if self._mode is not Mode.RUNNING or child.retiring:
            logger.info(
                "%s stopped: %s", label, describe_exit(code), extra={"action": "child_stopped"}
            )
            return
        key = (child.spec_index, child.instance)
        slot = self._slot(key)
        if code == exitcodes.CHILD_BOOT_FAILURE:
            logger.error(
                "%s failed to boot; stopping the tree", label, extra={"action": "boot_failed"}
            )
            self._begin_drain(exitcodes.BOOT_FAILED, now, f"{spec.name} failed to boot")
            return
        if code == exitcodes.CHILD_RECYCLE:
            logger.info("%s recycled; replacing it", label, extra={"action": "child_recycled"})
            self._service.child_exited(f"{label} recycled; replacing it")
            slot.not_before = now
            return
        if spec.restart is Restart.TEMPORARY or (spec.restart is Restart.TRANSIENT and code == 0):
            logger.info(
                "%s finished: %s", label, describe_exit(code), extra={"action": "child_finished"}
            )
            slot.finished = True
            return
        slot.restarts += 1
        if self.intensity.record(now):
            logger.error(
                "%s %s; more than %d restarts in %.0fs: stopping the tree",
                label,
                describe_exit(code),
                self.intensity.max_restarts,
                self.intensity.period_s,
                extra={"action": "restart_limit"},
            )
            self._begin_drain(exitcodes.RESTART_LIMIT, now, "restart intensity exceeded")
            return
        delay = slot.backoff.next_delay(now - child.started_at if was_ready else 0.0)
        slot.not_before = now + delay
        logger.warning(
            "%s %s; restarting in %.1fs",
            label,
            describe_exit(code),
            delay,
            extra={"action": "child_died"},
        )
        self._service.child_exited(f"{label} {describe_exit(code)}; restarting in {delay:.1f}s")

    # ------------------------------------------------------------------ stopping

    def _begin_drain(self, code: int, now: float, why: str) -> None:
        if self._mode is not Mode.RUNNING:
            return
        self._mode = Mode.DRAINING
        self._exit_code = code
        self._deadline = now + self.drain_timeout_s
        self._rolling.clear()
        self._rolled = None
        logger.info(
            "draining (%s): stopping children in order within %.0fs",
            why,
            self.drain_timeout_s,
            extra={"action": "draining"},
        )
        self._service.draining(why, self.drain_timeout_s, len(self._children))

    def _fast_stop(self, why: str) -> None:
        self._mode = Mode.FAST_STOP
        logger.warning("fast stop (%s): killing every child", why, extra={"action": "fast_stop"})
        self._service.fast_stop(why, len(self._children))

    def _drive_stop(self, now: float) -> None:
        if self._mode is Mode.FAST_STOP or now >= self._deadline:
            if self._mode is Mode.DRAINING and any(not c.killed for c in self._children.values()):
                logger.warning(
                    "drain deadline passed; killing what remains", extra={"action": "drain_timeout"}
                )
            for child in self._children.values():
                self._kill(child)
            return
        groups = sorted({self.specs[c.spec_index].stop_group for c in self._children.values()})
        if groups:
            for child in self._children.values():
                if self.specs[child.spec_index].stop_group == groups[0]:
                    self._terminate(child, now)

    def _retire(self, child: Child, now: float) -> None:
        child.retiring = True
        self._terminate(child, now)

    def _terminate(self, child: Child, now: float) -> None:
        if child.term_sent_at is None:
            child.term_sent_at = now
            self.system.kill(child.pid, signal.SIGTERM)

    def _kill(self, child: Child) -> None:
        if not child.killed:
            child.killed = True
            self.system.kill(child.pid, signal.SIGKILL)

    def _enforce_shutdown_timeouts(self, now: float) -> None:
        for child in self._children.values():
            timeout = self.specs[child.spec_index].shutdown_timeout_s
            if child.term_sent_at is not None and now - child.term_sent_at > timeout:
                if not child.killed:
                    logger.warning(
                        "pid %d ignored SIGTERM for %.0fs; killing it", child.pid, timeout
                    )
                self._kill(child)

    # ------------------------------------------------------------------ health

    def _check_liveness(self, now: float) -> None:
        for child in self._children.values():
            timeout = self.specs[child.spec_index].liveness_timeout_s
            if timeout is None or child.retiring:
                continue
            if child.abort_sent_at is None and self._table.silent_for(child.slot, now) > timeout:
                logger.error(
                    "%s-%d (pid %d) is hung: silent for over %.0fs; aborting it",
                    self.specs[child.spec_index].name,
                    child.instance,
                    child.pid,
                    timeout,
                    extra={"action": "child_hung"},
                )
                child.abort_sent_at = now
                self.system.kill(child.pid, signal.SIGABRT)
            elif child.abort_sent_at is not None and now - child.abort_sent_at > ABORT_GRACE_S:
                self._kill(child)

    def _advance_rolling(self) -> None:
        if self._surge is not None:
            surge = self._children.get(self._surge)
            if surge is not None and self._table.is_ready(surge.slot):
                old = self._children.get(self._surge_for) if self._surge_for else None
                if old is not None:
                    self._retire(old, self.system.monotonic())
                self._surge = self._surge_for = None
                self._rolled = (self._rolled or 0) + 1
            return
        while self._rolling and self._rolling[0] not in self._children:
            self._rolling.popleft()  # it died meanwhile: its restart loaded the new code
        if self._rolling:
            self._surge_for = self._rolling.popleft()
            old = self._children[self._surge_for]
            self._surge = self._start(old.spec_index, old.instance, self.system.monotonic())
        elif self._rolled is not None:
            logger.info(
                "rolling restart done: %d child(ren) replaced",
                self._rolled,
                extra={"action": "rolled"},
            )
            self._rolled = None

    def _abandon_roll(self, label: str, code: int) -> None:
        """A replacement exited before it replaced its child: the new code does not run (an
        import that fails, a broken file). Neither a crash to restart nor a boot failure of
        the tree — the old child never stopped and keeps serving; the rest of the rolling
        restart is called off, so the tree runs what it ran (the children replaced so far
        excepted) until the next SIGHUP."""
        left = len(self._rolling)
        self._rolling.clear()
        self._rolled = None
        logger.error(
            "reload stopped: the new %s %s before it was ready; the old one keeps running,"
            " %d more child(ren) not replaced",
            label,
            describe_exit(code),
            left,
            extra={"action": "reload_failed"},
        )

    def readiness(self) -> dict[str, tuple[int, int]]:
        """For every spec: (children ready, children desired)."""
        found = self._table.readiness(range(len(self.specs)))
        return {self.specs[i].name: counts for i, counts in found.items()}

    def _report_readiness(self) -> None:
        readiness = self.readiness()
        ready = all(have >= want for have, want in readiness.values())
        summary = ", ".join(f"{name} {have}/{want}" for name, (have, want) in readiness.items())
        if ready and not self._ready:
            logger.info("tree ready: %s", summary, extra={"action": "tree_ready"})
            self.on_ready(readiness)
        self._ready = ready
        self._service.running(summary, ready, self._roll_left())

    def _log_status(self, now: float) -> None:
        lines = [
            f"{'CHILD':<16} {'PID':>7} {'UPTIME':>8} {'READY':>5} {'SILENT':>7} {'RESTARTS':>8}"
        ]
        for child in sorted(self._children.values(), key=lambda c: (c.spec_index, c.instance)):
            name = f"{self.specs[child.spec_index].name}-{child.instance}"
            lines.append(
                f"{name:<16} {child.pid:>7} {now - child.started_at:>7.0f}s "
                f"{'yes' if self._table.is_ready(child.slot) else 'no':>5} "
                f"{self._table.silent_for(child.slot, now):>6.1f}s "
                f"{self._slot((child.spec_index, child.instance)).restarts:>8}"
            )
        logger.info(
            "status (%s):\n%s", self._mode.value, "\n".join(lines), extra={"action": "status"}
        )


def describe_exit(code: int) -> str:
    """Human words for a wait status turned exit code (negative: killed by that signal)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:  # real-time signals have numbers, not names
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return f"killed by {name} — out of memory?"
    return f"killed by {name}"
