"""The worker's batch operations against real PostgreSQL, one behaviour per test.

A worker claims a batch of dispatches in one statement (``claim_many``), finishes the batch in
one statement (``finish_many``, which also releases the dependents of what succeeded), renews
all its leases in one statement (``renew_leases``) and hands back the claims queued behind a
slow handler (``release_claims``). Proven here by reading rows after driving the repository the
way the worker does. Scheduler passes (``drain``) only make tasks READY before the part under
test; dependents released by a finish are checked before any further pass.

The last tests pin down duplicates in one batch and a claim handed back after its run was
cancelled.
"""

from __future__ import annotations

import base64
import os
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Claim, ClaimOutcome, Continuation, Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import JsonText
from tests.helpers import (
    FAST_RETRY,
    chain,
    claim_task,
    diamond,
    dispatch,
    drain,
    expire_lease,
    outbox_token,
    single,
    task_ids,
)
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
Pair = tuple[uuid.UUID, int]

LEASE_S = 30.0


# ------------------------------------------------------------------ helpers


def ready_singles(repo: Store, count: int, name: str = "batch") -> list[uuid.UUID]:
    """``count`` one-task runs made READY by a scheduler pass; their task run ids, in order."""
    results = repo.trigger_many(single(name, retry=FAST_RETRY), [{"n": n} for n in range(count)])
    drain(repo)
    return [task_ids(repo, r.run_id)["only"] for r in results]


def dispatched(sql: Sql, task_id: uuid.UUID) -> Pair:
    """The (task run, token) pair the newest dispatch message of a task names."""
    return task_id, outbox_token(sql, task_id)


def outbox_rows(sql: Sql, task_id: uuid.UUID) -> list[tuple[int, datetime | None]]:
    """(token, published_at) of every outbox row of one task run, oldest first."""
    return [
        (int(t), p)
        for t, p in sql.execute(
            "SELECT fencing_token, published_at FROM outbox WHERE task_run_id = %s ORDER BY id",
            (task_id,),
        ).fetchall()
    ]


