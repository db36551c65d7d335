"""Creating runs: the statements a trigger (client, API, CLI) runs."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from flowforge.domain import transitions
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.model import Run, TaskRun, TriggerResult
from flowforge.domain.plan import RunPlan, RunRequest, group_requests, plan_runs
from flowforge.domain.states import TaskState
from flowforge.domain.timing import judge_start_at
from flowforge.errors import (
    DatabaseConstraintError,
    InputError,
    TriggerConflictError,
    UnknownWorkflowError,
)
from flowforge.store import limits, rows
from flowforge.store.db import Cursor, Database, Row
from flowforge.store.part import Part, Tx

#: Advisory-lock namespace for ordering keys (the second int is hashtext(key)).
ORDERING_LOCK_NAMESPACE = 0x4F52  # "OR"
#: The foreign key a run's definition must satisfy (migration 0001): broken when a definition
#: this process registered before is gone (a test's emptied tables, a restored database).
DEFINITION_KEY = "workflow_runs_workflow_workflow_digest_fkey"

#: One plan of a trigger: the workflow, its runs, the child workflows they may start.
Planned = tuple[WorkflowDef, RunPlan, Sequence[WorkflowDef]]


class Triggers(Part):
    """New runs and their task runs, planned in the domain and inserted as a few arrays.

    A workflow's definition is registered (``workflow_definitions``) by the first trigger of
    each version through this part, not by every trigger: its row never changes once written.
    Should it be gone all the same, the foreign key from the run refuses the insert and the
    trigger runs again, registering it (:func:`_missing_definition`)."""

    def __init__(self, db: Database, rand: Callable[[], float] = random.random) -> None:
        super().__init__(db, rand)
        #: Digests of the definitions registered through this part (one process's triggers).
        self._registered: set[str] = set()

    def trigger(
        self,
        workflow: WorkflowDef,
        run_input: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        *,
        start_at: datetime | None = None,
        delay: float | timedelta | None = None,
        deadline: float | timedelta | None = None,
        children: Sequence[WorkflowDef] = (),
        queue: str | None = None,
        priority: int | None = None,
        with_run: bool = False,
    ) -> TriggerResult:
        """Create a run and its task runs in one transaction.

        The same ``idempotency_key`` returns the same run (``created`` False); the same key
        with another workflow or input raises :class:`TriggerConflictError`. ``start_at`` (an
        aware datetime) or ``delay`` (seconds) creates the run SCHEDULED; ``deadline``
        (seconds) overrides the workflow's (see :meth:`trigger_many`).

        ``with_run``: the result's ``run`` is the run as a read of it right after the commit
        shows it (:meth:`Reads.get_run <flowforge.store.reads.Reads.get_run>`), built from what
        the inserts returned, in the same round trip — unless the run was not created here (a
        replayed key) or a task of it has a concurrency or rate key (its ``waiting_on`` depends
        on other tasks): then ``run`` is None and the caller reads it back.
        """
        plan = plan_runs(
            workflow,
            [run_input],
            [idempotency_key],
            start_at=start_at,
            delay=delay,
            deadline=deadline,
            queue=queue,
            priority=priority,
        )
        return self._insert([(workflow, plan, children)], with_run)[0][0]

    def trigger_many(
        self,
        workflow: WorkflowDef,
        inputs: Sequence[Mapping[str, Any] | None],
        idempotency_keys: Sequence[str | None] | None = None,
        *,
        start_at: datetime | None = None,
        delay: float | timedelta | None = None,
        deadline: float | timedelta | None = None,
        children: Sequence[WorkflowDef] = (),
        queue: str | None = None,
        priority: int | None = None,
    ) -> list[TriggerResult]:
        """Create one run per input in one transaction (a few array inserts, not one per run).

        Results are in input order; idempotency keys behave as in :meth:`trigger`, and one
        conflict fails the whole batch. Every run shares the timing: ``start_at`` (an aware
        datetime, refused more than a minute in the past by the *database's* clock) or
        ``delay`` (seconds, or a timedelta, added to the database's now) makes them SCHEDULED
        until then; ``deadline`` (seconds, or a timedelta) replaces the workflow's deadline.
        Bad values raise :class:`InputError` before anything is stored. ``children``: the
        workflows the runs may start as child runs (sub-workflows), registered with the
        workflow's definition so that the scheduler finds them.
        ``queue`` is the queue of every task that names none: the triggering config's
        ``broker.queue`` (None: unassigned, see :func:`~flowforge.domain.plan.plan_runs`).
        ``priority`` (0 to 9) replaces every task's own (None: each keeps its workflow's).
        """
        plan = plan_runs(
            workflow,
            inputs,
            idempotency_keys,
            start_at=start_at,
            delay=delay,
            deadline=deadline,
            queue=queue,
            priority=priority,
        )
        if not plan.run_ids:
            return []
        return self._insert([(workflow, plan, children)])[0]

    def trigger_batch(
        self,
        requests: Sequence[RunRequest],
        workflows: Callable[[str], tuple[WorkflowDef, Sequence[WorkflowDef]]],
        queue: str | None = None,
        with_run: bool = False,
    ) -> list[TriggerResult]:
        """Create one run per request, of any workflows, in one transaction; results in the
        requests' order.

        ``workflows(name)``: the definition of a request's workflow and the child workflows its
        runs may start (it raises for an unknown one). All or nothing: a bad request raises
        :class:`InputError` naming its place (``runs[N]: ...``) before anything is stored, a
        key used for another request :class:`TriggerConflictError` (nothing stored either).
        Each request's idempotency key behaves as in :meth:`trigger` (a replay answers its run
        with ``created`` False, a key repeated within the batch for the same request too).
        Requests that share a workflow, timing and priority are planned and inserted together
        (:func:`~flowforge.domain.plan.group_requests`), so runs are created group by group,
        the groups in the order of their first request. ``with_run``: each run created carries
        itself as written, as :meth:`trigger`'s.
        """
        planned: list[Planned] = []
        groups = group_requests(requests)
        for positions in groups:
            first = requests[positions[0]]
            try:
                workflow, children = workflows(first.workflow)
                plan = plan_runs(
                    workflow,
                    [requests[p].input for p in positions],
                    [requests[p].idempotency_key for p in positions],
                    start_at=first.start_at,
                    delay=first.delay,
                    deadline=first.deadline,
                    queue=queue,
                    priority=first.priority,
                    positions=positions,
                )
            except (InputError, UnknownWorkflowError) as exc:  # name the request's place
                if str(exc).startswith("runs["):
                    raise
                raise type(exc)(f"runs[{positions[0]}]: {exc}") from exc
            planned.append((workflow, plan, children))
        results: list[TriggerResult | None] = [None] * len(requests)
        for positions, got in zip(groups, self._insert(planned, with_run), strict=True):
            for position, result in zip(positions, got, strict=True):
                results[position] = result
        return [r for r in results if r is not None]

    def _insert(
        self, planned: Sequence[Planned], with_run: bool = False
    ) -> list[list[TriggerResult]]:
        """``planned`` in one pipelined transaction (the runs' clock, created_at, is its
        start): one round trip for runs without an idempotency key, a start time or limits
        (the definitions registered before, the notifications after the COMMIT in the same
        round trip), one more for each of those. Definitions are registered once per process
        (class docstring); a missing one is registered and the whole run again. ``with_run``:
        each result created carries its run as written (:meth:`trigger`)."""
        known = self._registered
        try:
            results, registered, written = self._pipelined(_insert_plans, planned, known, with_run)
        except DatabaseConstraintError as exc:
            if not _missing_definition(exc):
                raise
            known.clear()
            results, registered, written = self._pipelined(_insert_plans, planned, known, with_run)
        known.update(registered)  # committed: a rolled-back registration is no registration
        if written is None:
            return results
        runs = written.runs()  # committed: the answered inserts' rows are all there
        return [
            [replace(r, run=runs.get(r.run_id)) if r.created else r for r in got] for got in results
        ]


def _missing_definition(exc: DatabaseConstraintError) -> bool:
    """Whether ``exc`` is a run refused for its definition's missing row."""
    cause = exc.__cause__
    return (
        isinstance(cause, pg_errors.ForeignKeyViolation)
        and cause.diag.constraint_name == DEFINITION_KEY
    )


