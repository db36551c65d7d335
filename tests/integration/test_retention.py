"""Retention keeps what the engine promised to keep (issue 15), against real PostgreSQL.

Proven here by driving the repository as the roles do and counting rows; the database clock is
the only clock, so rows are aged by moving their timestamps back with SQL, never by sleeping:

- the retention purge never deletes a run that still has a DEAD task (nor its tasks, attempts,
  edges, requeue audit); once requeued and finished, the run ages and goes like any other;
- task idempotency keys outlive the purged runs on their own clock (a repeat reuses the stored
  result, a reuse renews the key), and execute again only once that clock ran out; a trigger
  key lives on its run row and goes with it;
- a stream held by ``on_dead: block`` stays held through retention; only the operator's purge
  of the dead task releases it, and says so;
- ``purge_dead`` deletes exactly the old, settled dead tasks with their runs, in bounded
  batches, with an audit row; its preview counts the same without deleting;
- the scheduler's housekeeping passes both clocks from the config.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest

from flowforge.config import Config, DatabaseConfig, SchedulerConfig
from flowforge.domain.dag import OnDead, TaskDef, WorkflowDef
from flowforge.domain.model import ClaimOutcome
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError
from flowforge.roles.scheduler import Scheduler
from tests.helpers import (
    FAST_RETRY,
    bury,
    chain,
    claim_task,
    drain,
    outbox_token,
    single,
    task_ids,
    wait_for,
)
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

HOUR = 3600.0
#: Retention ages used by the repository-level tests (seconds): runs 1 h, keys 3 h.
RUNS_AGE = HOUR
KEYS_AGE = 3 * HOUR

CHARGE = single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)
BLOCKING = single("streamed", ordering_key="account-{account}", on_dead=OnDead.BLOCK)


def count(sql: Sql, table: str, where: str = "true", params: tuple[Any, ...] = ()) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table} WHERE {where}", params).fetchone()
    assert row is not None
    return int(row[0])


def backdate(sql: Sql, run_id: uuid.UUID, hours: float) -> None:
    """Pretend the run and its tasks finished ``hours`` earlier than they did."""
    for table, column in (("workflow_runs", "id"), ("task_runs", "run_id")):
        sql.execute(
            f"UPDATE {table} SET finished_at = finished_at - make_interval(secs => %s)"
            f" WHERE {column} = %s AND finished_at IS NOT NULL",
            (hours * HOUR, run_id),
        )


def backdate_keys(sql: Sql, hours: float) -> None:
    sql.execute(
        "UPDATE idempotency_keys SET updated_at = updated_at - make_interval(secs => %s)",
        (hours * HOUR,),
    )


def retention(repo: Store) -> int:
    return repo.purge(RUNS_AGE, limit=100, key_age_s=KEYS_AGE)


def succeed(repo: Store, sql: Sql, task_id: uuid.UUID, result: Any = None) -> None:
    claim = claim_task(repo, sql, task_id)
    assert repo.finish(task_id, claim.fencing_token, TaskState.SUCCEEDED, result=result)
    drain(repo)


def die(repo: Store, sql: Sql, task_id: uuid.UUID) -> None:
    bury(repo, sql, task_id)


def run_with_dead_task(repo: Store, sql: Sql, workflow: WorkflowDef) -> uuid.UUID:
    """A run of ``workflow`` whose first task died, was requeued (an audit row) and died again."""
    run_id = repo.trigger(workflow).run_id
    drain(repo)
    first = repo.get_run(run_id).tasks[0].id
    die(repo, sql, first)
    repo.requeue_dead(first, "ops", "try once more")
    drain(repo)
    die(repo, sql, first)
    run = repo.get_run(run_id)
    assert run.state is RunState.FAILED and run.finished_at is not None
    return run_id


def finished_run(repo: Store, sql: Sql, workflow: WorkflowDef | None = None) -> uuid.UUID:
    run_id = repo.trigger(workflow or single()).run_id
    drain(repo)
    for task in repo.get_run(run_id).tasks:
        succeed(repo, sql, task.id)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    return run_id


def dead_single(repo: Store, sql: Sql, workflow: WorkflowDef, **run_input: Any) -> uuid.UUID:
    """A one-task run whose task died; returns the task run id."""
    run_id = repo.trigger(workflow, run_input).run_id
    drain(repo)
    task_id = task_ids(repo, run_id)["only"]
    die(repo, sql, task_id)
    return task_id


# ------------------------------------------------------------------ retention keeps DEAD tasks


def test_retention_keeps_an_old_finished_run_that_has_a_dead_task(repo: Store, sql: Sql) -> None:
    kept = run_with_dead_task(repo, sql, chain(length=2))
    gone = finished_run(repo, sql)
    backdate(sql, kept, hours=24 * 365)
    backdate(sql, gone, hours=2)
    assert retention(repo) >= 1
    assert [r[0] for r in sql.execute("SELECT id FROM workflow_runs")] == [kept]
    dead = repo.get_run(kept).task("t0")
    assert dead.state is TaskState.DEAD
    assert count(sql, "task_runs", "run_id = %s", (kept,)) == 2
    assert count(sql, "task_edges") == 1
    assert [a.outcome for a in repo.attempts(dead.id)] == ["failed", "failed"]
    detail = repo.task_detail(dead.id)
    assert [(a.requested_by, a.reason) for a in detail.audit] == [("ops", "try once more")]


def test_retention_keeps_a_run_whose_task_can_still_change(repo: Store, sql: Sql) -> None:
    """Even if a run reads finished while a task is unsettled, retention leaves it alone."""
    run_id = repo.trigger(chain(length=2)).run_id
    drain(repo)
    sql.execute(
        "UPDATE workflow_runs SET state = 'FAILED', finished_at = now() - interval '2 hours'"
        " WHERE id = %s",
        (run_id,),
    )
    retention(repo)
    assert count(sql, "workflow_runs") == 1 and count(sql, "task_runs") == 2


def test_a_requeued_dead_task_that_succeeds_lets_its_run_age_and_go(repo: Store, sql: Sql) -> None:
    run_id = run_with_dead_task(repo, sql, chain(length=2))
    backdate(sql, run_id, hours=48)
    retention(repo)
    ids = task_ids(repo, run_id)
    repo.requeue_dead(ids["t0"], "ops")
    drain(repo)
    succeed(repo, sql, ids["t0"])
    succeed(repo, sql, ids["t1"])
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    retention(repo)  # finished just now: not old enough
    assert count(sql, "workflow_runs") == 1
    assert count(sql, "requeue_audit") == 2
    backdate(sql, run_id, hours=2)
    retention(repo)
    for table in ("workflow_runs", "task_runs", "task_edges", "task_attempts", "requeue_audit"):
        assert count(sql, table) == 0, table


# ------------------------------------------------------------------ idempotency keys


def test_a_task_key_outlives_its_purged_run_and_a_repeat_reuses_its_result(
    repo: Store, sql: Sql
) -> None:
    first = repo.trigger(CHARGE, {"order_id": 1}).run_id
    drain(repo)
    succeed(repo, sql, task_ids(repo, first)["only"], result={"charged": 1})
    backdate(sql, first, hours=2)
    backdate_keys(sql, hours=2)
    retention(repo)
    assert count(sql, "workflow_runs") == 0  # the run is gone ...
    assert count(sql, "idempotency_keys", "key = 'charge-1' AND state = 'SUCCEEDED'") == 1

    again = repo.trigger(CHARGE, {"order_id": 1}).run_id  # ... and is triggered again
    drain(repo)
    task_id = task_ids(repo, again)["only"]
    reused = repo.claim(task_id, outbox_token(sql, task_id), "worker-2", 30)
    assert reused.outcome is ClaimOutcome.REUSED  # the handler does not run again
    drain(repo)
    task = repo.get_task(task_id)
    assert (task.state, task.result) == (TaskState.SUCCEEDED, {"charged": 1})
    assert [a.outcome for a in repo.attempts(task_id)] == ["reused"]


def test_reusing_a_key_renews_its_retention(repo: Store, sql: Sql) -> None:
    for order in (1, 2):
        run_id = repo.trigger(CHARGE, {"order_id": order}).run_id
        drain(repo)
        succeed(repo, sql, task_ids(repo, run_id)["only"], result={"order": order})
    backdate_keys(sql, hours=KEYS_AGE / HOUR + 1)  # both keys are past their retention
    repeat = task_ids(repo, repo.trigger(CHARGE, {"order_id": 1, "repeat": True}).run_id)["only"]
    drain(repo)
    assert repo.claim(repeat, outbox_token(sql, repeat), "w", 30).outcome is ClaimOutcome.REUSED
    retention(repo)
    assert [r[0] for r in sql.execute("SELECT key FROM idempotency_keys")] == ["charge-1"]


def test_a_key_past_its_own_retention_executes_again(repo: Store, sql: Sql) -> None:
    """The documented end of the promise: once the key is purged, a repeat runs the handler."""
    first = repo.trigger(CHARGE, {"order_id": 1}).run_id
    drain(repo)
    succeed(repo, sql, task_ids(repo, first)["only"], result={"charged": 1})
    backdate(sql, first, hours=2)
    backdate_keys(sql, hours=KEYS_AGE / HOUR - 0.5)
    retention(repo)
    assert count(sql, "idempotency_keys") == 1  # within the key's retention
    backdate_keys(sql, hours=1)
    retention(repo)
    assert count(sql, "idempotency_keys") == 0
    again = task_ids(repo, repo.trigger(CHARGE, {"order_id": 1}).run_id)["only"]
    drain(repo)
    claimed = repo.claim(again, outbox_token(sql, again), "worker-2", 30)
    assert claimed.outcome is ClaimOutcome.EXECUTE


def test_a_purge_given_no_key_age_leaves_keys_alone(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(CHARGE, {"order_id": 1}).run_id
    drain(repo)
    succeed(repo, sql, task_ids(repo, run_id)["only"], result={"charged": 1})
    backdate(sql, run_id, hours=1000)
    backdate_keys(sql, hours=1000)
    repo.purge(RUNS_AGE, limit=100)
    assert (count(sql, "workflow_runs"), count(sql, "idempotency_keys")) == (0, 1)


def test_a_trigger_key_lives_on_its_run_and_goes_with_it(repo: Store, sql: Sql) -> None:
    kept = repo.trigger(single("blocking-single"), {}, idempotency_key="order-1").run_id
    drain(repo)
    die(repo, sql, task_ids(repo, kept)["only"])
    done = repo.trigger(single(), {}, idempotency_key="order-2").run_id
    drain(repo)
    succeed(repo, sql, task_ids(repo, done)["only"])
    backdate(sql, kept, hours=48)
    backdate(sql, done, hours=48)
    retention(repo)
    # the run with a dead task stays, and so does its trigger key: a replay returns it
    replay = repo.trigger(single("blocking-single"), {}, idempotency_key="order-1")
    assert (replay.created, replay.run_id) == (False, kept)
    # the purged run's key went with it: the same key starts a new run
    fresh = repo.trigger(single(), {}, idempotency_key="order-2")
    assert fresh.created and fresh.run_id != done


# ------------------------------------------------------------------ ordering streams


def test_a_blocked_stream_stays_blocked_through_retention_until_an_operator_purge(
    repo: Store, sql: Sql
) -> None:
    first = dead_single(repo, sql, BLOCKING, account=1)
    waiting = task_ids(repo, repo.trigger(BLOCKING, {"account": 1}).run_id)["only"]
    drain(repo)
    assert repo.get_task(waiting).state is TaskState.PENDING
    backdate(sql, repo.get_task(first).run_id, hours=24 * 365)
    retention(repo)
    drain(repo)
    assert repo.get_task(first).state is TaskState.DEAD
    assert repo.get_task(waiting).state is TaskState.PENDING  # still held

    purged = repo.purge_dead(RUNS_AGE, "ops", limit=100)
    assert (purged.runs, purged.dead_task_ids, purged.released_streams) == (
        1,
        (first,),
        ("account-1",),
    )
    drain(repo)
    assert repo.get_task(waiting).state is TaskState.READY  # released, and said so


def test_a_stream_another_dead_task_still_holds_is_not_reported_released(
    repo: Store, sql: Sql
) -> None:
    old = dead_single(repo, sql, BLOCKING, account=1)
    # a later task of the same stream can only die after the first one let it run: make it
    # die in a stream of its own, then put it in the first one's
    recent = dead_single(repo, sql, BLOCKING, account=2)
    sql.execute("UPDATE task_runs SET ordering_key = 'account-1' WHERE id = %s", (recent,))
    backdate(sql, repo.get_task(old).run_id, hours=48)
    purged = repo.purge_dead(RUNS_AGE, "ops", limit=100)
    assert (purged.dead_task_ids, purged.released_streams) == ((old,), ())
    assert repo.get_task(recent).state is TaskState.DEAD


# ------------------------------------------------------------------ the operator's purge


def test_purge_dead_deletes_exactly_the_old_settled_dead_tasks_with_their_runs(
    repo: Store, sql: Sql
) -> None:
    old = dead_single(repo, sql, single("payments"))
    recent = dead_single(repo, sql, single("payments"), n=2)
    # a run whose old dead task has a sibling that can still run: kept, not cut in half
    siblings = WorkflowDef(
        "siblings",
        (TaskDef("x", "tests.noop", retry=FAST_RETRY), TaskDef("y", "tests.noop")),
        fail_fast=False,
    )
    active = repo.trigger(siblings).run_id
    drain(repo)
    die(repo, sql, task_ids(repo, active)["x"])
    untouched = finished_run(repo, sql)  # old, but nothing in it is dead
    for run_id in (repo.get_task(old).run_id, active, untouched):
        backdate(sql, run_id, hours=48)
    sql.execute("UPDATE task_runs SET finished_at = now() - interval '48 hours' WHERE name = 'x'")
    before = {t: count(sql, t) for t in ("workflow_runs", "task_runs", "task_attempts")}

    preview = repo.preview_dead_purge(RUNS_AGE)
    assert (preview.runs, preview.tasks, preview.dead_task_ids) == (1, 1, (old,))
    assert [s["id"] for s in preview.shown] == [str(old)]
    assert repo.count_old_dead(RUNS_AGE) == 2  # old and x: x is kept
    assert {t: count(sql, t) for t in before} == before  # the preview deleted nothing

    purged = repo.purge_dead(RUNS_AGE, "alice", limit=100)
    assert (purged.runs, purged.tasks, purged.dead_task_ids) == (1, 1, (old,))
    assert count(sql, "task_runs", "id = %s", (old,)) == 0
    assert count(sql, "task_attempts", "task_run_id = %s", (old,)) == 0
    assert count(sql, "workflow_runs") == 3  # recent's run, active, untouched
    assert repo.get_task(recent).state is TaskState.DEAD
    assert repo.get_run(active).task("x").state is TaskState.DEAD
    assert repo.purge_dead(RUNS_AGE, "alice", limit=100).runs == 0
    audit = sql.execute(
        "SELECT requested_by, older_than_s, workflow, runs, tasks, dead_task_ids,"
        " released_streams FROM purge_audit"
    ).fetchall()
    assert audit == [("alice", RUNS_AGE, None, 1, 1, [old], [])]


def test_purge_dead_works_in_bounded_batches(repo: Store, sql: Sql) -> None:
    for n in range(3):
        backdate(sql, repo.get_task(dead_single(repo, sql, single(), n=n)).run_id, hours=2)
    for left in (2, 1, 0):
        assert repo.purge_dead(RUNS_AGE, "ops", limit=1).runs == 1
        assert count(sql, "workflow_runs") == left
    assert repo.purge_dead(RUNS_AGE, "ops", limit=1).runs == 0
    assert count(sql, "purge_audit") == 3  # one audit row per batch


def test_purge_dead_of_one_workflow_leaves_the_others(repo: Store, sql: Sql) -> None:
    mine = dead_single(repo, sql, single("mine"))
    other = dead_single(repo, sql, single("other"))
    for task_id in (mine, other):
        backdate(sql, repo.get_task(task_id).run_id, hours=2)
    assert repo.preview_dead_purge(RUNS_AGE, "mine").dead_task_ids == (mine,)
    assert repo.purge_dead(RUNS_AGE, "ops", 100, workflow="mine").dead_task_ids == (mine,)
    assert repo.get_task(other).state is TaskState.DEAD


def test_a_requeue_racing_the_purge_wins_and_its_run_is_kept(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """The purge picked the run, then waits for the task a requeue holds; the requeue commits
    first, so the purge, looking again under its locks, keeps the run."""
    task_id = dead_single(repo, sql, single(), n=1)
    backdate(sql, repo.get_task(task_id).run_id, hours=2)
    outcome: dict[str, Any] = {}
    with psycopg.connect(clean_database_url) as requeue:  # one open transaction
        requeue.execute(
            "UPDATE task_runs SET state = 'PENDING', finished_at = NULL WHERE id = %s", (task_id,)
        )
        purge = threading.Thread(
            target=lambda: outcome.update(purged=repo.purge_dead(RUNS_AGE, "ops", 100))
        )
        purge.start()
        wait_for(
            lambda: count(
                sql, "pg_stat_activity", "wait_event_type = 'Lock' AND datname = current_database()"
            ),
            what="the purge waiting for the requeue's lock",
        )
        requeue.commit()
    purge.join(timeout=30)
    assert not purge.is_alive()
    assert outcome["purged"].runs == 0
    assert repo.get_task(task_id).state is TaskState.PENDING


def test_purge_dead_refuses_text_postgresql_cannot_store(repo: Store) -> None:
    with pytest.raises(InputError):
        repo.purge_dead(RUNS_AGE, "o\x00ps", 100)
    with pytest.raises(InputError):
        repo.preview_dead_purge(RUNS_AGE, "bad\udcffname")


# ------------------------------------------------------------------ the scheduler's housekeeping


def test_scheduler_housekeeping_ages_runs_and_keys_on_their_own_clocks(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id = repo.trigger(CHARGE, {"order_id": 1}).run_id
    drain(repo)
    succeed(repo, sql, task_ids(repo, run_id)["only"], result={"charged": 1})
    dead_run = repo.get_task(dead_single(repo, sql, BLOCKING, account=1)).run_id
    backdate(sql, run_id, hours=30)  # past a 1-day run retention
    backdate(sql, dead_run, hours=30)
    backdate_keys(sql, hours=30)  # within a 2-day key retention
    config = Config(
        database=DatabaseConfig(url=clean_database_url),
        scheduler=SchedulerConfig(
            poll_interval_s=0.05, retention_days=1, idempotency_retention_days=2
        ),
    )
    housekeeping_once(config)
    assert [r[0] for r in sql.execute("SELECT id FROM workflow_runs")] == [dead_run]
    assert count(sql, "idempotency_keys") == 1
    backdate_keys(sql, hours=20)  # now 50 hours old
    housekeeping_once(config)
    assert count(sql, "idempotency_keys") == 0
    assert [r[0] for r in sql.execute("SELECT id FROM workflow_runs")] == [dead_run]


def housekeeping_once(config: Config) -> None:
    """A real scheduler's first round of its loop: a pass, then housekeeping (due at once)."""

    class OneRound(threading.Event):
        rounds = 0

        def is_set(self) -> bool:
            self.rounds += 1
            return self.rounds > 1

    scheduler = Scheduler(config)
    scheduler.initialize()
    try:
        scheduler.loop(OneRound(), lambda: None)
    finally:
        scheduler.shutdown()


def test_a_retention_backlog_goes_in_paced_batches_not_one_batch_a_housekeeping_interval(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """Eleven old runs, batches of 2, housekeeping once a minute: before pacing, one batch a
    minute (2 runs); paced, the batches follow each other within their share of the time
    until none is left, and then the purge waits for the next interval."""
    runs = [finished_run(repo, sql) for _ in range(11)]
    for run_id in runs:
        backdate(sql, run_id, hours=30)
    keep = finished_run(repo, sql)  # finished just now: kept
    config = Config(
        database=DatabaseConfig(url=clean_database_url),
        scheduler=SchedulerConfig(
            poll_interval_s=0.05,
            batch_size=2,
            retention_days=1,
            idempotency_retention_days=2,
            housekeeping_interval_s=60.0,
            retention_share=0.5,
        ),
    )
    scheduler = Scheduler(config)
    scheduler.initialize()
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.loop, args=(stop, lambda: None), daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: count(sql, "workflow_runs") == 1,
            timeout=20.0,
            what="the old runs to be purged in paced batches",
        )
    finally:
        stop.set()
        thread.join(10.0)
        scheduler.shutdown()
    assert [r[0] for r in sql.execute("SELECT id FROM workflow_runs")] == [keep]
