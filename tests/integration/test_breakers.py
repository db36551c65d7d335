"""Circuit breakers and pauses (issue 20, SPEC 7.4) against real PostgreSQL.

The gate is the claim: a task whose handler's breaker is open, or whose queue or handler is
paused, is parked (RETRYING, no retry time, no attempt used, token bumped) instead of claimed; the
scheduler's gate pass probes, reopens lost probes and unparks. Every count is read from the
database.
"""

from __future__ import annotations

import threading
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.breakers import BreakerState, CircuitBreaker
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import ClaimOutcome
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import InputError, NotFoundError, WrongStateError
from tests.helpers import claim_task, drain, expire_lease, outbox_token, race, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: Retries due at once, and enough of them that no task dies while a breaker holds it.
NOW_RETRY = RetryPolicy(max_attempts=10, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
BREAKER = CircuitBreaker(failures=3, window=60.0, cooldown=30.0)
HANDLER = "tests.partner"


def partner(
    name: str = "calls", breaker: CircuitBreaker | None = BREAKER, queue: str | None = None
) -> WorkflowDef:
    """One task of handler tests.partner under ``breaker``."""
    task = TaskDef("call", HANDLER, retry=NOW_RETRY, circuit_breaker=breaker, queue=queue)
    return WorkflowDef(name, (task,))


def ready(repo: Store, sql: Sql, runs: int, **workflow: Any) -> list[UUID]:
    """Trigger ``runs`` runs of :func:`partner`; their (READY) task ids, oldest first."""
    ids = [repo.trigger(partner(**workflow)).run_id for _ in range(runs)]
    return [repo.get_run(r).tasks[0].id for r in ids]


def fail(
    repo: Store, sql: Sql, tid: UUID, reason: FailureReason = FailureReason.HANDLER_ERROR
) -> None:
    """Claim ``tid`` (it must execute) and finish it FAILED for ``reason``."""
    claim = claim_task(repo, sql, tid)
    assert repo.finish(tid, claim.fencing_token, TaskState.FAILED, reason=reason, error="down")


def succeed(repo: Store, sql: Sql, tid: UUID) -> None:
    claim = claim_task(repo, sql, tid)
    assert repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED, result=1)


def try_claim(repo: Store, sql: Sql, tid: UUID) -> ClaimOutcome:
    """Claim ``tid`` with its newest message's token; the outcome."""
    return repo.claim(tid, outbox_token(sql, tid), "worker-1", 30.0).outcome


def breaker(sql: Sql, handler: str = HANDLER) -> dict[str, Any]:
    row = sql.execute(
        "SELECT state, held, cardinality(failures) AS n, probe_task_id, opened_at"
        " FROM breakers WHERE handler = %s",
        (handler,),
    ).fetchone()
    assert row is not None, f"no breaker row for {handler}"
    return {"state": row[0], "held": row[1], "failures": row[2], "probe": row[3], "opened": row[4]}


def transitions(sql: Sql, handler: str = HANDLER) -> list[tuple[str, str, str]]:
    rows = sql.execute(
        "SELECT from_state, to_state, cause FROM breaker_transitions WHERE handler = %s"
        " ORDER BY id",
        (handler,),
    ).fetchall()
    return [(str(a), str(b), str(c)) for a, b, c in rows]


def facts(sql: Sql, tid: UUID) -> tuple[str, int, str | None, bool, int]:
    """(state, attempt, parked_on, has a retry time, attempt rows) of one task."""
    row = sql.execute(
        "SELECT state, attempt, parked_on, retry_at IS NOT NULL,"
        " (SELECT count(*) FROM task_attempts a WHERE a.task_run_id = t.id)"
        " FROM task_runs t WHERE id = %s",
        (tid,),
    ).fetchone()
    assert row is not None
    return (str(row[0]), int(row[1]), row[2], bool(row[3]), int(row[4]))


def lock_waiters(sql: Sql) -> int:
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def cooldown_over(sql: Sql, handler: str = HANDLER) -> None:
    """Move the breaker's opening an hour into the database's past."""
    sql.execute(
        "UPDATE breakers SET opened_at = opened_at - interval '1 hour' WHERE handler = %s",
        (handler,),
    )


