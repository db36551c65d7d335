"""A workflow DAG of several levels through real scheduler, publisher and worker processes."""

from __future__ import annotations

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState, TaskState
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

LEVELS = WorkflowDef(
    "levels",
    (
        TaskDef("extract", "e2e.record"),
        TaskDef("left", "e2e.record", depends_on=("extract",)),
        TaskDef("right", "e2e.record", depends_on=("extract",)),
        TaskDef("join", "e2e.record", depends_on=("left", "right")),
        TaskDef("report", "e2e.record", depends_on=("join",)),
    ),
)


def test_a_dag_of_several_levels_runs_to_succeeded_through_all_three_roles(
    stack: Stack, repo: Store, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    stack.start_all(workers=2)
    run_ids = [repo.trigger(LEVELS, {"n": i}).run_id for i in range(5)]

    def all_succeeded() -> bool:
        return all(repo.get_run(r).state is RunState.SUCCEEDED for r in run_ids)

    wait_for(all_succeeded, timeout=60, what="every run to succeed")
    for run_id in run_ids:
        run = repo.get_run(run_id)
        assert all(t.state is TaskState.SUCCEEDED and t.attempt == 1 for t in run.tasks)
        # upstream results are visible downstream
        assert set(run.task("join").result["upstream"]) == {"left", "right"}
        assert run.task("join").result["upstream"]["left"]["task"] == "left"
        assert set(run.task("report").result["upstream"]) == {"join"}
    executions = sql.execute(
        "SELECT task_run_id, count(*) FROM test_executions GROUP BY task_run_id"
    ).fetchall()
    assert len(executions) == 5 * len(LEVELS.tasks)
    assert all(count == 1 for _, count in executions)
    pending = sql.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()
    assert pending == (0,)
