"""Task-run and workflow-run states (SPEC section 2)."""

from __future__ import annotations

from enum import StrEnum


class TaskState(StrEnum):
    """Lifecycle of one task run."""

    PENDING = "PENDING"
    READY = "READY"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    RETRYING = "RETRYING"
    DEAD = "DEAD"
    CANCELLED = "CANCELLED"


class RunState(StrEnum):
    """Lifecycle of one workflow run, derived from its task runs.

    SCHEDULED: a delayed run whose start time (``start_at``, on the database clock) has not
    come yet; nothing of it can run until a scheduler opens its start gate.
    """

    SCHEDULED = "SCHEDULED"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


#: Task states that need no further work unless an operator intervenes.
FINISHED_TASK_STATES = frozenset({TaskState.SUCCEEDED, TaskState.DEAD, TaskState.CANCELLED})

#: Task states from which a cancellation takes effect at once (nothing is executing).
NOT_STARTED_TASK_STATES = frozenset(
    {TaskState.PENDING, TaskState.READY, TaskState.RETRYING, TaskState.FAILED}
)


class CancelCause(StrEnum):
    """Why a task run was cancelled; decides whether a requeue may revive it."""

    OPERATOR = "operator"
    UPSTREAM = "upstream"
    DEADLINE = "deadline"  # the run's deadline passed (the run ends FAILED, deadline_exceeded)
    #: a ``run_if`` task skipped because its condition can never hold, or a task downstream
    #: of only such skips: a skip, not a failure (the run can still succeed)
    CONDITION_NOT_MET = "condition_not_met"