def pending_deps(sql: Sql, task_id: uuid.UUID) -> int:
    row = sql.execute("SELECT pending_deps FROM task_runs WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return int(row[0])


def key_row(sql: Sql, key: str) -> tuple[str, uuid.UUID, int, datetime | None] | None:
    """(state, task_run_id, fencing_token, lease_expires_at) of an idempotency key, if any."""
    row = sql.execute(
        "SELECT state, task_run_id, fencing_token, lease_expires_at FROM idempotency_keys"
        " WHERE key = %s",
        (key,),
    ).fetchone()
    return None if row is None else (row[0], row[1], int(row[2]), row[3])


def held_key(sql: Sql, key: str) -> tuple[str, uuid.UUID, int, datetime | None]:
    """Like :func:`key_row` for a key that must exist."""
    row = key_row(sql, key)
    assert row is not None, f"no idempotency key {key!r}"
    return row


def db_now(sql: Sql) -> datetime:
    row = sql.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def stale_completions(repo: Store) -> int:
    return repo.counters().get("stale_completions", 0)


def claims_of(results: list[Any]) -> list[Claim]:
    """The claims of EXECUTE results (every one must be EXECUTE)."""
    assert [r.outcome for r in results] == [ClaimOutcome.EXECUTE] * len(results), results
    return [r.claim for r in results]


def make_stale(repo: Store, sql: Sql, task_id: uuid.UUID) -> Claim:
    """Claim a READY task, then let the reaper take it: the claim's token is stale after."""
    claim = claim_task(repo, sql, task_id, worker="presumed-dead")
    expire_lease(sql, task_id)
    assert repo.reap_expired(10) == 1
    assert repo.get_task(task_id).state is TaskState.RETRYING
    return claim


# ------------------------------------------------------------------ claim_many


def test_claim_many_claims_every_ready_task_in_one_statement_in_input_order(
    repo: Store, sql: Sql
) -> None:
    tasks = ready_singles(repo, 4)
    wanted = [dispatched(sql, t) for t in reversed(tasks)]  # not the order they were made in
    results = repo.claim_many(wanted, "worker-1", LEASE_S)

    claims = claims_of(results)
    assert [c.task_run_id for c in claims] == [t for t, _ in wanted]
    for claim, (task_id, token) in zip(claims, wanted, strict=True):
        assert (claim.attempt, claim.fencing_token) == (1, token + 1)
        task = repo.get_task(task_id)
        assert (task.state, task.attempt, task.lease_owner) == (TaskState.RUNNING, 1, "worker-1")
        assert task.fencing_token == claim.fencing_token
        assert task.lease_expires_at is not None and task.lease_expires_at > db_now(sql)
        [attempt] = repo.attempts(task_id)
        assert (attempt.attempt, attempt.fencing_token, attempt.worker, attempt.outcome) == (
            1,
            claim.fencing_token,
            "worker-1",
            "running",
        )
    # one statement: one transaction, one now() for every claim in it
    started = {repo.get_task(t).started_at for t in tasks}
    assert len(started) == 1 and None not in started
    assert {c.input["n"] for c in claims} == {0, 1, 2, 3}


def test_a_stale_pair_is_lost_while_the_rest_of_its_batch_is_claimed(repo: Store, sql: Sql) -> None:
    first, taken, last = ready_singles(repo, 3)
    stale = dispatched(sql, taken)
    elsewhere = claim_task(repo, sql, taken, worker="worker-2")  # its message is now stale

    results = repo.claim_many(
        [dispatched(sql, first), stale, dispatched(sql, last)], "worker-1", LEASE_S
    )

    assert [r.outcome for r in results] == [
        ClaimOutcome.EXECUTE,
        ClaimOutcome.LOST,
        ClaimOutcome.EXECUTE,
    ]
    assert results[1].claim is None
    assert [r.claim.task_run_id for r in (results[0], results[2]) if r.claim] == [first, last]
    untouched = repo.get_task(taken)
    assert (untouched.lease_owner, untouched.attempt) == ("worker-2", 1)
    assert untouched.fencing_token == elsewhere.fencing_token
    assert [a.worker for a in repo.attempts(taken)] == ["worker-2"]
    for task_id in (first, last):
        assert repo.get_task(task_id).lease_owner == "worker-1"


def test_keyed_tasks_in_a_batch_claim_their_key_or_reuse_a_settled_one(
    repo: Store, sql: Sql
) -> None:
    keyed = single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)
    settled = task_ids(repo, repo.trigger(keyed, {"order_id": 1, "try": 1}).run_id)["only"]
    drain(repo)
    first = claim_task(repo, sql, settled)
    assert repo.finish(settled, first.fencing_token, TaskState.SUCCEEDED, result={"charged": 1})

    reuse = task_ids(repo, repo.trigger(keyed, {"order_id": 1, "try": 2}).run_id)["only"]
    fresh = task_ids(repo, repo.trigger(keyed, {"order_id": 2}).run_id)["only"]
    before, after = ready_singles(repo, 2)
    wanted = [dispatched(sql, t) for t in (before, fresh, reuse, after)]

    results = repo.claim_many(wanted, "worker-1", LEASE_S)

    assert [r.outcome for r in results] == [
        ClaimOutcome.EXECUTE,
        ClaimOutcome.EXECUTE,
        ClaimOutcome.REUSED,
        ClaimOutcome.EXECUTE,
    ]
    assert [r.claim.task_run_id for r in results if r.claim] == [before, fresh, reuse, after]
    fresh_claim = results[1].claim
    assert fresh_claim is not None and fresh_claim.idempotency_key == "charge-2"
    assert held_key(sql, "charge-2")[:3] == ("RUNNING", fresh, fresh_claim.fencing_token)
    fresh_task = repo.get_task(fresh)
    assert (fresh_task.state, fresh_task.attempt) == (TaskState.RUNNING, 1)

    reused = repo.get_task(reuse)
    assert (reused.state, reused.result, reused.lease_owner) == (
        TaskState.SUCCEEDED,
        {"charged": 1},
        None,
    )
    assert [(a.outcome, a.worker) for a in repo.attempts(reuse)] == [("reused", "worker-1")]
    assert held_key(sql, "charge-1")[:2] == ("SUCCEEDED", settled)


# ------------------------------------------------------------------ finish_many


