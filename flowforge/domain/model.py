"""Read models: immutable snapshots of runs, task runs, attempts and counts of the whole system,
as the store returns them (``store/rows.py`` maps the rows, ``views.py`` the JSON)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any
from uuid import UUID

from flowforge.domain.conditions import RunIf
from flowforge.domain.output import Captured, Progress
from flowforge.domain.reasons import FailureReason, RunFailureReason
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.errors import InvalidIdError


@dataclass(frozen=True)
class TaskRun:
    """One task of one run, as last committed."""

    id: UUID
    run_id: UUID
    name: str
    handler: str
    state: TaskState
    attempt: int
    max_attempts: int
    fencing_token: int
    failure_reason: FailureReason | None
    last_error: str | None
    result: Any
    idempotency_key: str | None
    ordering_key: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    retry_at: datetime | None
    cancel_requested: bool
    created_at: datetime
    ready_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    depends_on: tuple[str, ...] = ()
    sleep_s: float | None = None  # a durable timer: how long it sleeps (seconds)
    wake_at: datetime | None = None  # a sleeping (or woken) timer: when it succeeds
    for_each: str | None = None  # a map task: the upstream task it maps over
    item_counts: Mapping[str, int] | None = None  # a map task: its items by state (run reads)
    map_id: UUID | None = None  # a map's item: its map task run (task reads)
    item_index: int | None = None  # a map's item: its position from 0 (task reads)
    event_name: str | None = None  # a wait_for_event task: the event it waits for
    event_key: str | None = None  # ... and its key, rendered from the run input
    run_if: RunIf = RunIf.ALL_SUCCEEDED  # its condition on its dependencies (SPEC 7.3)
    cancel_cause: CancelCause | None = None  # why it was cancelled (condition_not_met: skipped)
    child_workflow: str | None = None  # a child-workflow task: the workflow it starts
    child_run_id: UUID | None = None  # ... and the child run of its latest attempt
    queue: str | None = None  # the broker queue its messages go to (None: unassigned, 0014)
    concurrency_key: str | None = None  # its concurrency key, rendered (None: no limit)
    concurrency_limit: int | None = None  # ... and the slots of that key
    rate_key: str | None = None  # its rate key, rendered (None: no rate limit)
    rate_limit: int | None = None  # ... the starts it allows per window
    rate_per_s: float | None = None  # ... and the window, in seconds
    breaker_key: str | None = None  # its circuit breaker's key, rendered (None: the handler's)
    waiting_on: str | None = None  # why it waits (SPEC 7.4): start_at, timer, event, concurrency,
    # rate_limit
    priority: int = 0  # 0..9, higher first within its queue (migration 0019)
    progress: Progress | None = None  # its current attempt's last ctx.progress (0021)

    @property
    def skipped(self) -> bool:
        """A ``run_if`` skip (or downstream of skips only): CANCELLED, not a failure."""
        return self.cancel_cause is CancelCause.CONDITION_NOT_MET


@dataclass(frozen=True)
class ChildRun:
    """A child run one attempt of a child-workflow task started (sub-workflows)."""

    task: str | None  # the task's name (None if its parent run is gone)
    task_run_id: UUID
    attempt: int
    run_id: UUID
    workflow: str
    state: RunState


@dataclass(frozen=True)
class Run:
    """A workflow run with its task runs (in creation order).

    ``start_at``: a delayed run's start time (SCHEDULED until then); ``deadline_at``: when an
    unfinished run is ended; ``failure_reason``: why the run itself was ended
    (``deadline_exceeded``), None otherwise. All instants are the database's.
    """

    id: UUID
    workflow: str
    state: RunState
    input: Mapping[str, Any]
    idempotency_key: str | None
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    tasks: tuple[TaskRun, ...] = ()
    start_at: datetime | None = None
    deadline_at: datetime | None = None
    failure_reason: RunFailureReason | None = None
    schedule: str | None = None  # the schedule that made the run (None: triggered by a caller)
    fire_time: datetime | None = None  # the fire time it was made for (a manual fire's instant)
    parent_run_id: UUID | None = None  # a child run: the run whose task started it
    parent_task_id: UUID | None = None  # ... and that task run
    children: tuple[ChildRun, ...] = ()  # the child runs its tasks started (run reads)

    def task(self, name: str) -> TaskRun:
        """The task run called ``name``; KeyError if the run has none."""
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(name)

    @property
    def compensated(self) -> tuple[str, ...]:
        """Names of the compensation steps (``run_if: any_failed``) that SUCCEEDED: what was
        compensated for the failure (the run still ends FAILED)."""
        return tuple(
            t.name
            for t in self.tasks
            if t.run_if is RunIf.ANY_FAILED and t.state is TaskState.SUCCEEDED
        )


@dataclass(frozen=True)
class Rerun:
    """What ``rerun`` did: the run after it, the task runs it reset (ids and names, in one
    order) and the state the run had finished in."""

    run: Run
    task_ids: tuple[UUID, ...]
    task_names: tuple[str, ...]
    previous_state: RunState


@dataclass(frozen=True)
class RerunEntry:
    """One rerun of a finished run, as recorded in ``rerun_audit``."""

    requested_by: str
    reason: str | None
    from_task: str | None
    previous_state: RunState
    task_run_ids: tuple[UUID, ...]
    task_names: tuple[str, ...]
    requested_at: datetime


@dataclass(frozen=True)
class Attempt:
    """The history of one attempt (attempts are numbered from 1)."""

    task_run_id: UUID
    attempt: int
    fencing_token: int
    worker: str | None
    started_at: datetime
    finished_at: datetime | None
    outcome: str
    failure_reason: FailureReason | None
    error: str | None
    traceback: str | None


@dataclass(frozen=True)
class TriggerResult:
    """The run a trigger produced; ``created`` is False when an idempotency key replayed it.

    ``run``: the run as the trigger wrote it, when asked for (``with_run``) and known from the
    write, else None (read it back). Not part of the result's equality."""

    run_id: UUID
    created: bool
    run: Run | None = field(default=None, compare=False, repr=False)


