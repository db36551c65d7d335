"""A dispatch the broker lost after confirming it is sent again, and only then.

RabbitMQ 3.10 can lose a confirmed message when it is SIGKILLed within about a second of a
quorum queue's declaration (found by the chaos tests); an operator can also delete a queue by
hand. A READY task whose message was confirmed long ago and never claimed — while dispatches
published after it were claimed — gets a new dispatch generation.
"""

from __future__ import annotations

import random
import uuid
from typing import Any
from uuid import UUID

import pika
import psycopg
import pytest

from flowforge.domain.model import ClaimOutcome
from flowforge.domain.states import RunState, TaskState
from flowforge.store import queries
from tests.e2e import Stack
from tests.harness import plans
from tests.helpers import dispatch, drain, single, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]
AGE_S = 60.0


def age(sql: Conn, task_run_id: object, minutes: int = 10) -> None:
    """Pretend the task became READY and its message was confirmed ``minutes`` ago."""
    sql.execute(
        "UPDATE task_runs SET ready_at = now() - make_interval(mins => %s) WHERE id = %s",
        (minutes, task_run_id),
    )
    sql.execute(
        "UPDATE outbox SET published_at = now() - make_interval(mins => %s) WHERE task_run_id = %s",
        (minutes, task_run_id),
    )


def test_a_lost_dispatch_gets_a_new_generation_and_the_old_message_claims_nothing(
    repo: Store, sql: Conn
) -> None:
    wf = single("lost", "h")
    lost = repo.trigger(wf, {"n": 1}).run_id
    later = repo.trigger(wf, {"n": 2}).run_id
    drain(repo)
    (lost_task, old_token), (later_task, later_token) = dispatch(sql)
    assert repo.claim(later_task, later_token, "w", 30).outcome is ClaimOutcome.EXECUTE
    age(sql, lost_task)

    assert repo.redispatch_lost(AGE_S, 100) == 1
    assert repo.redispatch_lost(AGE_S, 100) == 0  # the new generation is young
    task = repo.get_run(lost).task("only")
    assert task.state is TaskState.READY and task.fencing_token == old_token + 1
    [(again, new_token)] = dispatch(sql)
    assert (again, new_token) == (lost_task, old_token + 1)
    assert repo.claim(lost_task, old_token, "w", 30).outcome is ClaimOutcome.LOST
    assert repo.claim(lost_task, new_token, "w", 30).outcome is ClaimOutcome.EXECUTE
    assert repo.get_run(later).state is RunState.RUNNING


def test_a_backlog_nobody_has_consumed_past_is_not_redispatched(repo: Store, sql: Conn) -> None:
    wf = single("backlog", "h")
    runs = [repo.trigger(wf, {"n": i}).run_id for i in range(3)]
    drain(repo)
    for task_run_id, _token in dispatch(sql):
        age(sql, task_run_id)
    assert repo.redispatch_lost(AGE_S, 100) == 0  # still queued behind each other: not lost
    assert all(repo.get_run(r).task("only").fencing_token == 0 for r in runs)


def test_a_queue_no_worker_consumes_is_judged_once_a_worker_of_it_registers(
    repo: Store, sql: Conn
) -> None:
    """A lost dispatch on a named queue is judged only while a worker of that queue is
    registered: a backlog of a queue nobody consumes is never compared with the claimed
    dispatches (at a million READY tasks that comparison is what took the scheduler's time)."""
    wf = single("served", "h")
    lost = repo.trigger(wf, {"n": 1}, queue="served").run_id
    repo.trigger(wf, {"n": 2}, queue="served")
    drain(repo)
    (lost_task, old_token), (later_task, later_token) = dispatch(sql)
    assert repo.claim(later_task, later_token, "w", 30).outcome is ClaimOutcome.EXECUTE
    age(sql, lost_task)
    repo.register_process(uuid.uuid4(), "host", 1, "worker", queue="another")
    assert repo.redispatch_lost(AGE_S, 100) == 0  # nobody consumes "served"
    assert repo.get_run(lost).task("only").fencing_token == old_token
    repo.register_process(uuid.uuid4(), "host", 2, "worker", queue="served")
    assert repo.redispatch_lost(AGE_S, 100) == 1
    assert repo.get_run(lost).task("only").fencing_token == old_token + 1


def test_a_young_unclaimed_dispatch_is_left_alone(repo: Store, sql: Conn) -> None:
    wf = single("young", "h")
    repo.trigger(wf, {"n": 1})
    repo.trigger(wf, {"n": 2})
    drain(repo)
    [_first, (later_task, later_token)] = dispatch(sql)
    repo.claim(later_task, later_token, "w", 30)
    assert repo.redispatch_lost(AGE_S, 100) == 0


