"""Control of single tasks (issue 20, SPEC 7.4) against real PostgreSQL: cancel one task, retry a
RETRYING task now, bury one by hand, and what holds an ordering key.

Every outcome is counted in the database: task states, causes and reasons, audit rows, outbox
rows, attempts; refusals change and audit nothing; races are two actors on their own
connections released together.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from flowforge.domain.control import Action, Effect, HoldKind
from flowforge.domain.dag import OnDead, TaskDef, WorkflowDef
from flowforge.domain.model import ClaimOutcome
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.domain.values import MAX_NOTE_BYTES
from flowforge.errors import (
    InvalidIdError,
    NotFoundError,
    UnstorableValueError,
    WrongStateError,
)
from tests.helpers import (
    FAST_RETRY,
    chain,
    claim_task,
    diamond,
    drain,
    expire_lease,
    outbox_token,
    race,
    task_ids,
)
from tests.integration.test_conditions import CHAIN, CLEANUP
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: A backoff long enough that only retry-now can end it within a test.
SLOW_RETRY = RetryPolicy(max_attempts=3, base_delay=3600.0, max_delay=3600.0, jitter=Jitter.NONE)
STREAM = WorkflowDef(
    "stream",
    (TaskDef("step", "tests.noop", ordering_key="acct-{account}", on_dead=OnDead.BLOCK),),
)
TIMER = WorkflowDef(
    "timer", (TaskDef("nap", sleep=3600.0), TaskDef("after", "tests.noop", depends_on=("nap",)))
)


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def audit(sql: Sql, task_run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    """The task's task_audit rows: (action, requested_by, reason, previous, new), oldest first."""
    return sql.execute(
        "SELECT action, requested_by, reason, previous_state, new_state FROM task_audit"
        " WHERE task_run_id = %s ORDER BY id",
        (task_run_id,),
    ).fetchall()


def audit_count(sql: Sql) -> int:
    return int(scalar(sql, "SELECT count(*) FROM task_audit"))


def states(repo: Store, run_id: uuid.UUID) -> dict[str, tuple[TaskState, CancelCause | None]]:
    return {t.name: (t.state, t.cancel_cause) for t in repo.get_run(run_id).tasks}


def ready_run(repo: Store, workflow: WorkflowDef, run_input: Any = None) -> dict[str, uuid.UUID]:
    ids = task_ids(repo, repo.trigger(workflow, run_input).run_id)
    drain(repo)
    return ids