def test_finish_many_commits_each_outcome_and_counts_every_stale_one(repo: Store, sql: Sql) -> None:
    won, failed, cancelled, late_a, late_b = ready_singles(repo, 5)
    claims = claims_of(
        repo.claim_many([dispatched(sql, t) for t in (won, failed, cancelled)], "w", LEASE_S)
    )
    stale = [make_stale(repo, sql, t) for t in (late_a, late_b)]
    reaped = {t: repo.get_task(t) for t in (late_a, late_b)}
    counted_before = stale_completions(repo)

    outcomes = [
        (claims[0].task_run_id, claims[0].fencing_token, Finish(TaskState.SUCCEEDED, {"ok": 1})),
        (
            claims[1].task_run_id,
            claims[1].fencing_token,
            Finish(
                TaskState.FAILED,
                reason=FailureReason.HANDLER_ERROR,
                error="RuntimeError: boom",
                traceback="Traceback: boom",
            ),
        ),
        (claims[2].task_run_id, claims[2].fencing_token, Finish(TaskState.CANCELLED)),
        *[(c.task_run_id, c.fencing_token, Finish(TaskState.SUCCEEDED, {"r": 1})) for c in stale],
    ]
    finished = repo.finish_many(outcomes)

    assert finished.committed == {won, failed, cancelled}
    assert finished.ready == ()
    assert stale_completions(repo) == counted_before + 2

    task = repo.get_task(won)
    assert (task.state, task.result, task.lease_owner, task.lease_expires_at) == (
        TaskState.SUCCEEDED,
        {"ok": 1},
        None,
        None,
    )
    assert task.finished_at is not None
    task = repo.get_task(failed)
    assert (task.state, task.failure_reason, task.last_error) == (
        TaskState.FAILED,
        FailureReason.HANDLER_ERROR,
        "RuntimeError: boom",
    )
    assert task.finished_at is None  # FAILED waits for routing
    task = repo.get_task(cancelled)
    assert (task.state, task.failure_reason) == (TaskState.CANCELLED, FailureReason.CANCELLED)

    closed = {t: repo.attempts(t) for t in (won, failed, cancelled)}
    assert [(a.outcome, a.failure_reason) for a in closed[won]] == [("succeeded", None)]
    assert [(a.outcome, a.failure_reason, a.error, a.traceback) for a in closed[failed]] == [
        ("failed", FailureReason.HANDLER_ERROR, "RuntimeError: boom", "Traceback: boom")
    ]
    assert [(a.outcome, a.failure_reason) for a in closed[cancelled]] == [
        ("cancelled", FailureReason.CANCELLED)
    ]
    assert all(a.finished_at is not None for history in closed.values() for a in history)

    for task_id, was in reaped.items():  # the stale outcomes changed nothing
        now = repo.get_task(task_id)
        assert (now.state, now.fencing_token, now.result) == (
            TaskState.RETRYING,
            was.fencing_token,
            None,
        )
        assert [a.outcome for a in repo.attempts(task_id)] == ["lease_expired"]


def test_finish_many_with_only_current_tokens_counts_nothing_stale(repo: Store, sql: Sql) -> None:
    tasks = ready_singles(repo, 3)
    claims = claims_of(repo.claim_many([dispatched(sql, t) for t in tasks], "w", LEASE_S))
    counted_before = stale_completions(repo)
    finished = repo.finish_many(
        [(c.task_run_id, c.fencing_token, Finish(TaskState.SUCCEEDED)) for c in claims]
    )
    assert finished.committed == set(tasks)
    assert stale_completions(repo) == counted_before