def _insert_plans(
    tx: Tx, planned: Sequence[Planned], known: set[str], with_run: bool = False
) -> tuple[list[list[TriggerResult]], list[str], Written | None]:
    """Insert every plan of ``planned`` in the caller's transaction, registering first the
    definitions whose digests are not in ``known``; the results of each plan, the digests
    registered (for the caller to add to ``known`` once the transaction committed) and, with
    ``with_run``, what the inserts wrote (read once the transaction committed)."""
    new: dict[str, WorkflowDef] = {}
    for workflow, _plan, children in planned:
        for definition in (workflow, *children):
            if definition.digest not in known:
                new.setdefault(definition.digest, definition)
    if new:
        register_definitions(tx, list(new.values()))
    written = Written() if with_run else None
    results = [
        _insert_plan(tx, w, plan, children, register=False, written=written)
        for w, plan, children in planned
    ]
    return results, list(new), written


def _insert_plan(
    tx: Tx,
    workflow: WorkflowDef,
    plan: RunPlan,
    children: Sequence[WorkflowDef] = (),
    *,
    register: bool = True,
    written: Written | None = None,
) -> list[TriggerResult]:
    """Insert ``plan``'s runs of ``workflow`` in the caller's transaction. Their deadline is the
    plan's, else the workflow's (so runs made by any caller get it). With ``register`` the
    workflow's and ``children``' definitions are registered too (the child runs the runs may
    start are made from them); a trigger registers each once (:meth:`Triggers._insert`).
    With ``written``, a plan none of whose tasks has a concurrency or rate key is inserted by
    the answered statements, whose rows ``written`` keeps (:class:`Written`); the same round
    trips.

    Statements whose results are not read are sent (:meth:`Tx.send`): in a pipelined
    transaction they travel with the next statement read, or with the commit. Runs without an
    idempotency key are always inserted (their ids are new), so theirs is not read either; the
    task counts are not read at all: the notifications after the commit read what was
    inserted (``notify_new_tasks``)."""
    if plan.start_at is not None:
        clock = tx.one("trigger_clock")
        assert clock is not None  # SELECT now() always answers
        try:
            judge_start_at(plan.start_at, clock["now"])
        except InputError as exc:  # every run of the plan has it: a batch names the first
            if plan.positions is None:
                raise
            raise InputError(f"runs[{plan.positions[0]}]: {exc}") from exc
    deadline_s = plan.deadline_s if plan.deadline_s is not None else workflow.deadline
    if register:
        register_definitions(tx, [workflow, *children])
    ordering = plan.ordering_keys()
    if ordering:
        tx.send("lock_ordering_keys", {"namespace": ORDERING_LOCK_NAMESPACE, "keys": ordering})
    runs = {
        "ids": plan.run_ids,
        "workflow": workflow.name,
        "digest": workflow.digest,
        "inputs": rows.jsonb_array(plan.inputs),
        "fail_fast": workflow.fail_fast,
        "keys": plan.keys,
        "digests": plan.digests,
        "start_at": plan.start_at,
        "delay_s": plan.delay_s,
        "deadline_s": deadline_s,
        "parent_run_id": plan.parent_run_id,
        "parent_task_id": plan.parent_task_id,
        "parent_attempt": plan.parent_attempt,
        "depth": plan.depth,
        "priority": plan.priority,
    }
    results = [TriggerResult(rid, created=True) for rid in plan.run_ids]
    if written is not None and any(t.concurrency_key or t.rate_key for t in plan.tasks):
        written = None  # its tasks' waiting_on depends on other tasks: read back
    inserted = _insert_runs(tx, plan, runs, written)
    if len(inserted) < len(plan.run_ids):
        results = _replayed(tx, plan, inserted, results)
    _insert_tasks(tx, plan, inserted, written)
    return results


