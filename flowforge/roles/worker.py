"""The worker role: consume a dispatch, claim it, ack it, run the handler, finish it.

* The claim (READY → RUNNING, token bumped, lease set) commits before the ack: from then on
  the lease, not the broker, owns the task, so a handler longer than RabbitMQ's
  ``consumer_timeout`` is safe, and a worker that dies is reaped and re-dispatched.
* A claim that fails because PostgreSQL is unreachable leaves the message unacked: the role
  drops its connections (the broker requeues the message) and reconnects with backoff.
* A redelivered message for a task already claimed or finished is acked without executing.
* While the handler runs on its own thread, the main thread serves the broker connection
  (heartbeats) and renews the lease; the consumer is paused so no second message waits here,
  and the next message is pulled only once the worker is free again.
* A finish that cannot reach the database is retried until it commits or its token is stale.
"""

from __future__ import annotations

import logging
import os
import random
import resource
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from flowforge.broker.consume import Consumer, Delivery
from flowforge.broker.messages import MessageError, decode
from flowforge.config import Config
from flowforge.domain.model import Claim, ClaimOutcome
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import BrokerUnavailableError, DatabaseUnavailableError
from flowforge.handlers import collect
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import Finish, HandlerThread, Job, classify
from flowforge.roles.lease import LeaseKeeper
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