def test_a_claim_says_how_many_bytes_its_input_and_inline_upstream_results_carry(
    repo: Store, sql: Sql
) -> None:
    """What the worker's window follows besides time (roles/intake.py): the claim's
    payload_bytes, the size of what it carries as JSON text — what the worker decodes, not
    what TOAST stores."""
    blob = base64.b64encode(os.urandom(120_000)).decode()  # 160,000 characters
    run_id = repo.trigger(chain(length=2), {"blob": blob}).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    first = claim_task(repo, sql, ids["t0"])
    assert 0.9 * len(blob) <= first.payload_bytes <= len(blob) + 1_000
    assert repo.finish(ids["t0"], first.fencing_token, TaskState.SUCCEEDED, result=blob)
    second = claim_task(repo, sql, ids["t1"])
    assert second.upstream == {"t0": blob}
    assert 1.8 * len(blob) <= second.payload_bytes <= 2 * len(blob) + 1_000
    [small] = claims_of(
        repo.claim_many([dispatched(sql, t) for t in ready_singles(repo, 1)], "w", LEASE_S)
    )
    assert 0 < small.payload_bytes < 200
    # repeated text, which TOAST compresses to a few KB: counted as what the worker decodes
    plain = "ab" * 200_000
    run_id = repo.trigger(single("plain"), {"blob": plain}).run_id
    drain(repo)
    stored = sql.execute(
        "SELECT pg_column_size(input) FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert stored and stored[0] < len(plain) // 20
    decoded = claim_task(repo, sql, task_ids(repo, run_id)["only"])
    assert len(plain) <= decoded.payload_bytes <= len(plain) + 1_000


# ------------------------------------------------------------------ dependents released by finish


def test_finishing_a_task_releases_its_dependent_without_a_scheduler_pass(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(chain(length=2)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)  # the only scheduler pass: t0 becomes READY
    dispatch(sql)
    claim = claim_task(repo, sql, ids["t0"])
    assert repo.get_task(ids["t1"]).state is TaskState.PENDING

    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.SUCCEEDED, result={"x": 1})

    released = repo.get_task(ids["t1"])
    assert released.state is TaskState.READY and released.ready_at is not None
    assert pending_deps(sql, ids["t1"]) == 0
    assert outbox_rows(sql, ids["t1"]) == [(released.fencing_token, None)]  # to be published
    follow = claim_task(repo, sql, ids["t1"])  # the outbox row names the current generation
    assert follow.upstream == {"t0": {"x": 1}}


@pytest.mark.parametrize(
    "outcome",
    [
        Finish(TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="boom"),
        Finish(TaskState.CANCELLED),
    ],
    ids=["failed", "cancelled"],
)
def test_an_upstream_that_did_not_succeed_releases_nothing(
    repo: Store, sql: Sql, outcome: Finish
) -> None:
    run_id = repo.trigger(chain(length=2)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    claim = claim_task(repo, sql, ids["t0"])
    finished = repo.finish_many([(ids["t0"], claim.fencing_token, outcome)])
    assert (finished.committed, finished.ready) == ({ids["t0"]}, ())
    assert repo.get_task(ids["t1"]).state is TaskState.PENDING
    assert pending_deps(sql, ids["t1"]) == 1
    assert outbox_rows(sql, ids["t1"]) == []


def test_a_join_is_released_only_by_the_finish_of_its_last_dependency(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(diamond()).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    a = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], a.fencing_token, TaskState.SUCCEEDED)
    for name in ("b", "c"):
        assert repo.get_task(ids[name]).state is TaskState.READY
        assert len(outbox_rows(sql, ids[name])) == 1
    assert (repo.get_task(ids["d"]).state, pending_deps(sql, ids["d"])) == (TaskState.PENDING, 2)

    b = claim_task(repo, sql, ids["b"])
    assert repo.finish(ids["b"], b.fencing_token, TaskState.SUCCEEDED)
    assert (repo.get_task(ids["d"]).state, pending_deps(sql, ids["d"])) == (TaskState.PENDING, 1)
    assert outbox_rows(sql, ids["d"]) == []

    c = claim_task(repo, sql, ids["c"])
    assert repo.finish(ids["c"], c.fencing_token, TaskState.SUCCEEDED)
    d = repo.get_task(ids["d"])
    assert (d.state, pending_deps(sql, ids["d"])) == (TaskState.READY, 0)
    assert outbox_rows(sql, ids["d"]) == [(d.fencing_token, None)]


def test_both_dependencies_finished_in_one_statement_release_their_join_once(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(diamond()).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    a = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], a.fencing_token, TaskState.SUCCEEDED)
    b, c = claims_of(repo.claim_many([dispatched(sql, ids[n]) for n in "bc"], "w", LEASE_S))

    finished = repo.finish_many(
        [
            (ids["b"], b.fencing_token, Finish(TaskState.SUCCEEDED, {"from": "b"})),
            (ids["c"], c.fencing_token, Finish(TaskState.SUCCEEDED, {"from": "c"})),
        ]
    )

    assert finished.committed == {ids["b"], ids["c"]}
    d = repo.get_task(ids["d"])
    assert finished.ready == ((ids["d"], d.fencing_token),)  # offered to the finishing worker
    assert (d.state, pending_deps(sql, ids["d"])) == (TaskState.READY, 0)
    assert outbox_rows(sql, ids["d"]) == [(d.fencing_token, None)]
    assert claim_task(repo, sql, ids["d"]).upstream == {"b": {"from": "b"}, "c": {"from": "c"}}


