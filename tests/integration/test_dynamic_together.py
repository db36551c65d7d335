"""The constructs of issue 19 in one workflow (docs/dynamic.md): a map whose items fail, a
compensation that waits for the map (``run_if: any_failed``), a cleanup after everything
(``run_if: all_done``) and an event wait beside them (which fail-fast ends).

Played statement by statement against real PostgreSQL: the worker's claims and finishes by
hand, the scheduler by its passes (tests/helpers.py ``drain``). Each construct is proven alone
in its own module; this one proves they meet: a map's death releases a condition, fail-fast
ends a waiting event task and the cleanup still runs, the run says what was compensated, and a
rerun brings the map back."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from tests.helpers import claim_task, dispatch, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

ONCE = RetryPolicy(max_attempts=1, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
SAGA = WorkflowDef(
    "saga-map",
    (
        TaskDef("list", "tests.noop"),
        TaskDef("charge", "tests.noop", for_each="list", retry=ONCE),
        TaskDef("refund", "tests.noop", depends_on=("charge",), run_if=RunIf.ANY_FAILED),
        TaskDef("approve", wait_for_event=EventWait("saga.approved", "{order}", 3600.0)),
        TaskDef("tidy", "tests.noop", depends_on=("charge", "approve"), run_if=RunIf.ALL_DONE),
    ),
    fail_fast=True,
)


def finish(repo: Store, sql: Sql, task_id: uuid.UUID, state: TaskState, result: Any = None) -> None:
    claim = claim_task(repo, sql, task_id)
    if state is TaskState.SUCCEEDED:
        assert repo.finish(task_id, claim.fencing_token, state, result=result)
    else:
        assert repo.finish(
            task_id,
            claim.fencing_token,
            state,
            reason=FailureReason.HANDLER_ERROR,
            error="card declined",
        )
    dispatch(sql)
    drain(repo)


def item_ids(sql: Sql, run_id: uuid.UUID) -> list[uuid.UUID]:
    return [
        r[0]
        for r in sql.execute(
            "SELECT id FROM task_runs WHERE run_id = %s AND map_id IS NOT NULL ORDER BY item_index",
            (run_id,),
        ).fetchall()
    ]


def states(repo: Store, run_id: uuid.UUID) -> dict[str, TaskState]:
    return {t.name: t.state for t in repo.get_run(run_id).tasks}


def test_a_failed_map_item_releases_the_compensation_and_the_cleanup_runs_after_all(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(SAGA, {"order": "o-1"}).run_id
    ids = task_ids(repo, run_id)
    finish(repo, sql, ids["list"], TaskState.SUCCEEDED, ["a", "b", "c"])
    first, second, third = item_ids(sql, run_id)
    finish(repo, sql, first, TaskState.SUCCEEDED, 1)
    finish(repo, sql, second, TaskState.FAILED)  # one attempt: DEAD
    drain(repo)
    third_state = sql.execute("SELECT state FROM task_runs WHERE id = %s", (third,)).fetchone()
    assert third_state == ("CANCELLED",)  # fail-fast: the item not yet started never runs
    now = states(repo, run_id)
    assert now["charge"] is TaskState.DEAD  # an item died: the map is DEAD
    assert now["refund"] in (TaskState.READY, TaskState.RUNNING)  # released by that death
    # fail-fast ends the event wait at once (it is upstream of the cleanup, not downstream of
    # a compensation: only those are spared); so every dependency of the cleanup is finished
    assert now["approve"] is TaskState.CANCELLED
    assert now["tidy"] is TaskState.READY  # all_done: the map DEAD, the wait CANCELLED
    assert repo.send_event("saga.approved", "o-1", {"by": "ops"}).woke == ()  # nobody waits
    finish(repo, sql, ids["refund"], TaskState.SUCCEEDED, "refunded")
    drain(repo)
    run = repo.get_run(run_id)
    final = {t.name: t.state for t in run.tasks}
    assert final["refund"] is TaskState.SUCCEEDED
    finish(repo, sql, ids["tidy"], TaskState.SUCCEEDED)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert "refund" in run.compensated
    executed = sql.execute(
        "SELECT count(*) FROM task_attempts a JOIN task_runs t ON t.id = a.task_run_id"
        " WHERE t.run_id = %s AND t.map_id IS NOT NULL",
        (run_id,),
    ).fetchone()
    assert executed == (2,)  # one attempt per started item, none again


def test_a_rerun_brings_a_dead_map_back_and_keeps_its_succeeded_list(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(SAGA, {"order": "o-2"}).run_id
    ids = task_ids(repo, run_id)
    finish(repo, sql, ids["list"], TaskState.SUCCEEDED, ["a"])
    (only,) = item_ids(sql, run_id)
    finish(repo, sql, only, TaskState.FAILED)
    drain(repo)
    repo.send_event("saga.approved", "o-2")
    finish(repo, sql, ids["refund"], TaskState.SUCCEEDED)
    finish(repo, sql, ids["tidy"], TaskState.SUCCEEDED)
    assert repo.get_run(run_id).state is RunState.FAILED
    repo.rerun(run_id, requested_by="test", reason="card fixed")
    drain(repo)
    now = states(repo, run_id)
    assert now["list"] is TaskState.SUCCEEDED  # kept, with its result
    assert now["charge"] is not TaskState.DEAD