@pytest.mark.slow  # real role processes
def test_a_message_lost_by_the_broker_still_runs_once_through_the_roles(
    stack: Stack, repo: Store, sql: Conn
) -> None:
    settings = {
        "scheduler": {
            "poll_interval_s": 0.2,
            "redispatch_after_s": 1.0,
            "housekeeping_interval_s": 0.5,
        }
    }
    stack.start("scheduler", **settings)
    stack.start("publisher", **settings)
    lost = repo.trigger(single("lost-e2e", "e2e.record"), {"n": 1}).run_id
    wait_for(
        lambda: (
            sql.execute("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").fetchone()
            == (1,)
        ),
        what="the dispatch to be confirmed",
    )
    conn = pika.BlockingConnection(pika.URLParameters(stack.broker_url))
    try:
        conn.channel().queue_purge(stack.queue)  # the broker "loses" the confirmed message
    finally:
        conn.close()
    later = repo.trigger(single("lost-e2e", "e2e.record"), {"n": 2}).run_id
    stack.start("worker", **settings)
    wait_for(
        lambda: all(repo.get_run(r).state is RunState.SUCCEEDED for r in (lost, later)),
        timeout=30,
        what="both runs, the lost one re-dispatched",
    )
    assert repo.get_run(lost).task("only").fencing_token >= 2  # a second generation ran
    counts = sql.execute("SELECT run_id, count(*) FROM test_executions GROUP BY run_id").fetchall()
    assert sorted(n for _, n in counts) == [1, 1]


# ------------------------------------------------------------------ the rule, on random dispatches


def oracle(sql: Conn, age_s: float) -> set[UUID]:
    """The tasks the rule calls lost, computed here from the rows: a READY task aged past
    ``age_s`` on a served queue (or none), whose current dispatch was published before
    ``age_s`` ago, and some claimed dispatch of the same queue and band published after it —
    by publication order (published_at, unpublished last; then priority, higher first; then
    id)."""
    served = {r[0] for r in sql.execute("SELECT queue FROM processes WHERE role = 'worker'")}
    rows = sql.execute(
        "SELECT o.id, o.task_run_id, coalesce(o.queue, ''), o.priority, o.published_at,"
        "       t.state = 'READY' AND t.fencing_token = o.fencing_token"
        "         AND t.ready_at < now() - make_interval(secs => %s)"
        "         AND o.published_at < now() - make_interval(secs => %s)"
        "         AND (t.queue IS NULL OR t.queue = ANY(%s)),"
        "       EXISTS (SELECT 1 FROM task_attempts a WHERE a.task_run_id = o.task_run_id"
        "                  AND a.fencing_token = o.fencing_token + 1)"
        "  FROM outbox o JOIN task_runs t ON t.id = o.task_run_id",
        (age_s, age_s, list(served)),
    ).fetchall()

    def band(priority: Any) -> tuple[bool, bool]:
        return (int(priority) > 0, int(priority) >= 5)

    def key(row: Any) -> tuple[Any, ...]:
        published = row[4]
        return (published is None, published or 0, -int(row[3]), int(row[0]))

    claimed = [r for r in rows if r[6]]
    return {
        UUID(str(c[1]))
        for c in rows
        if c[5]
        and any((d[2], band(d[3])) == (c[2], band(c[3])) and key(d) > key(c) for d in claimed)
    }


@pytest.mark.parametrize("seed", [22, 7, 2026])
def test_the_lost_are_exactly_those_a_claimed_dispatch_of_their_band_was_published_after(
    repo: Store, sql: Conn, seed: int
) -> None:
    """Random dispatches over two queues (one served, one not), every band, published at a
    few times (ties in one sweep), some claimed and some of those never published; each round
    adds more to what the earlier rounds left. What the statement re-dispatches is what the
    rule says, round after round."""
    rng = random.Random(seed)
    repo.register_process(uuid.uuid4(), "host", 1, "worker", queue="served")
    wf = single("random-dispatch", "h")
    renewed_total = 0
    for _round in range(12):
        runs = [
            repo.trigger(
                wf,
                {"n": n},
                queue=rng.choice([None, "served", "idle"]),
                priority=rng.choice([0, 1, 4, 5, 9]),
            ).run_id
            for n in range(10)
        ]
        sent = sql.execute(  # this round's dispatches (an earlier round's NULLs stay NULL)
            "UPDATE outbox o SET published_at = now() FROM task_runs t"
            " WHERE t.id = o.task_run_id AND t.run_id = ANY(%s) AND o.published_at IS NULL"
            " RETURNING o.task_run_id, o.fencing_token",
            (runs,),
        ).fetchall()
        assert len(sent) == 10
        for task_run_id, token in sent:
            minutes = rng.choice([10, 10, 9, 8, 0])  # ties within a sweep; 0: too young
            sql.execute(
                "UPDATE outbox SET published_at = date_trunc('second', now())"
                " - make_interval(mins => %s) WHERE task_run_id = %s AND fencing_token = %s",
                (minutes, task_run_id, token),
            )
            sql.execute(
                "UPDATE task_runs SET ready_at = now() - make_interval(mins => 10) WHERE id = %s",
                (task_run_id,),
            )
            if rng.random() < 0.35:
                claimed = repo.claim(task_run_id, int(token), "w", 30)
                assert claimed.outcome is ClaimOutcome.EXECUTE
                if rng.random() < 0.2:  # claimed straight from a finish: never published
                    sql.execute(
                        "UPDATE outbox SET published_at = NULL"
                        " WHERE task_run_id = %s AND fencing_token = %s",
                        (task_run_id, token),
                    )
        expected = oracle(sql, AGE_S)
        before = dict(sql.execute("SELECT id, fencing_token FROM task_runs").fetchall())
        assert repo.redispatch_lost(AGE_S, 1000) == len(expected)
        after = dict(sql.execute("SELECT id, fencing_token FROM task_runs").fetchall())
        assert {UUID(str(i)) for i in after if after[i] != before[i]} == expected
        renewed_total += len(expected)
    assert renewed_total > 10  # the rounds did exercise the rule