def test_a_dependent_with_an_ordering_key_waits_for_the_scheduler_to_promote_it(
    repo: Store, sql: Sql
) -> None:
    workflow = WorkflowDef(
        "streamed-chain",
        (
            TaskDef("a", "tests.noop", retry=FAST_RETRY),
            TaskDef(
                "b",
                "tests.noop",
                depends_on=("a",),
                ordering_key="account-{account}",
                retry=FAST_RETRY,
            ),
        ),
    )
    ids = task_ids(repo, repo.trigger(workflow, {"account": 7}).run_id)
    drain(repo)
    a = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], a.fencing_token, TaskState.SUCCEEDED)

    assert repo.get_task(ids["b"]).state is TaskState.PENDING
    assert pending_deps(sql, ids["b"]) == 0  # its dependency is met; its stream is not checked
    assert outbox_rows(sql, ids["b"]) == []

    assert repo.promote_ready(10) == 1
    b = repo.get_task(ids["b"])
    assert b.state is TaskState.READY
    assert outbox_rows(sql, ids["b"]) == [(b.fencing_token, None)]


# ------------------------------------------------------------------ release_claims


def test_a_released_claim_is_as_if_never_claimed_and_dispatched_again(
    repo: Store, sql: Sql
) -> None:
    [task_id] = ready_singles(repo, 1)
    dispatch(sql)  # the first message went out
    [(first_token, published)] = outbox_rows(sql, task_id)
    assert published is not None
    claim = claim_task(repo, sql, task_id)

    assert repo.release_claims([(task_id, claim.fencing_token)]) == 1

    task = repo.get_task(task_id)
    assert (task.state, task.attempt, task.fencing_token) == (
        TaskState.READY,
        0,
        claim.fencing_token + 1,
    )
    assert (task.lease_owner, task.lease_expires_at, task.started_at) == (None, None, None)
    assert repo.attempts(task_id) == []
    rows = outbox_rows(sql, task_id)
    assert [token for token, _ in rows] == [first_token, task.fencing_token]
    assert rows[1][1] is None  # the new generation waits for the publisher

    # the old message is stale; the new one claims attempt 1 again
    assert repo.claim(task_id, first_token, "w", LEASE_S).outcome is ClaimOutcome.LOST
    again = claim_task(repo, sql, task_id, worker="worker-2")
    assert again.attempt == 1
    assert [(a.attempt, a.worker) for a in repo.attempts(task_id)] == [(1, "worker-2")]


def test_releasing_a_batch_leaves_its_stale_pairs_alone(repo: Store, sql: Sql) -> None:
    held, finished = ready_singles(repo, 2)
    held_claim, done_claim = claims_of(
        repo.claim_many([dispatched(sql, t) for t in (held, finished)], "w", LEASE_S)
    )
    assert repo.finish(finished, done_claim.fencing_token, TaskState.SUCCEEDED, result={"r": 1})
    finished_before = repo.get_task(finished)

    released = repo.release_claims(
        [(held, held_claim.fencing_token), (finished, done_claim.fencing_token)]
    )

    assert released == 1
    assert repo.get_task(held).state is TaskState.READY
    assert repo.get_task(finished) == finished_before
    assert [a.outcome for a in repo.attempts(finished)] == ["succeeded"]
    assert len(outbox_rows(sql, finished)) == 1


def test_releasing_a_stale_claim_changes_nothing(repo: Store, sql: Sql) -> None:
    [task_id] = ready_singles(repo, 1)
    stale = make_stale(repo, sql, task_id)
    before = repo.get_task(task_id)

    assert repo.release_claims([(task_id, stale.fencing_token)]) == 0

    assert repo.get_task(task_id) == before
    assert [a.outcome for a in repo.attempts(task_id)] == ["lease_expired"]
    assert len(outbox_rows(sql, task_id)) == 1