#: ``worker.upstream_inline_items``'s default: upstream tasks, and elements of one upstream
#: list, a claim carries inline at most (issue 22).
DEFAULT_UPSTREAM_INLINE = 1000
#: ``worker.upstream_page_items``'s default: elements (or upstream tasks) per page fetched.
DEFAULT_UPSTREAM_PAGE = 500


@dataclass(frozen=True)
class LargeUpstream:
    """An upstream task's list result too long to travel inline with a claim (issue 22):
    ``task_run_id`` names the upstream task, ``length`` its elements; ``items`` when it is a
    map, whose elements are read from its items' rows rather than from its stored list."""

    task_run_id: UUID
    length: int
    items: bool = False


@dataclass(frozen=True)
class Claim:
    """What a worker holds after a successful claim: enough to run the handler and finish.

    ``upstream`` holds the upstream results that travel inline; ``upstream_large`` the lists
    left out of it for their length; ``upstream_deferred`` the number of upstream tasks when
    there were too many to carry any (``upstream`` is then empty): :mod:`flowforge.roles.upstream`
    pages what is left out (``worker.upstream_inline_items``)."""

    task_run_id: UUID
    run_id: UUID
    name: str
    handler: str
    attempt: int
    fencing_token: int
    input: Mapping[str, Any]
    upstream: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    idempotency_key: str | None = None
    dispatch_lag_s: float = 0.0  # READY → claimed, by the database clock
    workflow: str = ""  # the run's workflow name (for log lines)
    item: Any = None  # a map item's element of the upstream list (for_each), else None
    index: int | None = None  # a map item's position from 0, else None
    upstream_large: Mapping[str, LargeUpstream] = field(default_factory=dict)
    upstream_deferred: int | None = None
    # the input, item and inline upstream results as JSON text (bytes, as received: never
    # their compressed stored size): what the worker's window follows besides time
    payload_bytes: int = 0


class ClaimOutcome(StrEnum):
    EXECUTE = "execute"  # run the handler
    REUSED = "reused"  # the idempotency key had a result: the task SUCCEEDED without running
    DEFERRED = "deferred"  # the key is held by a live execution: retry later, no attempt used
    LOST = "lost"  # not READY with that token any more (duplicate or stale delivery)


@dataclass(frozen=True)
class ClaimResult:
    outcome: ClaimOutcome
    claim: Claim | None = None