def open_by_failures(repo: Store, sql: Sql, extra: int = 3) -> list[UUID]:
    """Three failures open the breaker; returns ``extra`` more READY tasks of the handler."""
    tasks = ready(repo, sql, 3 + extra)
    for tid in tasks[:3]:
        fail(repo, sql, tid)
    assert breaker(sql)["state"] == "open"
    return tasks[3:]


def test_the_failure_that_reaches_the_threshold_opens_it_in_its_own_finish(
    repo: Store, sql: Sql
) -> None:
    tasks = ready(repo, sql, 4)
    fail(repo, sql, tasks[0])
    fail(repo, sql, tasks[1])
    assert breaker(sql) | {"opened": None} == {
        "state": "closed",
        "held": False,
        "failures": 2,
        "probe": None,
        "opened": None,
    }
    fail(repo, sql, tasks[2])  # no scheduler pass in between: the finish opened it
    assert breaker(sql)["state"] == "open"
    assert transitions(sql) == [("closed", "open", "failures")]
    # the fourth is not claimed but parked: no attempt used, no retry time, token bumped
    token = outbox_token(sql, tasks[3])
    assert try_claim(repo, sql, tasks[3]) is ClaimOutcome.LOST
    assert facts(sql, tasks[3]) == ("RETRYING", 0, "circuit_open", False, 0)
    assert repo.claim(tasks[3], token, "worker-2", 30.0).outcome is ClaimOutcome.LOST  # stale
    assert repo.get_task(tasks[3]).waiting_on == "circuit_open"
    drain(repo)  # the scheduler leaves it parked while the cooldown runs
    assert facts(sql, tasks[3]) == ("RETRYING", 0, "circuit_open", False, 0)


def test_only_handler_failures_count(repo: Store, sql: Sql) -> None:
    tasks = ready(repo, sql, 6)
    for tid, reason in zip(
        tasks,
        (
            FailureReason.PERMANENT_ERROR,
            FailureReason.UNKNOWN_HANDLER,
            FailureReason.UNSERIALIZABLE_RESULT,
            FailureReason.RESULT_TOO_LARGE,
        ),
        strict=False,
    ):
        fail(repo, sql, tid, reason)
    claim = claim_task(repo, sql, tasks[4])
    assert repo.finish(tasks[4], claim.fencing_token, TaskState.CANCELLED)
    assert sql.execute("SELECT count(*) FROM breakers").fetchone() == (0,)
    fail(repo, sql, tasks[5], FailureReason.TIMEOUT)  # a timeout does count
    assert breaker(sql)["failures"] == 1


def test_failures_older_than_the_window_do_not_count(repo: Store, sql: Sql) -> None:
    tasks = ready(repo, sql, 4)
    fail(repo, sql, tasks[0])
    fail(repo, sql, tasks[1])
    sql.execute("UPDATE breakers SET failures = ARRAY[now() - interval '2 minutes', now()]")
    fail(repo, sql, tasks[2])  # two within 60 s: still closed, the old one forgotten
    assert breaker(sql) | {"opened": None, "probe": None} == {
        "state": "closed",
        "held": False,
        "failures": 2,
        "probe": None,
        "opened": None,
    }
    fail(repo, sql, tasks[3])
    assert breaker(sql)["state"] == "open"


def test_after_the_cooldown_exactly_one_probe_runs_and_its_success_closes_it(
    repo: Store, sql: Sql
) -> None:
    waiting = open_by_failures(repo, sql, extra=4)
    for tid in waiting:
        assert try_claim(repo, sql, tid) is ClaimOutcome.LOST
    drain(repo)
    assert breaker(sql)["state"] == "open"  # cooldown not over: no probe
    cooldown_over(sql)
    drain(repo)
    state = breaker(sql)
    assert state["state"] == "half_open"
    probe = UUID(str(state["probe"]))
    assert probe == waiting[0]  # the oldest parked task
    assert repo.get_task(probe).state is TaskState.READY
    assert [facts(sql, t)[2] for t in waiting[1:]] == ["circuit_open"] * 3
    succeed(repo, sql, probe)  # the probe's success: the next pass closes it and unparks
    assert breaker(sql)["state"] == "half_open"
    drain(repo)  # closed, unparked and dispatched, none used an attempt while parked
    assert breaker(sql)["state"] == "closed"
    assert breaker(sql)["failures"] == 0
    for tid in waiting[1:]:
        assert facts(sql, tid) == ("READY", 0, None, False, 0)
        succeed(repo, sql, tid)
    assert transitions(sql) == [
        ("closed", "open", "failures"),
        ("open", "half_open", "cooldown"),
        ("half_open", "closed", "probe_succeeded"),
    ]