def test_releasing_a_retry_keeps_the_history_of_the_earlier_attempt(repo: Store, sql: Sql) -> None:
    [task_id] = ready_singles(repo, 1)
    first = claim_task(repo, sql, task_id)
    assert repo.finish(
        task_id, first.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    drain(repo)  # routed to a retry, due at once, READY again
    second = claim_task(repo, sql, task_id)
    assert second.attempt == 2

    assert repo.release_claims([(task_id, second.fencing_token)]) == 1

    task = repo.get_task(task_id)
    assert (task.state, task.attempt, task.fencing_token) == (
        TaskState.READY,
        1,
        second.fencing_token + 1,
    )
    assert task.started_at is not None  # the task did start, in attempt 1
    assert [(a.attempt, a.outcome) for a in repo.attempts(task_id)] == [(1, "failed")]
    assert claim_task(repo, sql, task_id).attempt == 2


def test_releasing_a_keyed_claim_frees_its_idempotency_key(repo: Store, sql: Sql) -> None:
    keyed = single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)
    holder, waiter = (
        task_ids(repo, repo.trigger(keyed, {"order_id": 5, "try": n}).run_id)["only"]
        for n in (1, 2)
    )
    drain(repo)
    claim = claim_task(repo, sql, holder)
    assert held_key(sql, "charge-5")[:3] == ("RUNNING", holder, claim.fencing_token)

    assert repo.release_claims([(holder, claim.fencing_token)]) == 1

    assert key_row(sql, "charge-5") is None
    other = repo.claim(waiter, outbox_token(sql, waiter), "worker-2", LEASE_S, key_wait_s=60)
    assert other.outcome is ClaimOutcome.EXECUTE  # not DEFERRED: nobody holds the key
    assert held_key(sql, "charge-5")[1] == waiter


# ------------------------------------------------------------------ renew_leases


def test_renew_leases_extends_every_held_lease_and_reports_cancellation_per_task(
    repo: Store, sql: Sql
) -> None:
    keyed = single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)
    plain = task_ids(repo, repo.trigger(single("plain", retry=FAST_RETRY)).run_id)["only"]
    key_task = task_ids(repo, repo.trigger(keyed, {"order_id": 3}).run_id)["only"]
    stopping_run = repo.trigger(single("stopping", retry=FAST_RETRY)).run_id
    stopping = task_ids(repo, stopping_run)["only"]
    [lost] = ready_singles(repo, 1)
    drain(repo)
    claims = claims_of(
        repo.claim_many([dispatched(sql, t) for t in (plain, key_task, stopping)], "w", lease_s=5.0)
    )
    lost_claim = make_stale(repo, sql, lost)
    repo.cancel_run(stopping_run)  # asks the running task to stop
    short = {t: repo.get_task(t).lease_expires_at for t in (plain, key_task, stopping)}
    key_lease = held_key(sql, "charge-3")[3]

    held = repo.renew_leases(
        [(c.task_run_id, c.fencing_token) for c in claims] + [(lost, lost_claim.fencing_token)],
        lease_s=600.0,
    )

    assert held == {plain: False, key_task: False, stopping: True}
    horizon = db_now(sql) + timedelta(seconds=500)
    for task_id, before in short.items():
        after = repo.get_task(task_id).lease_expires_at
        assert after is not None and before is not None
        assert after > horizon > before
    renewed_key = held_key(sql, "charge-3")[3]
    assert renewed_key is not None and key_lease is not None
    assert renewed_key > horizon > key_lease
    reaped = repo.get_task(lost)
    assert (reaped.state, reaped.lease_expires_at) == (TaskState.RETRYING, None)


# ------------------------------------------------------------------ duplicates and cancellations


def test_a_batch_naming_one_dispatch_twice_executes_it_once(repo: Store, sql: Sql) -> None:
    [task_id] = ready_singles(repo, 1)
    message = dispatched(sql, task_id)
    results = repo.claim_many([message, message], "w", LEASE_S)
    assert sorted(r.outcome for r in results) == [ClaimOutcome.EXECUTE, ClaimOutcome.LOST]