@dataclass(frozen=True)
class Finish:
    """How a task run's attempt ended, as the worker reports it."""

    state: TaskState
    result: Any = None
    reason: FailureReason | None = None
    error: str | None = None
    traceback: str | None = None
    captured: Captured | None = None  # the attempt's output and progress, if it had any


@dataclass(frozen=True)
class Continuation:
    """A finish that also claims, in its own transaction, up to ``limit`` of the dependents it
    makes READY (those without an idempotency key) for ``worker``, leased for ``lease_s``."""

    worker: str
    lease_s: float
    limit: int


@dataclass(frozen=True)
class Finished:
    """What a batch of finishes did: the task runs that committed (the rest were stale), the
    dependents made READY, as (task run, token) pairs a worker may claim itself, and those of
    them a :class:`Continuation` already claimed (their READY token is in ``ready`` too).
    ``queued``: the outbox rows the finish wrote (one per dependent made READY, on any queue);
    ``unpublished``: how many of them no notification told the publisher of yet (the caller
    that claims them in the same transaction tells it of the rest)."""

    committed: frozenset[UUID]
    ready: tuple[tuple[UUID, int], ...] = ()
    claimed: tuple[Claim, ...] = ()
    queued: int = 0
    unpublished: int = 0


@dataclass(frozen=True)
class PassReport:
    """What one scheduler pass changed, by kind of work."""

    promoted: int = 0
    routed: int = 0
    reaped: int = 0
    propagated: int = 0
    started: int = 0  # delayed runs started
    timers: int = 0  # durable timers started or woken
    expired: int = 0  # runs ended by their deadline
    fired: int = 0  # schedules whose due fire times were decided
    maps: int = 0  # map tasks expanded, buried or settled, and item slots opened
    events: int = 0  # event waits started (or delivered at once) or timed out
    conditions: int = 0  # run_if tasks decided (gate opened or skipped)
    children: int = 0  # child-workflow tasks started (or buried) or settled
    admitted: int = 0  # tasks with a concurrency or rate key admitted to READY
    unparked: int = 0  # parked tasks a breaker or pause no longer holds (probes included)

    @property
    def total(self) -> int:
        return (
            self.promoted
            + self.routed
            + self.reaped
            + self.propagated
            + self.started
            + self.timers
            + self.expired
            + self.fired
            + self.maps
            + self.events
            + self.conditions
            + self.children
            + self.admitted
            + self.unparked
        )


@dataclass(frozen=True)
class Routed:
    """One task the scheduler moved on from FAILED (routing) or RUNNING (an expired lease),
    as committed: ``state`` is RETRYING (``delay_s`` seconds of backoff), DEAD or CANCELLED."""

    task_run_id: UUID
    run_id: UUID
    workflow: str
    task: str
    attempt: int
    source: TaskState
    state: TaskState
    reason: FailureReason
    delay_s: float = 0.0


def parse_id(value: UUID | str, what: str = "id") -> UUID:
    """``value`` as a UUID; :class:`InvalidIdError` for anything malformed."""
    if isinstance(value, UUID):
        return value
    try:
        return UUID(str(value))
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidIdError(f"malformed {what} {str(value)[:80]!r}: expected a UUID") from exc


@dataclass(frozen=True)
class Dispatch:
    """One pending outbox row: publish a message naming this task run and generation to
    ``queue`` (None: a row from before migration 0014: the publisher's own ``broker.queue``),
    in the band of ``priority`` (migration 0019)."""

    outbox_id: int
    task_run_id: UUID
    fencing_token: int
    queue: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class ProcessInfo:
    """A registered role process (from the registry, by the database clock)."""

    id: UUID
    host: str
    pid: int
    role: str
    started_at: datetime
    last_seen_at: datetime
    silent_s: float
    queue: str | None = None  # a worker: the queue it consumes


@dataclass(frozen=True)
class DeadTask(TaskRun):
    """A DEAD task run with the workflow of its run (what the dead-task lists show)."""

    workflow: str = ""


@dataclass(frozen=True)
class DeadFilter:
    """Which dead tasks an operator means; a None field matches everything."""

    reason: FailureReason | None = None
    workflow: str | None = None
    handler: str | None = None


@dataclass(frozen=True)
class AuditEntry:
    """One operator action on a task, as audited: a requeue (``requeue_audit``, with the
    reason it had died with) or a cancel, retry-now or bury (``task_audit``); the states it
    went from and to (a task asked to stop stays RUNNING until it stops)."""

    requested_by: str
    reason: str | None
    previous_reason: str | None
    attempt: int
    requested_at: datetime
    action: str = "requeue"
    previous_state: str | None = None
    new_state: str | None = None