def _insert_runs(tx: Tx, plan: RunPlan, runs: dict[str, Any], written: Written | None) -> set[UUID]:
    """Insert the runs (``runs``: ``insert_runs``' parameters); the ids of those inserted. Runs
    without an idempotency key are always inserted (their ids are new), so the statement's
    result is not waited for; with a key it is read at once (which were inserted decides the
    rest). With ``written``, the answered insert, its rows kept there."""
    keyless = all(key is None for key in plan.keys)
    if written is None and keyless:
        tx.send("insert_runs", runs)
        return set(plan.run_ids)
    if written is None:
        return {r["id"] for r in tx.all("insert_runs", runs)}
    if keyless:
        written.runs_from(tx.later("insert_runs_answered", runs))
        return set(plan.run_ids)
    found = tx.all("insert_runs_answered", runs)
    written.runs_from(found)
    return {r["id"] for r in found}


class Written:
    """What a trigger's answered inserts return (``insert_runs_answered``,
    ``insert_tasks_answered``, ``insert_edges_answered``): the runs it created as a read of them
    right after the commit answers (``Reads.get_run``), without that read — its round trip and
    the planning of its three statements were two thirds of a ``POST /api/v1/runs``
    (docs/performance.md, "Submitting work, part 3").

    Each source is a cursor queued in the pipelined transaction (:meth:`Tx.later`), read once it
    committed (:meth:`runs`), or rows already read. A new run has no child runs; a new map has
    no items (its ``item_counts`` empty), so nothing else is read."""

    __slots__ = ("_edges", "_runs", "_tasks")

    def __init__(self) -> None:
        self._runs: list[Cursor | list[Row]] = []
        self._tasks: list[Cursor] = []
        self._edges: list[Cursor] = []

    def runs_from(self, source: Cursor | list[Row]) -> None:
        """Keep ``insert_runs_answered``'s rows (its cursor, or the rows read)."""
        self._runs.append(source)

    def tasks_from(self, source: Cursor) -> None:
        """Keep ``insert_tasks_answered``'s cursor."""
        self._tasks.append(source)

    def edges_from(self, source: Cursor) -> None:
        """Keep ``insert_edges_answered``'s cursor."""
        self._edges.append(source)

    def runs(self) -> dict[UUID, Run]:
        """The runs written, by id, each with its tasks in creation order."""
        depends = {r["id"]: r["depends_on"] for source in self._edges for r in source.fetchall()}
        tasks: dict[UUID, list[TaskRun]] = {}
        for source in self._tasks:
            for row in source.fetchall():
                row["depends_on"] = depends.get(row["id"], ())
                tasks.setdefault(row["run_id"], []).append(rows.task_run(row))
        return {
            r["id"]: rows.run(r, tuple(tasks.get(r["id"], ())))
            for source in self._runs
            for r in (source if isinstance(source, list) else source.fetchall())
        }


