"""Mapping database rows to the domain's read models."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from flowforge.domain.model import Attempt, AuditEntry, DeadTask, Run, TaskRun
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState

Row = dict[str, Any]


def _reason(value: str | None) -> FailureReason | None:
    return FailureReason(value) if value else None


def task_run(row: Row) -> TaskRun:
    return TaskRun(
        id=row["id"],
        run_id=row["run_id"],
        name=row["name"],
        handler=row["handler"],
        state=TaskState(row["state"]),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        fencing_token=row["fencing_token"],
        failure_reason=_reason(row["failure_reason"]),
        last_error=row["last_error"],
        result=row["result"],
        idempotency_key=row["idempotency_key"],
        ordering_key=row["ordering_key"],
        lease_owner=row["lease_owner"],
        lease_expires_at=row["lease_expires_at"],
        retry_at=row["retry_at"],
        cancel_requested=row["cancel_requested"],
        created_at=row["created_at"],
        ready_at=row["ready_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        depends_on=tuple(row["depends_on"] or ()),
    )


def dead_task(row: Row) -> DeadTask:
    """A ``list_dead`` row: a task run plus the workflow of its run."""
    task = task_run(row)
    return DeadTask(
        **{f.name: getattr(task, f.name) for f in fields(task)}, workflow=row["workflow"]
    )


def run(row: Row, tasks: tuple[TaskRun, ...] = ()) -> Run:
    return Run(
        id=row["id"],
        workflow=row["workflow"],
        state=RunState(row["state"]),
        input=row["input"],
        idempotency_key=row["idempotency_key"],
        cancel_requested=row["cancel_requested_at"] is not None,
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        tasks=tasks,
    )


def attempt(row: Row) -> Attempt:
    return Attempt(
        task_run_id=row["task_run_id"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        worker=row["worker"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        outcome=row["outcome"],
        failure_reason=_reason(row["failure_reason"]),
        error=row["error"],
        traceback=row["traceback"],
    )


def audit_entry(row: Row) -> AuditEntry:
    return AuditEntry(
        requested_by=row["requested_by"],
        reason=row["reason"],
        previous_reason=row["previous_reason"],
        attempt=row["attempt"],
        requested_at=row["requested_at"],
    )