def test_a_failed_probe_reopens_it_for_a_fresh_cooldown(repo: Store, sql: Sql) -> None:
    waiting = open_by_failures(repo, sql, extra=2)
    for tid in waiting:
        try_claim(repo, sql, tid)
    cooldown_over(sql)
    drain(repo)
    probe = UUID(str(breaker(sql)["probe"]))
    fail(repo, sql, probe)
    state = breaker(sql)
    assert (state["state"], state["probe"]) == ("open", None)
    drain(repo)  # a new cooldown from now: no second probe yet
    assert breaker(sql)["state"] == "open"
    assert transitions(sql)[-1] == ("half_open", "open", "probe_failed")
    # the failed probe's retry comes due, is dispatched, and is parked at its claim again
    assert repo.get_task(probe).state is TaskState.READY
    assert try_claim(repo, sql, probe) is ClaimOutcome.LOST
    assert facts(sql, probe)[:3] == ("RETRYING", 1, "circuit_open")


def test_a_probe_whose_worker_died_does_not_wedge_it_half_open(repo: Store, sql: Sql) -> None:
    waiting = open_by_failures(repo, sql, extra=2)
    for tid in waiting:
        try_claim(repo, sql, tid)
    cooldown_over(sql)
    drain(repo)
    first = UUID(str(breaker(sql)["probe"]))
    claim_task(repo, sql, first)
    expire_lease(sql, first)  # its worker died
    drain(repo)  # reaped → RETRYING; the lost probe reopens and the next parked task probes
    state = breaker(sql)
    assert state["state"] == "half_open"
    assert UUID(str(state["probe"])) == waiting[1]
    assert ("half_open", "open", "probe_lost") in transitions(sql)
    succeed(repo, sql, waiting[1])
    drain(repo)
    assert breaker(sql)["state"] == "closed"
    assert repo.get_task(first).state is TaskState.READY  # its retry, dispatched again


def test_a_cancelled_probe_is_replaced(repo: Store, sql: Sql) -> None:
    waiting = open_by_failures(repo, sql, extra=2)
    for tid in waiting:
        try_claim(repo, sql, tid)
    cooldown_over(sql)
    drain(repo)
    first = UUID(str(breaker(sql)["probe"]))
    repo.cancel_task(first, "ops")
    drain(repo)
    assert UUID(str(breaker(sql)["probe"])) == waiting[1]


def test_running_tasks_finish_and_due_retries_are_parked_while_it_is_open(
    repo: Store, sql: Sql
) -> None:
    tasks = ready(repo, sql, 5)
    running = claim_task(repo, sql, tasks[4])  # in flight when it opens
    for tid in tasks[:3]:
        fail(repo, sql, tid)
    assert repo.finish(tasks[4], running.fencing_token, TaskState.SUCCEEDED, result=1)
    assert breaker(sql)["state"] == "open"  # only a probe's verdict closes it
    drain(repo)  # the three failures' retries come due (no backoff) and are dispatched...
    for tid in tasks[:3]:
        assert try_claim(repo, sql, tid) is ClaimOutcome.LOST  # ...and parked, no attempt used
        assert facts(sql, tid)[:3] == ("RETRYING", 1, "circuit_open")


def test_a_task_without_a_breaker_is_held_by_its_handlers_but_does_not_count(
    repo: Store, sql: Sql
) -> None:
    plain = ready(repo, sql, 4, name="plain", breaker=None)
    for tid in plain[:3]:
        fail(repo, sql, tid)
    assert sql.execute("SELECT count(*) FROM breakers").fetchone() == (0,)
    open_by_failures(repo, sql, extra=0)
    assert try_claim(repo, sql, plain[3]) is ClaimOutcome.LOST
    assert facts(sql, plain[3])[2] == "circuit_open"


