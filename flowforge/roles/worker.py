"""The worker role: take dispatches, claim them, run their handlers, finish them.

* Deliveries come in batches of up to ``broker.prefetch`` while handlers are fast: the batch is
  claimed in one statement (READY → RUNNING, tokens bumped, leases set), run one task after
  another on the handler thread, acked with one ``basic.ack(multiple)`` and finished in one
  statement, which also releases dependents. The batch (and the consumer's prefetch) grows
  1, 2, 4, … while every handler ends within ``worker.fast_handler_ms``, and falls back to 1
  after a slow one.
* Dependents that a finish made READY are claimed next by the same worker (up to a window),
  straight from the finish's result: their outbox rows are marked dispatched in the claim, so
  the next step of a DAG costs no broker round trip. If a publisher got to a row first, its
  message finds the task claimed and is acked without running.
* Claims commit before any ack: from then on the lease, not the broker, owns the task, so a
  handler longer than RabbitMQ's ``consumer_timeout`` is safe, and a worker that dies is reaped
  and re-dispatched. Until the batch is acked the prefetch window is full, so the broker
  pushes nothing more to a worker that is busy.
* A handler that outlasts ``fast_handler_ms`` holds the worker up, so the worker stops its
  consumer, acks the batch, and hands back what waits behind the slow handler: claims not
  started go back to READY (attempt un-counted, new outbox row) for other workers.
* A claim that fails because PostgreSQL is unreachable leaves the messages unacked: the role
  drops its connections (the broker requeues them) and reconnects with backoff.
* A redelivered message for a task already claimed or finished is acked without executing.
* While a slow handler runs, the main thread serves the broker connection (heartbeats); a
  thread of its own renews the leases, so a broker call that blocks (a quorum queue electing a
  leader) cannot make a lease lapse under a handler that ran; another LISTENs for
  cancellations (roles/lease.py).
* Finishing a batch that cannot reach the database is retried until it commits or the leases
  have lapsed (the reaper then retries the tasks); it is never dropped silently.
* Results, error text and tracebacks are made storable before any finish (see
  :func:`~flowforge.roles.execution.classify`). Should PostgreSQL still refuse a batch's finish
  for a reason that is not an outage, its tasks are finished one by one so that only the
  culprit fails (:mod:`flowforge.roles.apart`); the worker never exits for it.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
from collections.abc import Callable, Sequence
from uuid import UUID

from flowforge.broker.consume import Consumer, Deliveries, Delivery
from flowforge.config import Config
from flowforge.domain.model import Claim, Continuation
from flowforge.domain.names import band
from flowforge.errors import DatabaseUnavailableError
from flowforge.handlers import collect
from flowforge.roles.batch import Batch, Crew, Handlers
from flowforge.roles.concerns import Metrics, Recycling, TaskLog, TimeLimit
from flowforge.roles.execution import Executor, is_async
from flowforge.roles.hooks import WORKER_LOGGER, Hook, Hooks, Recycle
from flowforge.roles.intake import Intake
from flowforge.roles.lease import CancelWatch, Leases
from flowforge.roles.ledger import Ledger
from flowforge.roles.presence import Presence
from flowforge.roles.seams import Pool, WorkerStore
from flowforge.roles.stopping import on_stop
from flowforge.roles.upstream import UpstreamSource, bounded
from flowforge.store.claims import Claims
from flowforge.store.db import Database
from flowforge.store.processes import Processes
from flowforge.store.upstreams import Upstreams
from flowforge.telemetry import Telemetry

logger = logging.getLogger(WORKER_LOGGER)

#: How long one wait for a delivery lasts before housekeeping runs (seconds).
IDLE_WAIT_S = 1.0


class WorkerStatements(Claims, Processes):
    """The worker's part of the store: claim, finish, renew, release, and its registry row."""