def test_in_one_sweep_the_latest_claimed_dispatch_is_the_last_published_not_the_highest(
    repo: Store, sql: Conn
) -> None:
    """One sweep publishes a band's rows by priority, then id: A (priority 4), C (4), then B
    (1). With A and B claimed, C was moved past (B went out after it) — B, not A, is its
    band's latest claimed dispatch, though A has the higher priority."""
    wf = single("sweep", "h")
    a, c, b = (repo.trigger(wf, {"n": n}, priority=p).run_id for n, p in ((1, 4), (2, 4), (3, 1)))
    sent = {UUID(str(r[0])): int(str(r[1])) for r in dispatch(sql)}
    tasks = {run: repo.get_run(run).task("only").id for run in (a, c, b)}
    for run in (a, b):
        assert repo.claim(tasks[run], sent[tasks[run]], "w", 30).outcome is ClaimOutcome.EXECUTE
    ids = list(sent)
    sql.execute(  # one published_at for all three: one sweep
        "UPDATE outbox SET published_at = now() - make_interval(mins => 10)"
        " WHERE task_run_id = ANY(%s)",
        (ids,),
    )
    sql.execute(
        "UPDATE task_runs SET ready_at = now() - make_interval(mins => 10) WHERE id = ANY(%s)",
        (ids,),
    )
    assert repo.redispatch_lost(AGE_S, 100) == 1
    assert repo.get_run(c).task("only").fencing_token == sent[tasks[c]] + 1


HALF = 1500  # claimed dispatches; as many behind them: a task_attempts no plan reads whole


@pytest.mark.parametrize(
    "analyzed", ["on-what-it-reads", "before-the-backlog-was-published-or-claimed"]
)
def test_the_latest_claimed_dispatch_is_found_once_per_group_not_once_per_candidate(
    repo: Store, sql: Conn, analyzed: str
) -> None:
    """The statement is linear in the candidates: the outbox is searched for a queue and
    band's latest claimed dispatch once, whatever the backlog (1,500 candidates, 1,500
    claimed before them). Read from EXPLAIN ANALYZE of the statement, rolled back: every scan of the
    claimed dispatches ran once. Searched once per candidate, as the statement did before,
    they ran 1,500 times (docs/performance.md "redispatch_lost, linear").

    It is planned at each run on what the last ANALYZE saw, so the tables are analyzed here
    (the shared database's statistics are whatever earlier tests left): on what the statement
    reads, and while the backlog was neither published nor claimed, as an autovacuum between
    a burst of triggers and its dispatch leaves them. On those, the statement before joined
    the candidates to the outbox by rescanning one for each row of the other and read
    task_attempts whole for each dispatch: millions of rows handled for 3,000 dispatches
    (docs/performance.md "redispatch_lost on stale statistics"); linear, it handles a few
    thousand."""
    repo.trigger_many(single("linear", "h"), [{"n": n} for n in range(2 * HALF)])
    if analyzed == "before-the-backlog-was-published-or-claimed":
        sql.execute("ANALYZE outbox, task_attempts, task_runs")
    sql.execute("UPDATE outbox SET published_at = now() - interval '20 min' + id * interval '1 ms'")
    first = sql.execute(
        "SELECT task_run_id, fencing_token FROM outbox ORDER BY id LIMIT %s", (HALF,)
    ).fetchall()
    claimed = repo.claim_many([(UUID(str(t)), int(str(k))) for t, k in first], "w", 30.0)
    assert all(c.outcome is ClaimOutcome.EXECUTE for c in claimed)
    sql.execute("UPDATE task_runs SET ready_at = now() - interval '30 min' WHERE state = 'READY'")
    if analyzed == "on-what-it-reads":
        sql.execute("ANALYZE outbox, task_attempts, task_runs")
    loops: list[int] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "outbox" and str(node.get("Alias", "")).startswith("later"):
            loops.append(int(node["Actual Loops"]))
        for child in node.get("Plans", ()):
            walk(child)

    params = {"age_s": AGE_S, "limit": 1000}
    root = plans.explain_analyzed(sql, queries.load()["redispatch_lost"], params)
    walk(root)
    assert len(loops) == 2 and loops == [1, 1]  # unpublished and published: once each
    assert plans.rows_handled(root) <= 20 * 2 * HALF  # linear in the dispatches
    assert repo.redispatch_lost(AGE_S, 1000) == 0  # a backlog nothing was claimed after
