"""Sub-workflows (``workflow:`` as a task) through real role processes, with a SIGKILL
mid-creation of a child run (issue 19).

The creation is made to stop half-way deterministically: the test holds, in an open
transaction, an uncommitted child run with the (parent task, attempt 1) the scheduler is about
to use, so the scheduler's transaction — the task moved to RUNNING, its child run being
inserted, uncommitted — waits on that unique key. The scheduler is SIGKILLed while it waits
(pg_stat_activity shows the wait), the test's transaction is rolled back, and a new scheduler
starts the child again: one child run for the attempt, its tasks run once, the parent
completes with the child's result.
"""

from __future__ import annotations

import uuid
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState, TaskState
from tests.e2e import Stack
from tests.helpers import kill_scheduler_while_it_waits, task_ids, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

BILLING = WorkflowDef(
    "billing-e2e",
    (
        TaskDef("charge", "e2e.record"),
        TaskDef("receipt", "e2e.record", depends_on=("charge",)),
        TaskDef("audit", "e2e.record", depends_on=("charge",)),
    ),
)
ORDER = WorkflowDef(
    "order-e2e",
    (
        TaskDef("take", "e2e.record"),
        TaskDef("bill", workflow="billing-e2e", depends_on=("take",), input={"n": "{n}"}),
        TaskDef("ship", "e2e.record", depends_on=("bill",)),
    ),
)


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def executions(sql: Sql, run_id: UUID) -> dict[str, int]:
    rows = sql.execute(
        "SELECT task, count(*) FROM test_executions WHERE run_id = %s GROUP BY task", (run_id,)
    ).fetchall()
    return {task: int(n) for task, n in rows}


def test_killing_the_scheduler_mid_child_creation_leaves_one_child_per_attempt(
    stack: Stack, repo: Store, sql: Sql, clean_database_url: str
) -> None:
    repo.register_workflows([BILLING])
    scheduler = stack.start("scheduler")
    stack.start("publisher")
    run_id: UUID = repo.trigger(ORDER, {"n": 3}).run_id
    bill = task_ids(repo, run_id)["bill"]
    digest = BILLING.digest
    with psycopg.connect(clean_database_url) as blocker:
        blocker.execute(
            "INSERT INTO workflow_runs (id, workflow, workflow_digest, input, fail_fast,"
            " parent_run_id, parent_task_id, parent_attempt, depth)"
            " VALUES (%s, %s, %s, '{}', true, %s, %s, 1, 1)",
            (uuid.uuid4(), BILLING.name, digest, run_id, bill),
        )
        stack.start("worker")  # runs "take"; the scheduler then starts the child and waits
        kill_scheduler_while_it_waits(scheduler, sql, blocker, "the child creation")
    # the killed creation committed nothing: the task waits, with no child and no attempt
    assert scalar(sql, "SELECT count(*) FROM workflow_runs WHERE parent_task_id = %s", bill) == 0
    task = repo.get_task(bill)
    assert task.state is TaskState.PENDING and task.attempt == 0 and task.child_run_id is None
    stack.start("scheduler")
    wait_for(
        lambda: repo.get_run(run_id).state is RunState.SUCCEEDED,
        timeout=120,
        what="the parent run to succeed",
    )
    children = sql.execute(
        "SELECT id, parent_attempt FROM workflow_runs WHERE parent_task_id = %s", (bill,)
    ).fetchall()
    assert [a for _, a in children] == [1]  # exactly one child, for attempt 1
    child: UUID = children[0][0]
    assert repo.get_run(child).input == {"n": 3}  # one field: its value, its type
    assert executions(sql, child) == {"charge": 1, "receipt": 1, "audit": 1}
    assert executions(sql, run_id) == {"take": 1, "ship": 1}
    result = repo.get_task(bill).result
    assert set(result) == {"receipt", "audit"}  # the child's leaves
    ship = repo.get_run(run_id).task("ship").result
    assert ship["upstream"]["bill"] == result


def test_a_tree_runs_a_parent_whose_child_runs_real_handlers(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    repo.register_workflows([BILLING])
    stack.start("scheduler")
    stack.start_all(workers=2)  # a second scheduler, a publisher and two workers
    runs = [repo.trigger(ORDER, {"n": i}).run_id for i in range(5)]
    wait_for(
        lambda: all(repo.get_run(r).state is RunState.SUCCEEDED for r in runs),
        timeout=120,
        what="every parent run to succeed",
    )
    for run_id in runs:
        [(child, attempt)] = sql.execute(
            "SELECT id, parent_attempt FROM workflow_runs WHERE parent_run_id = %s", (run_id,)
        ).fetchall()
        assert attempt == 1 and repo.get_run(child).state is RunState.SUCCEEDED
        assert executions(sql, child) == {"charge": 1, "receipt": 1, "audit": 1}
        assert executions(sql, run_id) == {"take": 1, "ship": 1}
