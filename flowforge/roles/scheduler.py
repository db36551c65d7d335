"""The scheduler role: runs the store's passes continuously.

A pass reaps expired leases, routes failed attempts, applies the consequences of finished tasks
(release dependents, fail-fast, run states), ends runs past their deadline, starts delayed runs
whose time came, starts and wakes durable timers, starts and settles child runs of
child-workflow tasks, and promotes READY tasks with their outbox rows.
Each retry, death and cancellation it decides is logged once (:mod:`flowforge.roles.tasklog`).
It also fires the schedules of the workflows in the config's files (SPEC 7.2): it syncs them
into the ``schedules`` table at :meth:`Scheduler.initialize` (so SIGHUP's rolling restart is
a reload) and decides their due fire times in every pass (:mod:`flowforge.store.schedules`).
While passes find work they repeat at once; then the scheduler waits for a NOTIFY (a trigger or
a finished task), a stop (:class:`~flowforge.roles.stopping.Stop`) or the poll interval — or
less, when a start time, a timer's wake-up or a deadline (by the database clock) comes sooner.
Several schedulers at once are safe: every step locks its batch with ``FOR UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from flowforge.config import Config
from flowforge.discovery import check_config
from flowforge.domain.breakers import BreakerState, Transition, breaker_name
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.model import FireRecord, PassReport, Routed
from flowforge.domain.states import TaskState
from flowforge.roles import tasklog
from flowforge.roles.presence import Presence
from flowforge.roles.retention import RetentionPacing
from flowforge.roles.stopping import stop_fd, wait_readable
from flowforge.store.breakers import Gates
from flowforge.store.children import Children
from flowforge.store.db import Database
from flowforge.store.events import Events
from flowforge.store.limits import Limits
from flowforge.store.maps import Maps
from flowforge.store.notify import SCHEDULER_CHANNEL, Listener
from flowforge.store.passes import Passes
from flowforge.store.processes import Processes
from flowforge.store.schedules import Schedules
from flowforge.telemetry import Telemetry

logger = logging.getLogger(__name__)

#: A registration silent this long belongs to a dead process (seconds).
SILENT_PROCESS_AGE_S = 300.0
SECONDS_PER_DAY = 86_400.0
#: Shortest wait between passes that found nothing to do (seconds).
MIN_WAIT_S = 0.01


class SchedulerStatements(Passes, Processes, Schedules, Maps, Events, Children, Limits, Gates):
    """The scheduler's part of the store: its passes, the process registry, the schedules, the
    map tasks, the event waits, the child-workflow tasks."""


class Scheduler:
    """The scheduler role (see module docstring). Nothing is opened before :meth:`initialize`."""

    title = "Scheduler"

    def __init__(
        self,
        config: Config,
        telemetry: Telemetry | None = None,
        workflows: tuple[WorkflowDef, ...] = (),
    ) -> None:
        self._config = config
        self._extra = workflows  # beside the config's files (tests, Python-defined workflows)
        self._workflows: dict[str, WorkflowDef] = {}
        self._telemetry = telemetry or Telemetry()
        self._db = Database(config.database, application_name="flowforge-scheduler")
        self._repo = SchedulerStatements(self._db)
        self._listener = Listener(config.database, SCHEDULER_CHANNEL)
        self._presence = Presence(self._repo, "scheduler")
        self._next_housekeeping = 0.0
        scheduler = config.scheduler
        self._retention = RetentionPacing(
            limit=scheduler.batch_size,
            interval_s=scheduler.housekeeping_interval_s,
            batch_s=scheduler.retention_batch_s,
            share=scheduler.retention_share,
        )

    def initialize(self) -> None:
        # A file (or a workflow module) with a problem must not stop the tree (a typo before
        # SIGHUP would take every role down): its workflows are left out, loudly; their
        # schedules are neither fired nor retired until it is fixed. `flowforge workflows
        # validate` lists the same problems.
        workflows, problems = check_config(self._config)
        for problem in problems:
            logger.error(
                "workflow file problem, its schedules are not fired: %s",
                problem,
                extra={"action": "workflow_invalid"},
            )
        workflows.update((w.name, w) for w in self._extra)
        self._db.open()
        self._listener.open()
        # a child task's run is made from its workflow's latest registered definition: every
        # workflow this tree loaded is registered, whoever triggers the parent
        self._repo.register_workflows(list(workflows.values()))
        synced = self._repo.sync(workflows)
        # only a workflow with schedules can have an active one (sync retired the others): a
        # tree without any asks nothing in its passes
        self._workflows = {name: w for name, w in workflows.items() if w.schedules}
        if synced.added or synced.changed or synced.retired:
            logger.info(
                "schedules synced: %d added, %d changed, %d retired (%s)",
                len(synced.added),
                len(synced.changed),
                len(synced.retired),
                ", ".join([*synced.added, *synced.changed, *synced.retired]),
                extra={"action": "schedules_synced"},
            )
        # last: the registry lists a scheduler once it is ready to run passes
        self._presence.announce()

    def loop(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        poll = self._config.scheduler.poll_interval_s
        stopped = stop_fd(stop)  # the wait ends at a stop, not at its poll
        while not stop.is_set():
            self._listener.drain()  # clear "work arrived" before looking, never after
            report = self.run_pass()
            self._presence.tick()
            beat()
            self._housekeeping()
            self._retain()
            if report.total == 0:
                # a NOTIFY makes the listener's socket readable; the drain above reads it
                wake = self._listener.fileno()
                wait_readable((wake,) if stopped is None else (wake, stopped), self._wait_s(poll))

    def _wait_s(self, poll: float) -> float:
        """How long to wait for a NOTIFY: the poll interval, or until the next start time,
        wake-up, deadline or fire time of this scheduler's schedules if sooner (never less than
        MIN_WAIT_S: a due item another scheduler holds locked is not spun on)."""
        due = self._repo.next_due_s(list(self._workflows))
        wait = poll if due is None else min(poll, max(due, MIN_WAIT_S))
        return min(wait, max(self._retention.wait_s(time.monotonic()), MIN_WAIT_S))

    def run_pass(self) -> PassReport:
        """One pass over every kind of work, each bounded by the batch size."""
        batch = self._config.scheduler.batch_size
        threshold = self._config.scheduler.crash_loop_threshold
        with self._telemetry.scheduler_pass.time():
            # the next level of a DAG waits on propagate → promote: they go first; deadlines
            # before starts, so a run already past its deadline is ended, not dispatched
            propagated = self._repo.propagate(batch)
            expired = self._repo.expire_deadlines(batch)
            started = self._repo.start_due_runs(batch)
            timers = self._repo.wake_timers(batch) + self._repo.start_timers(batch)
            # expand before settling: an empty list completes in the pass that expands it;
            # slots open before promote, which dispatches the items given one
            maps = (
                self._repo.expand_maps(batch)
                + self._repo.settle_maps(batch)
                + self._repo.open_item_slots(batch)
            )
            # timeouts before starts, as deadlines before starts: a wait past its timeout is
            # not taken for one that an event may still wake
            events = self._repo.expire_event_waits(batch) + self._repo.start_event_waits(
                batch, self._config.events.retention
            )
            # settle before start: a finished child frees its task (a failure is routed at
            # the end of this pass and its retry started by a later one)
            children = self._repo.settle_children(batch) + self._repo.start_children(batch)
            conditions = self._repo.evaluate_conditions(batch)  # opened gates: promoted now
            # breakers and pauses before promote: an unparked task (a probe too) is due now
            gated = self._repo.pass_gates(batch)
            _log_transitions(gated.transitions)
            promoted = self._repo.promote_ready(batch)
            admitted = self._repo.admit_gated(batch)  # tasks with a concurrency or rate key
            return PassReport(
                propagated=propagated,
                promoted=promoted,
                started=started,
                timers=timers,
                expired=expired,
                routed=self._repo.route_failed(batch, threshold, self._observe),
                reaped=self._repo.reap_expired(batch, threshold, self._observe),
                fired=self._fire(batch),
                maps=maps,
                events=events,
                conditions=conditions,
                children=children,
                admitted=admitted,
                unparked=gated.unparked + len(gated.transitions),
            )

    def _fire(self, batch: int) -> int:
        """Decide the due schedules (up to ``batch``); how many schedules were decided."""
        decided = self._repo.fire_due(self._workflows, batch, self._config.broker.queue)
        for record in decided:
            _log_fire(record)
        return len({r.schedule for r in decided})

    def _observe(self, event: Routed) -> None:
        """Count and log one committed routing or reaping decision (one line per task)."""
        if event.state is TaskState.RETRYING:
            self._telemetry.tasks_retried.labels(reason=str(event.reason)).inc()
        elif event.state is TaskState.DEAD:
            self._telemetry.tasks_dead.labels(reason=str(event.reason)).inc()
        tasklog.routed(logger, event)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + self._config.scheduler.housekeeping_interval_s
        # (finished runs and task keys: _retain, paced on its own)
        purged = self._repo.purge_fires(
            self._config.scheduler.retention_days * SECONDS_PER_DAY,
            self._config.scheduler.batch_size,
        )
        purged += self._repo.purge_events(
            self._config.events.retention, self._config.scheduler.batch_size
        )
        self._repo.redispatch_lost(
            self._config.scheduler.redispatch_after_s, self._config.scheduler.batch_size
        )
        forgotten = self._repo.forget_silent_processes(SILENT_PROCESS_AGE_S)
        if purged or forgotten:
            logger.info(
                "purged %d old row(s), forgot %d silent process(es)",
                purged,
                forgotten,
                extra={"action": "housekeeping"},
            )

    def _retain(self) -> None:
        """One retention batch if one is due (:class:`RetentionPacing` says when, and how
        big): finished runs without a DEAD task, published outbox rows, breaker and gate
        history, and task keys on their own clock. Logged once the purge has caught up."""
        if not self._retention.due(time.monotonic()):
            return
        started = time.monotonic()
        purged = self._repo.purge(
            self._config.scheduler.retention_days * SECONDS_PER_DAY,
            self._retention.limit,
            key_age_s=self._config.scheduler.idempotency_retention_days * SECONDS_PER_DAY,
        )
        ended = time.monotonic()
        caught_up = self._retention.done(ended, purged, ended - started)
        if caught_up:
            logger.info("retention purged %d old row(s)", caught_up, extra={"action": "retention"})

    def reset(self) -> None:
        self._listener.close()
        self._db.close()

    def shutdown(self) -> None:
        self._presence.leave()
        self.reset()


def _log_fire(record: FireRecord) -> None:
    """One line per committed decision: a run created, or fire times skipped and why."""
    if record.outcome == "created":
        logger.info(
            "schedule %s fired %s: run %s",
            record.schedule,
            record.fire_time.isoformat(),
            record.run_id,
            extra={"action": "schedule_fired"},
        )
        return
    span = (
        f"{record.fire_time.isoformat()} .. {record.last_fire_time.isoformat()}"
        if record.last_fire_time is not None and record.last_fire_time != record.fire_time
        else record.fire_time.isoformat()
    )
    logger.info(
        "schedule %s skipped %s (%s)",
        record.schedule,
        span,
        record.reason,
        extra={"action": "schedule_skipped"},
    )


def _log_transitions(moved: Sequence[Transition]) -> None:
    """Log each breaker transition once, whichever tree made it (the database row is the
    record; this scheduler's pass took it)."""
    for one in moved:
        level = logging.WARNING if one.to_state is BreakerState.OPEN else logging.INFO
        logger.log(
            level,
            "circuit %s: %s -> %s (%s)",
            breaker_name(one.handler, one.key),
            one.from_state,
            one.to_state,
            one.cause,
            extra={
                "action": "breaker_transition",
                "handler": one.handler,
                "breaker_key": one.key,
                "from_state": str(one.from_state),
                "to_state": str(one.to_state),
                "cause": one.cause,
            },
        )
