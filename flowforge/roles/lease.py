"""Renewing the leases a worker holds while handlers run, and hearing of cancellations.

Leases are renewed by a thread of their own (:meth:`Leases.start`), not by the worker's main
thread: the main thread can be held up in a broker call far longer than a lease — a quorum
queue's ``basic.cancel`` or ``basic.consume`` waits for the queue's leader, up to RabbitMQ's
30 s command timeout per node, while a leader is being elected — and a lease that lapsed under a
handler that already ran would make the reaper run that task a second time. A main thread that
stays stuck stops beating and the supervisor replaces the process (``liveness_timeout_s``); its
leases then lapse with it.

The keeper also writes what held attempts captured (``ctx.log``, stdout, stderr, progress:
:mod:`flowforge.roles.attemptlog`) while they run, every ``output_flush_s`` in one statement
for every held attempt that wrote something since — none for attempts that wrote nothing — so
``flowforge logs --follow`` and ``status`` see it live; the finish stores the final tail.

Two paths set a held task's ``ctx.cancelled``: :class:`CancelWatch` (a thread LISTENing on
``flowforge_cancel``, which the cancelling transaction NOTIFYs with the run id, or with
``task:`` and the task run id when an operator stops one task) within
milliseconds, and the lease renewal every ``heartbeat_s`` (the renewal returns each task's
``cancel_requested``), which stays the fallback when a notification is missed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from uuid import UUID

from flowforge.config import DatabaseConfig
from flowforge.domain.model import Claim
from flowforge.errors import DatabaseUnavailableError, StoreError
from flowforge.roles.context import TaskContext
from flowforge.roles.runner import RECONNECT_BACKOFF
from flowforge.roles.seams import WorkerStore
from flowforge.store.notify import CANCEL_CHANNEL, Listener

logger = logging.getLogger(__name__)

#: After a renewal failed for lack of a database, try again this soon (seconds).
RENEW_RETRY_S = 1.0
#: A ``flowforge_cancel`` payload that names one task run (queries.sql notify_task_cancel).
TASK_PREFIX = "task:"
#: The cancel listener checks whether it should stop at least this often (seconds).
LISTEN_POLL_S = 1.0


class _Daemon:
    """A named daemon thread running ``target(stop_event)`` that can be stopped and started
    again: a thread from before a stop keeps its own event, so a restart never revives it."""

    def __init__(self, name: str, target: Callable[[threading.Event], None]) -> None:
        self._name = name
        self._target = target
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing while it runs)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._target, args=(self._stop,), name=self._name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Set the thread's stop event (it ends at its next look)."""
        self._stop.set()
        self._thread = None


