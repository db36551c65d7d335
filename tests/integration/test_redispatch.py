"""A dispatch the broker lost after confirming it is sent again, and only then.

RabbitMQ 3.10 can lose a confirmed message when it is SIGKILLed within about a second of a
quorum queue's declaration (found by the chaos tests); an operator can also delete a queue by
hand. A READY task whose message was confirmed long ago and never claimed — while dispatches
published after it were claimed — gets a new dispatch generation.
"""

from __future__ import annotations

import uuid

import pika
import psycopg
import pytest

from flowforge.domain.model import ClaimOutcome
from flowforge.domain.states import RunState, TaskState
from tests.e2e import Stack
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
