"""A worker above processes.max_memory_mb_per_child finishes its task and asks to be replaced."""

from __future__ import annotations

import psycopg
import pytest

from flowforge.domain.states import RunState
from flowforge.store.repository import Repository
from supervisor.exitcodes import CHILD_RECYCLE
from tests.e2e import Stack
from tests.helpers import single, wait_for

pytestmark = pytest.mark.integration


def test_a_worker_over_its_memory_limit_finishes_the_task_then_exits_to_be_recycled(
    stack: Stack, repo: Repository, sql: psycopg.Connection[tuple[object, ...]]
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
