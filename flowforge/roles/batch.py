"""One batch of claims on its way through the worker: run, ack, finish, hand back.

A :class:`Batch` owns its claims, their outcomes and the pending ack. :meth:`Batch.run` runs
the handlers one after another on the handler thread and waits for each on the main thread
(serving the broker and beating while one is slow; the leases renew on a thread of their own).
When a handler outlasts ``worker.fast_handler_ms``, the batch stops the consumer, acks, commits
the outcomes already known and hands back the claims queued behind it; once every handler it
kept has ended, it acks (if not done yet) and commits the rest in one statement, which may claim
the dependents it releases for this worker (:attr:`Batch.claimed`; the others are in
:attr:`Batch.ready`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from flowforge.broker.consume import Delivery
from flowforge.domain.model import Claim, Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import HandlerThread, Job, classify
from flowforge.roles.hooks import WORKER_LOGGER, Hooks
from flowforge.roles.intake import PUMP_INTERVAL_S, Intake
from flowforge.roles.lease import CancelWatch, Leases
from flowforge.roles.ledger import Ledger, Then

logger = logging.getLogger(WORKER_LOGGER)

Handlers = Mapping[str, Callable[[TaskContext], Any]]


@dataclass(frozen=True)
class Crew:
    """The worker's long-lived parts a batch works with."""

    intake: Intake
    ledger: Ledger
    executor: HandlerThread
    leases: Leases
    cancels: CancelWatch
    hooks: Hooks
    beat: Callable[[], None]
    fast_s: float  # worker.fast_handler_ms, in seconds
    max_result_bytes: int
    listen_for_cancel: bool


@dataclass(frozen=True)
class _Task:
    """A claimed task and its handler call."""

    claim: Claim
    job: Job


class Batch:
    """Claims this worker holds, run and finished together (see module docstring).

    ``ack``: the batch's deliveries, acked once (the claims committed); empty for claims made
    without a message. ``then``: whether the final finish may claim dependents.
    """

    def __init__(
        self, crew: Crew, handlers: Handlers, claims: Sequence[Claim], ack: Sequence[Delivery]
    ) -> None:
        self._crew = crew
        self._handlers = handlers
        self._claims = claims
        self._pending_ack: Sequence[Delivery] = ack
        self._outcomes: list[tuple[Claim, Finish]] = []
        self.claimed: list[Claim] = []
        self.ready: list[tuple[UUID, int]] = []
        self.abandoned = False  # a hook gave up a running handler: the worker must go
        self._withdrawn: set[int] = set()  # id() of the jobs handed back before they started

    def run(self, then: Then) -> bool:
        """Run, ack and finish the batch; True if a handler was slow (the rest handed back)."""
        crew = self._crew
        crew.hooks.after_claim(self._claims)
        tasks: list[_Task] = []
        for claim in self._claims:
            handler = self._handlers.get(claim.handler)
            if handler is None:
                error = f"no handler is registered as {claim.handler!r} in this worker"
                unknown = Finish(
                    TaskState.FAILED, reason=FailureReason.UNKNOWN_HANDLER, error=error
                )
                self._outcomes.append((claim, unknown))
            else:
                ctx = TaskContext(
                    claim.input,
                    claim.upstream,
                    claim.attempt,
                    claim.task_run_id,
                    claim.run_id,
                    claim.name,
                    item=claim.item,
                    index=claim.index,
                )
                tasks.append(_Task(claim, Job(handler, ctx)))
        crew.leases.hold([(t.claim, t.job.ctx) for t in tasks])
        crew.executor.submit([t.job for t in tasks])
        slow = False
        for index, task in enumerate(tasks):
            if id(task.job) in self._withdrawn:
                continue  # handed back behind a slow handler
            # A job behind a slow one that the handler thread started before the hand-back
            # withdrew the rest could not be handed back: it is waited for like any other.
            if not self._wait(task, tasks[index + 1 :]):
                slow = True
                if self.abandoned:
                    break  # the handler thread is stuck in it: nothing behind it can start
        self._ack()
        self._flush(then if not slow else None)
        self._check_released(tasks)
        return slow

    def _check_released(self, tasks: Sequence[_Task]) -> None:
        """Every claim of the batch is finished or handed back by now, so no lease of it may
        still be held: one held would be renewed for ever with nothing to finish it. Should
        one be (a defect), it is let go, loudly, and lapses to the reaper."""
        leftover = self._crew.leases.held([t.claim.task_run_id for t in tasks])
        if leftover:
            logger.error(
                "a batch ended with %d claim(s) neither finished nor handed back; their "
                "leases are let go and lapse to the reaper: %s",
                len(leftover),
                ", ".join(str(i) for i in leftover),
                extra={"action": "claims_leaked"},
            )
            self._crew.leases.drop(leftover)

    def _ack(self) -> None:
        taken, self._pending_ack = self._pending_ack, ()
        self._crew.intake.ack(taken)

    def _wait(self, task: _Task, behind: Sequence[_Task]) -> bool:
        """Wait for one job and record its outcome; False if it outlasted fast_handler_ms
        (or a hook gave it up): then everything behind it was handed back."""
        crew, job = self._crew, task.job
        fast_s = crew.fast_s
        fast = True
        while not job.done.is_set():
            started = job.started
            if started is None:  # not picked up yet: it cannot have been slow so far
                job.done.wait(fast_s)
                continue
            elapsed = time.monotonic() - started
            said = crew.hooks.while_running(task.claim, elapsed)
            given_up = isinstance(said, Finish)
            if fast and (elapsed > fast_s or given_up):
                fast = False
                if crew.listen_for_cancel:
                    crew.cancels.start()  # a cancel now reaches it at once, not at renewal
                self._hand_back(behind)
            if isinstance(said, Finish):
                self._outcomes.append((task.claim, said))
                self.abandoned = True
                return False
            budget = fast_s - elapsed if fast else PUMP_INTERVAL_S
            if said is not None:
                budget = min(budget, said)
            if job.done.wait(max(budget, 0.0)):
                break
            if not fast:
                crew.intake.serve()  # the leases are the keeper thread's (roles/lease.py)
                crew.beat()
        assert job.started is not None
        duration_s = time.monotonic() - job.started
        finish = classify(job, crew.max_result_bytes)
        crew.hooks.after_execute(task.claim, finish, duration_s)
        self._outcomes.append((task.claim, finish))
        return fast

    def _hand_back(self, behind: Sequence[_Task]) -> None:
        """A slow handler holds this worker: stop consuming, ack, give back what waits."""
        crew = self._crew
        withdrawn = {id(job) for job in crew.executor.withdraw()}
        self._withdrawn |= withdrawn
        unstarted = [t.claim for t in behind if id(t.job) in withdrawn]
        crew.intake.hand_back()
        self._ack()
        self._flush(None)
        if unstarted:
            released = crew.ledger.release(unstarted)
            logger.info(
                "a slow handler holds this worker: handed back %d claimed task(s)",
                released,
                extra={"action": "claims_released"},
            )

    def _flush(self, then: Then | None) -> None:
        """Commit the outcomes recorded so far (``then``: see :meth:`Ledger.finish`)."""
        outcomes, self._outcomes = self._outcomes, []
        if not outcomes:
            return
        finished = self._crew.ledger.finish(outcomes, then)
        if finished is None:
            return
        claimed = {claim.task_run_id for claim in finished.claimed}
        self.claimed.extend(finished.claimed)
        self.ready.extend(pair for pair in finished.ready if pair[0] not in claimed)
