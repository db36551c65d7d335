"""One batch of claims on its way through the worker: run, ack, finish, hand back.

A :class:`Batch` owns its claims, their outcomes and the pending ack. :meth:`Batch.run` runs
the handlers one after another on the handler thread and waits for each on the main thread
(serving the broker and beating while one is slow; the leases renew on a thread of their own).
When a handler outlasts ``worker.fast_handler_ms``, the batch stops the consumer, acks, commits
the outcomes already known and hands back the claims queued behind it; once every handler it
kept has ended, it acks (if not done yet) and commits the rest in one statement, which may claim
the dependents it releases for this worker (:attr:`Batch.claimed`; the others are in
:attr:`Batch.ready`).

Async handlers (``async def``) of a batch run at once on the worker's event loop, up to
``worker.async_concurrency``; the batch still waits for its tasks in order, but an async one
counts as slow only past :data:`ASYNC_SLOW_S` (or ``fast_handler_ms`` if longer). A slow async
call takes the slow path too (ack, commit what ended, hand back what has not started), but it
does not *hold the batch up* (:attr:`Batch.held_up`, which sets the window back to 1): the calls
beside it run meanwhile, so a batch of async calls lasts as long as its longest, and the
window keeps its size. A batch of async calls *rolls* (``top_up``): it is acked as soon as its
calls start (the worker asks for this at its full window only), and each slot a call frees is
filled at once with a delivery that came in meanwhile, claimed and acked there, so the worker's
slots stay busy instead of waiting for the batch's longest call and the next batch's round
trips. While none of its calls is slow it rolls for :data:`ROLL_S` (its outcomes are committed
when it ends, or every :data:`FLUSH_AFTER` of them); once one is slow (its outcomes are then
committed about every second) it rolls for as long as it runs, so long calls never leave slots
idle while work waits, and it consumes
only while a slot is free: with every slot busy it hands back what came in, so a delivery
waits here at most about a second before it is taken or requeued for another worker. A
rolling batch forgets the tasks it is done with, so one that rolls for hours holds only its
running calls. It stops rolling at a sync claim, or when the worker stops or has no room left
(``max_tasks_per_child``, ``max_memory_mb_per_child``). A hook that gives an async handler up
cancels it (no worker is replaced unless it ignores the cancellation).

Between two tasks (and after the last), while no handler was slow, the batch asks whether a
delivery of a higher priority band than its own came in meanwhile; if so it is claimed and runs
next, ahead of the batch's tasks not started yet, and is finished with the batch
(docs/flow-control.md "Priorities": no task is stopped for it, and none is released).
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
from flowforge.errors import FlowForgeError
from flowforge.roles.attemptlog import AttemptOutput
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import Executor, Job, captured, classify
from flowforge.roles.hooks import WORKER_LOGGER, Hooks
from flowforge.roles.intake import PUMP_INTERVAL_S, BatchCost, Intake
from flowforge.roles.lease import CancelWatch, Leases
from flowforge.roles.ledger import Ledger, Then

logger = logging.getLogger(WORKER_LOGGER)

Handlers = Mapping[str, Callable[[TaskContext], Any]]
#: Given the band a delivery must be above and the batch's size: claims of such deliveries
#: waiting here (claimed now), and the deliveries (to ack with the batch).
Overtake = Callable[[int, int], tuple[list[Claim], list[Delivery]]]
#: Given the free async slots and the batch's size: claims of deliveries waiting here, at most
#: that many (claimed now), and the deliveries (acked at once).
TopUp = Callable[[int, int], tuple[list[Claim], list[Delivery]]]
#: An async handler is slow (the slow path: hand back, ack) only past
#: this, or fast_handler_ms if longer (seconds): the main thread must serve the broker about
#: this often anyway (intake.PUMP_INTERVAL_S), and calls behind it are not waiting for it.
ASYNC_SLOW_S = PUMP_INTERVAL_S
#: How long a batch of async calls none of which is slow keeps filling the slots its calls
#: free (seconds): its outcomes are committed when it ends, so this bounds how long they wait
#: (with its calls). A slow batch commits as it goes and rolls as long as it runs.
ROLL_S = PUMP_INTERVAL_S
#: A rolling batch forgets the tasks it is done with once it has waited for this many.
FORGET_AFTER = 32
#: A rolling batch commits its outcomes once it holds this many, not only when it ends: at 16
#: async calls of 50 ms a worker ends ~320 a second, each outcome holding its claim, context
#: and captured output until committed (docs/performance.md, "The tree under 250 MB again").
FLUSH_AFTER = 64
#: An async handler given up by a hook (cancelled) that is still running after this long
#: ignored its cancellation: the worker is replaced, as for a sync one (seconds).
GIVE_UP_GRACE_S = 1.0


@dataclass(frozen=True)
class Crew:
    """The worker's long-lived parts a batch works with."""

    intake: Intake
    ledger: Ledger
    executor: Executor
    leases: Leases
    cancels: CancelWatch
    hooks: Hooks
    beat: Callable[[], None]
    fast_s: float  # worker.fast_handler_ms, in seconds
    max_result_bytes: int
    listen_for_cancel: bool
    log_capture_bytes: int  # worker.log_capture_bytes: the tail of each attempt's output kept
    # ctx.upstream of a claim: what it carries, with views paging what it left out (issue 22)
    upstream: Callable[[Claim], Mapping[str, Any]] = lambda claim: claim.upstream


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
        self.held_up = False  # a sync handler was slow: what waited behind it was handed back
        self._failure: FlowForgeError | None = None  # an overtaking claim failed: raised last
        # the lowest band the batch's deliveries came on (claims without any: band 0), which
        # a delivery must be above to overtake the rest of the batch
        self._floor = min((d.band for d in ack), default=0)
        self._withdrawn: set[int] = set()  # id() of the jobs handed back before they started
        self._recorded: set[int] = set()  # id() of the jobs whose outcome is recorded early
        self._tasks: list[_Task] = []  # the batch's tasks, in the order they are waited for
        self._next = 0  # the first of them not waited for yet
        self._top_up: TopUp | None = None  # set while the batch rolls
        self._roll_until = 0.0  # while no call is slow, it rolls until then
        self._slow = False  # a call outlasted its limit: outcomes harvested as they end
        self._consuming = True  # while a slow batch rolls: its consumer is on
        self._open = len(claims)  # claims of the batch neither committed nor handed back
        # what the batch cost (cost()): its sync handlers' time (s), its payload (bytes)
        self._busy_s = 0.0
        self._payload_bytes = 0
        self._claimed = 0
        self._rolled = False

    def run(
        self, then: Then, overtake: Overtake | None = None, top_up: TopUp | None = None
    ) -> bool:
        """Run, ack and finish the batch; True if a handler was slow (the rest handed back).

        ``overtake``: asked between two tasks (and after the last) for claims of deliveries of
        a band above the batch's that came in meanwhile; they run next (see :meth:`_overtake`).
        ``top_up``: asked while a batch of async calls only rolls (module docstring).
        """
        tasks = self._tasks = self._prepare(self._claims)
        self._crew.executor.submit([t.job for t in tasks])
        if top_up is not None and tasks and all(t.job.asynchronous for t in tasks):
            self._ack()  # claims committed: the next deliveries may come in while they run
            self._top_up = top_up
            self._rolled = True
            self._roll_until = time.monotonic() + ROLL_S
        slow = False
        while self._next < len(self._tasks):
            self._forget()
            task = self._tasks[self._next]
            self._next += 1
            if id(task.job) in self._withdrawn or id(task.job) in self._recorded:
                continue  # handed back behind a slow handler, or ended while it ran
            # A job behind a slow one that the handler thread started before the hand-back
            # withdrew the rest could not be handed back: it is waited for like any other.
            # After a sync job was abandoned, the jobs left are async ones already running
            # (every other was withdrawn): they are waited for too.
            if not self._wait(task):
                slow = True
            elif overtake is not None and not slow and self._failure is None:
                self._overtake(overtake)
        self._ack()
        self._flush(then if not slow else None)
        self._check_released(self._tasks)
        if self._failure is not None:
            raise self._failure
        return slow

    def cost(self) -> BatchCost:
        """What the batch cost, which its worker's window follows (:meth:`Intake.settle
        <flowforge.roles.intake.Intake.settle>`): its sync handlers' time (seconds), its
        payload — its claims' (:attr:`Claim.payload_bytes
        <flowforge.domain.model.Claim.payload_bytes>`) and what each outcome holds until the
        finish commits (:func:`_held`) — and how many claims it ran. A batch that rolled says
        nothing here: its calls ran side by side, its window is ``async_concurrency``'s, and
        it committed every :data:`FLUSH_AFTER` outcomes."""
        if self._rolled:
            return BatchCost()
        return BatchCost(self._busy_s, self._payload_bytes, self._claimed)

    def _forget(self) -> None:
        """Drop the tasks waited for already once there are :data:`FORGET_AFTER` of them (a
        batch rolling for long would otherwise keep every input, result and captured output
        it ever ran). Their outcomes are recorded, and their ids leave the sets that name jobs
        by id, which a new job may reuse once the old one is gone."""
        if self._next < FORGET_AFTER:
            return
        done, self._tasks = self._tasks[: self._next], self._tasks[self._next :]
        self._next = 0
        for task in done:
            self._recorded.discard(id(task.job))
            self._withdrawn.discard(id(task.job))

    def _prepare(self, claims: Sequence[Claim]) -> list[_Task]:
        """The handler calls of ``claims``, their leases held; a claim without a handler here
        is recorded as failed at once."""
        crew = self._crew
        crew.hooks.after_claim(claims)
        tasks: list[_Task] = []
        self._claimed += len(claims)
        for claim in claims:
            self._payload_bytes += claim.payload_bytes
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
                    crew.upstream(claim),
                    claim.attempt,
                    claim.task_run_id,
                    claim.run_id,
                    claim.name,
                    item=claim.item,
                    index=claim.index,
                    output=AttemptOutput(crew.log_capture_bytes),
                )
                tasks.append(_Task(claim, Job(handler, ctx, claim.timeout_s)))
        crew.leases.hold([(t.claim, t.job.ctx) for t in tasks])
        return tasks

    def _overtake(self, overtake: Overtake) -> None:
        """Claim what a band above the batch's delivered while it ran, and run it next: the
        jobs not started yet are taken back and submitted again behind it (their claims stay
        held, their leases renewing). Its deliveries join the batch's ack: still exact per
        band, as a band's deliveries are taken in the order they came. Should the claim fail
        (an outage), the batch still finishes what it ran, then raises it (the role
        reconnects; the broker requeues the deliveries taken, which are never acked)."""
        try:
            claims, taken = overtake(self._floor, self._open)
        except FlowForgeError as exc:
            self._failure = exc
            return
        if not taken:
            return
        self._pending_ack = [*self._pending_ack, *taken]
        self._open += len(claims)
        ahead = self._prepare(claims)
        if not ahead:
            return
        waiting = {id(job) for job in self._crew.executor.withdraw()}
        # the jobs the handler thread started already stay ahead: the list is the run order
        tasks, index = self._tasks, self._next
        while index < len(tasks) and id(tasks[index].job) not in waiting:
            index += 1
        tasks[index:index] = ahead
        self._crew.executor.submit([t.job for t in tasks[index:]])
        logger.debug(
            "%d task(s) of a higher priority band run before %d of this batch",
            len(ahead),
            len(waiting),
            extra={"action": "overtaken"},
        )

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

    def _wait(self, task: _Task) -> bool:
        """Wait for one job and record its outcome; False if it outlasted fast_handler_ms
        (or a hook gave it up): then everything behind it was handed back."""
        crew, job = self._crew, task.job
        fast_s = max(crew.fast_s, ASYNC_SLOW_S) if job.asynchronous else crew.fast_s
        fast = True
        while not job.done.is_set():
            started = job.started
            if started is None:  # not picked up yet: it cannot have been slow so far
                self._pause(job, fast_s)
                continue
            elapsed = time.monotonic() - started
            said = crew.hooks.while_running(task.claim, elapsed)
            given_up = isinstance(said, Finish)
            if fast and (elapsed > fast_s or given_up):
                fast = False
                self.held_up = self.held_up or not job.asynchronous
                if crew.listen_for_cancel:
                    crew.cancels.start()  # a cancel now reaches it at once, not at renewal
                self._hand_back(self._tasks[self._next :])
            if isinstance(said, Finish):
                self._outcomes.append((task.claim, captured(job, said)))
                self._give_up(job)
                return False
            budget = fast_s - elapsed if fast else PUMP_INTERVAL_S
            if said is not None:
                budget = min(budget, said)
            if self._pause(job, max(budget, 0.0)):
                break
            if not fast:
                crew.intake.serve()  # the leases are the keeper thread's (roles/lease.py)
                crew.beat()
                self._harvest(self._tasks[self._next :])
        self._record(task)
        if self._top_up is not None and len(self._outcomes) >= FLUSH_AFTER:
            self._ack()  # ack, then commit, as the batch's end does (an overtake's deliveries)
            self._flush(None)
        return fast

    def _pause(self, job: Job, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``job`` to end; True if it did. While the batch rolls,
        any call's end wakes it, and the slots freed are filled (:meth:`_roll`)."""
        if self._top_up is None:  # also after a hand-back: the slow path does not roll
            return job.done.wait(seconds)
        self._roll(seconds)
        return job.done.is_set()

    def _roll(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a call to end, then fill the free slots with what came in
        meanwhile: claimed, acked, and run as tasks of this batch."""
        loop = self._crew.executor.loop
        loop.freed.wait(wait_s)
        loop.freed.clear()  # before looking: a call ending from now on wakes the next wait
        if self._top_up is None:
            return
        free = loop.free()
        if self._slow:
            if not self._consume_while(free > 0):
                return
        elif free <= 0 or time.monotonic() > self._roll_until:
            return
        try:
            claims, taken = self._top_up(free, self._open)
        except FlowForgeError as exc:  # as for an overtake: finish what runs, then raise
            self._failure, self._top_up = exc, None
            return
        if not taken:
            return
        self._pending_ack = [*self._pending_ack, *taken]
        self._open += len(claims)
        more = self._prepare(claims)
        self._tasks.extend(more)
        self._crew.executor.submit([t.job for t in more])
        self._ack()
        if not all(t.job.asynchronous for t in more):
            self._top_up = None  # a sync call: the batch is an ordinary one from now on

    def _consume_while(self, room: bool) -> bool:
        """A slow batch rolling: consume while a slot is free (``room``), and with every slot
        busy hand back what came in and stop, so that no delivery waits here for calls that
        may last long. True if the consumer is on."""
        intake = self._crew.intake
        if room and not self._consuming:
            intake.resume()  # what it brings is taken at the next turn
        elif not room and self._consuming:
            intake.hand_back()
        self._consuming = room
        return room

    def _record(self, task: _Task) -> None:
        """Record the outcome of a job that ended."""
        job = task.job
        assert job.started is not None
        # its own end, not this moment: the main thread comes to each job after a wake-up
        # (a GIL switch), which summed over a batch would pass for handler time
        duration_s = (job.ended or time.monotonic()) - job.started
        finish = classify(job, self._crew.max_result_bytes)
        self._busy_s += 0.0 if job.asynchronous else duration_s
        self._payload_bytes += _held(finish)
        self._crew.hooks.after_execute(task.claim, finish, duration_s)
        self._outcomes.append((task.claim, finish))
        self._recorded.add(id(job))

    def _harvest(self, behind: Sequence[_Task]) -> None:
        """While a slow handler runs: record and commit the calls behind it that ended
        (async ones run meanwhile), so their tasks do not wait for it, and forget them."""
        ended = [
            t
            for t in behind
            if t.job.done.is_set()
            and id(t.job) not in self._recorded
            and id(t.job) not in self._withdrawn
        ]
        for t in ended:
            self._record(t)
        if not ended:
            return
        self._flush(None)
        # done with them: a batch rolling on behind one long call holds only what runs
        gone = {id(t.job) for t in ended}
        self._tasks[self._next :] = [t for t in self._tasks[self._next :] if id(t.job) not in gone]
        self._recorded -= gone

    def _give_up(self, job: Job) -> None:
        """A hook gave ``job`` up (its outcome is recorded): an async call is cancelled; a
        sync one, or an async one still running after :data:`GIVE_UP_GRACE_S`, cannot be
        stopped, so the worker must be replaced once the batch is done."""
        self._recorded.add(id(job))
        if job.asynchronous:
            self._crew.executor.cancel(job)
            if job.done.wait(GIVE_UP_GRACE_S):
                return
        self.abandoned = True

    def _hand_back(self, behind: Sequence[_Task]) -> None:
        """A slow handler holds this worker: ack, commit what ended, give back what waits
        and, unless the batch rolls on (its consumer follows its free slots then:
        :meth:`_consume_while`), stop consuming and requeue what came in."""
        crew = self._crew
        self._slow = True
        withdrawn = {id(job) for job in crew.executor.withdraw()}
        self._withdrawn |= withdrawn
        unstarted = [t.claim for t in behind if id(t.job) in withdrawn]
        if self._top_up is None:
            crew.intake.hand_back()
        self._ack()
        self._flush(None)
        if unstarted:
            self._open -= len(unstarted)
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
        self._open -= len(outcomes)
        finished = self._crew.ledger.finish(outcomes, then)
        if finished is None:
            return
        claimed = {claim.task_run_id for claim in finished.claimed}
        self.claimed.extend(finished.claimed)
        self.ready.extend(pair for pair in finished.ready if pair[0] not in claimed)


def _held(finish: Finish) -> int:
    """What an outcome holds until its batch's finish commits, in characters: its result as
    JSON and the output its attempt wrote (up to ``worker.log_capture_bytes``); an error and
    a traceback are cut short (domain/values.py) and not counted."""
    result = len(finish.result) if isinstance(finish.result, str) else 0
    found = finish.captured.output if finish.captured is not None else None
    return result + (len(found.text) if found is not None else 0)