class Leases:
    """The claims a worker holds until their outcome commits, renewed together.

    Every ``heartbeat_s`` one statement, run by the ``lease-keeper`` thread, extends all of them
    by ``lease_s``; a claim whose run was cancelled, or whose lease was lost (reaped, finished
    elsewhere), gets its ``ctx.cancelled`` set so a cooperative handler stops. A finish or a
    hand-back runs inside :meth:`settling`, so a renewal never reads a task it just finished as
    lost.
    """

    def __init__(
        self,
        repo: WorkerStore,
        lease_s: float,
        heartbeat_s: float,
        output_flush_s: float = 1.0,
        on_renewed: Callable[[], None] = lambda: None,
    ) -> None:
        self._repo = repo
        # after each renewal (the database answered): the worker's presence, which its loop
        # refreshes only between batches, and a batch may last long
        self._on_renewed = on_renewed
        self._lease_s = lease_s
        self._heartbeat_s = heartbeat_s
        self._flush_s = output_flush_s
        self._flush_at = time.monotonic() + output_flush_s
        self._held: dict[UUID, tuple[Claim, TaskContext]] = {}
        self._lock = threading.Lock()  # the keeper and the cancel listener read what is held
        self._settling = threading.Lock()  # a renewal and a finish/hand-back never interleave
        self._wake = threading.Event()
        # the keeper waits without end (nothing held): only then must a hold() wake it; a wake
        # at every claim costs the hop a thread switch (docs/performance.md "The worker's side
        # of a hop")
        self._idle = False
        self._keeper = _Daemon("lease-keeper", self._keep)
        self.renewed_at = time.monotonic()
        self._next_at = self.renewed_at + heartbeat_s

    def start(self) -> None:
        """Start the keeper thread (once; later calls do nothing while it runs)."""
        self._keeper.start()

    def stop(self) -> None:
        """Ask the keeper to end (at once, or after the renewal it is running)."""
        self._keeper.stop()
        self._wake.set()

    def settling(self) -> threading.Lock:
        """Held around a statement that ends claims (finish, hand-back) and the :meth:`drop`
        that follows it."""
        return self._settling

    def hold(self, claims: list[tuple[Claim, TaskContext]]) -> None:
        """Start holding freshly claimed tasks (their lease was just set by the claim)."""
        with self._lock:
            if not self._held:
                self.renewed_at = time.monotonic()
                self._next_at = self.renewed_at + self._heartbeat_s
            for claim, ctx in claims:
                self._held[claim.task_run_id] = (claim, ctx)
            idle, self._idle = self._idle, False
        if idle:
            # the keeper sleeps without end while nothing is held; otherwise its timed wait
            # ends by the renewal (or output flush) due, earlier than the one just set
            self._wake.set()

    def drop(self, task_run_ids: list[UUID]) -> None:
        with self._lock:
            for task_run_id in task_run_ids:
                self._held.pop(task_run_id, None)

    def held(self, task_run_ids: list[UUID]) -> list[UUID]:
        """Those of ``task_run_ids`` still held."""
        with self._lock:
            return [i for i in task_run_ids if i in self._held]

    def drop_all(self) -> None:
        """Stop holding anything (the role resets: what it held is left to the reaper)."""
        with self._lock:
            self._held.clear()

    def cancel_run(self, run_id: UUID) -> int:
        """Set ``ctx.cancelled`` of every held task of ``run_id`` (its run was asked to stop);
        return how many were newly asked. Safe from any thread."""
        return self._ask(lambda held_id, claim: claim.run_id == run_id)

    def cancel_task(self, task_run_id: UUID) -> int:
        """Set ``ctx.cancelled`` of the held task ``task_run_id`` (an operator stopped that
        task alone); return 1 if it was newly asked, else 0. Safe from any thread."""
        return self._ask(lambda held_id, claim: held_id == task_run_id)

    def _ask(self, chosen: Callable[[UUID, Claim], bool]) -> int:
        with self._lock:
            asked = [
                (held_id, ctx)
                for held_id, (claim, ctx) in self._held.items()
                if chosen(held_id, claim) and not ctx.cancelled.is_set()
            ]
        for held_id, ctx in asked:
            ctx.cancelled.set()
            logger.info(
                "task run %s was asked to stop",
                held_id,
                extra={"action": "cancel_requested", "via": "notify"},
            )
        return len(asked)

    def renew_soon(self) -> None:
        """Make the next renewal due now (the cancel listener connected: a cancel requested
        before its LISTEN took effect is read by that renewal). Safe from any thread."""
        self._next_at = 0.0
        self._wake.set()

    def due_in(self) -> float:
        """Seconds until the next renewal is due (0 when overdue)."""
        return max(0.0, self._next_at - time.monotonic())

    def _keep(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.clear()  # before looking: a hold() from now on wakes the wait below
            with self._lock:
                holding = bool(self._held)
                self._idle = not holding  # a hold() from now on must wake the wait below
            flush_in = self._flush_at - time.monotonic()
            if not holding:
                self._wake.wait()
            elif min(self.due_in(), flush_in) > 0:
                self._wake.wait(min(self.due_in(), flush_in))
            elif not stop.is_set():
                try:
                    if flush_in <= 0:
                        self.flush_output()
                    self.maybe_renew()
                except Exception:  # never let the keeper die silently: retry, logged
                    logger.exception("lease renewal failed", extra={"action": "renew_failed"})
                    self._next_at = time.monotonic() + RENEW_RETRY_S

    def maybe_renew(self) -> None:
        """Renew every held lease if a renewal is due (the keeper's step)."""
        now = time.monotonic()
        if not self._held or now < self._next_at:
            return
        with self._settling:
            with self._lock:
                pairs = [(c.task_run_id, c.fencing_token) for c, _ in self._held.values()]
            if not pairs:
                return
            try:
                held = self._repo.renew_leases(pairs, self._lease_s)
            except DatabaseUnavailableError as exc:
                logger.warning("lease renewal failed: %s", exc, extra={"action": "renew_failed"})
                self._next_at = now + RENEW_RETRY_S
                return
            self.renewed_at = now
            self._next_at = now + self._heartbeat_s
            with self._lock:
                renewed = [(i, self._held[i]) for i, _ in pairs if i in self._held]
        for task_run_id, (_claim, ctx) in renewed:
            if task_run_id not in held:
                self.drop([task_run_id])
                ctx.cancelled.set()
                logger.warning(
                    "lost the lease of task run %s (reaped or finished elsewhere); asking it "
                    "to stop",
                    task_run_id,
                    extra={"action": "lease_lost"},
                )
            elif held[task_run_id] and not ctx.cancelled.is_set():
                ctx.cancelled.set()
                logger.info(
                    "task run %s was asked to stop",
                    task_run_id,
                    extra={"action": "cancel_requested", "via": "renewal"},
                )
        self._on_renewed()

    def flush_output(self) -> int:
        """Write the output and progress held attempts captured since the last flush, in one
        statement (none when nothing changed); returns how many were written. A write the
        database refuses for an outage is skipped: the next line (or the finish) writes the
        whole tail again."""
        self._flush_at = time.monotonic() + self._flush_s
        with self._settling:
            with self._lock:
                held = list(self._held.values())
            changed = [
                (claim.task_run_id, claim.fencing_token, found)
                for claim, ctx in held
                if (found := ctx.output.take_live()) is not None
            ]
            if not changed:
                return 0
            try:
                return self._repo.write_output(changed)
            except DatabaseUnavailableError as exc:
                logger.debug("output write failed: %s", exc, extra={"action": "output_failed"})
                return 0

    def expired_locally(self) -> bool:
        """True once a full lease has passed since the last successful renewal."""
        return time.monotonic() - self.renewed_at > self._lease_s


class CancelWatch:
    """A daemon thread LISTENing on ``flowforge_cancel`` for the worker's :class:`Leases`.

    Started at the worker's first slow handler (a worker that only runs fast handlers never
    opens the connection: a PostgreSQL backend each), then kept until :meth:`stop`. After every
    (re)connection it makes the next renewal due, so a cancel that no LISTEN heard yet is
    read within a second. While it cannot connect, renewal is the only path (and backs it
    off: 0.5 s doubling to 30 s, as the roles reconnect).
    """

    def __init__(
        self,
        config: DatabaseConfig,
        leases: Leases,
        listener: Callable[[DatabaseConfig, str], Listener] = Listener,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._config = config
        self._leases = leases
        self._listener = listener
        self._rand = rand
        self._listening = _Daemon("cancel-listener", self._serve)

    def start(self) -> None:
        """Start listening (once; later calls do nothing while the thread runs)."""
        self._listening.start()

    def stop(self) -> None:
        """Ask the thread to close its connection and end (within :data:`LISTEN_POLL_S`)."""
        self._listening.stop()

    def _serve(self, stop: threading.Event) -> None:
        failures = 0
        while not stop.is_set():
            listener = self._listener(self._config, CANCEL_CHANNEL)
            try:
                listener.open()
                self._leases.renew_soon()
                if failures:
                    logger.info("cancel listener recovered", extra={"action": "recovered"})
                failures = 0
                while not stop.is_set():
                    for payload in listener.receive(LISTEN_POLL_S):
                        self._deliver(payload)
            except (DatabaseUnavailableError, StoreError) as exc:
                failures += 1
                delay = RECONNECT_BACKOFF.delay(failures, self._rand)
                # once per outage: the role logs its own reconnects
                logger.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "cancel listener lost its connection (%s); cancellations arrive at lease "
                    "renewal until it is back (retrying in %.1fs)",
                    exc,
                    delay,
                    extra={"action": "cancel_listener_down"},
                )
                stop.wait(delay)
            finally:
                listener.close()

    def _deliver(self, payload: str) -> None:
        one_task = payload.startswith(TASK_PREFIX)
        try:
            target = UUID(payload[len(TASK_PREFIX) :] if one_task else payload)
        except ValueError:  # not ours: anyone may NOTIFY the channel
            return
        if one_task:
            self._leases.cancel_task(target)
        else:
            self._leases.cancel_run(target)
