"""Conditions and compensation through real role processes (issue 19): the scheduler that
evaluates ``run_if`` conditions is SIGKILLed again and again while sagas fail and succeed;
every compensation runs exactly once where a shipment died and never where it did not."""

from __future__ import annotations

import signal
from typing import Any

import psycopg
import pytest

from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]


def saga(name: str, ship: str) -> WorkflowDef:
    return WorkflowDef(
        name,
        (
            TaskDef("charge", "e2e.record"),
            TaskDef("ship", ship, depends_on=("charge",)),
            TaskDef("refund", "e2e.record", depends_on=("ship",), run_if=RunIf.ANY_FAILED),
        ),
    )


def scalar(sql: Sql, query: str) -> int:
    row = sql.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def test_killing_the_condition_scheduler_never_runs_a_compensation_twice_nor_loses_one(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    failing = [r.run_id for r in repo.trigger_many(saga("saga-dies", "e2e.permanent"), [{}] * 30)]
    passing = [r.run_id for r in repo.trigger_many(saga("saga-ships", "e2e.record"), [{}] * 30)]
    stack.start("publisher")
    # a long lease and no slow-handler hand-back: a worker starved of CPU then neither loses a
    # lease nor hands a claim back, each of which dispatches its task again (a new outbox
    # row), so the outbox counts the scheduler's decisions alone
    stack.start("worker", worker={"lease_s": 30.0, "heartbeat_s": 1.0, "fast_handler_ms": 30000})
    refunds = "SELECT count(*) FROM test_executions WHERE task = 'refund'"
    decided = (
        "SELECT count(*) FROM task_runs WHERE name = 'refund'"
        " AND (pending_deps = 0 OR state <> 'PENDING')"
    )
    for round_ in range(3):  # kill the evaluating scheduler part-way, three times
        scheduler = stack.start("scheduler")
        target = (round_ + 1) * 15
        wait_for(lambda t=target: scalar(sql, decided) >= min(t, 60), timeout=60, what="decisions")
        scheduler.signal(signal.SIGKILL)
        scheduler.wait()
    stack.start("scheduler")
    wait_for(
        lambda: all(repo.get_run(r).finished_at is not None for r in failing + passing),
        timeout=120,
        what="every run to finish",
    )
    for run_id in failing:
        run = repo.get_run(run_id)
        assert run.state is RunState.FAILED and run.compensated == ("refund",)
    for run_id in passing:
        run = repo.get_run(run_id)
        assert run.state is RunState.SUCCEEDED and run.task("refund").skipped
    per_run = sql.execute(
        "SELECT t.run_id, count(e.id) FROM task_runs t"
        " LEFT JOIN test_executions e ON e.task_run_id = t.id"
        " WHERE t.name = 'refund' GROUP BY t.run_id"
    ).fetchall()
    counts = {run_id: n for run_id, n in per_run}
    assert all(counts[r] == 1 for r in failing), counts  # each exactly once
    assert all(counts[r] == 0 for r in passing), counts  # never where nothing died
    assert scalar(sql, refunds) == 30
    # one dispatch per compensation, and no gate counted below zero
    assert (
        scalar(
            sql,
            "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
            " WHERE t.name = 'refund'",
        )
        == 30
    )
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE pending_deps < 0") == 0