def retrying(repo: Store, sql: Sql) -> uuid.UUID:
    """A task waiting out an hour's backoff after its failed first attempt."""
    tid = ready_run(repo, WorkflowDef("slow", (TaskDef("only", "tests.noop", retry=SLOW_RETRY),)))[
        "only"
    ]
    claim = claim_task(repo, sql, tid)
    assert repo.finish(
        tid, claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    drain(repo)
    assert repo.get_task(tid).state is TaskState.RETRYING
    return tid


# ------------------------------------------------------------------ cancel


def test_cancel_a_ready_task_cancels_what_only_it_feeds_and_is_audited(
    repo: Store, sql: Sql
) -> None:
    ids = ready_run(repo, chain("c3", 3))
    token = outbox_token(sql, ids["t0"])
    done = repo.cancel_task(ids["t0"], "alice", "wrong input")
    assert (done.action, done.previous_state, done.effect) == (
        Action.CANCEL,
        TaskState.READY,
        Effect.NOW,
    )
    assert done.task.state is TaskState.CANCELLED
    assert done.task.cancel_cause is CancelCause.OPERATOR
    drain(repo)
    run = repo.get_run(done.task.run_id)
    assert states(repo, run.id) == {
        "t0": (TaskState.CANCELLED, CancelCause.OPERATOR),
        "t1": (TaskState.CANCELLED, CancelCause.UPSTREAM),
        "t2": (TaskState.CANCELLED, CancelCause.UPSTREAM),
    }
    assert run.state is RunState.CANCELLED
    assert audit(sql, ids["t0"]) == [("cancel", "alice", "wrong input", "READY", "CANCELLED")]
    # the message already sent for it is stale: no worker executes it
    assert repo.claim(ids["t0"], token, "w", 30.0).outcome is not ClaimOutcome.EXECUTE
    # the task's detail lists the action beside requeues
    (entry,) = repo.task_detail(ids["t0"]).audit
    assert (entry.action, entry.previous_state, entry.new_state) == ("cancel", "READY", "CANCELLED")


def test_cancel_a_pending_task_leaves_its_siblings_running(repo: Store, sql: Sql) -> None:
    ids = ready_run(repo, diamond("d", fail_fast=True))
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    repo.cancel_task(ids["b"], "bob")
    drain(repo)
    found = states(repo, repo.get_task(ids["a"]).run_id)
    # a cancellation is not a death: fail-fast leaves c alone; d can no longer run
    assert found["c"] == (TaskState.READY, None)
    assert found["d"] == (TaskState.CANCELLED, CancelCause.UPSTREAM)


def test_cancel_follows_run_if_rules_of_dependents(repo: Store, sql: Sql) -> None:
    saga = ready_run(repo, CHAIN)
    repo.cancel_task(saga["ship"], "op")
    drain(repo)
    # any_failed: a cancellation is no failure, so the refund is skipped, and what follows it
    assert states(repo, repo.get_task(saga["ship"]).run_id) == {
        "ship": (TaskState.CANCELLED, CancelCause.OPERATOR),
        "refund": (TaskState.CANCELLED, CancelCause.CONDITION_NOT_MET),
        "notify": (TaskState.CANCELLED, CancelCause.CONDITION_NOT_MET),
    }
    cleanup = ready_run(repo, CLEANUP)
    repo.cancel_task(cleanup["a"], "op")
    claim = claim_task(repo, sql, cleanup["b"])
    assert repo.finish(cleanup["b"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    # all_done: runs once both are finished, whatever their outcome
    assert repo.get_task(cleanup["tidy"]).state is TaskState.READY


def test_cancel_a_running_task_asks_its_worker_to_stop(repo: Store, sql: Sql) -> None:
    ids = ready_run(repo, chain("c2", 2))
    claim = claim_task(repo, sql, ids["t0"])
    done = repo.cancel_task(ids["t0"], "op", "stuck")
    assert (done.effect, done.task.state, done.task.cancel_requested) == (
        Effect.STOP,
        TaskState.RUNNING,
        True,
    )
    assert repo.renew_lease(ids["t0"], claim.fencing_token, 30.0).cancel_requested
    assert audit(sql, ids["t0"]) == [("cancel", "op", "stuck", "RUNNING", "RUNNING")]
    # asked once: a second request is refused, and not audited
    with pytest.raises(WrongStateError, match="already asked to stop"):
        repo.cancel_task(ids["t0"], "op")
    assert audit_count(sql) == 1
    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.CANCELLED)
    drain(repo)
    assert states(repo, done.task.run_id) == {
        "t0": (TaskState.CANCELLED, CancelCause.OPERATOR),
        "t1": (TaskState.CANCELLED, CancelCause.UPSTREAM),
    }


def test_cancel_a_sleeping_timer_ends_it_at_once(repo: Store, sql: Sql) -> None:
    ids = ready_run(repo, TIMER)
    assert repo.get_task(ids["nap"]).state is TaskState.RUNNING  # asleep, no worker
    done = repo.cancel_task(ids["nap"], "op")
    assert (done.effect, done.task.state) == (Effect.NOW, TaskState.CANCELLED)
    drain(repo)
    assert repo.get_task(ids["after"]).state is TaskState.CANCELLED


# ------------------------------------------------------------------ bury


def test_bury_a_ready_task_is_dead_operator_with_fail_fast_and_requeue(
    repo: Store, sql: Sql
) -> None:
    ids = ready_run(repo, diamond("d", fail_fast=True))
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    done = repo.bury_task(ids["b"], "carol", "poison input")
    assert (done.task.state, done.task.failure_reason) == (TaskState.DEAD, FailureReason.OPERATOR)
    drain(repo)
    run_id = done.task.run_id
    found = states(repo, run_id)
    assert found["c"] == (TaskState.CANCELLED, CancelCause.UPSTREAM)  # fail-fast, as a death
    assert found["d"] == (TaskState.CANCELLED, CancelCause.UPSTREAM)
    assert repo.get_run(run_id).state is RunState.FAILED
    assert [t.id for t in repo.list_dead(10)] == [ids["b"]]
    assert audit(sql, ids["b"]) == [("bury", "carol", "poison input", "READY", "DEAD")]
    # then it is any DEAD task: a requeue brings it (and what its death cancelled) back
    repo.requeue_dead(ids["b"], "carol", "fixed")
    drain(repo)
    assert {n: s for n, (s, _) in states(repo, run_id).items()} == {
        "a": TaskState.SUCCEEDED,
        "b": TaskState.READY,
        "c": TaskState.READY,
        "d": TaskState.PENDING,
    }
    assert [e.action for e in repo.task_detail(ids["b"]).audit] == ["bury", "requeue"]
    # one shape for every operator action, whichever table holds it
    actions = sql.execute(
        "SELECT source, action, previous_state, new_state FROM operator_actions"
        " WHERE task_run_id = %s ORDER BY requested_at, source",
        (ids["b"],),
    ).fetchall()
    assert actions == [
        ("task_audit", "bury", "READY", "DEAD"),
        ("requeue_audit", "requeue", "DEAD", "PENDING"),
    ]


@pytest.mark.parametrize("stop", ["cancelled", "failed", "lease_expired", "unstarted"])
def test_bury_a_running_task_ends_it_dead_operator_when_it_stops(
    repo: Store, sql: Sql, stop: str
) -> None:
    ids = ready_run(repo, chain("c2", 2, retry=FAST_RETRY))
    claim = claim_task(repo, sql, ids["t0"])
    done = repo.bury_task(ids["t0"], "op")
    assert (done.effect, done.task.state) == (Effect.STOP, TaskState.RUNNING)
    assert repo.renew_lease(ids["t0"], claim.fencing_token, 30.0).cancel_requested
    if stop == "cancelled":  # the handler heard it: the worker finishes CANCELLED
        assert repo.finish(ids["t0"], claim.fencing_token, TaskState.CANCELLED)
    elif stop == "failed":  # it raised instead: routing, not a retry
        assert repo.finish(
            ids["t0"], claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
        )
    elif stop == "lease_expired":  # its worker died: the reaper
        expire_lease(sql, ids["t0"])
    else:  # its worker handed the claim back before the handler started
        assert repo.release_claims([(ids["t0"], claim.fencing_token)]) == 1
    drain(repo)
    task = repo.get_task(ids["t0"])
    assert (task.state, task.failure_reason, task.cancel_cause) == (
        TaskState.DEAD,
        FailureReason.OPERATOR,
        None,
    )
    assert repo.get_task(ids["t1"]).state is TaskState.CANCELLED
    assert audit(sql, ids["t0"]) == [("bury", "op", None, "RUNNING", "RUNNING")]


def test_a_handler_that_finishes_before_it_hears_the_bury_wins(repo: Store, sql: Sql) -> None:
    ids = ready_run(repo, chain("c2", 2))
    claim = claim_task(repo, sql, ids["t0"])
    repo.bury_task(ids["t0"], "op")
    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.SUCCEEDED, result=1)
    drain(repo)
    assert repo.get_task(ids["t0"]).state is TaskState.SUCCEEDED
    assert repo.get_task(ids["t1"]).state is TaskState.READY


def test_bury_holds_an_on_dead_block_stream_and_keys_show_says_why(repo: Store, sql: Sql) -> None:
    first = ready_run(repo, STREAM, {"account": 7})
    second = ready_run(repo, STREAM, {"account": 7})
    assert repo.get_task(second["step"]).state is TaskState.PENDING  # behind the first
    (hold,) = repo.key_holds("acct-7")
    assert (hold.kind, hold.limit, hold.waiting) == (HoldKind.ORDERING, 1, 1)
    assert [t.id for t in hold.holders] == [first["step"]]
    assert "READY" in hold.holders[0].why
    repo.bury_task(first["step"], "op", "bad account")
    drain(repo)
    assert repo.get_task(second["step"]).state is TaskState.PENDING  # on_dead: block holds it
    (hold,) = repo.key_holds("acct-7")
    holder = hold.holders[0]
    assert (holder.id, holder.state, holder.failure_reason) == (
        first["step"],
        TaskState.DEAD,
        "operator",
    )
    assert "on_dead: block" in holder.why
    assert [t.id for t in hold.next] == [second["step"]]
    assert repo.key_holds("acct-8") == ()
    # a requeue releases the stream to the first again, not to the second
    repo.requeue_dead(first["step"], "op")
    drain(repo)
    assert repo.get_task(first["step"]).state is TaskState.READY


# ------------------------------------------------------------------ retry now


def test_retry_now_dispatches_a_retrying_task_without_an_extra_attempt(
    repo: Store, sql: Sql
) -> None:
    ids = {"only": retrying(repo, sql)}
    before = repo.get_task(ids["only"])
    assert (before.state, before.attempt) == (TaskState.RETRYING, 1)
    done = repo.retry_task_now(ids["only"], "op", "dependency is back")
    assert (done.previous_state, done.task.state, done.task.attempt) == (
        TaskState.RETRYING,
        TaskState.READY,
        1,
    )
    assert done.task.retry_at is None
    # one dispatch of the new generation, which a worker claims as attempt 2 of 3
    assert outbox_token(sql, ids["only"]) == done.task.fencing_token
    again = claim_task(repo, sql, ids["only"])
    assert again.attempt == 2
    assert audit(sql, ids["only"]) == [
        ("retry_now", "op", "dependency is back", "RETRYING", "READY")
    ]
    with pytest.raises(WrongStateError, match="is RUNNING: only a RETRYING task"):
        repo.retry_task_now(ids["only"], "op")
    assert audit_count(sql) == 1


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("action", list(Action))
def test_refusals_change_and_audit_nothing(repo: Store, sql: Sql, action: Action) -> None:
    act = {
        Action.CANCEL: repo.cancel_task,
        Action.RETRY_NOW: repo.retry_task_now,
        Action.BURY: repo.bury_task,
    }[action]
    ids = ready_run(repo, chain("c2", 2))
    claim = claim_task(repo, sql, ids["t0"])
    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    before = repo.get_task(ids["t0"])
    with pytest.raises(WrongStateError, match="is SUCCEEDED"):
        act(ids["t0"], "op")
    with pytest.raises(NotFoundError):
        act(uuid.uuid4(), "op")
    with pytest.raises(InvalidIdError):
        act("not-a-uuid", "op")
    with pytest.raises(UnstorableValueError):
        act(ids["t1"], "op", "nul \x00 in the reason")
    with pytest.raises(UnstorableValueError):
        act(ids["t1"], "x" * (MAX_NOTE_BYTES + 1))
    assert repo.get_task(ids["t0"]) == before
    assert repo.get_task(ids["t1"]).state is TaskState.READY
    assert audit_count(sql) == 0


def test_a_running_map_is_refused_its_items_are_what_runs(repo: Store, sql: Sql) -> None:
    mapped = WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("each", "tests.noop", for_each="list"),
        ),
    )
    ids = ready_run(repo, mapped)
    claim = claim_task(repo, sql, ids["list"])
    assert repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=[1, 2])
    drain(repo)
    assert repo.get_task(ids["each"]).state is TaskState.RUNNING
    with pytest.raises(WrongStateError, match="RUNNING map"):
        repo.bury_task(ids["each"], "op")
    # an item is a task like any other: cancelling it settles its map CANCELLED
    items = [i.id for i in repo.map_page(ids["each"], None, 10, None).items]
    for item in items:
        repo.cancel_task(item, "op")
    drain(repo)
    assert repo.get_task(ids["each"]).state is TaskState.CANCELLED
    assert audit_count(sql) == 2


