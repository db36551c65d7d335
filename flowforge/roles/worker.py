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
* While a slow handler runs, the main thread serves the broker connection (heartbeats) and
  renews the leases it holds; a thread LISTENs for cancellations (roles/lease.py).
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
import resource
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from flowforge.broker.consume import Consumer, Deliveries, Delivery
from flowforge.broker.messages import MessageError, decode
from flowforge.config import Config
from flowforge.domain.model import Claim, ClaimOutcome, Continuation, Finish, Finished
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import BrokerUnavailableError, DatabaseUnavailableError
from flowforge.handlers import collect
from flowforge.roles import tasklog
from flowforge.roles.apart import finish_apart, refused
from flowforge.roles.claims import Pool, WorkerStore
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import HandlerThread, Job, classify
from flowforge.roles.lease import CancelWatch, Leases
from flowforge.roles.presence import Presence
from flowforge.roles.runner import RECONNECT_BACKOFF
from flowforge.store.db import Database
from flowforge.store.repository import Repository
from flowforge.telemetry import Telemetry

logger = logging.getLogger(__name__)

#: How long one wait for a delivery lasts before housekeeping runs (seconds).
IDLE_WAIT_S = 1.0
#: While a handler runs, serve the broker connection at least this often (seconds).
PUMP_INTERVAL_S = 1.0
#: Recycling jitter: up to this fraction is added to max_tasks_per_child.
RECYCLE_JITTER = 0.1
#: A failed finish is retried at least this many times before the lapsed leases give it up.
FINISH_ATTEMPTS_BEFORE_GIVING_UP = 3


@dataclass(frozen=True)
class _Task:
    """A claimed task on its way through this worker."""

    claim: Claim
    job: Job