def test_an_old_message_batched_with_the_current_one_is_lost(repo: Store, sql: Sql) -> None:
    [task_id] = ready_singles(repo, 1)
    old = dispatched(sql, task_id)
    claim = claim_task(repo, sql, task_id)
    assert repo.release_claims([(task_id, claim.fencing_token)]) == 1
    current = dispatched(sql, task_id)
    results = repo.claim_many([old, current], "w", LEASE_S)
    assert [r.outcome for r in results] == [ClaimOutcome.LOST, ClaimOutcome.EXECUTE]


def test_a_claim_released_after_its_run_was_cancelled_never_runs(repo: Store, sql: Sql) -> None:
    workflow = WorkflowDef(
        "pair",
        (TaskDef("slow", "tests.noop", retry=FAST_RETRY), TaskDef("behind", "tests.noop")),
    )
    run_id = repo.trigger(workflow).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    _, behind = claims_of(
        repo.claim_many([dispatched(sql, ids[n]) for n in ("slow", "behind")], "w", LEASE_S)
    )
    repo.cancel_run(run_id)  # while "slow" runs; "behind" is claimed, not started
    repo.release_claims([(ids["behind"], behind.fencing_token)])  # the worker hands it back
    released = repo.get_task(ids["behind"])
    assert (released.state, released.attempt) == (TaskState.CANCELLED, 0)
    assert repo.attempts(ids["behind"]) == []
    drain(repo)
    again = repo.claim(ids["behind"], outbox_token(sql, ids["behind"]), "w2", LEASE_S)
    assert again.outcome is not ClaimOutcome.EXECUTE


# ------------------------------------------------------------------ claiming what a finish released


