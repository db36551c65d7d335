"""SPEC section 2 against real PostgreSQL, one behaviour per test.

Proven here, by counting rows in the database after driving the repository the way the roles
will (trigger, scheduler passes, claim, renew, finish, operator actions):

- a trigger is one transaction, and its idempotency key replays or conflicts;
- a DAG runs to SUCCEEDED with upstream results handed to downstream claims;
- failures retry on the database clock, exhaust into DEAD with the whole attempt history, and
  non-retryable reasons (permanent error, unknown handler, unserialisable result) and crash
  loops go DEAD at once;
- fail-fast, non-fail-fast and operator cancellation stop exactly what they should;
- requeue of a dead task is refused when it must be, audited, revives what the death
  cancelled and restores a retry budget;
- ordering-key streams, with ``on_dead`` release and block;
- illegal transitions raise before any SQL; run states are derived from task states;
- retention purges old finished runs in bounded batches and keeps the rest.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain import transitions
from flowforge.domain.dag import OnDead, TaskDef, WorkflowDef
from flowforge.domain.model import ClaimOutcome
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import (
    IllegalTransitionError,
    InputError,
    InvalidIdError,
    NotDeadError,
    NotFoundError,
    StoreError,
    TriggerConflictError,
)
from flowforge.store.db import Database
from tests.helpers import (
    FAST_RETRY,
    chain,
    claim_task,
    diamond,
    dispatch,
    drain,
    expire_lease,
    outbox_token,
    scheduler_pass,
    single,
    task_ids,
    wait_for,
)
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

ALL_TABLES = (
    "workflow_definitions",
    "workflow_runs",
    "task_runs",
    "task_edges",
    "task_attempts",
    "outbox",
    "idempotency_keys",
    "requeue_audit",
)


def count(sql: Sql, table: str, where: str = "true", params: tuple[Any, ...] = ()) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table} WHERE {where}", params).fetchone()
    assert row is not None
    return int(row[0])


def db_now(sql: Sql) -> Any:
    row = sql.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def succeed(repo: Store, sql: Sql, task_id: uuid.UUID, result: Any = None) -> None:
    claim = claim_task(repo, sql, task_id)
    assert repo.finish(task_id, claim.fencing_token, TaskState.SUCCEEDED, result=result)


def fail(
    repo: Store,
    sql: Sql,
    task_id: uuid.UUID,
    reason: FailureReason = FailureReason.HANDLER_ERROR,
    error: str = "boom",
    worker: str = "worker-1",
) -> None:
    claim = claim_task(repo, sql, task_id, worker=worker)
    assert repo.finish(task_id, claim.fencing_token, TaskState.FAILED, reason=reason, error=error)


def fanout(
    name: str = "fanout", fail_fast: bool = True, retry: RetryPolicy = FAST_RETRY
) -> WorkflowDef:
    """x, y and z are independent; w depends on x."""
    return WorkflowDef(
        name,
        (
            TaskDef("x", "tests.noop", retry=retry),
            TaskDef("y", "tests.noop", retry=retry),
            TaskDef("z", "tests.noop", retry=retry),
            TaskDef("w", "tests.noop", depends_on=("x",), retry=retry),
        ),
        fail_fast=fail_fast,
    )


def states(repo: Store, run_id: uuid.UUID) -> dict[str, TaskState]:
    return {t.name: t.state for t in repo.get_run(run_id).tasks}


# ------------------------------------------------------------------ trigger


def test_trigger_creates_the_run_and_its_tasks_together(repo: Store, sql: Sql) -> None:
    result = repo.trigger(diamond(), {"order_id": 7})
    assert result.created
    run = repo.get_run(result.run_id)
    assert run.state is RunState.PENDING and run.input == {"order_id": 7}
    # the root has nothing to wait for: it is READY with its dispatch, without a scheduler pass
    assert {t.name: t.state for t in run.tasks} == {
        "a": TaskState.READY,
        **dict.fromkeys("bcd", TaskState.PENDING),
    }
    pending = dict(
        sql.execute("SELECT name, pending_deps FROM task_runs WHERE run_id = %s", (run.id,))
    )
    assert pending == {"a": 0, "b": 1, "c": 1, "d": 2}
    assert count(sql, "task_edges") == 4
    assert count(sql, "workflow_definitions") == 1
    root = task_ids(repo, run.id)["a"]
    assert dispatch(sql) == [(root, repo.get_task(root).fencing_token)]
    assert scheduler_pass(repo) == 0  # nothing left for the scheduler to promote


def test_a_trigger_whose_key_template_cannot_render_leaves_nothing(repo: Store, sql: Sql) -> None:
    workflow = single("charge", idempotency_key="charge-{order_id}")
    with pytest.raises(InputError, match="order_id"):
        repo.trigger(workflow, {"customer": 1})
    assert {t: count(sql, t) for t in ALL_TABLES} == dict.fromkeys(ALL_TABLES, 0)


def test_a_trigger_failing_inside_its_transaction_leaves_nothing(repo: Store, sql: Sql) -> None:
    # max_attempts beyond int4 passes the domain's checks but fails in insert_tasks, after the
    # definition and the run rows were written in the same transaction.
    workflow = single("huge", retry=RetryPolicy(max_attempts=2**31))
    with pytest.raises(StoreError):
        repo.trigger(workflow, {})
    assert {t: count(sql, t) for t in ALL_TABLES} == dict.fromkeys(ALL_TABLES, 0)


def test_the_same_trigger_key_returns_the_same_run(repo: Store, sql: Sql) -> None:
    first = repo.trigger(single(), {"n": 1}, idempotency_key="order-1")
    again = repo.trigger(single(), {"n": 1}, idempotency_key="order-1")
    assert first.created and not again.created
    assert again.run_id == first.run_id
    assert count(sql, "workflow_runs") == 1 and count(sql, "task_runs") == 1


@pytest.mark.parametrize(
    ("workflow", "run_input"),
    [(single(), {"n": 2}), (single("other"), {"n": 1})],
    ids=["other-input", "other-workflow"],
)
def test_the_same_trigger_key_for_another_request_conflicts(
    repo: Store, sql: Sql, workflow: WorkflowDef, run_input: dict[str, int]
) -> None:
    repo.trigger(single(), {"n": 1}, idempotency_key="order-1")
    with pytest.raises(TriggerConflictError, match="order-1"):
        repo.trigger(workflow, run_input, idempotency_key="order-1")
    assert count(sql, "workflow_runs") == 1 and count(sql, "task_runs") == 1


# ------------------------------------------------------------------ the happy path


def test_a_diamond_runs_to_success_with_upstream_results(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(diamond(), {"order_id": 7}).run_id
    ids = task_ids(repo, run_id)
    for wave, upstream in (
        ({"a"}, {"a": {}}),
        ({"b", "c"}, {"b": {"a": {"from": "a"}}, "c": {"a": {"from": "a"}}}),
        ({"d"}, {"d": {"b": {"from": "b"}, "c": {"from": "c"}}}),
    ):
        drain(repo)
        assert {name for name, s in states(repo, run_id).items() if s is TaskState.READY} == wave
        for name in sorted(wave):
            claim = claim_task(repo, sql, ids[name])
            assert claim.input == {"order_id": 7}
            assert claim.upstream == upstream[name]
            assert repo.finish(
                ids[name], claim.fencing_token, TaskState.SUCCEEDED, result={"from": name}
            )
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.SUCCEEDED and run.finished_at is not None
    assert all(t.state is TaskState.SUCCEEDED and t.attempt == 1 for t in run.tasks)
    assert count(sql, "outbox") == 4  # one dispatch per task, no more


# ------------------------------------------------------------------ failures and retries


def test_a_failed_attempt_waits_for_its_backoff_on_the_database_clock(
    repo: Store, sql: Sql
) -> None:
    policy = RetryPolicy(max_attempts=3, base_delay=0.5, max_delay=0.5, jitter=Jitter.NONE)
    run_id = repo.trigger(single(retry=policy)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    claim = claim_task(repo, sql, task_id)
    assert repo.finish(
        task_id,
        claim.fencing_token,
        TaskState.FAILED,
        reason=FailureReason.HANDLER_ERROR,
        error="flaky",
    )
    assert repo.route_failed(10) == 1
    task = repo.get_task(task_id)
    assert task.state is TaskState.RETRYING and task.failure_reason is FailureReason.HANDLER_ERROR
    routed_at = sql.execute("SELECT updated_at FROM task_runs WHERE id = %s", (task_id,))
    assert task.retry_at is not None
    assert task.retry_at - routed_at.fetchone()[0] == timedelta(seconds=0.5)  # the DB's now()
    assert task.retry_at > db_now(sql)
    assert repo.promote_ready(10) == 0  # not due yet
    assert count(sql, "outbox") == 1
    wait_for(lambda: repo.promote_ready(10), timeout=5, what="the retry to become due")
    promoted = repo.get_task(task_id)
    assert promoted.state is TaskState.READY and promoted.ready_at is not None
    assert promoted.ready_at >= task.retry_at
    assert outbox_token(sql, task_id) == claim.fencing_token  # a new generation, a new row
    assert count(sql, "outbox", "task_run_id = %s", (task_id,)) == 2
    again = claim_task(repo, sql, task_id)
    assert again.attempt == 2


def test_exhausting_the_retries_buries_the_task_with_its_full_history(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(single(retry=FAST_RETRY)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    for n in (1, 2, 3):
        fail(repo, sql, task_id, error=f"boom {n}", worker=f"worker-{n}")
        drain(repo)
    task = repo.get_task(task_id)
    assert task.state is TaskState.DEAD
    assert task.failure_reason is FailureReason.MAX_ATTEMPTS_EXCEEDED
    assert task.attempt == 3 and task.last_error == "boom 3" and task.finished_at is not None
    history = repo.attempts(task_id)
    assert [(a.attempt, a.worker, a.outcome, a.failure_reason, a.error) for a in history] == [
        (n, f"worker-{n}", "failed", FailureReason.HANDLER_ERROR, f"boom {n}") for n in (1, 2, 3)
    ]
    for a in history:
        assert a.finished_at is not None and a.started_at <= a.finished_at
    assert history[0].finished_at <= history[1].started_at  # type: ignore[operator]
    assert repo.get_run(run_id).state is RunState.FAILED
    assert [t.id for t in repo.list_dead()] == [task_id]


@pytest.mark.parametrize(
    "reason",
    [
        FailureReason.PERMANENT_ERROR,
        FailureReason.UNKNOWN_HANDLER,
        FailureReason.UNSERIALIZABLE_RESULT,
    ],
)
def test_a_non_retryable_failure_is_dead_at_once(
    repo: Store, sql: Sql, reason: FailureReason
) -> None:
    run_id = repo.trigger(single(retry=RetryPolicy(max_attempts=5))).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    fail(repo, sql, task_id, reason=reason, error=str(reason))
    drain(repo)
    task = repo.get_task(task_id)
    assert (task.state, task.failure_reason, task.attempt) == (TaskState.DEAD, reason, 1)
    assert [(a.outcome, a.failure_reason) for a in repo.attempts(task_id)] == [("failed", reason)]
    assert count(sql, "outbox") == 1  # never dispatched again


@pytest.mark.parametrize("reason", [FailureReason.HANDLER_ERROR, FailureReason.TIMEOUT])
def test_a_retryable_failure_is_retried(repo: Store, sql: Sql, reason: FailureReason) -> None:
    run_id = repo.trigger(single(retry=FAST_RETRY)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    fail(repo, sql, task_id, reason=reason)
    drain(repo)
    task = repo.get_task(task_id)
    assert (task.state, task.failure_reason, task.attempt) == (TaskState.READY, reason, 1)


def test_three_expired_leases_in_a_row_are_a_crash_loop(repo: Store, sql: Sql) -> None:
    policy = RetryPolicy(max_attempts=10, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
    run_id = repo.trigger(single(retry=policy)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    for n in (1, 2, 3):
        claim_task(repo, sql, task_id, worker=f"doomed-{n}")
        expire_lease(sql, task_id)
        assert repo.reap_expired(10) == 1
        task = repo.get_task(task_id)
        if n < 3:
            assert (task.state, task.failure_reason) == (TaskState.RETRYING, "lease_expired")
            drain(repo)
    assert (task.state, task.failure_reason) == (TaskState.DEAD, FailureReason.CRASH_LOOP)
    assert task.attempt == 3 < policy.max_attempts  # the crash loop, not exhaustion
    assert [(a.outcome, a.failure_reason, a.worker) for a in repo.attempts(task_id)] == [
        ("lease_expired", FailureReason.LEASE_EXPIRED, f"doomed-{n}") for n in (1, 2, 3)
    ]


def test_a_finished_attempt_breaks_the_crash_streak(repo: Store, sql: Sql) -> None:
    policy = RetryPolicy(max_attempts=10, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
    run_id = repo.trigger(single(retry=policy)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    for expired in (True, True, False, True, True):
        if expired:
            claim_task(repo, sql, task_id)
            expire_lease(sql, task_id)
        else:
            fail(repo, sql, task_id)
        drain(repo)
    task = repo.get_task(task_id)
    assert (task.state, task.attempt) == (TaskState.READY, 5)  # 4 expiries, never 3 in a row


# ------------------------------------------------------------------ fail-fast and cancellation


def test_fail_fast_cancels_the_run_and_asks_running_siblings_to_stop(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(fanout(fail_fast=True)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    z_token = outbox_token(sql, ids["z"])
    x = claim_task(repo, sql, ids["x"])
    y = claim_task(repo, sql, ids["y"])
    assert repo.finish(
        ids["x"], x.fencing_token, TaskState.FAILED, reason=FailureReason.PERMANENT_ERROR
    )
    drain(repo)
    assert states(repo, run_id) == {
        "x": TaskState.DEAD,
        "y": TaskState.RUNNING,
        "z": TaskState.CANCELLED,  # not started: cancelled at once
        "w": TaskState.CANCELLED,  # depends on the dead task
    }
    assert repo.claim(ids["z"], z_token, "late", 30).outcome is ClaimOutcome.LOST
    renewal = repo.renew_lease(ids["y"], y.fencing_token, 30)
    assert renewal.held and renewal.cancel_requested
    run = repo.get_run(run_id)
    # terminal only once y has settled: until then a task of the run can still change
    assert run.state is RunState.RUNNING and run.finished_at is None
    assert repo.finish(ids["y"], y.fencing_token, TaskState.CANCELLED)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert run.task("y").state is TaskState.CANCELLED


def test_without_fail_fast_only_dependents_are_cancelled(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(fanout(fail_fast=False)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    y = claim_task(repo, sql, ids["y"])
    fail(repo, sql, ids["x"], reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    assert states(repo, run_id) == {
        "x": TaskState.DEAD,
        "y": TaskState.RUNNING,
        "z": TaskState.READY,
        "w": TaskState.CANCELLED,
    }
    assert repo.renew_lease(ids["y"], y.fencing_token, 30).cancel_requested is False
    assert repo.finish(ids["y"], y.fencing_token, TaskState.SUCCEEDED, result=1)
    succeed(repo, sql, ids["z"], result=2)
    drain(repo)
    run = repo.get_run(run_id)
    assert {t.name: t.state for t in run.tasks}["z"] is TaskState.SUCCEEDED
    assert run.state is RunState.FAILED and run.finished_at is not None


def test_cancelling_a_run_stops_what_has_not_started_and_asks_the_rest(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(fanout()).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    x = claim_task(repo, sql, ids["x"])
    run = repo.cancel_run(str(run_id))
    assert {t.name: t.state for t in run.tasks} == {
        "x": TaskState.RUNNING,
        "y": TaskState.CANCELLED,
        "z": TaskState.CANCELLED,
        "w": TaskState.CANCELLED,
    }
    assert run.cancel_requested and run.finished_at is None
    renewal = repo.renew_lease(ids["x"], x.fencing_token, 30)
    assert renewal.held and renewal.cancel_requested
    assert repo.finish(ids["x"], x.fencing_token, TaskState.CANCELLED)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.CANCELLED and run.finished_at is not None
    assert all(t.state is TaskState.CANCELLED for t in run.tasks)
    [attempt] = repo.attempts(ids["x"])
    assert (attempt.outcome, attempt.failure_reason) == ("cancelled", FailureReason.CANCELLED)


def test_a_cancelled_task_that_fails_anyway_is_not_retried(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single(retry=FAST_RETRY)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    claim = claim_task(repo, sql, task_id)
    repo.cancel_run(run_id)
    assert repo.finish(
        task_id,
        claim.fencing_token,
        TaskState.FAILED,
        reason=FailureReason.HANDLER_ERROR,
        error="interrupted",
    )
    drain(repo)
    assert repo.get_task(task_id).state is TaskState.CANCELLED
    assert repo.get_run(run_id).state is RunState.CANCELLED
    assert count(sql, "outbox") == 1


def test_cancelling_an_unknown_or_malformed_run_is_refused(repo: Store) -> None:
    with pytest.raises(NotFoundError):
        repo.cancel_run(uuid.uuid4())
    with pytest.raises(InvalidIdError):
        repo.cancel_run("run-42")


# ------------------------------------------------------------------ requeue


def test_requeue_refuses_what_is_not_a_dead_task(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(chain(length=2)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    succeed(repo, sql, ids["t0"])
    drain(repo)
    for task_id in (ids["t0"], ids["t1"]):  # SUCCEEDED, READY
        with pytest.raises(NotDeadError, match="not DEAD"):
            repo.requeue_dead(task_id, "alice")
    with pytest.raises(InvalidIdError, match="malformed"):
        repo.requeue_dead("not-a-uuid", "alice")
    with pytest.raises(NotFoundError):
        repo.requeue_dead(uuid.uuid4(), "alice")
    assert count(sql, "requeue_audit") == 0


def test_requeue_audits_and_gives_a_fresh_retry_budget(repo: Store, sql: Sql) -> None:
    policy = RetryPolicy(max_attempts=2, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
    run_id = repo.trigger(single(retry=policy)).run_id
    task_id = task_ids(repo, run_id)["only"]
    drain(repo)
    for _ in range(2):
        fail(repo, sql, task_id)
        drain(repo)
    dead = repo.get_task(task_id)
    assert (dead.state, dead.failure_reason) == (TaskState.DEAD, "max_attempts_exceeded")

    requeued = repo.requeue_dead(str(task_id), "alice", reason="fixed the card processor")
    assert requeued.state is TaskState.PENDING and requeued.failure_reason is None
    assert requeued.fencing_token > dead.fencing_token
    audit = sql.execute(
        "SELECT requested_by, reason, previous_reason, attempt, requested_at IS NOT NULL"
        " FROM requeue_audit WHERE task_run_id = %s",
        (task_id,),
    ).fetchall()
    assert audit == [("alice", "fixed the card processor", "max_attempts_exceeded", 2, True)]
    run = repo.get_run(run_id)
    assert run.state is RunState.RUNNING and run.finished_at is None

    drain(repo)
    assert repo.get_task(task_id).state is TaskState.READY
    assert outbox_token(sql, task_id) == requeued.fencing_token
    fail(repo, sql, task_id)  # attempt 3 overall, but the first of the new budget
    drain(repo)
    assert repo.get_task(task_id).state is TaskState.READY
    succeed(repo, sql, task_id, result="ok")
    drain(repo)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    assert [a.attempt for a in repo.attempts(task_id)] == [1, 2, 3, 4]


def test_requeue_revives_what_fail_fast_cancelled(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(fanout(fail_fast=True)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    y = claim_task(repo, sql, ids["y"])
    fail(repo, sql, ids["x"], reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    assert repo.finish(ids["y"], y.fencing_token, TaskState.CANCELLED)  # honours the stop
    drain(repo)
    assert repo.get_run(run_id).state is RunState.FAILED

    repo.requeue_dead(ids["x"], "bob", reason="deployed the fix")
    drain(repo)
    assert states(repo, run_id) == {
        "x": TaskState.READY,
        "y": TaskState.READY,
        "z": TaskState.READY,
        "w": TaskState.PENDING,
    }
    assert repo.get_run(run_id).state is RunState.RUNNING
    for name in ("x", "y", "z"):
        succeed(repo, sql, ids[name])
    drain(repo)
    succeed(repo, sql, ids["w"])
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.SUCCEEDED and run.finished_at is not None


def test_requeue_does_not_revive_what_an_operator_cancelled(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(fanout(fail_fast=False)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    fail(repo, sql, ids["x"], reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    repo.cancel_run(run_id)
    drain(repo)
    repo.requeue_dead(ids["x"], "carol")
    drain(repo)
    assert states(repo, run_id) == {
        "x": TaskState.READY,  # the operator asked for it explicitly
        "y": TaskState.CANCELLED,
        "z": TaskState.CANCELLED,
        "w": TaskState.CANCELLED,
    }


def test_requeue_revives_only_what_the_requeued_task_cancelled(repo: Store, sql: Sql) -> None:
    """Two independent branches die; requeueing one must not revive the other's dependents.

    The other branch's dependent still waits on a DEAD task: revived, it can never run, and
    the run can never be finished (so retention never purges it).
    """
    workflow = WorkflowDef(
        "two-branches",
        (
            TaskDef("x", "tests.noop", retry=FAST_RETRY),
            TaskDef("wx", "tests.noop", depends_on=("x",), retry=FAST_RETRY),
            TaskDef("y", "tests.noop", retry=FAST_RETRY),
            TaskDef("wy", "tests.noop", depends_on=("y",), retry=FAST_RETRY),
        ),
        fail_fast=False,
    )
    run_id = repo.trigger(workflow).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    fail(repo, sql, ids["x"], reason=FailureReason.PERMANENT_ERROR)
    fail(repo, sql, ids["y"], reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    assert states(repo, run_id) == {
        "x": TaskState.DEAD,
        "wx": TaskState.CANCELLED,
        "y": TaskState.DEAD,
        "wy": TaskState.CANCELLED,
    }
    repo.requeue_dead(ids["x"], "dave")
    drain(repo)
    succeed(repo, sql, ids["x"])
    drain(repo)
    succeed(repo, sql, ids["wx"])
    drain(repo)
    assert states(repo, run_id)["wy"] is TaskState.CANCELLED  # y is still DEAD
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None


def test_requeue_lets_a_sibling_still_running_from_fail_fast_finish_the_run(
    repo: Store, sql: Sql
) -> None:
    """Fail-fast asked the running sibling y to stop; the operator requeues x before y noticed.

    y does what its next renewal says. Whatever that is, the requeued run must be able to
    finish SUCCEEDED: a stop request whose cause was undone by the requeue must not leave y
    CANCELLED after the revival already happened (and the run CANCELLED).
    """
    run_id = repo.trigger(fanout(fail_fast=True)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    y = claim_task(repo, sql, ids["y"])
    fail(repo, sql, ids["x"], reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    repo.requeue_dead(ids["x"], "frank", reason="fixed before y noticed")
    drain(repo)
    if repo.renew_lease(ids["y"], y.fencing_token, 30).cancel_requested:
        assert repo.finish(ids["y"], y.fencing_token, TaskState.CANCELLED)
    else:
        assert repo.finish(ids["y"], y.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    for _ in range(3):  # x, then z / w as they become READY
        for task in repo.get_run(run_id).tasks:
            if task.state is TaskState.READY:
                succeed(repo, sql, task.id)
        drain(repo)
    assert states(repo, run_id) == dict.fromkeys("xyzw", TaskState.SUCCEEDED)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


# ------------------------------------------------------------------ ordering keys


def streamed(on_dead: OnDead = OnDead.RELEASE, retry: RetryPolicy = FAST_RETRY) -> WorkflowDef:
    return single("streamed", ordering_key="account-{account}", on_dead=on_dead, retry=retry)


def test_a_later_task_of_a_stream_waits_for_the_earlier_one(repo: Store, sql: Sql) -> None:
    first = task_ids(repo, repo.trigger(streamed(), {"account": 1}).run_id)["only"]
    second = task_ids(repo, repo.trigger(streamed(), {"account": 1}).run_id)["only"]
    other = task_ids(repo, repo.trigger(streamed(), {"account": 2}).run_id)["only"]
    drain(repo)

    def state(task_id: uuid.UUID) -> TaskState:
        return repo.get_task(task_id).state

    assert (state(first), state(second), state(other)) == (
        TaskState.READY,
        TaskState.PENDING,
        TaskState.READY,
    )
    claim = claim_task(repo, sql, first)
    drain(repo)
    assert state(second) is TaskState.PENDING
    assert repo.finish(first, claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    assert state(second) is TaskState.READY


def test_a_retrying_earlier_task_still_holds_its_stream(repo: Store, sql: Sql) -> None:
    slow = RetryPolicy(max_attempts=3, base_delay=60.0, max_delay=60.0, jitter=Jitter.NONE)
    first = task_ids(repo, repo.trigger(streamed(retry=slow), {"account": 1}).run_id)["only"]
    second = task_ids(repo, repo.trigger(streamed(retry=slow), {"account": 1}).run_id)["only"]
    drain(repo)
    fail(repo, sql, first)
    drain(repo)
    assert repo.get_task(first).state is TaskState.RETRYING
    assert repo.get_task(second).state is TaskState.PENDING


def test_a_dead_task_releases_its_stream_by_default(repo: Store, sql: Sql) -> None:
    first = task_ids(repo, repo.trigger(streamed(), {"account": 1}).run_id)["only"]
    second = task_ids(repo, repo.trigger(streamed(), {"account": 1}).run_id)["only"]
    drain(repo)
    fail(repo, sql, first, reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    assert repo.get_task(first).state is TaskState.DEAD
    assert repo.get_task(second).state is TaskState.READY


def test_a_dead_task_that_blocks_holds_its_stream_until_requeued_and_done(
    repo: Store, sql: Sql
) -> None:
    workflow = streamed(on_dead=OnDead.BLOCK)
    first = task_ids(repo, repo.trigger(workflow, {"account": 1}).run_id)["only"]
    second = task_ids(repo, repo.trigger(workflow, {"account": 1}).run_id)["only"]
    drain(repo)
    fail(repo, sql, first, reason=FailureReason.PERMANENT_ERROR)
    drain(repo)
    assert repo.get_task(first).state is TaskState.DEAD
    assert repo.get_task(second).state is TaskState.PENDING
    repo.requeue_dead(first, "erin")
    drain(repo)
    assert repo.get_task(first).state is TaskState.READY
    assert repo.get_task(second).state is TaskState.PENDING
    succeed(repo, sql, first)
    drain(repo)
    assert repo.get_task(second).state is TaskState.READY


# ------------------------------------------------------------------ idempotency keys (serial)


def test_a_task_whose_key_already_succeeded_reuses_the_result(repo: Store, sql: Sql) -> None:
    workflow = single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)
    first = repo.trigger(workflow, {"order_id": 9, "try": 1}).run_id
    second = repo.trigger(workflow, {"order_id": 9, "try": 2}).run_id
    first_id, second_id = task_ids(repo, first)["only"], task_ids(repo, second)["only"]
    drain(repo)
    claim = claim_task(repo, sql, first_id)
    assert repo.finish(first_id, claim.fencing_token, TaskState.SUCCEEDED, result={"charge": 1})
    reused = repo.claim(second_id, outbox_token(sql, second_id), "worker-2", 30)
    assert reused.outcome is ClaimOutcome.REUSED
    drain(repo)
    task = repo.get_task(second_id)
    assert (task.state, task.result) == (TaskState.SUCCEEDED, {"charge": 1})
    assert [(a.outcome, a.worker) for a in repo.attempts(second_id)] == [("reused", "worker-2")]
    assert repo.get_run(second).state is RunState.SUCCEEDED


def test_a_reaped_holder_releases_its_idempotency_key(repo: Store, sql: Sql) -> None:
    workflow = single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)
    first = task_ids(repo, repo.trigger(workflow, {"order_id": 9, "try": 1}).run_id)["only"]
    second = task_ids(repo, repo.trigger(workflow, {"order_id": 9, "try": 2}).run_id)["only"]
    drain(repo)
    claim_task(repo, sql, first)
    assert count(sql, "idempotency_keys", "task_run_id = %s", (first,)) == 1
    expire_lease(sql, first)
    assert repo.reap_expired(10) == 1
    assert count(sql, "idempotency_keys") == 0
    claim_task(repo, sql, second)  # EXECUTE: the key is free again


# ------------------------------------------------------------------ the state machine


def test_an_illegal_transition_raises_before_any_sql(database_url: str) -> None:
    never_opened = Store(Database(DatabaseConfig(url=database_url)))
    task_id = uuid.uuid4()
    with pytest.raises(IllegalTransitionError, match="RUNNING -> PENDING"):
        never_opened.finish(task_id, 1, TaskState.PENDING)
    with pytest.raises(IllegalTransitionError, match="SUCCEEDED -> READY"):
        transitions.check(TaskState.SUCCEEDED, TaskState.READY)
    with pytest.raises(IllegalTransitionError, match="not READY"):  # legal, but not finish's
        never_opened.finish(task_id, 1, TaskState.READY)
    with pytest.raises(StoreError, match="not open"):  # control: a legal one does reach SQL
        never_opened.finish(task_id, 1, TaskState.SUCCEEDED)


def test_finish_refuses_a_target_it_cannot_write_before_any_sql(database_url: str) -> None:
    """RUNNING → DEAD / RETRYING are legal for the reaper, not for finish().

    finish() must refuse them with a clear error, not a bare KeyError from its outcome table.
    """
    never_opened = Store(Database(DatabaseConfig(url=database_url)))
    for target in (TaskState.DEAD, TaskState.RETRYING):
        with pytest.raises((IllegalTransitionError, ValueError)):
            never_opened.finish(uuid.uuid4(), 1, target)


def test_a_failure_without_a_reason_is_refused(repo: Store, sql: Sql) -> None:
    task_id = task_ids(repo, repo.trigger(single()).run_id)["only"]
    drain(repo)
    claim = claim_task(repo, sql, task_id)
    with pytest.raises(ValueError, match="reason"):
        repo.finish(task_id, claim.fencing_token, TaskState.FAILED)
    assert repo.get_task(task_id).state is TaskState.RUNNING


def test_the_run_state_follows_its_tasks(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(chain(length=2)).run_id
    ids = task_ids(repo, run_id)
    assert repo.get_run(run_id).state is RunState.PENDING
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.PENDING and run.started_at is None  # READY is not started
    claim = claim_task(repo, sql, ids["t0"])
    run = repo.get_run(run_id)
    assert run.state is RunState.RUNNING and run.started_at is not None
    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    assert repo.get_run(run_id).state is RunState.RUNNING
    succeed(repo, sql, ids["t1"])
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.SUCCEEDED and run.finished_at is not None
    assert [r.id for r in repo.list_runs(state="SUCCEEDED")] == [run_id]


# ------------------------------------------------------------------ retention


def age(sql: Sql, run_id: uuid.UUID, hours: int = 2) -> None:
    """Pretend a run finished ``hours`` ago (and was published as long ago)."""
    sql.execute(
        "UPDATE workflow_runs SET finished_at = finished_at - make_interval(hours => %s)"
        " WHERE id = %s AND finished_at IS NOT NULL",
        (hours, run_id),
    )


def finished_run(repo: Store, sql: Sql) -> uuid.UUID:
    run_id = repo.trigger(single()).run_id
    drain(repo)
    dispatch(sql)
    succeed(repo, sql, task_ids(repo, run_id)["only"])
    drain(repo)
    assert repo.get_run(run_id).finished_at is not None
    return run_id


def test_purge_removes_only_old_finished_runs(repo: Store, sql: Sql) -> None:
    old = finished_run(repo, sql)
    recent = finished_run(repo, sql)
    unfinished = repo.trigger(chain(length=2)).run_id
    sql.execute(
        "UPDATE workflow_runs SET created_at = now() - interval '3 hours' WHERE id = %s",
        (unfinished,),
    )
    age(sql, old)
    assert repo.purge(age_s=3600, limit=100) >= 1
    remaining = {r[0] for r in sql.execute("SELECT id FROM workflow_runs")}
    assert remaining == {recent, unfinished}
    assert count(sql, "task_runs", "run_id = %s", (old,)) == 0
    assert count(sql, "task_attempts") == 1  # only the recent run's attempt
    # the recent run's dispatch, and the unfinished run's first one (still pending)
    assert count(sql, "outbox", "published_at IS NOT NULL") == 1
    assert count(sql, "outbox", "published_at IS NULL") == 1
    assert count(sql, "task_runs") == 3  # recent: 1, unfinished: 2


def test_purge_works_in_bounded_batches(repo: Store, sql: Sql) -> None:
    runs = [finished_run(repo, sql) for _ in range(3)]
    for run_id in runs:
        age(sql, run_id)
    for left in (2, 1, 0):
        repo.purge(age_s=3600, limit=1)
        assert count(sql, "workflow_runs") == left
    assert repo.purge(age_s=3600, limit=1) == 0


def test_purge_drops_old_published_outbox_rows_and_settled_keys(repo: Store, sql: Sql) -> None:
    workflow = single("charge", idempotency_key="charge-{order_id}")
    done = task_ids(repo, repo.trigger(workflow, {"order_id": 1}).run_id)["only"]
    drain(repo)
    dispatch(sql)
    succeed(repo, sql, done, result={"ok": True})
    live = task_ids(repo, repo.trigger(workflow, {"order_id": 2}).run_id)["only"]
    drain(repo)  # live: READY with an unpublished outbox row
    claim_task(repo, sql, live)  # its key is RUNNING
    sql.execute(
        "UPDATE outbox SET created_at = created_at - interval '2 hours',"
        " published_at = published_at - interval '2 hours'"
    )
    sql.execute("UPDATE idempotency_keys SET updated_at = updated_at - interval '2 hours'")
    repo.purge(age_s=3600, limit=100, key_age_s=3600)
    assert [r[0] for r in sql.execute("SELECT task_run_id FROM outbox")] == [live]
    assert [r[0] for r in sql.execute("SELECT key FROM idempotency_keys")] == ["charge-2"]


def test_a_run_of_many_successes_is_derived_when_its_last_task_succeeds(
    repo: Store, sql: Sql
) -> None:
    """A pass of successes that leaves tasks unfinished skips re-deriving a RUNNING run (that
    would read every task of a big run on every pass): the run still reads RUNNING throughout,
    SUCCEEDED once its last task succeeded, and a cancellation still takes effect."""
    width = 4
    fan = WorkflowDef(
        "fan",
        (
            TaskDef("start", "tests.noop"),
            *(TaskDef(f"m{i}", "tests.noop", depends_on=("start",)) for i in range(width)),
        ),
    )
    run_id = repo.trigger(fan).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["start"])
    for i in range(width - 1):
        succeed(repo, sql, ids[f"m{i}"])
        assert repo.propagate(100) >= 1
        assert repo.get_run(run_id).state is RunState.RUNNING
    succeed(repo, sql, ids[f"m{width - 1}"])
    assert repo.propagate(100) == 1
    run = repo.get_run(run_id)
    assert (run.state, run.finished_at is not None) == (RunState.SUCCEEDED, True)

    other = repo.trigger(fan).run_id
    other_ids = task_ids(repo, other)
    succeed(repo, sql, other_ids["start"])
    repo.cancel_run(other)  # the fan-out is READY: cancelled at once
    assert repo.propagate(100) >= 1
    assert repo.get_run(other).state is RunState.CANCELLED
