"""``scripts/bench --stored`` fills its database with rows the store itself reads back as a
deployment's: a READY backlog, finished runs, and failed runs with DEAD tasks
(tests/harness/stored_fill.py). A row the store cannot read (a failure reason it does not
know, say) would make every figure of the loaded phase measure an error instead."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.reasons import FailureReason
from flowforge.store.db import Database
from flowforge.store.reads import Reads
from tests.harness import stored_fill

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def test_the_fill_is_read_back_by_the_store_as_written(clean_database_url: str, sql: Sql) -> None:
    took = stored_fill.fill(clean_database_url, backlog=30, finished=20, dead=10)
    assert set(took) == {"backlog_s", "finished_s", "dead_s", "vacuum_s"}

    db = Database(DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=1), "fill-test")
    db.open()
    try:
        reads = Reads(db)
        assert reads.task_state_counts() == {"READY": 30, "SUCCEEDED": 20, "DEAD": 10}
        stats = reads.stats(3)
    finally:
        db.close()
    # ten dead tasks over the handlers, every one of the dead workflow, after all its attempts
    assert {d.workflow for d in stats.dead} == {stored_fill.DEAD_WORKFLOW.name}
    assert {d.reason for d in stats.dead} == {FailureReason.MAX_ATTEMPTS_EXCEEDED}
    assert sum(d.n for d in stats.dead) == 10
    assert len(stats.dead) == stored_fill.DEAD_HANDLERS
    assert stats.failure_reasons == {"handler_error": 10 * stored_fill.DEAD_ATTEMPTS}
    assert stats.attempts == {0: 30, 1: 20, stored_fill.DEAD_ATTEMPTS: 10}

    runs = dict(sql.execute("SELECT state, count(*) FROM workflow_runs GROUP BY state").fetchall())
    assert runs == {"RUNNING": 30, "SUCCEEDED": 20, "FAILED": 10}
    # a dispatch and an attempt per attempt made, every dispatch published
    outbox = sql.execute(
        "SELECT count(*), count(published_at), count(DISTINCT (task_run_id, fencing_token))"
        " FROM outbox"
    ).fetchone()
    assert outbox == (30 + 20 + 10 * stored_fill.DEAD_ATTEMPTS,) * 3
    attempts = sql.execute("SELECT outcome, count(*) FROM task_attempts GROUP BY 1").fetchall()
    assert dict(attempts) == {"succeeded": 20, "failed": 10 * stored_fill.DEAD_ATTEMPTS}