def _insert_tasks(tx: Tx, plan: RunPlan, inserted: set[UUID], written: Written | None) -> None:
    """Insert the tasks of the runs ``inserted`` and their edges, and notify (after the commit)
    whoever moves them on — the publisher if a task is created READY, the scheduler if one is
    created PENDING, known from the plan (:meth:`PlannedTask.created_ready`) without reading
    the tasks back; with ``written``, the answered inserts, their rows kept there."""
    tasks = plan.tasks_of(inserted)
    if not tasks:
        return
    transitions.check(TaskState.PENDING, TaskState.READY)  # created READY when free
    admitted = limits.admit_new(tx, tasks)  # tasks with a concurrency key: READY if room
    records = rows.task_records(tasks, admitted)
    ready = [t.created_ready(a) for t, a in zip(tasks, admitted, strict=True)]
    edges = plan.edges_of({t.id for t in tasks})
    if written is None:
        tx.send("insert_tasks", records)
        if edges.upstream:
            tx.send("insert_edges", edges._asdict())
    else:
        written.tasks_from(tx.later("insert_tasks_answered", records))
        if edges.upstream:
            written.edges_from(tx.later("insert_edges_answered", edges._asdict()))
    tx.notify("notify_new_tasks", {"ready": any(ready), "pending": not all(ready)})


def _replayed(
    tx: Tx, plan: RunPlan, inserted: set[UUID], results: list[TriggerResult]
) -> list[TriggerResult]:
    """Resolve runs whose idempotency key already existed: the same request or a conflict."""
    keys = [k for rid, k in zip(plan.run_ids, plan.keys, strict=True) if rid not in inserted]
    existing = {r["idempotency_key"]: r for r in tx.all("find_runs_by_keys", {"keys": keys})}
    for index, (rid, key) in enumerate(zip(plan.run_ids, plan.keys, strict=True)):
        if rid in inserted:
            continue
        found = existing.get(key)
        if found is None or found["request_digest"] != plan.digests[index]:
            raise TriggerConflictError(
                f"{plan.where(index)}idempotency key {key!r} was used for a different request"
            )
        results[index] = TriggerResult(found["id"], created=False)
    return results


def register_definitions(tx: Tx, workflows: Sequence[WorkflowDef], latest: bool = False) -> None:
    """Register the definitions of ``workflows`` (each version once) in the caller's
    transaction. ``latest``: each becomes the latest of its workflow (the one child runs are
    made from), even a version registered before — a scheduler's loaded set, not a trigger's."""
    params = {
        "names": [w.name for w in workflows],
        "digests": [w.digest for w in workflows],
        "definitions": [Jsonb(w.to_dict()) for w in workflows],
    }
    if latest:
        tx.send("register_latest_definitions", params)
    else:
        tx.send("register_definitions", params)


#: The plan insert, for parts that create runs inside a transaction of their own (a schedule's
#: fire: flowforge/store/schedules.py), so every run is created by the same statements.
insert_plan = _insert_plan