# ------------------------------------------------------------------ races


def test_two_operators_burying_one_task_one_wins(
    clean_database_url: str, sql: Sql, repo: Store
) -> None:
    ids = ready_run(repo, chain("c1", 1))

    def operator(who: str) -> Any:
        def act(store: Store) -> str:
            try:
                return str(store.bury_task(ids["t0"], who).effect)
            except WrongStateError:
                return "refused"

        return act

    outcomes = race(clean_database_url, operator("a"), operator("b"))
    assert sorted(outcomes) == ["now", "refused"]
    assert audit_count(sql) == 1
    assert repo.get_task(ids["t0"]).state is TaskState.DEAD


def test_a_claim_racing_a_bury_never_executes_a_buried_task(
    clean_database_url: str, sql: Sql, repo: Store
) -> None:
    for _ in range(5):  # each round a fresh race; either order is fine, never both
        ids = ready_run(repo, chain("c1", 1))
        tid, token = ids["t0"], outbox_token(sql, ids["t0"])
        buried, claimed = race(clean_database_url, _burier(tid), _claimer(tid, token))
        task = repo.get_task(tid)
        attempts = "SELECT count(*) FROM task_attempts WHERE task_run_id = %s"
        if claimed is ClaimOutcome.EXECUTE:  # the claim won: the bury asks it to stop
            assert buried in ("stop", "refused")
            assert task.state is TaskState.RUNNING
            assert task.cancel_requested is (buried == "stop")
        else:  # the bury won: nothing executes it
            assert buried == "now"
            assert task.state is TaskState.DEAD
            assert scalar(sql, attempts, tid) == 0
        audited = scalar(sql, "SELECT count(*) FROM task_audit WHERE task_run_id = %s", tid)
        assert audited == (0 if buried == "refused" else 1)


