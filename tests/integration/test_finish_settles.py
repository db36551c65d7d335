"""A worker's finish settles the one-task run its success ends, against real PostgreSQL.

When the run's definition has one task, the finish of that task marks the run SUCCEEDED and
the task propagated in the same statement, so no scheduler pass has to write the task's row
again and derive the run (docs/architecture.md, "A finish settles a one-task run"). The
definition's task count (migration 0028) decides, read by the definition's key: a run of
several tasks, a run asked to stop, a child run, a task a pass must see (a key, a map), a stale
outcome or a failure leave the run to the scheduler as before, and its pass still ends it.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency
from flowforge.domain.model import Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.store import queries
from flowforge.store.claims import _finish_params
from tests.harness import bench
from tests.helpers import (
    chain,
    claim_task,
    pool_of,
    single,
    stored_run,
    task_ids,
    wait_for,
    waits_on_a_lock,
)
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
PASS_LIMIT = 100
DONE = Finish(TaskState.SUCCEEDED, result={"ok": 1})


def propagated(sql: Sql, task_id: uuid.UUID) -> bool:
    row = sql.execute("SELECT propagated FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return bool(row[0])


def succeed(repo: Store, sql: Sql, task_id: uuid.UUID) -> None:
    claim = claim_task(repo, sql, task_id)
    assert repo.finish_many([(task_id, claim.fencing_token, DONE)]).committed == {task_id}


def test_the_definitions_task_count_is_kept_by_the_database(repo: Store, sql: Sql) -> None:
    repo.trigger(single("count-one"))
    repo.trigger(chain("count-three", 3))
    counts = dict(
        sql.execute(
            "SELECT name, task_count FROM workflow_definitions"
            " WHERE name IN ('count-one', 'count-three')"
        ).fetchall()
    )
    assert counts == {"count-one": 1, "count-three": 3}


def test_a_one_task_run_is_settled_by_its_finish(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single("settle-one")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    succeed(repo, sql, task_id)
    assert stored_run(sql, run_id) == ("SUCCEEDED", True)
    assert propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 0  # nothing left for a pass
    assert repo.get_run(run_id).tasks[0].result == {"ok": 1}


def test_one_finish_settles_each_of_its_one_task_runs_and_only_those(repo: Store, sql: Sql) -> None:
    """One batch: two one-task successes, a stale outcome and a failure."""
    runs = [repo.trigger(single("settle-batch"), {"n": n}).run_id for n in range(4)]
    ids = [task_ids(repo, run_id)["only"] for run_id in runs]
    tokens = [claim_task(repo, sql, task_id).fencing_token for task_id in ids]
    failed = Finish(TaskState.FAILED, error="boom", reason=FailureReason.HANDLER_ERROR)
    outcomes = [
        (ids[0], tokens[0], DONE),
        (ids[1], tokens[1], DONE),
        (ids[2], tokens[2] - 1, DONE),  # stale: ends nothing
        (ids[3], tokens[3], failed),  # a retry to route: the scheduler's
    ]
    assert repo.finish_many(outcomes).committed == {ids[0], ids[1], ids[3]}
    assert [stored_run(sql, run_id) for run_id in runs] == [
        ("SUCCEEDED", True),
        ("SUCCEEDED", True),
        ("RUNNING", False),
        ("RUNNING", False),
    ]
    assert propagated(sql, ids[0]) and propagated(sql, ids[1])
    stale = sql.execute("SELECT state FROM task_runs WHERE id = %s", (ids[2],)).fetchone()
    assert stale == ("RUNNING",)


def test_a_run_of_several_tasks_is_left_to_the_scheduler(repo: Store, sql: Sql) -> None:
    """Even its last task's success: only a pass derives a run with siblings."""
    run_id = repo.trigger(chain("settle-chain", 2)).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["t0"])
    succeed(repo, sql, ids["t1"])
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, ids["t1"])
    assert repo.propagate(PASS_LIMIT) == 2
    assert stored_run(sql, run_id) == ("SUCCEEDED", True)


def test_a_success_beside_an_unfinished_sibling_leaves_the_run_running(
    repo: Store, sql: Sql
) -> None:
    pair = WorkflowDef("settle-pair", (TaskDef("a", "tests.noop"), TaskDef("b", "tests.noop")))
    run_id = repo.trigger(pair).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["a"])  # b is still READY
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, ids["a"])
    repo.propagate(PASS_LIMIT)
    assert stored_run(sql, run_id) == ("RUNNING", False)