def test_the_failing_tasks_own_thresholds_judge_it(repo: Store, sql: Sql) -> None:
    strict = ready(repo, sql, 1, name="strict", breaker=CircuitBreaker(1, 60.0, 5.0))
    loose = ready(repo, sql, 2, name="loose", breaker=CircuitBreaker(5, 60.0, 30.0))
    fail(repo, sql, loose[0])
    assert breaker(sql)["state"] == "closed"
    fail(repo, sql, strict[0])  # 2 recent failures, and this task's rule is 1: open
    assert breaker(sql)["state"] == "open"
    row = sql.execute("SELECT failure_limit, cooldown_s FROM breakers").fetchone()
    assert row == (1, 5.0)


def test_failures_finished_at_once_on_two_connections_are_all_counted(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    tasks = ready(repo, sql, 6)
    claims = [claim_task(repo, sql, tid) for tid in tasks[:6]]

    def failer(index: int) -> Any:
        def run(store: Store) -> bool:
            return all(
                store.finish(
                    c.task_run_id,
                    c.fencing_token,
                    TaskState.FAILED,
                    reason=FailureReason.HANDLER_ERROR,
                    error="down",
                )
                for c in claims[index::2]
            )

        return run

    assert race(clean_database_url, failer(0), failer(1)) == [True, True]
    assert breaker(sql)["state"] == "open"
    assert breaker(sql)["failures"] == 3  # six counted, the three newest kept
    assert transitions(sql) == [("closed", "open", "failures")]  # opened once


def test_two_schedulers_never_both_probe(repo: Store, sql: Sql, clean_database_url: str) -> None:
    waiting = open_by_failures(repo, sql, extra=6)
    for tid in waiting:
        try_claim(repo, sql, tid)
    cooldown_over(sql)
    for _ in range(3):
        race(
            clean_database_url,
            lambda s: s.pass_gates(100).unparked,
            lambda s: s.pass_gates(100).unparked,
        )
    probes = sql.execute(
        "SELECT count(*) FROM task_runs WHERE parked_on IS NULL AND state = 'RETRYING'"
    ).fetchone()
    assert probes == (1,)  # one task unparked (due now): the probe
    assert [t for t in transitions(sql) if t[2] == "cooldown"] == [
        ("open", "half_open", "cooldown")
    ]
    parked = sql.execute("SELECT count(*) FROM task_runs WHERE parked_on IS NOT NULL").fetchone()
    assert parked == (5,)


def test_each_transition_is_taken_for_logging_once(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    open_by_failures(repo, sql, extra=0)
    repo.close_breaker(HANDLER, "ops", None)
    repo.open_breaker(HANDLER, "ops", None)
    taken = race(
        clean_database_url,
        lambda s: s.pass_gates(100).transitions,
        lambda s: s.pass_gates(100).transitions,
    )
    logged = [(t.from_state, t.to_state, t.cause) for batch in taken for t in batch]
    assert sorted(logged) == sorted(
        [
            (BreakerState.CLOSED, BreakerState.OPEN, "failures"),
            (BreakerState.OPEN, BreakerState.CLOSED, "operator"),
            (BreakerState.CLOSED, BreakerState.OPEN, "operator"),
        ]
    )
    assert repo.pass_gates(100).transitions == ()


def test_an_operator_holds_it_open_until_an_operator_closes_it(repo: Store, sql: Sql) -> None:
    tasks = ready(repo, sql, 3)
    done = repo.open_breaker(HANDLER, "ops", "partner maintenance")
    assert (done.previous_state, done.new_state) == ("closed", "open")
    for tid in tasks:
        assert try_claim(repo, sql, tid) is ClaimOutcome.LOST
    cooldown_over(sql)
    drain(repo)
    assert breaker(sql)["state"] == "open"  # held: no probe however long
    with pytest.raises(WrongStateError, match="held open already"):
        repo.open_breaker(HANDLER, "ops", None)
    repo.close_breaker(HANDLER, "ops", "back")
    drain(repo)
    assert [facts(sql, t)[:3] for t in tasks] == [("READY", 0, None)] * 3
    with pytest.raises(WrongStateError, match="closed already"):
        repo.close_breaker(HANDLER, "ops", None)
    audit = sql.execute(
        "SELECT action, requested_by, reason, previous_state, new_state, details"
        " FROM operator_actions WHERE source = 'gate_audit' ORDER BY id"
    ).fetchall()
    scope = {"scope": "handler", "name": HANDLER}
    assert audit == [
        ("breaker_open", "ops", "partner maintenance", "closed", "open", scope),
        ("breaker_close", "ops", "back", "open", "closed", scope),
    ]


def test_an_operator_close_racing_a_probes_failure_leaves_one_story(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    waiting = open_by_failures(repo, sql, extra=1)
    try_claim(repo, sql, waiting[0])
    cooldown_over(sql)
    drain(repo)
    claim = claim_task(repo, sql, waiting[0])  # the probe runs
    results: list[Any] = []

    def probe_fails(store: Store) -> bool:
        return store.finish(
            waiting[0],
            claim.fencing_token,
            TaskState.FAILED,
            reason=FailureReason.HANDLER_ERROR,
            error="down",
        )

    lock = psycopg.connect(clean_database_url)
    try:  # hold the breaker row so both writers queue on it, then let them go together
        lock.execute("SELECT 1 FROM breakers WHERE handler = %s FOR UPDATE", (HANDLER,))
        racing = threading.Thread(
            target=lambda: results.extend(
                race(
                    clean_database_url,
                    probe_fails,
                    lambda s: s.close_breaker(HANDLER, "ops", None),
                )
            )
        )
        racing.start()
        wait_for(lambda: lock_waiters(sql) == 2, what="both writers waiting on the breaker row")
        lock.rollback()
        racing.join(30)
    finally:
        lock.close()
    assert len(results) == 2
    story = transitions(sql)[2:]  # after opened and half-opened
    # whichever came first, each transition follows from the state the other left
    assert story in (
        [("half_open", "open", "probe_failed"), ("open", "closed", "operator")],
        [("half_open", "closed", "operator")],
    )
    assert breaker(sql)["state"] == "closed"


def test_pausing_a_queue_parks_its_claims_until_resumed(repo: Store, sql: Sql) -> None:
    mine = ready(repo, sql, 2, name="mine", breaker=None, queue="partner")
    other = ready(repo, sql, 1, name="other", breaker=None, queue="shop")
    done = repo.pause("queue", "partner", "ops", "deploying partner")
    assert (done.action, done.new_state) == ("pause", "paused")
    assert try_claim(repo, sql, mine[0]) is ClaimOutcome.LOST
    assert facts(sql, mine[0]) == ("RETRYING", 0, "paused", False, 0)
    assert repo.get_task(mine[0]).waiting_on == "paused"
    assert try_claim(repo, sql, other[0]) is ClaimOutcome.EXECUTE  # another queue runs
    drain(repo)
    assert facts(sql, mine[0])[2] == "paused"
    with pytest.raises(WrongStateError, match="paused already"):
        repo.pause("queue", "partner", "ops", None)
    (listed,) = repo.pauses()
    assert (listed.name, listed.paused_by, listed.parked) == ("partner", "ops", 1)
    repo.resume("queue", "partner", "ops", "done")
    drain(repo)
    assert facts(sql, mine[0]) == ("READY", 0, None, False, 0)
    assert try_claim(repo, sql, mine[1]) is ClaimOutcome.EXECUTE
    with pytest.raises(WrongStateError, match="not paused"):
        repo.resume("queue", "partner", "ops", None)
    actions = sql.execute(
        "SELECT action, details->>'name', previous_state, new_state FROM operator_actions"
        " WHERE source = 'gate_audit' ORDER BY id"
    ).fetchall()
    assert actions == [
        ("pause", "partner", "running", "paused"),
        ("resume", "partner", "paused", "running"),
    ]


def test_pausing_a_handler_parks_its_tasks_on_every_queue(repo: Store, sql: Sql) -> None:
    one = ready(repo, sql, 1, name="one", breaker=None, queue="a")
    two = ready(repo, sql, 1, name="two", breaker=None, queue="b")
    repo.pause("handler", HANDLER, "ops", None)
    assert try_claim(repo, sql, one[0]) is ClaimOutcome.LOST
    assert try_claim(repo, sql, two[0]) is ClaimOutcome.LOST
    repo.resume("handler", HANDLER, "ops", None)
    drain(repo)
    assert try_claim(repo, sql, one[0]) is ClaimOutcome.EXECUTE


def test_a_pause_holds_a_breakers_probe_back_too(repo: Store, sql: Sql) -> None:
    waiting = open_by_failures(repo, sql, extra=1)
    try_claim(repo, sql, waiting[0])
    repo.pause("handler", HANDLER, "ops", None)
    cooldown_over(sql)
    drain(repo)
    assert breaker(sql)["state"] == "open"  # no probe while the handler is paused
    repo.resume("handler", HANDLER, "ops", None)
    drain(repo)
    assert breaker(sql)["state"] == "half_open"


def test_refusals_name_the_problem_and_change_nothing(repo: Store, sql: Sql) -> None:
    ready(repo, sql, 1)
    with pytest.raises(NotFoundError, match=r"no workflow names handler 'nobody\.here'"):
        repo.open_breaker("nobody.here", "ops", None)
    with pytest.raises(NotFoundError):
        repo.pause("handler", "nobody.here", "ops", None)
    with pytest.raises(InputError, match="handler name"):
        repo.close_breaker("bad name!", "ops", None)
    with pytest.raises(InputError, match="scope"):
        repo.pause("tenant", "x", "ops", None)
    with pytest.raises(InputError, match="queue name"):
        repo.pause("queue", "amq.nope", "ops", None)
    with pytest.raises(InputError):
        repo.pause("queue", "ok", "ops\x00", None)
    assert sql.execute("SELECT count(*) FROM gate_audit").fetchone() == (0,)
    assert sql.execute("SELECT count(*) FROM pauses").fetchone() == (0,)


def test_breakers_list_shows_state_failures_cooldown_and_parked(repo: Store, sql: Sql) -> None:
    waiting = open_by_failures(repo, sql, extra=2)
    for tid in waiting:
        try_claim(repo, sql, tid)
    (shown,) = repo.breakers()
    assert (shown.handler, shown.state, shown.held, shown.recent_failures) == (
        HANDLER,
        BreakerState.OPEN,
        False,
        3,
    )
    assert (shown.failures, shown.window_s, shown.cooldown_s) == (3, 60.0, 30.0)
    assert shown.probe_due_in_s is not None and 0 < shown.probe_due_in_s <= 30.0
    assert (shown.parked, shown.transitions) == (2, 1)
    assert repo.breakers("tests.other") == []


def test_a_parked_task_retried_now_or_cancelled_keeps_no_stale_mark(repo: Store, sql: Sql) -> None:
    waiting = open_by_failures(repo, sql, extra=2)
    for tid in waiting:
        try_claim(repo, sql, tid)
    done = repo.retry_task_now(waiting[0], "ops", None)  # RETRYING (parked) → READY
    assert done.task.state is TaskState.READY
    assert try_claim(repo, sql, waiting[0]) is ClaimOutcome.LOST  # the gate still holds it
    assert facts(sql, waiting[0])[:3] == ("RETRYING", 0, "circuit_open")
    repo.cancel_task(waiting[1], "ops", None)
    (shown,) = repo.breakers()
    assert shown.parked == 1  # the cancelled one is not held by the breaker any more
    repo.close_breaker(HANDLER, "ops", None)
    drain(repo)
    claim = claim_task(repo, sql, waiting[0])
    assert facts(sql, waiting[0])[:3] == ("RUNNING", 1, None)  # the claim cleared its mark
    assert repo.finish(
        waiting[0],
        claim.fencing_token,
        TaskState.FAILED,
        reason=FailureReason.HANDLER_ERROR,
        error="x",
    )
    drain(repo)  # its retry is due at once (NOW_RETRY) and dispatched, not read as parked
    assert facts(sql, waiting[0])[:3] == ("READY", 1, None)
