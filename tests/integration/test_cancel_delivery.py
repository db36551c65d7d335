"""A cancellation reaches a running handler within a second (LISTEN/NOTIFY), and still at the
next lease renewal when no notification arrives.

Real role processes (tests/e2e.py) on the session database and broker. The handler
``e2e.cancel_seen`` polls ``ctx.cancelled`` every 5 ms and records, on the database clock, when
it saw it; the heartbeat is 30 s, so a cancel seen within a second came by notification.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from tests.cancel_probes import PROMPT_S, SLOW_RENEWAL, cli, listeners, seen_at
from tests.e2e import Stack
from tests.helpers import single, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]


def _started(sql: Sql, task_id: UUID) -> bool:
    found = sql.execute(
        "SELECT 1 FROM test_executions WHERE task_run_id = %s AND handler = 'e2e.cancel_seen'",
        (task_id,),
    ).fetchone()
    return found is not None


def _lease_expiry(sql: Sql, task_id: UUID) -> datetime:
    row = sql.execute("SELECT lease_expires_at FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row is not None and row[0] is not None
    return row[0]


def _wait_listening(sql: Sql, task_id: UUID) -> None:
    """Until the worker LISTENs and has made the renewal its listener asks for on connecting:
    the next renewal is then a heartbeat (30 s) away, so only a notification is prompt."""
    claimed = _lease_expiry(sql, task_id)
    wait_for(lambda: listeners(sql) >= 1, timeout=10, what="the worker to LISTEN")
    wait_for(
        lambda: _lease_expiry(sql, task_id) > claimed,
        timeout=10,
        what="the renewal that follows the LISTEN",
    )


def _cancel_by_cli(stack: Stack, run_id: UUID) -> None:
    cli(stack, "cancel", str(run_id))


def _task_of(repo: Store, run_id: UUID, name: str = "only") -> UUID:
    return next(t.id for t in repo.get_run(run_id).tasks if t.name == name)


def test_flowforge_cancel_reaches_a_running_handler_within_a_second(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start_all(workers=1, worker=SLOW_RENEWAL)
    run_id = repo.trigger(single("cancel-prompt", "e2e.cancel_seen"), {}).run_id
    task_id = _task_of(repo, run_id)
    wait_for(lambda: _started(sql, task_id), timeout=20, what="the handler to start")
    _wait_listening(sql, task_id)

    _cancel_by_cli(stack, run_id)
    seen = wait_for(lambda: seen_at(sql, task_id), timeout=20, what="the handler to see it")
    row = sql.execute(
        "SELECT cancel_requested_at FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None and row[0] is not None
    latency = seen - row[0]
    print(f"cancel → ctx.cancelled seen: {latency.total_seconds() * 1000:.1f} ms")
    assert latency < timedelta(seconds=PROMPT_S), latency

    wait_for(lambda: repo.get_task(task_id).state is TaskState.CANCELLED, timeout=20)
    task = repo.get_task(task_id)
    assert task.result == {"stopped": True}
    assert task.failure_reason is FailureReason.CANCELLED
    wait_for(lambda: repo.get_run(run_id).state is RunState.CANCELLED, timeout=20)


def test_fail_fast_stopping_a_running_sibling_reaches_it_within_a_second(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start_all(workers=2, worker=SLOW_RENEWAL)
    workflow = WorkflowDef(
        "cancel-fail-fast",
        (TaskDef("slow", "e2e.cancel_seen"), TaskDef("bad", "e2e.gate_then_fail")),
    )
    gate = stack.directory / "gate"
    run_id = repo.trigger(workflow, {"gate": str(gate)}).run_id
    slow_id, bad_id = _task_of(repo, run_id, "slow"), _task_of(repo, run_id, "bad")
    wait_for(lambda: _started(sql, slow_id), timeout=20, what="the slow sibling to start")
    _wait_listening(sql, slow_id)
    gate.touch()  # the sibling now dies; fail-fast stops the slow one

    seen = wait_for(lambda: seen_at(sql, slow_id), timeout=20, what="the sibling to be stopped")
    dead = sql.execute("SELECT finished_at FROM task_runs WHERE id = %s", (bad_id,)).fetchone()
    assert dead is not None and dead[0] is not None
    # from its death to the stop: a scheduler pass (0.2 s here), then the notification
    assert seen - dead[0] < timedelta(seconds=PROMPT_S), seen - dead[0]
    wait_for(lambda: repo.get_task(slow_id).state is TaskState.CANCELLED, timeout=20)
    assert repo.get_task(bad_id).state is TaskState.DEAD


def test_with_the_listener_off_renewal_still_delivers_the_cancel(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    renewal = {"lease_s": 6.0, "heartbeat_s": 2.0, "listen_for_cancel": False}
    stack.start_all(workers=1, worker=renewal)
    run_id = repo.trigger(single("cancel-renewal", "e2e.cancel_seen"), {}).run_id
    task_id = _task_of(repo, run_id)
    wait_for(lambda: _started(sql, task_id), timeout=20, what="the handler to start")

    _cancel_by_cli(stack, run_id)
    seen = wait_for(lambda: seen_at(sql, task_id), timeout=20, what="the handler to see it")
    assert listeners(sql) == 0, "the listener was off: renewal delivered it"
    row = sql.execute(
        "SELECT cancel_requested_at FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None and seen - row[0] < timedelta(seconds=2.0 + 1.0)
    wait_for(lambda: repo.get_task(task_id).state is TaskState.CANCELLED, timeout=20)
    assert repo.get_task(task_id).result == {"stopped": True}
