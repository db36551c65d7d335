"""run_if (conditions and compensation) and rerun (issue 19, SPEC 7.3) against real PostgreSQL.

Every outcome is counted in the database: task states and causes, gate counts
(``pending_deps``), outbox rows, audit rows.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.errors import InvalidIdError, NotFinishedError, NotFoundError
from flowforge.store.db import Database
from tests.helpers import bury, claim_task, drain, race, task_ids, until_idle
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

SAGA = WorkflowDef(
    "saga",
    (
        TaskDef("charge", "tests.noop"),
        TaskDef("ship", "tests.noop", depends_on=("charge",)),
        TaskDef("refund", "tests.noop", depends_on=("ship",), run_if=RunIf.ANY_FAILED),
    ),
)
#: ``undo`` compensates either of two independent tasks (fail_fast off: one dies, the other
#: still runs).
REGATE = WorkflowDef(
    "regate",
    (
        TaskDef("a", "tests.noop"),
        TaskDef("b", "tests.noop"),
        TaskDef("undo", "tests.noop", depends_on=("a", "b"), run_if=RunIf.ANY_FAILED),
    ),
    fail_fast=False,
)
CLEANUP = WorkflowDef(
    "cleanup",
    (
        TaskDef("a", "tests.noop"),
        TaskDef("b", "tests.noop"),
        TaskDef("tidy", "tests.noop", depends_on=("a", "b"), run_if=RunIf.ALL_DONE),
    ),
)
CHAIN = WorkflowDef(
    "chain",
    (
        TaskDef("ship", "tests.noop"),
        TaskDef("refund", "tests.noop", depends_on=("ship",), run_if=RunIf.ANY_FAILED),
        TaskDef("notify", "tests.noop", depends_on=("refund",)),
    ),
)


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def succeed(repo: Store, sql: Sql, task_run_id: uuid.UUID, result: Any = None) -> None:
    claim = claim_task(repo, sql, task_run_id)
    assert repo.finish(task_run_id, claim.fencing_token, TaskState.SUCCEEDED, result=result)
    drain(repo)


def compensated_run(repo: Store, sql: Sql) -> uuid.UUID:
    """A SAGA whose shipment died and whose refund succeeded: FAILED, compensated."""
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["charge"], {"charged": 10})
    bury(repo, sql, ids["ship"])
    drain(repo)
    succeed(repo, sql, ids["refund"])
    assert repo.get_run(run_id).state is RunState.FAILED
    return run_id


def states(repo: Store, run_id: uuid.UUID) -> dict[str, TaskState]:
    return {t.name: t.state for t in repo.get_run(run_id).tasks}


def outbox_rows(sql: Sql, task_run_id: uuid.UUID) -> int:
    return int(scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", task_run_id))


# ------------------------------------------------------------------ run_if


def test_saga_compensation_runs_after_the_failure_and_the_run_still_fails(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["charge"], {"charged": 10})
    bury(repo, sql, ids["ship"])
    drain(repo)
    # fail-fast did not cancel the compensation waiting for this very failure
    assert states(repo, run_id)["refund"] is TaskState.READY
    assert outbox_rows(sql, ids["refund"]) == 1
    assert repo.get_run(run_id).state is RunState.RUNNING
    succeed(repo, sql, ids["refund"])
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    assert run.compensated == ("refund",)
    assert states(repo, run_id) == {
        "charge": TaskState.SUCCEEDED,
        "ship": TaskState.DEAD,
        "refund": TaskState.SUCCEEDED,
    }


def test_saga_without_failure_skips_the_compensation_and_succeeds(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["charge"])
    succeed(repo, sql, ids["ship"])
    drain(repo)
    refund = repo.get_task(ids["refund"])
    assert (
        refund.state is TaskState.CANCELLED and refund.cancel_cause is CancelCause.CONDITION_NOT_MET
    )
    assert refund.skipped and refund.attempt == 0 and outbox_rows(sql, ids["refund"]) == 0
    run = repo.get_run(run_id)
    assert run.state is RunState.SUCCEEDED and run.compensated == ()


def test_any_failed_skips_when_its_dependency_was_only_cancelled(repo: Store, sql: Sql) -> None:
    # charge dies: fail-fast cancels ship; nothing was shipped, so there is nothing to refund
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    bury(repo, sql, ids["charge"])
    drain(repo)
    assert states(repo, run_id) == {
        "charge": TaskState.DEAD,
        "ship": TaskState.CANCELLED,
        "refund": TaskState.CANCELLED,
    }
    assert repo.get_task(ids["refund"]).cancel_cause is CancelCause.CONDITION_NOT_MET
    assert repo.get_run(run_id).state is RunState.FAILED


def test_all_done_runs_once_every_dependency_finished_whatever_the_outcome(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(CLEANUP).run_id
    ids = task_ids(repo, run_id)
    claim_b = claim_task(repo, sql, ids["b"])  # b runs while a dies
    bury(repo, sql, ids["a"])
    drain(repo)
    assert states(repo, run_id)["tidy"] is TaskState.PENDING  # b can still change
    assert repo.get_task(ids["tidy"]).cancel_requested is False
    assert repo.finish(ids["b"], claim_b.fencing_token, TaskState.CANCELLED)
    drain(repo)
    assert states(repo, run_id)["tidy"] is TaskState.READY
    succeed(repo, sql, ids["tidy"])
    assert repo.get_run(run_id).state is RunState.FAILED


def test_all_done_with_every_dependency_succeeded_runs_and_the_run_succeeds(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(CLEANUP).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["a"])
    assert states(repo, run_id)["tidy"] is TaskState.PENDING
    succeed(repo, sql, ids["b"])
    assert states(repo, run_id)["tidy"] is TaskState.READY
    succeed(repo, sql, ids["tidy"])
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


def test_fail_fast_does_not_stop_a_running_compensation(repo: Store, sql: Sql) -> None:
    wf = WorkflowDef(
        "two-failures",
        (
            TaskDef("x", "tests.noop"),
            TaskDef("y", "tests.noop"),
            TaskDef("undo", "tests.noop", depends_on=("x",), run_if=RunIf.ANY_FAILED),
        ),
    )
    run_id = repo.trigger(wf).run_id
    ids = task_ids(repo, run_id)
    claim_y = claim_task(repo, sql, ids["y"])
    bury(repo, sql, ids["x"])  # fail-fast: y asked to stop, undo let through
    assert repo.get_task(ids["y"]).cancel_requested is True
    claim_undo = claim_task(repo, sql, ids["undo"])
    assert repo.finish(
        ids["y"], claim_y.fencing_token, TaskState.FAILED, reason=FailureReason.PERMANENT_ERROR
    )
    drain(repo)  # y dead: fail-fast again, the running compensation is not asked to stop
    assert repo.get_task(ids["undo"]).cancel_requested is False
    assert repo.finish(ids["undo"], claim_undo.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.compensated == ("undo",)


def test_fail_fast_spares_what_follows_a_compensation(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(CHAIN).run_id
    ids = task_ids(repo, run_id)
    bury(repo, sql, ids["ship"])
    drain(repo)
    assert states(repo, run_id) == {
        "ship": TaskState.DEAD,
        "refund": TaskState.READY,
        "notify": TaskState.PENDING,
    }
    succeed(repo, sql, ids["refund"])
    assert states(repo, run_id)["notify"] is TaskState.READY
    succeed(repo, sql, ids["notify"])
    assert repo.get_run(run_id).state is RunState.FAILED


def test_a_task_after_a_skip_is_skipped_too_and_the_run_succeeds(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(CHAIN).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["ship"])
    drain(repo)
    notify = repo.get_task(ids["notify"])
    assert notify.state is TaskState.CANCELLED and notify.skipped
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


def test_an_operator_cancel_cancels_a_waiting_compensation(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(SAGA).run_id
    repo.cancel_run(run_id)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.CANCELLED
    assert repo.get_task(task_ids(repo, run_id)["refund"]).cancel_cause is CancelCause.OPERATOR


def test_requeueing_a_dead_dependency_makes_the_condition_wait_for_it_again(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(REGATE).run_id
    ids = task_ids(repo, run_id)
    gate = "SELECT pending_deps FROM task_runs WHERE id = %s"
    assert scalar(sql, gate, ids["undo"]) == 3  # two dependencies and the condition gate
    bury(repo, sql, ids["a"])
    assert scalar(sql, gate, ids["undo"]) == 2
    repo.requeue_dead(ids["a"], "tester", "try again")
    assert scalar(sql, gate, ids["undo"]) == 3  # a counts as unfinished again
    drain(repo)
    succeed(repo, sql, ids["a"])
    succeed(repo, sql, ids["b"])
    undo = repo.get_task(ids["undo"])
    assert undo.state is TaskState.CANCELLED and undo.skipped  # nothing failed in the end
    assert scalar(sql, gate, ids["undo"]) == 1
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


def test_two_schedulers_racing_decide_each_condition_once(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    runs = [r.run_id for r in repo.trigger_many(SAGA, [{"i": i} for i in range(30)])]
    for run_id in runs:
        ids = task_ids(repo, run_id)
        claim = claim_task(repo, sql, ids["charge"])
        assert repo.finish(ids["charge"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    for i, run_id in enumerate(runs):
        ids = task_ids(repo, run_id)
        claim = claim_task(repo, sql, ids["ship"])
        outcome = TaskState.SUCCEEDED if i % 2 else TaskState.FAILED
        reason = None if i % 2 else FailureReason.PERMANENT_ERROR
        assert repo.finish(ids["ship"], claim.fencing_token, outcome, reason=reason)
    # the deaths and successes are propagated, but no condition is decided yet
    while repo.route_failed(100) + repo.propagate(100):
        pass
    scheduler = until_idle(lambda own: own.evaluate_conditions(4))
    assert sum(race(clean_database_url, scheduler, scheduler)) == 30
    drain(repo)
    refunds = sql.execute(
        "SELECT state, cancel_cause, count(*) FROM task_runs WHERE name = 'refund'"
        " GROUP BY state, cancel_cause ORDER BY state"
    ).fetchall()
    assert refunds == [("CANCELLED", "condition_not_met", 15), ("READY", None, 15)]
    assert (
        scalar(
            sql,
            "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
            " WHERE t.name = 'refund'",
        )
        == 15
    )


# ------------------------------------------------------------------ rerun


def test_rerun_resets_failed_tasks_and_what_follows_keeping_successes(
    repo: Store, sql: Sql
) -> None:
    run_id = compensated_run(repo, sql)
    ids = task_ids(repo, run_id)
    charge_token = repo.get_task(ids["charge"]).fencing_token

    rerun = repo.rerun(run_id, "alice", "carrier is back")
    assert sorted(rerun.task_names) == ["refund", "ship"]
    assert rerun.previous_state is RunState.FAILED
    assert rerun.run.finished_at is None and rerun.run.state is RunState.RUNNING
    charge = repo.get_task(ids["charge"])
    assert charge.state is TaskState.SUCCEEDED and charge.result == {"charged": 10}
    assert charge.fencing_token == charge_token  # untouched
    drain(repo)
    assert states(repo, run_id)["ship"] is TaskState.READY
    assert states(repo, run_id)["refund"] is TaskState.PENDING
    succeed(repo, sql, ids["ship"])
    drain(repo)
    assert repo.get_task(ids["refund"]).skipped  # ship succeeded this time: no refund
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    (entry,) = repo.rerun_history(run_id)
    assert entry.requested_by == "alice" and entry.reason == "carrier is back"
    assert entry.from_task is None and entry.previous_state is RunState.FAILED
    assert sorted(entry.task_names) == ["refund", "ship"]
    assert set(entry.task_run_ids) == {ids["ship"], ids["refund"]}


def test_rerun_from_a_task_resets_it_and_everything_downstream(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["charge"], 1)
    succeed(repo, sql, ids["ship"], 2)
    drain(repo)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    rerun = repo.rerun(run_id, "bob", from_task="ship")
    assert sorted(rerun.task_names) == ["refund", "ship"]
    assert repo.get_task(ids["charge"]).result == 1
    drain(repo)
    ship = repo.get_task(ids["ship"])
    assert ship.state is TaskState.READY and ship.result is None
    assert repo.rerun_history(run_id)[0].from_task == "ship"
    succeed(repo, sql, ids["ship"], 3)
    drain(repo)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    assert repo.get_task(ids["ship"]).result == 3


def test_rerun_of_a_cancelled_run_runs_its_cancelled_tasks(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(CLEANUP).run_id
    repo.cancel_run(run_id)
    drain(repo)
    assert repo.get_run(run_id).state is RunState.CANCELLED
    rerun = repo.rerun(run_id, "carol")
    assert sorted(rerun.task_names) == ["a", "b", "tidy"]
    drain(repo)
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["a"])
    succeed(repo, sql, ids["b"])
    succeed(repo, sql, ids["tidy"])
    run = repo.get_run(run_id)
    assert run.state is RunState.SUCCEEDED and run.cancel_requested is False


def test_rerun_refusals_change_nothing(repo: Store, sql: Sql) -> None:
    running = repo.trigger(SAGA).run_id
    with pytest.raises(NotFinishedError, match="not finished"):
        repo.rerun(running, "x")
    with pytest.raises(NotFoundError, match="no run with id"):
        repo.rerun(uuid.uuid4(), "x")
    with pytest.raises(InvalidIdError):
        repo.rerun("not-a-uuid", "x")
    done = repo.trigger(CLEANUP).run_id
    ids = task_ids(repo, done)
    for name in ("a", "b", "tidy"):
        drain(repo)
        succeed(repo, sql, ids[name])
    assert repo.get_run(done).state is RunState.SUCCEEDED
    with pytest.raises(NotFoundError, match="no task named 'nope'"):
        repo.rerun(done, "x", from_task="nope")
    with pytest.raises(NotFinishedError, match="nothing to rerun"):
        repo.rerun(done, "x")
    assert scalar(sql, "SELECT count(*) FROM rerun_audit") == 0
    assert repo.get_run(done).state is RunState.SUCCEEDED


def test_two_racing_reruns_reset_once_and_audit_once(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    succeed(repo, sql, ids["charge"])
    bury(repo, sql, ids["ship"])
    drain(repo)
    succeed(repo, sql, ids["refund"])
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def operator(who: str) -> None:
        database = Database(DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=2))
        database.open()
        try:
            own = Store(database)
            barrier.wait()
            try:
                own.rerun(run_id, who)
                outcomes.append("rerun")
            except NotFinishedError:
                outcomes.append("refused")
        finally:
            database.close()

    threads = [threading.Thread(target=operator, args=(f"op-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["refused", "rerun"]
    assert scalar(sql, "SELECT count(*) FROM rerun_audit") == 1
    ship = repo.get_task(ids["ship"])
    assert ship.state is TaskState.PENDING and ship.attempt == 1
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", ids["ship"]) == 1
    drain(repo)
    assert scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", ids["ship"]) == 2


def test_a_requeue_before_the_death_was_propagated_keeps_the_gate_exact(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(REGATE).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(
        ids["a"], claim.fencing_token, TaskState.FAILED, reason=FailureReason.PERMANENT_ERROR
    )
    assert repo.route_failed(100) == 1  # DEAD, not propagated yet: the gate still counts it
    assert repo.get_task(ids["a"]).state is TaskState.DEAD
    repo.requeue_dead(ids["a"], "tester", "early")  # before any propagate pass
    gate = "SELECT pending_deps FROM task_runs WHERE id = %s"
    assert scalar(sql, gate, ids["undo"]) == 3
    drain(repo)
    succeed(repo, sql, ids["a"])
    succeed(repo, sql, ids["b"])
    undo = repo.get_task(ids["undo"])
    assert undo.state is TaskState.CANCELLED and undo.skipped  # decided, not stuck
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