class Worker:
    """The worker role (see module docstring)."""

    title = "Worker"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._config = config
        self._telemetry = telemetry or Telemetry()
        self._rand = rand
        self._db = Database(config.database, application_name="flowforge-worker")
        self._repo = Repository(self._db)
        self._consumer = Consumer(config.broker)
        self._presence = Presence(self._repo, "worker")
        self._executor = HandlerThread()
        self._handlers: Mapping[str, Callable[[TaskContext], Any]] | None = None
        self._broker_broken: BrokerUnavailableError | None = None
        self._id = ""
        self._task_limit = 0
        self._beat: Callable[[], None] = lambda: None
        self.tasks_done = 0
        self.recycle = False

    def initialize(self) -> None:
        if self._handlers is None:  # import errors are boot failures, not outages
            self._handlers = collect(self._config.handlers, self._config.base_dir)
            limit = self._config.processes.max_tasks_per_child
            self._task_limit = limit + int(limit * RECYCLE_JITTER * self._rand()) if limit else 0
        self._id = f"{socket.gethostname()}/{os.getpid()}"
        self._broker_broken = None
        self._db.open()
        self._presence.announce()
        self._consumer.connect()
        self._consumer.resume()

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        self._beat = beat
        while not stop.is_set() and not self.recycle:
            delivery = self._consumer.next_delivery(IDLE_WAIT_S)
            self._presence.tick()
            beat()
            if delivery is not None:
                self._handle(delivery)

    def reset(self) -> None:
        self._consumer.close()
        self._db.close()

    def shutdown(self) -> None:
        self._presence.leave()
        self.reset()

    # ------------------------------------------------------------------ one delivery

    def _handle(self, delivery: Delivery) -> None:
        try:
            message = decode(delivery.body)
        except MessageError as exc:
            logger.error(
                "dropping an undecodable message: %s", exc, extra={"action": "bad_message"}
            )
            self._consumer.ack(delivery.tag)
            return
        worker = self._config.worker
        result = self._repo.claim(
            message.task_run_id, message.token, self._id, worker.lease_s, worker.key_wait_s
        )
        if result.outcome is not ClaimOutcome.EXECUTE or result.claim is None:
            logger.debug(
                "task run %s not executed here: %s",
                message.task_run_id,
                result.outcome,
                extra={"action": f"claim_{result.outcome}"},
            )
            self._consumer.ack(delivery.tag)
            return
        self._telemetry.tasks_started.inc()
        self._telemetry.dispatch_lag.observe(result.claim.dispatch_lag_s)
        self._consumer.pause()
        self._ack_claimed(delivery)
        self._execute(result.claim)
        self.tasks_done += 1
        self._check_recycle()
        if self._broker_broken is not None:
            raise self._broker_broken

    def _ack_claimed(self, delivery: Delivery) -> None:
        try:
            self._consumer.ack(delivery.tag)
        except BrokerUnavailableError as exc:
            # The claim committed: the lease owns the task and the handler still runs. The
            # broker will redeliver the message, and that delivery is acked without running.
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

    # ------------------------------------------------------------------ running the handler

    def _execute(self, claim: Claim) -> None:
        handler = (self._handlers or {}).get(claim.handler)
        if handler is None:
            error = f"no handler is registered as {claim.handler!r} in this worker"
            self._finish(
                claim,
                Finish(TaskState.FAILED, reason=FailureReason.UNKNOWN_HANDLER, error=error),
                None,
            )
            return
        ctx = TaskContext(
            claim.input, claim.upstream, claim.attempt, claim.task_run_id, claim.run_id, claim.name
        )
        lease = LeaseKeeper(
            self._repo, claim, ctx, self._config.worker.lease_s, self._config.worker.heartbeat_s
        )
        started = time.monotonic()
        job = self._executor.submit(handler, ctx)
        finished_in_time = self._wait(job, lease, claim.timeout_s)
        self._telemetry.task_duration.labels(handler=claim.handler).observe(
            time.monotonic() - started
        )
        if not finished_in_time:
            self._finish(
                claim,
                Finish(
                    TaskState.FAILED,
                    reason=FailureReason.TIMEOUT,
                    error=f"the handler ran longer than its timeout of {claim.timeout_s}s",
                ),
                lease,
            )
            logger.error(
                "task run %s overran its timeout; this worker will be replaced",
                claim.task_run_id,
                extra={"action": "task_timeout"},
            )
            self.recycle = True
            return
        self._finish(claim, classify(job), lease)

    def _wait(self, job: Job, lease: LeaseKeeper, timeout_s: float | None) -> bool:
        """Wait for the job while serving the broker and the lease; False if it timed out."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            budget = min(PUMP_INTERVAL_S, lease.due_in())
            if deadline is not None:
                budget = min(budget, max(0.0, deadline - time.monotonic()))
            if job.done.wait(budget):
                return True
            self._serve_broker()
            self._beat()
            lease.maybe_renew()
            if deadline is not None and time.monotonic() >= deadline:
                return job.done.is_set()

    def _finish(self, claim: Claim, finish: Finish, lease: LeaseKeeper | None) -> None:
        """Commit the outcome; retry while the database is unreachable, never drop it silently."""
        failures = 0
        while True:
            try:
                committed = self._repo.finish(
                    claim.task_run_id,
                    claim.fencing_token,
                    finish.state,
                    result=finish.result,
                    reason=finish.reason,
                    error=finish.error,
                    traceback=finish.traceback,
                )
                break
            except DatabaseUnavailableError as exc:
                failures += 1
                if lease is not None and lease.expired_locally() and failures > 3:
                    logger.error(
                        "could not record the outcome of task run %s before its lease lapsed "
                        "(%s); the reaper will retry it",
                        claim.task_run_id,
                        exc,
                        extra={"action": "finish_abandoned"},
                    )
                    return
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
        self._count(finish, committed)
        if not committed:
            logger.warning(
                "stale completion of task run %s rejected (token %d is no longer current)",
                claim.task_run_id,
                claim.fencing_token,
                extra={"action": "stale_completion"},
            )

    def _count(self, finish: Finish, committed: bool) -> None:
        t = self._telemetry
        if not committed:
            t.stale_completions.inc()
        elif finish.state is TaskState.SUCCEEDED:
            t.tasks_succeeded.inc()
        elif finish.state is TaskState.CANCELLED:
            t.tasks_cancelled.inc()
        else:
            t.tasks_failed.labels(reason=str(finish.reason)).inc()

    def _check_recycle(self) -> None:
        if self._task_limit and self.tasks_done >= self._task_limit:
            logger.info("recycling after %d task(s)", self.tasks_done, extra={"action": "recycle"})
            self.recycle = True
        limit_mb = self._config.processes.max_memory_mb_per_child
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if limit_mb and peak_mb > limit_mb:
            logger.info("recycling at %.0f MB", peak_mb, extra={"action": "recycle"})
            self.recycle = True
