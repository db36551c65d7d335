"""The Python API for triggering and inspecting runs: :class:`Client`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any
from uuid import UUID

from flowforge.coalesce import Coalescer
from flowforge.config import Config
from flowforge.discovery import load_config_workflows
from flowforge.domain.children import referenced
from flowforge.domain.control import Controlled, KeyHold
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.model import (
    Attempt,
    EventSent,
    FireRecord,
    ManualFire,
    MapPage,
    Rerun,
    Run,
    ScheduleInfo,
    TaskRun,
    TriggerResult,
)
from flowforge.domain.output import AttemptLog
from flowforge.domain.plan import RunRequest
from flowforge.domain.states import TaskState
from flowforge.domain.timeline import TimelineFacts, TimelineLimits
from flowforge.errors import DefinitionError, UnknownWorkflowError
from flowforge.store.control import Control
from flowforge.store.db import Database
from flowforge.store.events import Events
from flowforge.store.maps import Maps
from flowforge.store.operator import Operator
from flowforge.store.schedules import Schedules
from flowforge.store.timelines import Timelines
from flowforge.store.triggers import Triggers
from flowforge.waiting import wait_for_run, wait_timeout


class ClientStatements(Triggers, Operator, Schedules, Events, Maps, Control, Timelines):
    """The client's part of the store: new runs, the operator's cancel and requeue (which
    answer with the read models of ``Reads``, :class:`Operator`'s base), schedules, events,
    a map's items, the control of single tasks, and a run's timeline."""


class Client:
    """Trigger, inspect, cancel and requeue runs.

    Workflows come from the config's ``workflows`` paths and ``workflow_modules`` plus any
    given here. The
    database pool opens on :meth:`open` (or entering the ``with`` block), never before.
    """

    def __init__(self, config: Config, workflows: Iterable[WorkflowDef] = ()) -> None:
        self._config = config
        self._extra = tuple(workflows)
        self._workflows: dict[str, WorkflowDef] | None = None
        self._db = Database(config.database, application_name="flowforge-client")
        self._store = ClientStatements(self._db)
        self._together = Coalescer(self._trigger_alone, self._trigger_together)

    @property
    def workflows(self) -> Mapping[str, WorkflowDef]:
        """Every known workflow by name (files are read on first use)."""
        if self._workflows is None:
            found = load_config_workflows(self._config)
            for workflow in self._extra:
                if workflow.name in found and found[workflow.name] != workflow:
                    raise DefinitionError(f"workflow {workflow.name!r} is defined twice")
                found[workflow.name] = workflow
            self._workflows = found
        return self._workflows

    @property
    def config(self) -> Config:
        return self._config

    @property
    def database(self) -> Database:
        """The connection pool :meth:`open` opens: the api builds the store parts it needs
        over it (``api/app.py``), so one process keeps one pool."""
        return self._db

    def open(self) -> Client:
        self._db.open()
        return self

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Client:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def trigger(
        self,
        workflow: str,
        input: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        *,
        start_at: datetime | None = None,
        delay: float | timedelta | None = None,
        deadline: float | timedelta | None = None,
        priority: int | None = None,
        with_run: bool = False,
    ) -> TriggerResult:
        """Start a run of ``workflow``; a replayed ``idempotency_key`` returns the same run.

        ``start_at`` (a datetime *with* a UTC offset) or ``delay`` (seconds, or a timedelta,
        counted on the database's clock) creates the run SCHEDULED until then; a start time
        more than a minute in the past (by the database's clock) is refused. ``deadline``
        (seconds or a timedelta) replaces the workflow's: past it, the run ends FAILED with
        reason ``deadline_exceeded``. Bad values raise :class:`~flowforge.errors.InputError`.
        A task whose workflow names no ``queue`` goes to this config's ``broker.queue``.
        ``priority`` (a whole number 0 to 9, higher first within a queue) replaces the
        ``priority`` of every task of the run, and of its child runs (None: each task keeps
        its workflow's, 0 by default). ``with_run``: the result's ``run`` is the run created,
        as :meth:`status` would answer right after the commit, built from what the trigger
        wrote, with no read (None when not created here, or when a task of it has a
        concurrency or rate key: read it with :meth:`status`).

        Thread-safe. Calls from several threads at once share transactions (group commit,
        ``flowforge/coalesce.py``): a call made while another's run is being committed goes,
        with every call made meanwhile, into the next commit; each still gets its own result
        or error, as alone. A lone call commits at once.
        """
        self._definition(workflow)  # an unknown workflow raises here, before any wait
        request = RunRequest(
            workflow,
            input,
            idempotency_key,
            start_at=start_at,
            delay=delay,
            deadline=deadline,
            priority=priority,
        )
        return self._together.trigger(request, with_run)

    def _trigger_alone(self, request: RunRequest, with_run: bool) -> TriggerResult:
        definition = self._definition(request.workflow)
        return self._store.trigger(
            definition,
            request.input,
            request.idempotency_key,
            start_at=request.start_at,
            delay=request.delay,
            deadline=request.deadline,
            children=referenced(definition, self.workflows),
            queue=self._config.broker.queue,
            priority=request.priority,
            with_run=with_run,
        )

    def _trigger_together(
        self, requests: Sequence[RunRequest], with_run: bool
    ) -> list[TriggerResult]:
        return self.trigger_batch(requests, with_run=with_run)

    def trigger_many(
        self,
        workflow: str,
        inputs: Sequence[Mapping[str, Any] | None],
        idempotency_keys: Sequence[str | None] | None = None,
        *,
        start_at: datetime | None = None,
        delay: float | timedelta | None = None,
        deadline: float | timedelta | None = None,
        priority: int | None = None,
    ) -> list[TriggerResult]:
        """Start one run of ``workflow`` per input in a single transaction (much faster than
        one by one); ``start_at``, ``delay``, ``deadline`` and ``priority`` apply to every run
        (see :meth:`trigger`). The results are in the inputs' order. All or nothing, as
        :meth:`trigger_batch`: a bad input raises :class:`~flowforge.errors.InputError`
        naming it (``input N: ...``) before anything is stored; each idempotency key (one per
        input, or None) replays its run (``created`` False), a key used for another request
        raises :class:`~flowforge.errors.TriggerConflictError` and nothing is stored."""
        definition = self._definition(workflow)
        return self._store.trigger_many(
            definition,
            inputs,
            idempotency_keys,
            start_at=start_at,
            delay=delay,
            deadline=deadline,
            children=referenced(definition, self.workflows),
            queue=self._config.broker.queue,
            priority=priority,
        )

    def trigger_batch(
        self, requests: Sequence[RunRequest], *, with_run: bool = False
    ) -> list[TriggerResult]:
        """Start one run per :class:`~flowforge.RunRequest` — each its own workflow, input,
        idempotency key, timing and priority, as :meth:`trigger` takes them — in a single
        transaction; the results in the requests' order (``POST /api/v1/runs:batch``).

        All or nothing: a bad request raises before anything is stored, naming its place
        (``runs[N]: ...``): :class:`~flowforge.errors.InputError`, or
        :class:`~flowforge.errors.UnknownWorkflowError` for a workflow this client does not
        know; a key used for another request raises
        :class:`~flowforge.errors.TriggerConflictError` and nothing is stored. A replayed
        key answers its run with ``created`` False (so does a key repeated within the batch
        for the same request). Runs are created grouped by workflow, timing and priority (the
        groups in the order of their first request), all in one commit. ``with_run``: each
        result created carries its run as written, as :meth:`trigger`'s.
        """

        def definition(name: str) -> tuple[WorkflowDef, tuple[WorkflowDef, ...]]:
            found = self._definition(name)
            return found, tuple(referenced(found, self.workflows))

        return self._store.trigger_batch(
            requests, definition, queue=self._config.broker.queue, with_run=with_run
        )

    def _definition(self, workflow: str) -> WorkflowDef:
        definition = self.workflows.get(workflow)
        if definition is None:
            raise UnknownWorkflowError(f"unknown workflow {workflow!r}")
        return definition

    def status(self, run_id: UUID | str) -> Run:
        return self._store.get_run(run_id)

    def wait(self, run_id: UUID | str, timeout: float | timedelta) -> Run:
        """The run once it is finished — SUCCEEDED, FAILED or CANCELLED — read again with a
        growing pause (50 ms doubling to 1 s: ``flowforge/waiting.py``), never busily.

        ``timeout`` (seconds, or a timedelta; more than 0, at most 366 days) bounds the wait:
        past it, :class:`~flowforge.errors.WaitTimeoutError` carries the last run read (its
        ``run``) and the run goes on. A bad ``timeout`` raises
        :class:`~flowforge.errors.InputError` before anything is read; a malformed or unknown
        id :class:`~flowforge.errors.InvalidIdError` / :class:`~flowforge.errors.NotFoundError`
        at the first read; an outage :class:`~flowforge.errors.DatabaseUnavailableError` at
        any read (the wait does not ride it out). A run that is rerun after it finished is
        returned as first seen finished.
        """
        timeout_s = wait_timeout(timeout)
        return wait_for_run(lambda: self._store.get_run(run_id), timeout_s)

    def cancel(self, run_id: UUID | str) -> Run:
        return self._store.cancel_run(run_id)

    def requeue(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> TaskRun:
        return self._store.requeue_dead(task_run_id, requested_by, reason)

    def rerun(
        self,
        run_id: UUID | str,
        requested_by: str,
        reason: str | None = None,
        from_task: str | None = None,
    ) -> Rerun:
        """Run a finished run again from its failed (DEAD / CANCELLED) tasks — or from
        ``from_task`` — and everything downstream of them, keeping the results of the tasks
        that succeeded upstream; audited (who, when, why, which tasks). Refused for a run that
        is not finished, an unknown run, a task the run does not have."""
        return self._store.rerun(run_id, requested_by, reason, from_task)

    def attempts(self, task_run_id: UUID | str) -> list[Attempt]:
        return self._store.attempts(task_run_id)

    def logs(self, task_run_id: UUID | str, attempt: int | None = None) -> AttemptLog:
        """What ``attempt`` (None: the latest) of a task run wrote — ``ctx.log``, stdout and
        stderr, the tail of ``worker.log_capture_bytes`` — as stored so far (``flowforge logs``,
        ``GET /api/v1/task-runs/{id}/logs``). NotFoundError for an unknown task run or attempt;
        InputError for an attempt that is not 1 to 2**31 - 1."""
        return self._store.attempt_log(task_run_id, attempt)

    def timeline(self, run_id: UUID | str, limits: TimelineLimits | None = None) -> TimelineFacts:
        """Where the run spent its time: its tasks in creation order (each map followed by its
        first items) with their latest attempts, read in one transaction at the database's now
        — what ``GET /api/v1/runs/{id}/timeline`` lays out for the run page, here as the
        objects it is drawn from (instants, not drawing coordinates). Bounded by ``limits``
        (None: the api's, :class:`~flowforge.domain.timeline.TimelineLimits`); what they leave
        out is counted (``tasks_total``, ``rests``, attempt numbers starting above 1). A
        malformed id raises :class:`~flowforge.errors.InvalidIdError`, an unknown run
        :class:`~flowforge.errors.NotFoundError`."""
        return self._store.timeline(run_id, limits or TimelineLimits())

    def map_items(
        self,
        task_run_id: UUID | str,
        *,
        state: TaskState | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> MapPage:
        """A map task (``for_each``) with all its items counted by state, then a page of up to
        ``limit`` (1 to 500) of them in item order — in ``state`` only, if given — after
        ``cursor`` (the ``next_cursor`` of the page before; None: from the first). The same
        page as ``GET /api/v1/task-runs/{id}/items``. A malformed cursor, limit or state raises
        :class:`~flowforge.errors.InputError`; an id of no task run, or of a task that is not a
        map, :class:`~flowforge.errors.NotFoundError`."""
        return self._store.map_page(task_run_id, cursor, limit, state)

    def schedules(self) -> list[ScheduleInfo]:
        """Every schedule in the database (of every tree's workflows), by name."""
        return self._store.list_schedules()

    def schedule(self, name: str) -> ScheduleInfo:
        """One schedule (``workflow/index`` or its ``name:``); NotFoundError if unknown."""
        return self._store.get_schedule(name)

    def schedule_history(self, name: str, limit: int = 20) -> list[FireRecord]:
        """The latest decisions about ``name``'s fire times, newest first."""
        self._store.get_schedule(name)  # an unknown name is an error, not an empty history
        return self._store.fire_history(name, limit)

    def pause_schedule(self, name: str) -> ScheduleInfo:
        return self._store.pause_schedule(name)

    def resume_schedule(self, name: str) -> ScheduleInfo:
        return self._store.resume_schedule(name)

    def trigger_schedule(self, name: str) -> ManualFire:
        """A run of schedule ``name`` now, outside its timetable (recorded as a manual fire)."""
        return self._store.trigger_schedule(name, self.workflows, self._config.broker.queue)

    def send_event(self, name: str, key: str, data: Any = None) -> EventSent:
        """Send event ``name`` with ``key``: every task waiting for it (``wait_for_event``
        with that name and rendered key) succeeds with ``data`` (any JSON value, or None) as
        its result, each once; the event is kept for ``events.retention`` for waits that
        start later. Bad input raises :class:`~flowforge.errors.InputError`; nothing is
        stored then."""
        return self._store.send_event(name, key, data)

    def cancel_task(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> Controlled:
        """Cancel one task (and, through the scheduler, what only it feeds: cause
        ``upstream``); a task a worker executes is asked to stop (``effect`` ``stop``).
        Audited. Refused — nothing changed — with :class:`~flowforge.errors.WrongStateError`
        for a finished task, a RUNNING map or a task asked to stop already,
        :class:`~flowforge.errors.NotFoundError` for an unknown id."""
        return self._store.cancel_task(task_run_id, requested_by, reason)

    def retry_task_now(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> Controlled:
        """A RETRYING task is dispatched now, its backoff skipped (no attempt added).
        Audited; any other state is refused (:class:`~flowforge.errors.WrongStateError`)."""
        return self._store.retry_task_now(task_run_id, requested_by, reason)

    def bury_task(
        self, task_run_id: UUID | str, requested_by: str, reason: str | None = None
    ) -> Controlled:
        """Bury one task by hand: DEAD, failure reason ``operator`` (a task a worker executes
        is asked to stop first and goes DEAD when it stops). Audited; refused as
        :meth:`cancel_task` is."""
        return self._store.bury_task(task_run_id, requested_by, reason)

    def key_holds(self, key: str) -> tuple[KeyHold, ...]:
        """What holds ``key``, per kind of limit it is (ordering, concurrency, rate_limit): the
        task(s) holding it (state, run, why) and how many wait behind them; empty when nothing
        does."""
        return self._store.key_holds(key)
