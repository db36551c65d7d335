"""The scheduler's passes over child-workflow tasks (``workflow:``, SPEC 7.3; docs/dynamic.md
"Sub-workflows").

A child task's row never reaches a worker. Two passes move it:

- :meth:`Children.start_children`: a child task whose dependencies are met (or whose retry is
  due) is locked, its child's input rendered (:func:`~flowforge.domain.children.render_input`)
  and planned against the latest registered definition of its workflow, and then — in ONE
  transaction — the task goes RUNNING with a new attempt and the child run is inserted
  through the trigger's own :func:`~flowforge.store.triggers.insert_plan`, linked both ways.
  A scheduler killed before the commit leaves neither; the task row stays locked from the read
  to the commit, so two schedulers never start the same attempt; and a unique index on the
  child run's (parent task, attempt) refuses a second child of one attempt whatever else
  happens. A child that cannot be started buries the task DEAD with its reason.
- :meth:`Children.settle_children`: a RUNNING child task whose child run has finished takes
  its outcome (one statement): the child's result and released dependents, or a failed
  attempt for the retry policy.

Cancelling a run cancels its RUNNING child tasks and their child runs, recursively
(:func:`~flowforge.store.runs.stop_runs`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from flowforge.domain import transitions
from flowforge.domain.children import MAX_CHILD_DEPTH, render_input
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.plan import RunPlan, plan_runs
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import MAX_ERROR_CHARS, clean_text
from flowforge.errors import DefinitionError, InputError
from flowforge.store.part import Part, Tx
from flowforge.store.triggers import insert_plan, register_definitions

logger = logging.getLogger(__name__)

#: Child runs started per pass at most, whatever the batch size: each is a trigger.
CHILDREN_PER_PASS = 50

_Buried = list[tuple[UUID, FailureReason, str]]


@dataclass(frozen=True)
class _Refusal:
    """Why no child can be started for a task: it dies of ``reason``, ``error`` saying why."""

    reason: FailureReason
    error: str


class Children(Part):
    """Starting and settling child-workflow tasks; registering the definitions children are
    made from."""

    def register_workflows(self, workflows: Sequence[WorkflowDef]) -> None:
        """Register the definitions of ``workflows`` (a scheduler's loaded set) as their
        workflows' latest versions, so that a child task finds the version the tree runs now
        whoever triggered its run — after a reload back to an earlier version too."""
        if workflows:
            self._transaction(register_definitions, list(workflows), True)

    def start_children(self, limit: int) -> int:
        """Child tasks whose dependencies are met (PENDING) or whose retry is due
        (RETRYING): → RUNNING with a new attempt and its child run created and linked, in one
        transaction; or → DEAD (``child_workflow_unknown``, ``child_input_error``,
        ``child_depth_exceeded``). Returns how many were started or buried (at most ``limit``
        and CHILDREN_PER_PASS)."""
        transitions.check((TaskState.PENDING, TaskState.RETRYING), TaskState.RUNNING)
        transitions.check((TaskState.PENDING, TaskState.RETRYING), TaskState.DEAD)
        buried: _Buried = []
        done = self._transaction(_start, min(limit, CHILDREN_PER_PASS), buried)
        for task_id, reason, error in buried:  # after the commit: a retried one logs once
            logger.warning(
                "child-workflow task %s is DEAD (%s): %s",
                task_id,
                reason,
                error,
                extra={"action": "child_buried", "task_run_id": str(task_id)},
            )
        return done

    def settle_children(self, limit: int) -> int:
        """RUNNING child tasks whose child run finished: → SUCCEEDED with the child's result
        (dependents released), or → FAILED ``child_failed`` / ``child_cancelled`` for the
        retry policy (``route_failed``). Returns how many."""
        transitions.check(TaskState.RUNNING, TaskState.SUCCEEDED)
        transitions.check(TaskState.RUNNING, TaskState.FAILED)
        return self._transaction(_settle, limit)


def _start(tx: Tx, limit: int, buried: _Buried) -> int:
    buried.clear()  # a retried transaction starts over
    locked = tx.all("lock_child_starts", {"limit": limit})
    if not locked:
        return 0
    names = sorted({r["child_workflow"] for r in locked})
    stored = {r["name"]: r["definition"] for r in tx.all("latest_definitions", {"names": names})}
    workflows = {name: _workflow(stored.get(name), name) for name in names}
    done = 0
    for row in locked:
        outcome = _plan_child(row, workflows[row["child_workflow"]])
        if isinstance(outcome, _Refusal):
            reason, error = outcome.reason, outcome.error
            params = {
                **_task_params(row),
                "reason": str(reason),
                "error": clean_text(error, MAX_ERROR_CHARS),
            }
            if tx.all("bury_child", params):
                buried.append((row["id"], reason, error))
                done += 1
            continue
        workflow, plan = outcome
        begun = tx.one("begin_child", {**_task_params(row), "child_run_id": plan.run_ids[0]})
        if begun is None:  # moved by someone else since the lock (cannot happen: locked)
            continue
        plan.parent_run_id, plan.parent_task_id = row["run_id"], row["id"]
        plan.parent_attempt, plan.depth = begun["attempt"], row["depth"] + 1
        insert_plan(tx, workflow, plan)
        done += 1
    return done


def _task_params(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "state": row["state"], "token": row["fencing_token"]}


def _workflow(definition: Any, name: str) -> WorkflowDef | None:
    """The registered definition as a WorkflowDef; None if there is none (or it no longer
    parses: a definition registered by an older FlowForge that this one refuses)."""
    if definition is None:
        return None
    from flowforge.definitions import workflow_from_mapping  # the scheduler has it loaded

    try:
        return workflow_from_mapping(definition, f"registered workflow {name!r}")
    except DefinitionError:
        return None


def _plan_child(
    row: Mapping[str, Any], workflow: WorkflowDef | None
) -> tuple[WorkflowDef, RunPlan] | _Refusal:
    """(the child's workflow, its run plan), or why the task dies instead."""
    label = f"task {row['name']!r}"
    if workflow is None:
        return _Refusal(
            FailureReason.CHILD_WORKFLOW_UNKNOWN,
            f"{label}: workflow {row['child_workflow']!r} is not registered "
            "(no scheduler loaded it and no trigger registered it)",
        )
    if row["depth"] + 1 > MAX_CHILD_DEPTH:
        return _Refusal(
            FailureReason.CHILD_DEPTH_EXCEEDED,
            f"{label}: a child run of {row['child_workflow']!r} would be nested "
            f"{row['depth'] + 1} levels deep (at most {MAX_CHILD_DEPTH}): runaway recursion?",
        )
    template = (row["definition"] or {}).get("input")
    try:
        child_input = (
            row["input"]
            if template is None
            else render_input(template, row["input"] or {}, row["upstream"] or {}, label)
        )
        if not isinstance(child_input, Mapping):  # a template is a mapping: cannot happen
            raise InputError(f"{label}: the child's input must be a JSON object")
        return workflow, plan_runs(
            workflow, [child_input], queue=row["queue"], priority=row["run_priority"]
        )
    except InputError as exc:  # a missing field, or an input the child's own keys cannot use
        return _Refusal(FailureReason.CHILD_INPUT_ERROR, str(exc))


def _settle(tx: Tx, limit: int) -> int:
    row = tx.one("settle_children", {"limit": limit})
    if row is None:
        return 0
    if row["queued"]:
        tx.all("notify_outbox")
    if row["failed"] or row["succeeded"]:
        tx.all("notify_scheduler")  # route the failed, propagate the finished
    return int(row["succeeded"]) + int(row["failed"])
