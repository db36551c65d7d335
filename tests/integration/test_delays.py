"""Delayed runs, durable timers and deadlines (issue 18, SPEC 7.2) against real PostgreSQL.

Every instant here is the database's: tests read ``now()`` and compare stored timestamps, and
"not before its time" is checked as ``start statement's now() >= start_at`` in the rows.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason, RunFailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError
from flowforge.store.db import Database
from tests.helpers import claim_task, drain, race, task_ids, until_idle, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

TWO = WorkflowDef(
    "two", (TaskDef("a", "tests.noop"), TaskDef("b", "tests.noop", depends_on=("a",)))
)
TIMED = WorkflowDef(
    "timed",
    (
        TaskDef("a", "tests.noop"),
        TaskDef("nap", sleep=1.0, depends_on=("a",)),
        TaskDef("b", "tests.noop", depends_on=("nap",)),
    ),
)
LONG_NAP = WorkflowDef(
    "long-nap", (TaskDef("nap", sleep=3600.0), TaskDef("after", "tests.noop", depends_on=("nap",)))
)
DEADLINED = WorkflowDef(
    "deadlined",
    (
        TaskDef("a", "tests.noop"),
        TaskDef("b", "tests.noop", depends_on=("a",)),
        TaskDef("c", "tests.noop"),
    ),
    deadline=3600.0,
)


def db_now(sql: Sql) -> datetime:
    row = sql.execute("SELECT now()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def outbox_rows(sql: Sql, run_id: uuid.UUID) -> int:
    return int(
        scalar(
            sql,
            "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
            " WHERE t.run_id = %s",
            run_id,
        )
    )


def count(sql: Sql, table: str) -> int:
    return int(scalar(sql, f"SELECT count(*) FROM {table}"))


# ------------------------------------------------------------------ delayed runs


def test_a_delayed_run_is_scheduled_listed_and_never_dispatched_before_its_time(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(TWO, {"n": 1}, delay=3600).run_id
    drain(repo)  # every pass, many times: nothing may start it
    run = repo.get_run(run_id)
    assert run.state is RunState.SCHEDULED and run.started_at is None
    assert run.start_at is not None
    assert 3599 <= (run.start_at - run.created_at).total_seconds() <= 3601  # on the db clock
    assert {t.name: t.state for t in run.tasks} == {"a": TaskState.PENDING, "b": TaskState.PENDING}
    assert outbox_rows(sql, run_id) == 0
    assert [r.id for r in repo.list_runs(state="SCHEDULED")] == [run_id]
    assert repo.list_runs(state="PENDING") == []


def test_a_delayed_run_starts_once_at_its_time_on_the_database_clock(repo: Store, sql: Sql) -> None:
    start_at = db_now(sql) + timedelta(seconds=1.5)
    # the same instant written with another offset: the run starts at the instant, not a text
    shifted = start_at.astimezone(timezone(timedelta(hours=14)))
    run_id = repo.trigger(TWO, start_at=shifted).run_id
    assert repo.start_due_runs(100) == 0  # not yet
    wait_for(lambda: repo.start_due_runs(100), timeout=10, what="the start time")
    started_row = sql.execute(
        "SELECT state, start_at, updated_at FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert started_row is not None
    assert started_row[0] == "PENDING" and started_row[1] == start_at
    assert started_row[2] >= start_at  # the statement's now(): never before its time
    assert repo.start_due_runs(100) == 0  # once
    drain(repo)
    ids = task_ids(repo, run_id)
    assert repo.get_task(ids["a"]).state is TaskState.READY
    assert repo.get_task(ids["b"]).state is TaskState.PENDING  # its real dependency remains
    assert outbox_rows(sql, run_id) == 1
    assert scalar(sql, "SELECT pending_deps FROM task_runs WHERE id = %s", ids["a"]) == 0


def test_two_schedulers_racing_start_each_due_run_exactly_once(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    results = repo.trigger_many(TWO, [{"i": i} for i in range(60)], delay=3600)
    sql.execute("UPDATE workflow_runs SET start_at = now() - interval '1 second'")
    scheduler = until_idle(lambda own: own.start_due_runs(7))
    assert sum(race(clean_database_url, scheduler, scheduler)) == len(results) == 60
    drain(repo)
    # every root was released once: one READY root and one outbox row per run, no gate left
    assert count(sql, "outbox") == 60
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE start_gate") == 0
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE state = 'READY'") == 60
    assert scalar(sql, "SELECT count(*) FROM workflow_runs WHERE state = 'SCHEDULED'") == 0


def test_cancelling_a_scheduled_run_cancels_it_at_once_and_nothing_ever_runs(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(TWO, delay=3600).run_id
    run = repo.cancel_run(run_id)
    assert run.state is RunState.CANCELLED and run.finished_at is not None
    assert {t.state for t in run.tasks} == {TaskState.CANCELLED}
    sql.execute("UPDATE workflow_runs SET start_at = now() - interval '1 second'")
    assert repo.start_due_runs(100) == 0
    drain(repo)
    assert repo.get_run(run_id).state is RunState.CANCELLED
    assert outbox_rows(sql, run_id) == 0 and count(sql, "task_attempts") == 0


def test_cancels_racing_starts_leave_every_run_cancelled_and_nothing_claimable(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """Either the cancel commits first (the run never starts) or the start does (the usual
    cancel of a PENDING run); a lock-order deadlock between them is retried, never surfaced."""
    runs = [r.run_id for r in repo.trigger_many(TWO, [{"i": i} for i in range(40)], delay=3600)]
    sql.execute("UPDATE workflow_runs SET start_at = now() - interval '1 second'")
    errors: list[BaseException] = []

    def starter() -> None:
        database = Database(DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=2))
        database.open()
        try:
            own = Store(database)
            while own.start_due_runs(1) or own.promote_ready(10):
                pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            database.close()

    thread = threading.Thread(target=starter)
    thread.start()
    for run_id in runs:
        repo.cancel_run(run_id)
    thread.join(timeout=60)
    assert not errors, errors
    drain(repo)
    states = {repo.get_run(run_id).state for run_id in runs}
    assert states == {RunState.CANCELLED}
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE state <> 'CANCELLED'") == 0
    # a message already published for a task cancelled after its start names a stale token
    stale = scalar(
        sql,
        "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
        " WHERE o.fencing_token = t.fencing_token",
    )
    assert stale == 0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"start_at": "past"}, "start_at"),
        ({"start_at": datetime(2030, 1, 1, 9)}, "no UTC offset"),
        ({"start_at": datetime(9999, 1, 1, tzinfo=UTC)}, "days ahead"),
        ({"start_at": "2030-01-01T00:00:00Z"}, "start_at must be a datetime"),
        ({"delay": 0}, "delay"),
        ({"delay": -5}, "delay"),
        ({"delay": float("nan")}, "delay"),
        ({"delay": 10**12}, "delay"),
        ({"delay": "10m"}, "delay must be a number"),
        ({"delay": 10, "start_at": "future"}, "not both"),
        ({"deadline": 0}, "deadline"),
        ({"deadline": True}, "deadline"),
    ],
)
def test_bad_timing_is_an_input_error_and_nothing_is_stored(
    repo: Store, sql: Sql, kwargs: dict[str, Any], fragment: str
) -> None:
    now = db_now(sql)
    values = {"past": now - timedelta(minutes=5), "future": now + timedelta(hours=1)}
    given = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(InputError, match=fragment):
        repo.trigger(TWO, **given)
    assert count(sql, "workflow_runs") == 0 and count(sql, "task_runs") == 0


def test_a_start_time_within_the_tolerance_before_now_is_accepted_and_starts_at_once(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(TWO, start_at=db_now(sql) - timedelta(seconds=20)).run_id
    assert repo.get_run(run_id).state is RunState.SCHEDULED
    assert repo.start_due_runs(100) == 1


# ------------------------------------------------------------------ durable timers


def test_a_timer_holds_no_worker_and_succeeds_at_its_wake_time(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(TIMED).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    nap = repo.get_task(ids["nap"])
    assert nap.state is TaskState.RUNNING and nap.wake_at is not None and nap.sleep_s == 1.0
    assert nap.lease_owner is None and nap.lease_expires_at is None and nap.attempt == 0
    assert nap.started_at is not None
    assert (nap.wake_at - nap.started_at).total_seconds() == pytest.approx(1.0, abs=0.01)
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", ids["nap"]) == 0
    assert repo.reap_expired(100) == 0  # no lease: never reaped as lost
    assert repo.get_task(ids["b"]).state is TaskState.PENDING
    wait_for(lambda: repo.wake_timers(100), timeout=10, what="the timer to wake")
    woke = repo.get_task(ids["nap"])
    assert woke.state is TaskState.SUCCEEDED and woke.finished_at is not None
    assert woke.finished_at >= nap.wake_at  # never before its wake time
    b = repo.get_task(ids["b"])
    assert b.state is TaskState.READY  # released by the wake, as a finish releases
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", ids["b"]) == 1
    claim = claim_task(repo, sql, ids["b"])
    assert repo.finish(ids["b"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    assert scalar(sql, "SELECT count(*) FROM task_attempts WHERE task_run_id = %s", ids["nap"]) == 0


def test_a_root_timer_starts_its_run_and_cancelling_the_run_ends_it_at_once(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(LONG_NAP).run_id
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.RUNNING and run.task("nap").state is TaskState.RUNNING
    cancelled = repo.cancel_run(run_id)
    assert cancelled.state is RunState.CANCELLED and cancelled.finished_at is not None
    assert cancelled.task("nap").state is TaskState.CANCELLED
    assert cancelled.task("after").state is TaskState.CANCELLED
    sql.execute("UPDATE task_runs SET wake_at = now() - interval '1 second'")
    assert repo.wake_timers(100) == 0
    assert count(sql, "outbox") == 0


def test_a_timer_is_woken_by_any_scheduler_after_a_restart(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id = repo.trigger(LONG_NAP).run_id
    drain(repo)
    sql.execute("UPDATE task_runs SET wake_at = now() WHERE name = 'nap'")
    # a fresh pool, as a restarted scheduler has: the timer is only rows
    other = Database(DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=2))
    other.open()
    try:
        assert Store(other).wake_timers(100) == 1
    finally:
        other.close()
    drain(repo)
    assert repo.get_run(run_id).task("after").state is TaskState.READY


# ------------------------------------------------------------------ deadlines


def test_the_deadline_ends_a_run_failed_cancels_waiting_tasks_and_asks_running_ones_to_stop(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(DEADLINED, deadline=1).run_id  # the trigger's deadline wins
    run = repo.get_run(run_id)
    assert run.deadline_at is not None
    assert (run.deadline_at - run.created_at).total_seconds() == pytest.approx(1.0, abs=0.01)
    ids = task_ids(repo, run_id)
    drain(repo)
    claim = claim_task(repo, sql, ids["a"])
    wait_for(lambda: repo.expire_deadlines(100), timeout=10, what="the deadline")
    run = repo.get_run(run_id)
    assert run.failure_reason is RunFailureReason.DEADLINE_EXCEEDED
    assert run.state is RunState.RUNNING and run.finished_at is None  # a still runs
    assert run.task("b").state is TaskState.CANCELLED
    assert run.task("c").state is TaskState.CANCELLED
    causes = dict(sql.execute("SELECT name, cancel_cause FROM task_runs").fetchall())
    assert causes == {"a": "deadline", "b": "deadline", "c": "deadline"}
    assert repo.renew_lease(ids["a"], claim.fencing_token, 30).cancel_requested  # ctx.cancelled
    assert repo.expire_deadlines(100) == 0  # once
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.CANCELLED)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert run.failure_reason is RunFailureReason.DEADLINE_EXCEEDED
    assert run.task("a").failure_reason is FailureReason.CANCELLED


def test_the_workflow_deadline_applies_and_a_delayed_run_counts_it_from_its_start(
    repo: Store, sql: Sql
) -> None:
    plain = repo.get_run(repo.trigger(DEADLINED).run_id)
    assert plain.deadline_at is not None
    assert (plain.deadline_at - plain.created_at).total_seconds() == pytest.approx(3600, abs=0.01)
    start_at = db_now(sql) + timedelta(days=2)
    delayed = repo.get_run(repo.trigger(DEADLINED, start_at=start_at).run_id)
    assert delayed.deadline_at == start_at + timedelta(hours=1)
    untimed = repo.get_run(repo.trigger(TWO).run_id)
    assert untimed.deadline_at is None and untimed.start_at is None


def test_a_run_past_both_start_and_deadline_is_failed_without_dispatching(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(DEADLINED, delay=3600).run_id
    sql.execute(
        "UPDATE workflow_runs SET start_at = now() - interval '2 hours',"
        " deadline_at = now() - interval '1 hour'"
    )
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.failure_reason is RunFailureReason.DEADLINE_EXCEEDED
    assert outbox_rows(sql, run_id) == 0


def test_an_operator_cancellation_before_the_deadline_stays_a_cancellation(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(DEADLINED).run_id
    repo.cancel_run(run_id)
    sql.execute("UPDATE workflow_runs SET deadline_at = now() - interval '1 second'")
    assert repo.expire_deadlines(100) == 0
    run = repo.get_run(run_id)
    assert run.state is RunState.CANCELLED and run.failure_reason is None


def test_a_deadline_ends_a_sleeping_timer(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(LONG_NAP, deadline=3600).run_id
    drain(repo)
    sql.execute("UPDATE workflow_runs SET deadline_at = now() - interval '1 second'")
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert run.task("nap").state is TaskState.CANCELLED
    assert run.task("after").state is TaskState.CANCELLED


def test_next_due_is_measured_on_the_database_clock(repo: Store, sql: Sql) -> None:
    assert repo.next_due_s() is None
    repo.trigger(TWO, delay=30)
    due = repo.next_due_s()
    assert due is not None and 28 < due <= 30
    repo.trigger(DEADLINED, deadline=5)
    due = repo.next_due_s()
    assert due is not None and 3 < due <= 5


def test_a_handler_that_ignores_the_deadline_finishes_but_the_run_still_fails(
    repo: Store, sql: Sql
) -> None:
    """The run stays RUNNING (failure_reason set) until the handler ends; its success counts,
    and the run reads FAILED, deadline_exceeded, with the tasks that never started cancelled."""
    run_id = repo.trigger(DEADLINED).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    claim = claim_task(repo, sql, ids["a"])
    sql.execute("UPDATE workflow_runs SET deadline_at = now() - interval '1 second'")
    assert repo.expire_deadlines(100) == 1
    drain(repo)
    during = repo.get_run(run_id)
    assert during.state is RunState.RUNNING and during.finished_at is None
    assert during.failure_reason is RunFailureReason.DEADLINE_EXCEEDED
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED, result={"late": 1})
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert run.task("a").state is TaskState.SUCCEEDED
    assert run.task("b").state is TaskState.CANCELLED  # never released by the late success
    # nothing was dispatched after the deadline: b never had an outbox row
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", ids["b"]) == 0