def test_a_run_asked_to_stop_is_left_to_the_scheduler(repo: Store, sql: Sql) -> None:
    """The run's cancel committed, its stop not yet on the task: the pass derives the run."""
    run_id = repo.trigger(single("settle-cancel")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    sql.execute("UPDATE workflow_runs SET cancel_requested_at = now() WHERE id = %s", (run_id,))
    assert repo.finish_many([(task_id, claim.fencing_token, DONE)]).committed == {task_id}
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 1
    assert stored_run(sql, run_id)[1]  # finished, as the scheduler derives it


def test_a_cancel_committed_while_the_finish_waits_for_the_run_is_seen(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """The operator's cancel holds the run's row when the finish comes: the finish waits for
    it, then rechecks the run as committed (asked to stop) and leaves it to the scheduler."""
    run_id = repo.trigger(single("settle-cancel-race")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    finished: dict[str, Any] = {}
    with psycopg.connect(clean_database_url) as operator:  # a transaction, left open
        operator.execute(
            "UPDATE workflow_runs SET cancel_requested_at = now() WHERE id = %s", (run_id,)
        )
        application = f"settle-race-{uuid.uuid4().hex[:8]}"
        with psycopg.connect(clean_database_url, application_name=application) as worker:
            params = _finish_params([(task_id, claim.fencing_token, DONE)])

            def finish() -> None:
                finished["rows"] = worker.execute(queries.load()["finish"], params).fetchall()
                worker.commit()

            racer = threading.Thread(target=finish)
            racer.start()
            try:
                wait_for(lambda: waits_on_a_lock(sql, application), 30, what="the finish to wait")
                operator.commit()
            finally:
                racer.join(30)
            assert not racer.is_alive()
    assert [row[0] for row in finished["rows"]] == [task_id]
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 1
    assert stored_run(sql, run_id)[1]


def deadlocks(sql: Sql) -> int:
    """Deadlocks PostgreSQL has detected in this database (pg_stat_database)."""
    row = sql.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_an_operators_cancel_deadlocking_with_the_settling_finish_loses_nothing(
    pg_server_url: str,
) -> None:
    """The one lock order the settling finish can meet the other way round: an operator's
    cancel locks the run, then its running task (request_stop); the finish locks the task,
    then the run. PostgreSQL breaks the cycle by failing one of them; the store runs a finish
    that lost again (Database retries conflicts), so either way the task ends once, the run
    ends, and nothing is left to a pass that it would not find.

    In a database of its own: the deadlock counter is the database's, and the session
    database's counts every other test's deadlocks too, flushed whenever their sessions
    report (a late one once made this test see two)."""
    with (
        bench.fresh_database(pg_server_url) as url,
        pool_of(url, 2, "settle-deadlock") as db,
        psycopg.connect(url, autocommit=True) as sql,
    ):
        _cancel_against_a_settling_finish(Store(db, rand=lambda: 0.5), sql, url)


def _cancel_against_a_settling_finish(repo: Store, sql: Sql, database_url: str) -> None:
    run_id = repo.trigger(single("settle-deadlock")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    before = deadlocks(sql)
    finished: dict[str, Any] = {}
    application = f"settle-operator-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, application_name=application) as operator:
        operator.execute(
            "UPDATE workflow_runs SET cancel_requested_at = now() WHERE id = %s", (run_id,)
        )
        racer = threading.Thread(
            target=lambda: finished.update(
                done=repo.finish_many([(task_id, claim.fencing_token, DONE)])
            )
        )
        racer.start()
        try:
            # the finish holds the task and waits for the run the operator holds
            wait_for(
                lambda: (
                    sql.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND application_name NOT LIKE %s AND wait_event_type = 'Lock'",
                        (application,),
                    ).fetchone()
                    == (1,)
                ),
                30,
                what="the finish to wait for the run",
            )
            try:  # the operator's stop of the running task closes the cycle
                operator.execute(
                    "UPDATE task_runs SET cancel_requested = true WHERE id = %s", (task_id,)
                )
                operator.commit()
            except psycopg.errors.DeadlockDetected:
                operator.rollback()  # the operator lost: its cancel is not there
        finally:
            racer.join(30)
        assert not racer.is_alive()
    # the cycle happened, and was broken once (sessions report their counts asynchronously)
    wait_for(lambda: deadlocks(sql) > before, 10, what="the deadlock to be counted")
    assert deadlocks(sql) == before + 1
    assert finished["done"].committed == {task_id}
    row = sql.execute("SELECT state FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row == ("SUCCEEDED",)
    repo.propagate(PASS_LIMIT)
    assert stored_run(sql, run_id)[1]  # ended, by the finish or by the pass
    assert propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 0


def test_a_child_run_is_left_to_the_scheduler(repo: Store, sql: Sql) -> None:
    parent = repo.trigger(single("settle-parent")).run_id
    (parent_task,) = task_ids(repo, parent).values()
    run_id = repo.trigger(single("settle-child")).run_id
    sql.execute(
        "UPDATE workflow_runs SET parent_run_id = %s, parent_task_id = %s, parent_attempt = 1,"
        " depth = 1 WHERE id = %s",
        (parent, parent_task, run_id),
    )
    (task_id,) = task_ids(repo, run_id).values()
    succeed(repo, sql, task_id)
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)


def test_a_task_a_pass_must_see_is_left_to_the_scheduler(repo: Store, sql: Sql) -> None:
    keyed = WorkflowDef(
        "settle-keyed", (TaskDef("only", "tests.noop", concurrency=Concurrency("k", 1)),)
    )
    run_id = repo.trigger(keyed).run_id
    (task_id,) = task_ids(repo, run_id).values()
    succeed(repo, sql, task_id)
    assert stored_run(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 1
    assert stored_run(sql, run_id) == ("SUCCEEDED", True)


def test_a_stale_outcome_settles_nothing(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single("settle-stale")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    stale = [(task_id, claim.fencing_token - 1, DONE)]
    assert repo.finish_many(stale).committed == frozenset()
    assert stored_run(sql, run_id) == ("RUNNING", False)
    row = sql.execute("SELECT state FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row == ("RUNNING",)


def test_a_failure_is_not_a_settling(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single("settle-failed")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    failed = Finish(TaskState.FAILED, error="boom", reason=FailureReason.HANDLER_ERROR)
    assert repo.finish_many([(task_id, claim.fencing_token, failed)]).committed == {task_id}
    assert stored_run(sql, run_id) == ("RUNNING", False)
