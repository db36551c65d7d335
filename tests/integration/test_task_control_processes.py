"""Control of single tasks on live role processes (issue 20): `flowforge task cancel` and
`flowforge task bury` stop the one running handler they name — within a second, by the
``task:`` notification (the lease renewal is 30 s away) — and leave its running sibling of the
same run alone; counted in the database (test_executions, task states, task_audit).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import CancelCause, RunState, TaskState
from tests.cancel_probes import PROMPT_S, SLOW_RENEWAL, cli, listeners, seen_at
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

#: Three handlers that run until stopped (one worker each), not fail-fast: burying one must
#: not stop the others through fail-fast, so what stops them is the operator alone.
LIVE = WorkflowDef(
    "control-live",
    (
        TaskDef("a", "e2e.cancel_seen"),
        TaskDef("a_next", "e2e.record", depends_on=("a",)),
        TaskDef("b", "e2e.cancel_seen"),
        TaskDef("b_next", "e2e.record", depends_on=("b",)),
        TaskDef("c", "e2e.gate"),
    ),
    fail_fast=False,
)


def executions(sql: Sql, task_id: UUID, handler: str) -> int:
    row = sql.execute(
        "SELECT count(*) FROM test_executions WHERE task_run_id = %s AND handler = %s",
        (task_id, handler),
    ).fetchone()
    assert row is not None
    return int(row[0])


def requested_at(sql: Sql, task_id: UUID) -> datetime:
    row = sql.execute(
        "SELECT requested_at FROM task_audit WHERE task_run_id = %s", (task_id,)
    ).fetchone()
    assert row is not None
    return row[0]


def test_cancel_and_bury_stop_the_one_running_handler_they_name(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start_all(workers=3, worker=SLOW_RENEWAL)
    gate = stack.directory / "gate"
    run_id = repo.trigger(LIVE, {"gate": str(gate)}).run_id
    ids = {t.name: t.id for t in repo.get_run(run_id).tasks}
    for name, handler in (("a", "e2e.cancel_seen"), ("b", "e2e.cancel_seen"), ("c", "e2e.gate")):
        wait_for(
            lambda n=name, h=handler: executions(sql, ids[n], h) == 1,
            timeout=30,
            what=f"{name} to start",
        )
    wait_for(lambda: listeners(sql) >= 3, timeout=20, what="every worker to LISTEN")

    out = cli(stack, "task", "cancel", str(ids["a"]), "--reason", "not wanted", "--by", "ops")
    assert "asked to stop" in out
    out = cli(stack, "task", "bury", str(ids["b"]), "--reason", "poison", "--by", "ops")
    assert "DEAD (operator)" in out

    for name in ("a", "b"):  # each stopped by its own notification, within a second
        seen = wait_for(lambda n=name: seen_at(sql, ids[n]), timeout=20, what=f"{name} stopped")
        latency = seen - requested_at(sql, ids[name])
        print(
            f"task {name}: request → ctx.cancelled seen in {latency.total_seconds() * 1000:.1f} ms"
        )
        assert latency < timedelta(seconds=PROMPT_S), latency
    wait_for(lambda: repo.get_task(ids["a"]).state is TaskState.CANCELLED, timeout=20)
    wait_for(lambda: repo.get_task(ids["b"]).state is TaskState.DEAD, timeout=20)
    wait_for(
        lambda: (
            {repo.get_task(ids[n]).state for n in ("a_next", "b_next")} == {TaskState.CANCELLED}
        ),
        timeout=20,
        what="what only they fed to be cancelled",
    )
    a, b = repo.get_task(ids["a"]), repo.get_task(ids["b"])
    assert (a.cancel_cause, a.result) == (CancelCause.OPERATOR, {"stopped": True})
    assert (b.failure_reason, b.cancel_cause) == (FailureReason.OPERATOR, None)
    assert repo.get_task(ids["a_next"]).cancel_cause is CancelCause.UPSTREAM
    # the sibling of the same run was neither asked to stop nor stopped
    c = repo.get_task(ids["c"])
    assert (c.state, c.cancel_requested) == (TaskState.RUNNING, False)
    gate.touch()
    wait_for(lambda: repo.get_run(run_id).finished_at is not None, timeout=30, what="the run")
    assert repo.get_task(ids["c"]).state is TaskState.SUCCEEDED
    assert repo.get_run(run_id).state is RunState.FAILED  # b is DEAD
    # each handler ran once; nothing downstream of a stopped one ran at all
    assert [
        executions(sql, ids[n], h)
        for n, h in (("a", "e2e.cancel_seen"), ("b", "e2e.cancel_seen"), ("c", "e2e.gate"))
    ] == [1, 1, 1]
    assert executions(sql, ids["a_next"], "e2e.record") == 0
    assert executions(sql, ids["b_next"], "e2e.record") == 0
    audit = sql.execute(
        "SELECT t.name, a.action, a.requested_by, a.reason, a.previous_state, a.new_state"
        " FROM task_audit a JOIN task_runs t ON t.id = a.task_run_id ORDER BY a.id"
    ).fetchall()
    assert audit == [
        ("a", "cancel", "ops", "not wanted", "RUNNING", "RUNNING"),
        ("b", "bury", "ops", "poison", "RUNNING", "RUNNING"),
    ]