class Worker:
    """The worker role (see module docstring): the loop over its parts.

    Parts: :class:`~flowforge.roles.intake.Intake` (the consumer side),
    :class:`~flowforge.roles.batch.Batch` (one batch: run, ack, finish, hand back),
    :class:`~flowforge.roles.ledger.Ledger` (the statements and their retries),
    :class:`~flowforge.roles.execution.Executor` (the handler thread, the async handlers'
    event loop), :class:`~flowforge.roles.lease.Leases`,
    and the hooks (:mod:`flowforge.roles.hooks`; the built-in ones in
    :mod:`flowforge.roles.concerns`, then ``hooks``).
    """

    title = "Worker"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        rand: Callable[[], float] = random.random,
        *,
        handlers: Handlers | None = None,
        broker: Deliveries | None = None,
        store: WorkerStore | None = None,
        db: Pool | None = None,
        hooks: Sequence[Hook] = (),
        pages: UpstreamSource | None = None,
    ) -> None:
        """The seams (tests): ``handlers`` instead of importing ``config.handlers``;
        ``broker``, ``store``, ``db`` and ``pages`` (what a claim's upstream views read)
        instead of RabbitMQ and PostgreSQL."""
        self._config = config
        database = Database(config.database, application_name="flowforge-worker")
        self._db: Pool = db or database
        worker = config.worker
        repo: WorkerStore = store or WorkerStatements(
            database, upstream_inline=worker.upstream_inline_items
        )
        # the pages a claim left out, read from the handler's thread through the same pool
        source = pages or Upstreams(database, inline=worker.upstream_inline_items)
        self._handlers = handlers
        self._recycle = Recycle()
        recycling = Recycling(config.processes, self._recycle, rand)
        builtin = [Metrics(telemetry or Telemetry()), TaskLog(), TimeLimit(), recycling]
        self._hooks = Hooks([*builtin, *hooks])
        broker = broker or Consumer(config.broker, band(config.worker.min_priority))
        fast_s = worker.fast_handler_ms / 1000
        self._intake = Intake(broker, config.broker.prefetch, fast_s)
        self._presence = Presence(repo, "worker", config.broker.queue)
        self._leases = Leases(
            repo,
            worker.lease_s,
            worker.heartbeat_s,
            worker.output_flush_ms / 1000,
            on_renewed=self._refresh,
        )
        self._cancels = CancelWatch(config.database, self._leases)
        self._ledger = Ledger(
            config, repo, self._db, self._leases, self._hooks, self._intake.serve, self._beat, rand
        )
        self._crew = Crew(
            self._intake,
            self._ledger,
            Executor(config.worker.async_concurrency),
            self._leases,
            self._cancels,
            self._hooks,
            self._beat,
            fast_s,
            config.worker.max_result_bytes,
            config.worker.listen_for_cancel,
            config.worker.log_capture_bytes,
            lambda claim: bounded(claim, source, worker.upstream_page_items),
        )
        self._ready: list[tuple[UUID, int]] = []  # released by our finishes, not claimed
        self._claimed_next: list[Claim] = []  # claimed for us by our finishes
        self._stop = threading.Event()
        self._beats: Callable[[], None] = lambda: None

    @property
    def recycle(self) -> bool:
        """True once this worker asked to be replaced (exit code 75)."""
        return self._recycle.asked

    def initialize(self) -> None:
        if self._handlers is None:  # import errors are boot failures, not outages
            self._handlers = collect(self._config.handlers, self._config.base_dir)
        kinds = {is_async(fn) for fn in self._handlers.values()}
        if True in kinds:
            # a batch of async handlers runs at once: let one fill every async slot, from the
            # first batch on when no sync handler could hold a batch up
            self._intake.widen(self._config.worker.async_concurrency, at_once=kinds == {True})
        self._ledger.worker_id = f"{socket.gethostname()}/{os.getpid()}"
        self._db.open()
        self._leases.start()
        self._presence.announce()
        self._intake.connect()  # take() starts consuming, with the prefetch of the batch

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        self._beats = beat
        self._stop = stop
        forget = on_stop(stop, self._intake.wake)  # a stop ends the take's wait at once
        try:
            self._serve(stop, beat)
        finally:
            forget()

    def _serve(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        """The loop's body: batches until ``stop`` is set or the worker is due to recycle."""
        while not stop.is_set() and not self.recycle:
            # dependents the last finish claimed for this worker in its own transaction
            if self._claimed_next:
                self._presence.tick()  # before taking them: should it fail, reset drops them
                beat()
                claimed, self._claimed_next = self._claimed_next, []
                self._run(claimed, ())
                continue
            # the next tasks of a DAG this worker just released come first, without the broker,
            # but at least every PUMP_INTERVAL_S the broker gets its turn (heartbeats, and
            # deliveries waiting here); dropped continuations go out through the outbox
            wanted, self._ready = self._ready[: self._batch_limit()], []
            taken: list[Delivery] = []
            if not wanted or self._intake.due():
                wanted, taken = self._intake.take(self._batch_limit(), IDLE_WAIT_S)
            self._presence.tick()
            beat()
            if wanted or taken:
                self._run(self._ledger.claim(wanted, local=not taken), taken)
        # stopping or recycling right after a finish claimed the next steps: give them back
        unstarted, self._claimed_next = self._claimed_next, []
        self._ledger.release(unstarted)

    def reset(self) -> None:
        self._ready = []
        self._claimed_next = []  # their leases lapse; the reaper re-dispatches them
        self._leases.drop_all()  # a batch cut short by an error: the same
        self._intake.close()
        self._db.close()

    def shutdown(self) -> None:
        self._cancels.stop()
        self._leases.stop()
        self._presence.leave()
        self.reset()

    def _beat(self) -> None:
        self._beats()

    def _refresh(self) -> None:
        """Keep this worker's registration fresh while a batch lasts (long calls, or a batch
        rolling on), from the lease keeper's thread after each renewal — never the main
        thread's wait, which an outage would block: as seen from status and readiness it is
        alive. A failure is the next renewal's to retry; the loop's own tick raises it."""
        try:
            self._presence.tick()
        except DatabaseUnavailableError as exc:
            logger.debug("cannot refresh this worker's registration: %s", exc)

    def _run(self, claims: Sequence[Claim], taken: Sequence[Delivery]) -> None:
        """Run a batch of claims (``taken``: its deliveries, empty if claimed without any)."""
        batch = Batch(self._crew, self._handlers or {}, claims, taken)
        # a batch of async calls rolls only at the full window: it lasts a second (ROLL_S),
        # which would hold up the window's ramp from 1 (a ramp of batches of 50 ms calls)
        full = self._intake.limit() >= self._config.worker.async_concurrency
        slow = batch.run(self._continuation, self._overtake, self._top_up if full else None)
        self._claimed_next.extend(batch.claimed)
        self._ready.extend(batch.ready)
        if batch.abandoned:
            self._recycle.ask()  # its handler thread is stuck in the handler given up
        self._hooks.after_batch(slow)
        self._intake.settle(batch.held_up, batch.cost())

    def _overtake(self, floor: int, size: int) -> tuple[list[Claim], list[Delivery]]:
        """Claims of deliveries of a band above ``floor`` that came in while a batch of
        ``size`` runs, and those deliveries (docs/flow-control.md "Priorities")."""
        return self._take_more(floor, size, None)

    def _top_up(self, free: int, size: int) -> tuple[list[Claim], list[Delivery]]:
        """Claims of up to ``free`` deliveries of any band that came in while a batch of
        ``size`` async calls runs, and those deliveries (roles/batch.py: a rolling batch)."""
        return self._take_more(-1, size, free)

    def _take_more(
        self, floor: int, size: int, most: int | None
    ) -> tuple[list[Claim], list[Delivery]]:
        """Claims of deliveries already here of a band above ``floor``, at most ``most``, for
        a batch of ``size`` still running, and those deliveries; none while stopping or due
        to recycle, nor beyond the room the hooks leave."""
        if self._stop.is_set() or self.recycle:
            return [], []
        limit = self._room(size) if most is None else min(most, self._room(size))
        if limit <= 0:
            return [], []
        wanted, taken = self._intake.take_above(floor, limit)
        if not taken:
            return [], []
        return self._ledger.claim(wanted, local=False), taken

    def _batch_limit(self) -> int:
        """Tasks the next batch may take (at least 1: a worker due to recycle has stopped)."""
        return max(1, self._room())

    def _room(self, finishing: int = 0) -> int:
        """The window, capped by what the hooks leave (``max_tasks_per_child``), counting
        ``finishing`` outcomes not yet committed."""
        room = self._hooks.room(finishing)
        limit = self._intake.limit()
        return limit if room is None else min(limit, room)

    def _continuation(self, finishing: int) -> Continuation | None:
        """Claim the next steps inside the finish, unless the worker is stopping or due to
        recycle, its broker connection broke (the reconnect would strand the claims until
        their leases lapsed), or the broker is due its turn and may have deliveries for it
        (:meth:`~flowforge.roles.intake.Intake.owed`): they then go out as messages."""
        if self._stop.is_set() or self.recycle or self._intake.broken is not None:
            return None
        if self._intake.owed():
            return None
        limit = self._room(finishing)
        if limit <= 0:
            return None
        return Continuation(self._ledger.worker_id, self._config.worker.lease_s, limit)