@dataclass(frozen=True)
class TaskDetail:
    """One task run with everything an operator inspects: its attempts, the run input it was
    given, the results of its upstream tasks and its requeue history."""

    task: TaskRun
    workflow: str
    run_state: RunState
    input: Mapping[str, Any]
    upstream: Mapping[str, Any]
    attempts: tuple[Attempt, ...]
    audit: tuple[AuditEntry, ...]


@dataclass(frozen=True)
class BulkRequeue:
    """The outcome of requeueing every dead task matching a filter.

    ``matched`` counts all matches; at most ``limit`` of them were taken this time, and those
    in ``requeued`` were requeued (with an audit row each). ``skipped`` were no longer DEAD
    when their turn came (requeued or deleted meanwhile). A dry run changes nothing.
    """

    matched: int
    limit: int
    dry_run: bool
    requeued: tuple[UUID, ...] = ()
    skipped: tuple[UUID, ...] = ()


@dataclass(frozen=True)
class DeadPurge:
    """What one batch of ``flowforge purge --dead`` deleted — or, for a dry run, would delete.

    ``runs`` and ``tasks`` count whole runs and all their task runs; ``dead_task_ids`` are the
    DEAD ones among them. ``released_streams`` are the ordering keys no DEAD ``on_dead: block``
    task holds any more once they are gone. ``shown`` lists some of the dead tasks (a dry run's
    preview, oldest death first: id, run_id, workflow, name, handler, failure_reason,
    finished_at).
    """

    runs: int = 0
    tasks: int = 0
    dead_task_ids: tuple[UUID, ...] = ()
    released_streams: tuple[str, ...] = ()
    shown: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class FinishedMinute:
    """Task runs that reached a final state within one minute (by the database clock)."""

    minute: datetime
    succeeded: int
    dead: int
    cancelled: int


@dataclass(frozen=True)
class RetryBacklog:
    """Task runs waiting in RETRYING: how many, and when the first and the last are due."""

    n: int = 0
    next_at: datetime | None = None
    latest_at: datetime | None = None


@dataclass(frozen=True)
class PoisonCandidate:
    """An unfinished task run that has used many attempts already."""

    id: UUID
    run_id: UUID
    name: str
    handler: str
    state: TaskState
    attempt: int
    failure_reason: FailureReason | None
    workflow: str


@dataclass(frozen=True)
class OutboxBacklog:
    """Outbox rows not yet confirmed, and the age of the oldest in seconds (0 when none)."""

    pending: int = 0
    oldest_s: float = 0.0


@dataclass(frozen=True)
class QueueLoad:
    """One task queue: its READY task runs and the live workers consuming it. ``queue`` None
    stands for task runs on no queue (migration 0014) and workers that record none."""

    queue: str | None
    ready: int
    consumers: int
    # ready is more than the caller's count cap: it reads cap + 1 (migration 0024)
    estimated: bool = False

    @property
    def unserved(self) -> bool:
        """READY tasks wait on a named queue that no live worker consumes (a warning)."""
        return self.queue is not None and self.ready > 0 and self.consumers == 0


@dataclass(frozen=True)
class LiveProcesses:
    """How many processes of one role on one host were seen lately."""

    host: str
    role: str
    n: int


@dataclass(frozen=True)
class DeadCount:
    """Dead task runs of one workflow, handler and failure reason."""

    workflow: str
    handler: str
    reason: FailureReason | None
    n: int