def _burier(tid: uuid.UUID) -> Any:
    def bury(store: Store) -> str:
        try:
            return str(store.bury_task(tid, "op").effect)
        except WrongStateError:
            return "refused"

    return bury


def _claimer(tid: uuid.UUID, token: int) -> Any:
    def claim(store: Store) -> ClaimOutcome:
        return store.claim(tid, token, "w", 30.0).outcome

    return claim


def test_retry_now_racing_the_promote_pass_dispatches_once(
    clean_database_url: str, sql: Sql, repo: Store
) -> None:
    ids = {"only": retrying(repo, sql)}
    # its backoff is over as the operator acts: the scheduler's promote races the retry-now
    sql.execute("UPDATE task_runs SET retry_at = now() WHERE id = %s", (ids["only"],))

    def retry_now(store: Store) -> str:
        try:
            return str(store.retry_task_now(ids["only"], "op").effect)
        except WrongStateError:
            return "refused"

    outcome, promoted = race(clean_database_url, retry_now, lambda s: s.promote_ready(10))
    assert (outcome, promoted) in (("now", 0), ("refused", 1))
    task = repo.get_task(ids["only"])
    assert task.state is TaskState.READY
    sent = int(
        scalar(
            sql,
            "SELECT count(*) FROM outbox WHERE task_run_id = %s AND fencing_token = %s",
            ids["only"],
            task.fencing_token,
        )
    )
    assert sent == 1
    assert audit_count(sql) == (1 if outcome == "now" else 0)
