"""A worker's finish settles the run its success ends, against real PostgreSQL.

When every other task of a run has SUCCEEDED, the finish of its last one marks the run
SUCCEEDED and the task propagated in the same statement, so no scheduler pass has to write the
task's row again and derive the run (docs/performance.md, "A finish settles its run"). Every
case where that is not known from the finish's own snapshot — siblings ending in the same
batch or at the same moment, a run asked to stop, a child run, a task a pass must see, a stale
outcome — leaves the run to the scheduler as before, and the pass still ends it SUCCEEDED.
"""

from __future__ import annotations

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
from tests.helpers import chain, claim_task, single, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
PASS_LIMIT = 100
DONE = Finish(TaskState.SUCCEEDED, result={"ok": 1})


def run_row(sql: Sql, run_id: uuid.UUID) -> tuple[str, bool]:
    """(state, finished) of a run."""
    row = sql.execute(
        "SELECT state, finished_at IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None
    return str(row[0]), bool(row[1])


def propagated(sql: Sql, task_id: uuid.UUID) -> bool:
    row = sql.execute("SELECT propagated FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return bool(row[0])


def succeed(repo: Store, sql: Sql, task_id: uuid.UUID) -> None:
    claim = claim_task(repo, sql, task_id)
    assert repo.finish_many([(task_id, claim.fencing_token, DONE)]).committed == {task_id}


def test_a_one_task_run_is_settled_by_its_finish(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single("settle-one")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    succeed(repo, sql, task_id)
    assert run_row(sql, run_id) == ("SUCCEEDED", True)
    assert propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 0  # nothing left for a pass


def test_a_chain_is_settled_by_its_last_finish(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(chain("settle-chain", 2)).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["t0"])
    assert run_row(sql, run_id) == ("RUNNING", False)  # t1 is still to run
    assert not propagated(sql, ids["t0"])
    succeed(repo, sql, ids["t1"])
    assert run_row(sql, run_id) == ("SUCCEEDED", True)
    assert propagated(sql, ids["t1"])
    assert repo.propagate(PASS_LIMIT) == 1  # t0's, which changes nothing
    assert run_row(sql, run_id) == ("SUCCEEDED", True)


def _pair(name: str) -> WorkflowDef:
    return WorkflowDef(name, (TaskDef("a", "tests.noop"), TaskDef("b", "tests.noop")))


def test_siblings_ending_in_one_finish_leave_their_run_to_the_scheduler(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(_pair("settle-batch")).run_id
    ids = task_ids(repo, run_id)
    claims = {name: claim_task(repo, sql, tid) for name, tid in ids.items()}
    outcomes = [(ids[n], claims[n].fencing_token, DONE) for n in ("a", "b")]
    assert repo.finish_many(outcomes).committed == set(ids.values())
    assert run_row(sql, run_id) == ("RUNNING", False)
    assert not any(propagated(sql, tid) for tid in ids.values())
    assert repo.propagate(PASS_LIMIT) == 2
    assert run_row(sql, run_id) == ("SUCCEEDED", True)


def test_siblings_ending_at_the_same_moment_leave_their_run_to_the_scheduler(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """One finish still uncommitted when the other runs: each sees the other RUNNING."""
    run_id = repo.trigger(_pair("settle-race")).run_id
    ids = task_ids(repo, run_id)
    claims = {name: claim_task(repo, sql, tid) for name, tid in ids.items()}
    params = _finish_params([(ids["a"], claims["a"].fencing_token, DONE)])
    params["publish"] = True
    with psycopg.connect(clean_database_url) as other:  # a transaction, left open
        other.execute(queries.load()["finish"], params)
        succeed_b = repo.finish_many([(ids["b"], claims["b"].fencing_token, DONE)])
        assert succeed_b.committed == {ids["b"]}
        other.commit()
    assert run_row(sql, run_id) == ("RUNNING", False)
    assert not any(propagated(sql, tid) for tid in ids.values())
    assert repo.propagate(PASS_LIMIT) == 2
    assert run_row(sql, run_id) == ("SUCCEEDED", True)


def test_a_run_asked_to_stop_is_left_to_the_scheduler(repo: Store, sql: Sql) -> None:
    """The run's cancel committed, its stop not yet on the task: the pass derives the run."""
    run_id = repo.trigger(single("settle-cancel")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    sql.execute("UPDATE workflow_runs SET cancel_requested_at = now() WHERE id = %s", (run_id,))
    assert repo.finish_many([(task_id, claim.fencing_token, DONE)]).committed == {task_id}
    assert run_row(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 1
    assert run_row(sql, run_id)[1]  # finished, as the scheduler derives it


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
    assert run_row(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)


def test_a_task_a_pass_must_see_is_left_to_the_scheduler(repo: Store, sql: Sql) -> None:
    keyed = WorkflowDef(
        "settle-keyed", (TaskDef("only", "tests.noop", concurrency=Concurrency("k", 1)),)
    )
    run_id = repo.trigger(keyed).run_id
    (task_id,) = task_ids(repo, run_id).values()
    succeed(repo, sql, task_id)
    assert run_row(sql, run_id) == ("RUNNING", False)
    assert not propagated(sql, task_id)
    assert repo.propagate(PASS_LIMIT) == 1
    assert run_row(sql, run_id) == ("SUCCEEDED", True)


def test_a_stale_outcome_settles_nothing(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single("settle-stale")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    stale = [(task_id, claim.fencing_token - 1, DONE)]
    assert repo.finish_many(stale).committed == frozenset()
    assert run_row(sql, run_id) == ("RUNNING", False)
    row = sql.execute("SELECT state FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row == ("RUNNING",)


def test_a_failure_is_not_a_settling(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(single("settle-failed")).run_id
    (task_id,) = task_ids(repo, run_id).values()
    claim = claim_task(repo, sql, task_id)
    failed = Finish(TaskState.FAILED, error="boom", reason=FailureReason.HANDLER_ERROR)
    assert repo.finish_many([(task_id, claim.fencing_token, failed)]).committed == {task_id}
    assert run_row(sql, run_id) == ("RUNNING", False)