class Worker:
    """The worker role (see module docstring)."""

    title = "Worker"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        rand: Callable[[], float] = random.random,
        *,
        handlers: Mapping[str, Callable[[TaskContext], Any]] | None = None,
        broker: Deliveries | None = None,
        store: WorkerStore | None = None,
        db: Pool | None = None,
    ) -> None:
        """The seams (tests): ``handlers`` instead of importing ``config.handlers``;
        ``broker``, ``store`` and ``db`` instead of RabbitMQ and PostgreSQL."""
        self._config = config
        self._telemetry = telemetry or Telemetry()
        self._rand = rand
        database = Database(config.database, application_name="flowforge-worker")
        self._db: Pool = db or database
        self._repo: WorkerStore = store or Repository(database)
        self._consumer: Deliveries = broker or Consumer(config.broker)
        self._presence = Presence(self._repo, "worker")
        self._executor = HandlerThread()
        self._leases = Leases(self._repo, config.worker.lease_s, config.worker.heartbeat_s)
        self._cancels = CancelWatch(config.database, self._leases)
        self._handlers = handlers
        self._broker_broken: BrokerUnavailableError | None = None
        self._id = ""
        limit = config.processes.max_tasks_per_child
        self._task_limit = limit + int(limit * RECYCLE_JITTER * rand()) if limit else 0
        self._window = 1
        self._outcomes: list[tuple[Claim, Finish]] = []
        self._pending_ack: Delivery | None = None
        self._continuations: list[tuple[UUID, int]] = []
        self._claimed_next: list[Claim] = []
        self._stop = threading.Event()
        self._took_at = 0.0
        self._beat: Callable[[], None] = lambda: None
        self.tasks_done = 0
        self.recycle = False

    def initialize(self) -> None:
        if self._handlers is None:  # import errors are boot failures, not outages
            self._handlers = collect(self._config.handlers, self._config.base_dir)
        self._id = f"{socket.gethostname()}/{os.getpid()}"
        self._broker_broken = None
        self._db.open()
        self._presence.announce()
        self._consumer.connect()  # take() starts consuming, with the prefetch of the batch

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        self._beat = beat
        self._stop = stop
        while not stop.is_set() and not self.recycle:
            # dependents the last finish claimed for this worker in its own transaction
            if self._claimed_next:
                self._presence.tick()  # before taking them: should it fail, reset drops them
                beat()
                claimed, self._claimed_next = self._claimed_next, []
                self._start(claimed, last=None)
                continue
            # the next tasks of a DAG this worker just released come first, without the broker,
            # but at least every PUMP_INTERVAL_S the broker gets its turn (heartbeats, and
            # deliveries waiting here); dropped continuations go out through the outbox
            local, self._continuations = self._continuations[: self._batch_limit()], []
            if local and time.monotonic() - self._took_at > PUMP_INTERVAL_S:
                local = []
            deliveries: Sequence[Delivery] = []
            if not local:
                deliveries = self._consumer.take(self._batch_limit(), IDLE_WAIT_S)
                self._took_at = time.monotonic()
            self._presence.tick()
            beat()
            if local:
                self._claim_and_run(local, last=None)
            elif deliveries:
                self._handle(deliveries)
        # stopping or recycling right after a finish claimed the next steps: give them back
        unstarted, self._claimed_next = self._claimed_next, []
        self._release(unstarted)

    def reset(self) -> None:
        self._pending_ack = None
        self._continuations = []
        self._claimed_next = []  # their leases lapse; the reaper re-dispatches them
        self._consumer.close()
        self._db.close()

    def shutdown(self) -> None:
        self._cancels.stop()
        self._presence.leave()
        self.reset()

    def _batch_limit(self) -> int:
        """Tasks the next batch may take (at least 1: a worker due to recycle has stopped)."""
        return max(1, self._room())

    def _room(self, finishing: int = 0) -> int:
        """The window, capped by ``broker.prefetch`` and by the tasks left before
        ``max_tasks_per_child``, counting ``finishing`` outcomes not yet in ``tasks_done``."""
        limit = min(self._window, self._config.broker.prefetch)
        if self._task_limit:
            limit = min(limit, self._task_limit - self.tasks_done - finishing)
        return limit

    # ------------------------------------------------------------------ one batch

    def _handle(self, deliveries: Sequence[Delivery]) -> None:
        wanted: list[tuple[UUID, int]] = []
        for delivery in deliveries:
            try:
                message = decode(delivery.body)
            except MessageError as exc:
                logger.error(
                    "dropping an undecodable message: %s", exc, extra={"action": "bad_message"}
                )
                continue
            wanted.append((message.task_run_id, message.token))
        self._claim_and_run(wanted, last=deliveries[-1])

    def _claim_and_run(self, wanted: Sequence[tuple[UUID, int]], last: Delivery | None) -> None:
        """Claim ``wanted`` in one statement, run what was claimed, finish it.

        ``last`` is the batch's last delivery (acked once the claims committed); None for
        dependents this worker's own finish made READY (claimed without a message).
        """
        worker = self._config.worker
        results = self._repo.claim_many(
            wanted, self._id, worker.lease_s, worker.key_wait_s, local=last is None
        )
        claims: list[Claim] = []
        for (task_run_id, _token), result in zip(wanted, results, strict=True):
            if result.outcome is ClaimOutcome.EXECUTE and result.claim is not None:
                claims.append(result.claim)
            else:
                logger.debug(
                    "task run %s not executed here: %s",
                    task_run_id,
                    result.outcome,
                    extra={"action": f"claim_{result.outcome}"},
                )
        self._start(claims, last)

    def _start(self, claims: Sequence[Claim], last: Delivery | None) -> None:
        """Run claims this worker holds and finish them (``last``: see _claim_and_run)."""
        for claim in claims:
            self._telemetry.tasks_started.inc()
            self._telemetry.dispatch_lag.observe(claim.dispatch_lag_s)
        self._pending_ack = last
        slow = self._run(claims)
        self._window = 1 if slow else min(self._window * 2, self._config.broker.prefetch)
        self._check_recycle()
        if self._broker_broken is not None:
            raise self._broker_broken

    def _ack_batch(self) -> None:
        """Ack the batch being worked on (its claims committed), if not done yet."""
        last, self._pending_ack = self._pending_ack, None
        if last is None or self._broker_broken is not None:
            return
        try:
            self._consumer.ack_through(last.tag)
        except BrokerUnavailableError as exc:
            # The claims committed: the leases own the tasks and the handlers still run. The
            # broker will redeliver the messages, and those deliveries are acked without running.
            logger.warning("ack after claim failed: %s", exc, extra={"action": "ack_failed"})
            self._broker_broken = exc

    def _serve_broker(self, seconds: float = 0.0) -> None:
        if self._broker_broken is not None:
            time.sleep(seconds)
            return
        try:
            self._consumer.pump(seconds)
        except BrokerUnavailableError as exc:
            logger.warning("broker connection lost while a handler runs: %s", exc)
            self._broker_broken = exc

    # ------------------------------------------------------------------ running the handlers

    def _run(self, claims: Sequence[Claim]) -> bool:
        """Run the claimed tasks in order and finish them; True if one of them was slow."""
        tasks: list[_Task] = []
        for claim in claims:
            job = self._prepare(claim)
            if job is None:
                error = f"no handler is registered as {claim.handler!r} in this worker"
                unknown = Finish(
                    TaskState.FAILED, reason=FailureReason.UNKNOWN_HANDLER, error=error
                )
                self._outcomes.append((claim, unknown))
            else:
                tasks.append(_Task(claim, job))
        self._leases.hold([(t.claim, t.job.ctx) for t in tasks])
        self._executor.submit([t.job for t in tasks])
        slow = False
        for index, task in enumerate(tasks):
            if not self._wait(task, tasks[index + 1 :]):
                slow = True  # everything behind it was handed back
                break
        self._ack_batch()
        self._flush(continue_here=not slow)
        return slow

    def _prepare(self, claim: Claim) -> Job | None:
        """The handler call for a claim; None when no handler is registered under its name."""
        handler = (self._handlers or {}).get(claim.handler)
        if handler is None:
            return None
        ctx = TaskContext(
            claim.input, claim.upstream, claim.attempt, claim.task_run_id, claim.run_id, claim.name
        )
        return Job(handler, ctx)

    def _wait(self, task: _Task, behind: Sequence[_Task]) -> bool:
        """Wait for one job and record its outcome; False if it outlasted fast_handler_ms.

        A slow (or timed-out) handler makes the worker hand back everything behind it.
        """
        job = task.job
        fast_s = self._config.worker.fast_handler_ms / 1000
        timeout_s = task.claim.timeout_s
        fast = True
        while not job.done.is_set():
            started = job.started
            if started is None:  # not picked up yet: it cannot have been slow so far
                job.done.wait(fast_s)
                continue
            elapsed = time.monotonic() - started
            timed_out = timeout_s is not None and elapsed >= timeout_s
            if fast and (elapsed > fast_s or timed_out):
                fast = False
                if self._config.worker.listen_for_cancel:
                    self._cancels.start()  # a cancel now reaches it at once, not at renewal
                self._hand_back(behind)
            if timed_out:
                self._overran(task)
                return False
            budget = fast_s - elapsed if fast else self._slow_budget()
            if timeout_s is not None:
                budget = min(budget, timeout_s - elapsed)
            if job.done.wait(max(budget, 0.0)):
                break
            if not fast:
                self._serve_broker()
                self._beat()
                self._leases.maybe_renew()
        assert job.started is not None
        self._telemetry.task_duration.labels(handler=task.claim.handler).observe(
            time.monotonic() - job.started
        )
        self._outcomes.append((task.claim, classify(job, self._config.worker.max_result_bytes)))
        return fast

    def _slow_budget(self) -> float:
        return min(PUMP_INTERVAL_S, self._leases.due_in())

    def _hand_back(self, behind: Sequence[_Task]) -> None:
        """A slow handler holds this worker: stop consuming, ack, give back what waits."""
        withdrawn = {id(job) for job in self._executor.withdraw()}
        unstarted = [t.claim for t in behind if id(t.job) in withdrawn]
        if self._broker_broken is None:
            try:
                requeued = self._consumer.hand_back()
                if requeued:
                    logger.debug("requeued %d unclaimed deliveries", requeued)
            except BrokerUnavailableError as exc:
                logger.warning("broker connection lost while handing back: %s", exc)
                self._broker_broken = exc
        self._ack_batch()
        self._flush()
        if unstarted:
            released = self._release(unstarted)
            logger.info(
                "a slow handler holds this worker: handed back %d claimed task(s)",
                released,
                extra={"action": "claims_released"},
            )

    def _release(self, claims: Sequence[Claim]) -> int:
        """Hand back claims whose handlers never started; returns how many went back."""
        if not claims:
            return 0
        pairs = [(c.task_run_id, c.fencing_token) for c in claims]
        try:
            released = self._repo.release_claims(pairs)
        except DatabaseUnavailableError as exc:
            # Still ours until their leases lapse: then the reaper re-dispatches them.
            logger.warning(
                "could not hand back %d claim(s): %s",
                len(pairs),
                exc,
                extra={"action": "release_failed"},
            )
            released = 0
        self._leases.drop([task_run_id for task_run_id, _ in pairs])
        return released

    def _overran(self, task: _Task) -> None:
        timeout = Finish(
            TaskState.FAILED,
            reason=FailureReason.TIMEOUT,
            error=f"the handler ran longer than its timeout of {task.claim.timeout_s}s",
        )
        self._outcomes.append((task.claim, timeout))
        logger.error(
            "task run %s overran its timeout; this worker will be replaced",
            task.claim.task_run_id,
            extra={"action": "task_timeout"},
        )
        self.recycle = True

    def _flush(self, continue_here: bool = False) -> None:
        """Commit the recorded outcomes in one statement; retry while the database is away.

        ``continue_here``: this worker is free for the next batch, so the finish's transaction
        also claims the dependents it releases (up to a window; see :meth:`_continuation`).
        """
        outcomes, self._outcomes = self._outcomes, []
        if not outcomes:
            return
        batch = [(c.task_run_id, c.fencing_token, f) for c, f in outcomes]
        try:
            finished = self._commit(batch, continue_here)
        except Exception as exc:
            if not refused(exc):
                raise
            finished = finish_apart(outcomes, self._commit)
        if finished is None:
            return
        self._leases.drop([c.task_run_id for c, _ in outcomes])
        claimed = {claim.task_run_id for claim in finished.claimed}
        self._claimed_next.extend(finished.claimed)
        self._continuations.extend(pair for pair in finished.ready if pair[0] not in claimed)
        self.tasks_done += len(outcomes)
        for claim, finish in outcomes:
            self._count(claim, finish, claim.task_run_id in finished.committed)

    def _commit(
        self, batch: Sequence[tuple[UUID, int, Finish]], continue_here: bool = False
    ) -> Finished | None:
        """Finish ``batch`` in one statement, retried while the database is away; None once
        the leases have lapsed meanwhile (given up: the reaper retries the tasks)."""
        failures = 0
        while True:
            # decided per attempt: serving the broker between retries may have found it broken
            then = self._continuation(len(batch)) if continue_here else None
            try:
                # only what one window can take comes back; the rest go out as messages
                return self._repo.finish_many(batch, offer=self._config.broker.prefetch, then=then)
            except DatabaseUnavailableError as exc:
                failures += 1
                if self._leases.expired_locally() and failures > FINISH_ATTEMPTS_BEFORE_GIVING_UP:
                    logger.error(
                        "could not record the outcome of %d task run(s) before their leases "
                        "lapsed (%s); the reaper will retry them",
                        len(batch),
                        exc,
                        extra={"action": "finish_abandoned"},
                    )
                    self._leases.drop([task_run_id for task_run_id, _, _ in batch])
                    return None
                delay = RECONNECT_BACKOFF.delay(failures, self._rand)
                logger.warning(
                    "finish failed (%s); retrying in %.1fs",
                    exc,
                    delay,
                    extra={"action": "finish_retry"},
                )
                self._db.reset()
                self._beat()
                self._serve_broker(delay)

    def _continuation(self, finishing: int) -> Continuation | None:
        """Claim the next steps inside the finish, unless the worker is stopping or due to
        recycle, its broker connection broke (the reconnect would strand the claims until
        their leases lapsed), or the broker is due its turn: they then go out as messages."""
        if self._stop.is_set() or self.recycle or self._broker_broken is not None:
            return None
        if time.monotonic() - self._took_at > PUMP_INTERVAL_S:
            return None
        limit = self._room(finishing)
        if limit <= 0:
            return None
        return Continuation(self._id, self._config.worker.lease_s, limit)

    def _count(self, claim: Claim, finish: Finish, committed: bool) -> None:
        t = self._telemetry
        if not committed:
            t.stale_completions.inc()
            logger.warning(
                "stale completion of task run %s rejected (token %d is no longer current)",
                claim.task_run_id,
                claim.fencing_token,
                extra={"action": "stale_completion"},
            )
        elif finish.state is TaskState.SUCCEEDED:
            t.tasks_succeeded.inc()
        elif finish.state is TaskState.CANCELLED:
            t.tasks_cancelled.inc()
            tasklog.attempt_ended(logger, claim, finish)
        else:
            t.tasks_failed.labels(reason=str(finish.reason)).inc()
            tasklog.attempt_ended(logger, claim, finish)  # a line per failure, none per success

    def _check_recycle(self) -> None:
        if self._task_limit and self.tasks_done >= self._task_limit:
            logger.info("recycling after %d task(s)", self.tasks_done, extra={"action": "recycle"})
            self.recycle = True
        limit_mb = self._config.processes.max_memory_mb_per_child
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if limit_mb and peak_mb > limit_mb:
            logger.info("recycling at %.0f MB", peak_mb, extra={"action": "recycle"})
            self.recycle = True
