"""Creating runs: the statements a trigger (client, API, CLI) runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from flowforge.domain import transitions
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.model import TriggerResult
from flowforge.domain.plan import RunPlan, plan_runs
from flowforge.domain.states import TaskState
from flowforge.domain.timing import judge_start_at
from flowforge.errors import TriggerConflictError
from flowforge.store import limits, rows
from flowforge.store.part import Part, Tx

#: Advisory-lock namespace for ordering keys (the second int is hashtext(key)).
ORDERING_LOCK_NAMESPACE = 0x4F52  # "OR"


class Triggers(Part):
    """New runs and their task runs, planned in the domain and inserted as a few arrays."""

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
    ) -> TriggerResult:
        """Create a run and its task runs in one transaction.

        The same ``idempotency_key`` returns the same run (``created`` False); the same key
        with another workflow or input raises :class:`TriggerConflictError`. ``start_at`` (an
        aware datetime) or ``delay`` (seconds) creates the run SCHEDULED; ``deadline``
        (seconds) overrides the workflow's (see :meth:`trigger_many`).
        """
        return self.trigger_many(
            workflow,
            [run_input],
            [idempotency_key],
            start_at=start_at,
            delay=delay,
            deadline=deadline,
            children=children,
            queue=queue,
            priority=priority,
        )[0]

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
        # pipelined: the run's clock (created_at, the transaction's start) runs from BEGIN to
        # COMMIT: two round trips rather than six (three with an idempotency key)
        return self._pipelined(_insert_plan, workflow, plan, children)


def _insert_plan(
    tx: Tx, workflow: WorkflowDef, plan: RunPlan, children: Sequence[WorkflowDef] = ()
) -> list[TriggerResult]:
    """Insert ``plan``'s runs of ``workflow`` in the caller's transaction. Their deadline is the
    plan's, else the workflow's (so runs made by any caller get it). ``children``' definitions
    are registered too (the child runs the runs may start are made from them).

    Statements whose results are not read are sent (:meth:`Tx.send`): in a pipelined
    transaction they travel with the next statement read, or with the commit. Runs without an
    idempotency key are always inserted (their ids are new), so theirs is not read either."""
    if plan.start_at is not None:
        clock = tx.one("trigger_clock")
        assert clock is not None  # SELECT now() always answers
        judge_start_at(plan.start_at, clock["now"])
    deadline_s = plan.deadline_s if plan.deadline_s is not None else workflow.deadline
    tx.send(
        "register_definition",
        {
            "name": workflow.name,
            "digest": workflow.digest,
            "definition": Jsonb(workflow.to_dict()),
        },
    )
    if children:
        register_definitions(tx, children)
    ordering = plan.ordering_keys()
    if ordering:
        tx.send("lock_ordering_keys", {"namespace": ORDERING_LOCK_NAMESPACE, "keys": ordering})
    runs = {
        "ids": plan.run_ids,
        "workflow": workflow.name,
        "digest": workflow.digest,
        "inputs": [rows.jsonb(i) for i in plan.inputs],
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
    if all(key is None for key in plan.keys):
        tx.send("insert_runs", runs)
        inserted = set(plan.run_ids)
    else:
        inserted = {r["id"] for r in tx.all("insert_runs", runs)}
    if len(inserted) < len(plan.run_ids):
        results = _replayed(tx, plan, inserted, results)
    tasks = plan.tasks_of(inserted)
    if tasks:
        transitions.check(TaskState.PENDING, TaskState.READY)  # created READY when free
        admitted = limits.admit_new(tx, tasks)  # tasks with a concurrency key: READY if room
        counts = tx.one("insert_tasks", rows.task_columns(tasks, admitted))
        upstream, downstream = plan.edges_of({t.id for t in tasks})
        if upstream:
            tx.send("insert_edges", {"upstream": upstream, "downstream": downstream})
        if counts and counts["queued"]:
            tx.notify("notify_outbox")
        if counts and counts["waiting"]:
            tx.notify("notify_scheduler")
    return results


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
            raise TriggerConflictError(f"idempotency key {key!r} was used for a different request")
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