def test_a_local_claim_marks_the_dispatch_sent_and_a_broker_claim_leaves_it(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(chain(length=3)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    first = claim_task(repo, sql, ids["t0"])
    finished = repo.finish_many([(ids["t0"], first.fencing_token, Finish(TaskState.SUCCEEDED))])
    [(released, token)] = finished.ready
    assert released == ids["t1"] and outbox_rows(sql, released) == [(token, None)]

    [result] = repo.claim_many([(released, token)], "w", LEASE_S, local=True)

    assert result.outcome is ClaimOutcome.EXECUTE
    [(sent_token, sent_at)] = outbox_rows(sql, released)
    assert sent_token == token and sent_at is not None  # the publisher will not send it
    finished = repo.finish_many([(released, token + 1, Finish(TaskState.SUCCEEDED))])
    [(last, last_token)] = finished.ready
    [result] = repo.claim_many([(last, last_token)], "w", LEASE_S)  # as from a message
    assert result.outcome is ClaimOutcome.EXECUTE
    assert outbox_rows(sql, last) == [(last_token, None)]  # the publisher's to stamp


def test_a_finish_offers_at_most_what_the_worker_can_take_and_releases_every_dependent(
    repo: Store, sql: Sql
) -> None:
    width = 5
    fan = WorkflowDef(
        "offer",
        (
            TaskDef("root", "tests.noop"),
            *(TaskDef(f"d{i}", "tests.noop", depends_on=("root",)) for i in range(width)),
        ),
    )
    ids = task_ids(repo, repo.trigger(fan).run_id)
    root = claim_task(repo, sql, ids["root"])
    finished = repo.finish_many(
        [(ids["root"], root.fencing_token, Finish(TaskState.SUCCEEDED))], offer=2
    )
    assert finished.committed == {ids["root"]}
    assert len(finished.ready) == 2
    dependents = {ids[f"d{i}"] for i in range(width)}
    assert {task_id for task_id, _ in finished.ready} <= dependents
    for task_id in dependents:  # offered or not, every one is READY with its dispatch
        assert repo.get_task(task_id).state is TaskState.READY
        assert len(outbox_rows(sql, task_id)) == 1


def test_a_finish_with_a_continuation_claims_the_next_step_in_its_own_transaction(
    repo: Store, sql: Sql
) -> None:
    """The dependent is RUNNING for the finishing worker, its attempt recorded and its outbox
    row stamped when the finish commits: no publisher ever sees it pending."""
    run_id = repo.trigger(chain(length=2)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    first = claim_task(repo, sql, ids["t0"])

    finished = repo.finish_many(
        [(ids["t0"], first.fencing_token, Finish(TaskState.SUCCEEDED, result={"x": 1}))],
        offer=16,
        then=Continuation("w-next", LEASE_S, 16),
    )

    assert finished.committed == {ids["t0"]}
    [(released, ready_token)] = finished.ready
    [claim] = finished.claimed
    assert released == ids["t1"] == claim.task_run_id
    assert claim.fencing_token == ready_token + 1 and claim.attempt == 1
    assert claim.upstream == {"t0": {"x": 1}}
    task = repo.get_task(ids["t1"])
    assert task.state is TaskState.RUNNING and task.lease_owner == "w-next"
    [(token, sent_at)] = outbox_rows(sql, ids["t1"])
    assert token == ready_token and sent_at is not None
    assert [a.attempt for a in repo.attempts(ids["t1"])] == [1]


def test_a_continuation_claims_at_most_its_limit_and_no_keyed_dependent(
    repo: Store, sql: Sql
) -> None:
    fan = WorkflowDef(
        "continue-limit",
        (
            TaskDef("root", "tests.noop"),
            *(TaskDef(f"d{i}", "tests.noop", depends_on=("root",)) for i in range(4)),
            TaskDef("k", "tests.noop", depends_on=("root",), idempotency_key="k-{n}"),
        ),
    )
    ids = task_ids(repo, repo.trigger(fan, {"n": 1}).run_id)
    root = claim_task(repo, sql, ids["root"])

    finished = repo.finish_many(
        [(ids["root"], root.fencing_token, Finish(TaskState.SUCCEEDED))],
        offer=None,
        then=Continuation("w-next", LEASE_S, 6),
    )

    claimed = {c.task_run_id for c in finished.claimed}
    assert len(finished.ready) == 5 and ids["k"] not in claimed  # keyed: claimed on its own
    assert claimed == {ids[f"d{i}"] for i in range(4)}
    assert repo.get_task(ids["k"]).state is TaskState.READY
    assert outbox_rows(sql, ids["k"])[0][1] is None  # still the publisher's to send

    root2 = claim_task(repo, sql, task_ids(repo, repo.trigger(fan, {"n": 2}).run_id)["root"])
    limited = repo.finish_many(
        [(root2.task_run_id, root2.fencing_token, Finish(TaskState.SUCCEEDED))],
        offer=None,
        then=Continuation("w-next", LEASE_S, 2),
    )
    assert len(limited.claimed) == 2 and len(limited.ready) == 5


# ------------------------------------------------------------------ payloads as one jsonb array


def test_a_batch_s_inputs_and_results_reach_their_own_rows_with_null_apart_from_none(
    repo: Store, sql: Sql
) -> None:
    """insert_runs' inputs and finish's results travel as one jsonb array each, read back by
    position (rows.jsonb_array): each lands on its own row, and a result
    that is JSON null is stored as such where no result is stored as SQL NULL."""
    inputs = [{"n": n, "text": 'quote " and \\ backslash ' * n} for n in range(6)]
    results = repo.trigger_many(single("payloads", retry=FAST_RETRY), inputs)
    stored_inputs = dict(
        sql.execute("SELECT id, input FROM workflow_runs WHERE workflow = 'payloads'").fetchall()
    )
    assert [stored_inputs[r.run_id] for r in results] == inputs
    drain(repo)
    tasks = [task_ids(repo, r.run_id)["only"] for r in results]
    claims = claims_of(repo.claim_many([dispatched(sql, t) for t in tasks], "w", LEASE_S))
    stored: list[Any] = [None, JsonText("null"), {"n": 2}, 'a "quoted" \\ string', [3], 5]
    finished = repo.finish_many(
        [
            (c.task_run_id, c.fencing_token, Finish(TaskState.SUCCEEDED, value))
            for c, value in zip(claims, stored, strict=True)
        ]
    )
    assert finished.committed == set(tasks)
    by_task = dict(
        sql.execute(
            "SELECT id, result IS NULL FROM task_runs WHERE id = ANY(%s)", (tasks,)
        ).fetchall()
    )
    assert [by_task[c.task_run_id] for c in claims] == [True] + [False] * 5
    got = {c.task_run_id: repo.get_task(c.task_run_id).result for c in claims}
    assert [got[c.task_run_id] for c in claims] == [None, None, *stored[2:]]
