"""A worker above processes.max_memory_mb_per_child finishes its task and asks to be replaced."""

from __future__ import annotations

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState, TaskState
from supervisor.exitcodes import CHILD_RECYCLE
from tests.e2e import Stack
from tests.helpers import single, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes


def test_a_worker_over_its_memory_limit_finishes_the_task_then_exits_to_be_recycled(
    stack: Stack, repo: Store, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    # any Python process is above 1 MB: the first finished task must trigger the recycle
    worker = stack.start("worker", processes={"max_memory_mb_per_child": 1})
    run_id = repo.trigger(single("recycled", "e2e.record"), {"n": 1}).run_id
    wait_for(lambda: repo.get_run(run_id).state is RunState.SUCCEEDED, timeout=30, what="the run")
    assert worker.wait(timeout=30) == CHILD_RECYCLE
    assert "recycling at" in worker.log()
    executions = sql.execute("SELECT count(*) FROM test_executions").fetchone()
    assert executions == (1,)


def test_a_worker_recycled_right_after_its_finish_claimed_the_next_step_hands_it_back(
    stack: Stack, repo: Store, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The finish of step a claims step b for the same worker (in the finishing transaction);
    the memory check right after it asks for a recycle. The worker must hand b back (READY
    again, attempt un-counted, a new outbox row) before it exits, so another worker runs it at
    once, not after b's lease has lapsed. No scheduler runs: nothing else could bring b back."""
    stack.start("publisher")
    recycled = stack.start("worker", processes={"max_memory_mb_per_child": 1})
    steps = (TaskDef("a", "e2e.record"), TaskDef("b", "e2e.record", depends_on=("a",)))
    run_id = repo.trigger(WorkflowDef("handed-back", steps)).run_id
    assert recycled.wait(timeout=30) == CHILD_RECYCLE
    assert "recycling at" in recycled.log()
    b = next(t for t in repo.get_run(run_id).tasks if t.name == "b")
    assert (b.state, b.attempt) == (TaskState.READY, 0), "b was not handed back"
    outbox = sql.execute(
        "SELECT published_at IS NOT NULL FROM outbox WHERE task_run_id = %s ORDER BY id", (b.id,)
    ).fetchall()
    assert len(outbox) == 2 and outbox[0] == (True,)  # claimed with the finish, handed back

    successor = stack.start("worker")
    wait_for(lambda: repo.get_task(b.id).state is TaskState.SUCCEEDED, timeout=30, what="b")
    executions = sql.execute(
        "SELECT t.name, e.pid, t.attempt FROM test_executions e"
        " JOIN task_runs t ON t.id = e.task_run_id ORDER BY t.seq"
    ).fetchall()
    assert executions == [("a", recycled.pid, 1), ("b", successor.pid, 1)]