@dataclass(frozen=True)
class Overview:
    """The dashboard's overview (``GET /api/v1/overview``), read in one transaction.

    ``runs`` and ``tasks`` count by state, every state present; ``finished_per_minute`` covers
    the last hour, oldest first, every minute present; ``poison_candidates`` are bounded by the
    caller's limit; ``dead_by_reason`` counts DEAD task runs by reason (``unknown`` for none);
    ``processes`` are those seen within the caller's freshness.
    """

    runs: Mapping[str, int]
    tasks: Mapping[str, int]
    finished_per_minute: tuple[FinishedMinute, ...]
    retry_backlog: RetryBacklog
    poison_candidates: tuple[PoisonCandidate, ...]
    dead_by_reason: Mapping[str, int]
    outbox: OutboxBacklog
    processes: tuple[LiveProcesses, ...]
    queues: tuple[QueueLoad, ...] = ()  # READY tasks and live consumers per queue
    # the states of ``runs`` and ``tasks`` whose count is PostgreSQL's estimate, not a count:
    # more than the caller's cap (docs/operations.md "Counts above 100,000")
    estimated_runs: frozenset[str] = frozenset()
    estimated_tasks: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Stats:
    """``flowforge stats``: task runs by attempts used (``{attempts: task runs}``), failure
    reasons of all attempts, the retry backlog, poison candidates and dead task runs."""

    attempts: Mapping[int, int]
    failure_reasons: Mapping[str, int]
    retry_backlog: RetryBacklog
    poison_candidates: tuple[PoisonCandidate, ...]
    dead: tuple[DeadCount, ...]
    queues: tuple[QueueLoad, ...] = ()  # READY tasks and live consumers per queue
    attempts_estimated: bool = False  # ``attempts`` is PostgreSQL's estimate (a big table)
    # ``dead`` counts only the newest this many dead task runs: there are more (None: all)
    dead_newest_only: int | None = None


@dataclass(frozen=True)
class FireRecord:
    """One decision about a schedule's fire time, as stored: ``outcome`` ``created`` (a run,
    ``run_id``) or ``skipped`` for ``reason`` (a span up to ``last_fire_time``); ``manual``
    for a fire by hand, outside the timetable."""

    schedule: str
    fire_time: datetime
    outcome: str
    reason: str | None = None
    last_fire_time: datetime | None = None
    manual: bool = False
    run_id: UUID | None = None
    decided_at: datetime | None = None


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as the operator sees it (``flowforge schedules list``).

    ``state`` is ``active``, ``paused`` or ``retired`` (gone from the workflow files);
    ``spec`` is the stored timetable and policies; ``last_run_state`` is the state of the last
    run a fire made (None if none, or purged); ``last_decision`` the latest fire decision."""

    name: str
    workflow: str
    spec: Mapping[str, Any]
    state: str
    next_fire_at: datetime | None
    last_fire_at: datetime | None
    last_run_id: UUID | None
    last_run_state: RunState | None
    last_decision: FireRecord | None
    paused_at: datetime | None = None
    retired_at: datetime | None = None
    created_at: datetime | None = None


@dataclass(frozen=True)
class ScheduleSync:
    """What a scheduler's sync of its workflow files changed: schedules added, changed (their
    next fire time recomputed) and retired."""

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()


@dataclass(frozen=True)
class ManualFire:
    """A run started by hand from a schedule (``flowforge schedules trigger``)."""

    schedule: str
    run_id: UUID
    fire_time: datetime


@dataclass(frozen=True)
class MapItem:
    """One item of a map task (``for_each``): its element of the list and how it went.
    ``waiting_on``: why it waits, as a task's (``concurrency``, ``rate_limit`` for an item
    held by its key; None otherwise)."""

    id: UUID
    index: int
    state: TaskState
    attempt: int
    failure_reason: FailureReason | None
    last_error: str | None
    item: Any
    result: Any
    idempotency_key: str | None
    started_at: datetime | None
    finished_at: datetime | None
    waiting_on: str | None = None


@dataclass(frozen=True)
class MapPage:
    """A map task, its items counted by state (all of them, whatever the page's filter), and
    one page of its items in item order.

    ``next_cursor``: the opaque cursor that reads the next page
    (:func:`~flowforge.domain.maps.item_cursor`); None on the last page.
    """

    task: TaskRun
    counts: Mapping[str, int]
    items: tuple[MapItem, ...]
    next_cursor: str | None


@dataclass(frozen=True)
class WokenTask:
    """A waiting task an event woke (it SUCCEEDED with the event's data as its result)."""

    run_id: UUID
    task_run_id: UUID
    task: str


@dataclass(frozen=True)
class EventSent:
    """An event as stored (``id``, ``created_at`` by the database clock) and the waiting tasks
    it woke at once; a wait that starts later (within ``events.retention``) receives it then."""

    id: int
    name: str
    key: str
    created_at: datetime
    woke: tuple[WokenTask, ...] = ()
