"""Delivery guarantees through real role processes, real RabbitMQ and real signals.

Each test starts `flowforge role NAME` subprocesses (tests/e2e.py) on a queue of its own and
counts handler executions in the database (``test_executions``, written by
tests/e2e_handlers.py), so "ran once" means one row, whatever the logs say. Faults are real:
SIGKILL, SIGSTOP/SIGCONT, SIGTERM, a channel closed without an ack, a duplicate message on the
queue, a publisher confirm thrown away, a queue deleted under the publisher, a queue of the
wrong type. Waits poll with a deadline; the only fixed-length waits prove an absence (a queue
that *stays* empty after its consumer left, so nothing was left unacked).
"""

from __future__ import annotations

import signal
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.broker import messages
from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import ClaimOutcome, Dispatch, TaskRun
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import FINISHED_TASK_STATES, RunState, TaskState
from flowforge.roles.publisher import Publisher
from supervisor import exitcodes
from tests.delivery import (
    BROKER_POLL_S,
    broker_channel,
    consumer_count,
    executions,
    exit_code,
    outbox_rows,
    publish_raw,
    publish_twice_losing_the_first_confirm,
    queue_depth,
    stale_completions,
    stays_empty,
    stop_cleanly,
    worker_pid,
)
from tests.e2e import RoleProcess, Stack
from tests.helpers import FAST_RETRY, drain, single, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

#: Worker settings for tests that wait for a lease to lapse.
SHORT_LEASE = {"lease_s": 2.0, "heartbeat_s": 0.5}
ONE_ATTEMPT = RetryPolicy(max_attempts=1, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)


# ------------------------------------------------------------------ helpers


def trigger_one(
    repo: Store, handler: str, run_input: dict[str, Any] | None = None, **task: Any
) -> tuple[UUID, UUID]:
    """Trigger a one-task run (fast retries unless told otherwise); (run id, task run id)."""
    task.setdefault("retry", FAST_RETRY)
    run_id = repo.trigger(single("delivery", handler, **task), run_input or {}).run_id
    return run_id, repo.get_run(run_id).tasks[0].id


def wait_task(repo: Store, task_id: UUID, state: TaskState, timeout: float = 20.0) -> TaskRun:
    """Poll until the task is in ``state``; fail at once if it finished in another state."""

    def probe() -> TaskRun | None:
        task = repo.get_task(task_id)
        if task.state in FINISHED_TASK_STATES and task.state is not state:
            raise AssertionError(
                f"task ended {task.state} ({task.failure_reason}: {task.last_error}), "
                f"expected {state}"
            )
        return task if task.state is state else None

    return wait_for(probe, timeout=timeout, what=f"task {task_id} to be {state}")


def wait_run(repo: Store, run_id: UUID, state: RunState, timeout: float = 20.0) -> None:
    wait_for(
        lambda: repo.get_run(run_id).state is state, timeout=timeout, what=f"run to be {state}"
    )


def wait_executions(sql: Sql, task_id: UUID, count: int, timeout: float = 20.0) -> None:
    wait_for(
        lambda: len(executions(sql, task_id)) >= count,
        timeout=timeout,
        what=f"{count} recorded execution(s)",
    )


def registered_roles(sql: Sql) -> dict[str, tuple[str, int, datetime, datetime]]:
    """role → (host, pid, started_at, last_seen_at) of every registered process."""
    found = sql.execute("SELECT role, host, pid, started_at, last_seen_at FROM processes")
    return {r[0]: (r[1], int(r[2]), r[3], r[4]) for r in found.fetchall()}


def wait_registered(sql: Sql, *processes: RoleProcess) -> None:
    """Wait until every process has booted and registered itself in ``processes``."""
    pids = sorted(p.pid for p in processes)

    def registered() -> bool:
        found = sql.execute("SELECT pid FROM processes WHERE pid = ANY(%s)", (pids,)).fetchall()
        return sorted(int(r[0]) for r in found) == pids

    wait_for(registered, what=f"processes {pids} to register")


def declare_quorum_queue(stack: Stack) -> None:
    with broker_channel(stack) as channel:
        channel.queue_declare(stack.queue, durable=True, arguments={"x-queue-type": "quorum"})


def wait_depth(stack: Stack, depth: int, timeout: float = 20.0) -> None:
    wait_for(
        lambda: queue_depth(stack) == depth,
        timeout=timeout,
        interval=BROKER_POLL_S,
        what=f"queue depth {depth}",
    )


def drain_queue(stack: Stack, limit: int) -> list[tuple[str | None, bytes]]:
    """Take every message off the queue (acking each): (message_id, body) in queue order."""
    taken: list[tuple[str | None, bytes]] = []
    with broker_channel(stack) as channel:
        for _ in range(limit + 1):
            method, properties, body = channel.basic_get(stack.queue, auto_ack=False)
            if method is None:
                return taken
            taken.append((properties.message_id, body))
            channel.basic_ack(method.delivery_tag)
    raise AssertionError(f"the queue held more than {limit} messages")


# ------------------------------------------------------------------ duplicate delivery


def test_duplicate_delivery_runs_the_handler_once(stack: Stack, repo: Store, sql: Sql) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    worker = stack.start("worker", logging={"level": "DEBUG"})
    _, task_id = trigger_one(repo, "e2e.record")
    wait_task(repo, task_id, TaskState.SUCCEEDED)
    wait_depth(stack, 0)
    [(outbox_id, token, published_at)] = outbox_rows(sql, task_id)
    assert published_at is not None

    # The broker delivers the same dispatch (same task run, same token) a second time.
    publish_raw(stack, Dispatch(outbox_id, task_id, token))
    worker.wait_for_log(f"task run {task_id} not executed here: lost")
    assert queue_depth(stack) == 0
    stop_cleanly(worker)
    assert stays_empty(stack), "the duplicate was never acked: it came back to the queue"

    assert executions(sql, task_id) == [(1, worker.pid)]
    task = repo.get_task(task_id)
    assert (task.state, task.attempt, task.fencing_token) == (TaskState.SUCCEEDED, 1, token + 1)


def test_lost_ack_redelivers_and_the_redelivery_is_acked_without_running(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    _, task_id = trigger_one(repo, "e2e.record")
    wait_depth(stack, 1)

    # A consumer receives the dispatch, claims it the way a worker does (the claim commits),
    # then its channel closes before the ack: the broker still owns the message.
    with broker_channel(stack) as channel:
        method, _, body = channel.basic_get(stack.queue, auto_ack=False)
        assert method is not None and not method.redelivered
        message = messages.decode(body)
        claimed = repo.claim(message.task_run_id, message.token, "elsewhere/1", lease_s=60)
        assert claimed.outcome is ClaimOutcome.EXECUTE and claimed.claim is not None
        channel.close()  # no ack
    wait_depth(stack, 1)
    with broker_channel(stack) as channel:  # the message came back, marked as a redelivery
        method, _, body = channel.basic_get(stack.queue, auto_ack=False)
        assert method is not None and method.redelivered
        assert messages.decode(body) == message
        channel.basic_nack(method.delivery_tag, requeue=True)

    worker = stack.start("worker", logging={"level": "DEBUG"})
    worker.wait_for_log(f"task run {task_id} not executed here: lost")
    assert queue_depth(stack) == 0
    stop_cleanly(worker)
    assert stays_empty(stack), "the redelivered message was not acked"

    assert executions(sql, task_id) == [], "the redelivery ran the handler"
    task = repo.get_task(task_id)
    assert (task.state, task.attempt, task.lease_owner) == (TaskState.RUNNING, 1, "elsewhere/1")
    assert task.fencing_token == claimed.claim.fencing_token
    # the claim that did commit still owns the task and can finish it
    assert repo.finish(task_id, claimed.claim.fencing_token, TaskState.SUCCEEDED, result={})
    assert repo.get_task(task_id).state is TaskState.SUCCEEDED


# ------------------------------------------------------------------ dead and stale workers


def test_a_killed_worker_is_reaped_retried_and_finally_succeeds(
    stack: Stack, repo: Store, sql: Sql, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    stack.start("scheduler")
    stack.start("publisher")
    first = stack.start("worker", worker=SHORT_LEASE)
    _, task_id = trigger_one(repo, "e2e.gate", {"gate": str(gate)})
    wait_executions(sql, task_id, 1)
    running = wait_task(repo, task_id, TaskState.RUNNING)

    first.signal(signal.SIGKILL)
    assert exit_code(first) == -signal.SIGKILL
    after_kill = repo.get_task(task_id)
    assert after_kill.state is TaskState.RUNNING, "nothing but the reaper may move it"
    assert after_kill.fencing_token == running.fencing_token

    def reaped() -> bool:
        attempts = repo.attempts(task_id)
        return bool(attempts) and attempts[0].outcome == "lease_expired"

    wait_for(reaped, timeout=15, what="the reaper to close attempt 1")
    wait_for(lambda: len(outbox_rows(sql, task_id)) == 2, what="a new dispatch generation")
    task = repo.get_task(task_id)
    assert task.attempt == 1 and task.fencing_token > running.fencing_token
    assert task.lease_expires_at is None and task.lease_owner is None
    [attempt] = repo.attempts(task_id)
    assert attempt.failure_reason is FailureReason.LEASE_EXPIRED
    assert worker_pid(attempt.worker) == first.pid

    gate.touch()
    second = stack.start("worker", worker=SHORT_LEASE)
    done = wait_task(repo, task_id, TaskState.SUCCEEDED)
    assert done.attempt == 2 and done.lease_expires_at is None
    assert executions(sql, task_id) == [(1, first.pid), (2, second.pid)]
    assert [(a.attempt, a.outcome) for a in repo.attempts(task_id)] == [
        (1, "lease_expired"),
        (2, "succeeded"),
    ]


def test_a_killed_scheduler_cannot_double_dispatch(stack: Stack, repo: Store, sql: Sql) -> None:
    scheduler = stack.start("scheduler")
    first_batch = [trigger_one(repo, "e2e.record")[1] for _ in range(30)]
    wait_for(lambda: outbox_rows(sql, first_batch[0]), what="the scheduler's first outbox row")
    scheduler.signal(signal.SIGKILL)  # possibly in the middle of promoting the others
    assert exit_code(scheduler) == -signal.SIGKILL
    before = {t: outbox_rows(sql, t) for t in first_batch}
    assert all(len(rows) <= 1 for rows in before.values())

    stack.start("scheduler")
    second_batch = [trigger_one(repo, "e2e.record")[1] for _ in range(5)]
    everything = first_batch + second_batch
    wait_for(
        lambda: all(outbox_rows(sql, t) for t in everything),
        what="the fresh scheduler to dispatch every task",
    )
    drain(repo)  # and more passes in this process, for good measure
    for task_id in everything:
        rows = outbox_rows(sql, task_id)
        assert len(rows) == 1, f"task run {task_id} was dispatched {len(rows)} times"
        if before.get(task_id):
            assert rows == before[task_id], "a row written before the kill was rewritten"
        assert repo.get_task(task_id).state is TaskState.READY
    total = sql.execute("SELECT count(*) FROM outbox").fetchone()
    assert total == (len(everything),)


def test_a_resurrected_worker_result_is_rejected_and_counted(
    stack: Stack, repo: Store, sql: Sql, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    stack.start("scheduler")
    stack.start("publisher")
    frozen = stack.start("worker", worker=SHORT_LEASE)
    _, task_id = trigger_one(repo, "e2e.gate", {"gate": str(gate)})
    wait_executions(sql, task_id, 1)
    wait_task(repo, task_id, TaskState.RUNNING)

    frozen.signal(signal.SIGSTOP)
    try:
        rescuer = stack.start("worker", worker=SHORT_LEASE)
        wait_for(lambda: len(executions(sql, task_id)) == 2, timeout=20, what="attempt 2 to start")
        assert executions(sql, task_id) == [(1, frozen.pid), (2, rescuer.pid)]
        gate.touch()
        done = wait_task(repo, task_id, TaskState.SUCCEEDED)
        assert stale_completions(repo) == 0
    finally:
        frozen.signal(signal.SIGCONT)

    wait_for(lambda: stale_completions(repo) == 1, what="the stale completion to be counted")
    assert frozen.alive()
    after = repo.get_task(task_id)
    assert (after.state, after.attempt, after.fencing_token, after.result) == (
        TaskState.SUCCEEDED,
        2,
        done.fencing_token,
        done.result,
    )
    attempts = repo.attempts(task_id)
    assert [(a.attempt, a.outcome) for a in attempts] == [(1, "lease_expired"), (2, "succeeded")]
    assert [worker_pid(a.worker) for a in attempts] == [frozen.pid, rescuer.pid]

    # The resurrected worker acked its stale result and went back to consuming.
    stop_cleanly(rescuer)
    _, next_task = trigger_one(repo, "e2e.record")
    wait_task(repo, next_task, TaskState.SUCCEEDED)
    assert executions(sql, next_task) == [(1, frozen.pid)]
    assert stale_completions(repo) == 1


def test_a_resurrected_worker_cannot_overwrite_the_attempt_that_replaced_it(
    stack: Stack, repo: Store, sql: Sql, tmp_path: Path
) -> None:
    """The frozen worker wakes while its successor still holds the task RUNNING: only the
    fencing token (not the state) can reject its write."""
    gate = tmp_path / "gate"
    stack.start("scheduler")
    stack.start("publisher")
    frozen = stack.start("worker", worker=SHORT_LEASE)
    _, task_id = trigger_one(repo, "e2e.gate", {"gate": str(gate)})
    wait_executions(sql, task_id, 1)
    wait_task(repo, task_id, TaskState.RUNNING)

    frozen.signal(signal.SIGSTOP)
    try:
        rescuer = stack.start("worker", worker=SHORT_LEASE)
        wait_executions(sql, task_id, 2)
        held = wait_task(repo, task_id, TaskState.RUNNING)
        assert held.attempt == 2 and worker_pid(held.lease_owner) == rescuer.pid
    finally:
        frozen.signal(signal.SIGCONT)

    # It learns on its next renewal that the lease is gone, its handler stops, and its
    # finish (with the old token) is discarded while the task is RUNNING under a new one.
    wait_for(lambda: stale_completions(repo) == 1, what="the stale completion to be counted")
    still = repo.get_task(task_id)
    assert (still.state, still.attempt, still.fencing_token, still.lease_owner) == (
        TaskState.RUNNING,
        2,
        held.fencing_token,
        held.lease_owner,
    )
    assert [a.outcome for a in repo.attempts(task_id)] == ["lease_expired", "running"]

    gate.touch()
    done = wait_task(repo, task_id, TaskState.SUCCEEDED)
    assert (done.attempt, done.result) == (2, {"gated": True})
    assert executions(sql, task_id) == [(1, frozen.pid), (2, rescuer.pid)]
    assert stale_completions(repo) == 1


# ------------------------------------------------------------------ publisher confirms


def test_broker_rows_are_published_exactly_once_by_two_publishers(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    runs = 200
    declare_quorum_queue(stack)
    publishers = [stack.start("publisher"), stack.start("publisher")]
    stack.start("scheduler")
    wait_registered(sql, *publishers)  # both connected: both compete for every batch
    workflow = single("fan", "e2e.record")
    for i in range(runs):
        repo.trigger(workflow, {"i": i})

    wait_for(
        lambda: sql.execute("SELECT count(published_at) FROM outbox").fetchone() == (runs,),
        timeout=30,
        what="every outbox row to be stamped",
    )
    for publisher in publishers:  # nothing can still be in flight once both have exited
        stop_cleanly(publisher)
    rows = sql.execute("SELECT id, task_run_id, fencing_token FROM outbox").fetchall()
    assert len(rows) == runs

    delivered = drain_queue(stack, limit=2 * runs)
    ids = [message_id for message_id, _ in delivered]
    generations = [messages.decode(body) for _, body in delivered]
    assert len(delivered) == runs, f"{len(delivered)} messages for {runs} outbox rows"
    assert sorted(int(str(i)) for i in ids) == sorted(int(r[0]) for r in rows)
    assert {(g.task_run_id, g.token) for g in generations} == {
        (UUID(str(r[1])), int(r[2])) for r in rows
    }


def test_a_lost_publisher_confirm_keeps_the_row_pending_and_the_next_sweep_delivers_it_once(
    stack: Stack, repo: Store, sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, task_id = trigger_one(repo, "e2e.record")
    assert repo.promote_ready(10) == 0  # the trigger made it READY with its outbox row
    publisher = Publisher(load_config(stack.config_path(), env={}))
    publisher.initialize()
    try:
        publish_twice_losing_the_first_confirm(stack, sql, publisher, task_id, monkeypatch)
    finally:
        publisher.shutdown()

    worker = stack.start("worker", logging={"level": "DEBUG"})
    wait_task(repo, task_id, TaskState.SUCCEEDED)
    worker.wait_for_log(f"task run {task_id} not executed here: lost")
    assert queue_depth(stack) == 0
    stop_cleanly(worker)
    assert stays_empty(stack)
    assert executions(sql, task_id) == [(1, worker.pid)]  # ... at most once executed
    assert len(outbox_rows(sql, task_id)) == 1


def test_a_worker_whose_consumer_the_broker_cancelled_subscribes_again(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """Deleting the queue makes RabbitMQ cancel the worker's consumer (basic.cancel); the
    worker must notice, declare the queue again and consume, not idle on a dead consumer."""
    worker = stack.start("worker")
    wait_for(lambda: consumer_count(stack) == 1, what="the worker to consume")
    stack.delete_queue()
    worker.wait_for_log("the broker cancelled this consumer")
    wait_for(lambda: consumer_count(stack) == 1, what="the worker to consume again")

    _, task_id = trigger_one(repo, "e2e.record")
    publisher = stack.start("publisher")
    wait_task(repo, task_id, TaskState.SUCCEEDED)
    stop_cleanly(publisher)
    stop_cleanly(worker)
    assert executions(sql, task_id) == [(1, worker.pid)]


# ------------------------------------------------------------------ shutdown, heartbeats, time


def test_sigterm_during_a_handler_finishes_the_task_and_exits_cleanly(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    worker = stack.start("worker")
    wait_registered(sql, worker)
    _, task_id = trigger_one(repo, "e2e.sleep", {"seconds": 2})
    wait_executions(sql, task_id, 1)
    assert repo.get_task(task_id).state is TaskState.RUNNING

    worker.signal(signal.SIGTERM)
    assert exit_code(worker) == exitcodes.CLEAN
    task = repo.get_task(task_id)
    assert task.state is TaskState.SUCCEEDED and task.result == {"slept": 2}
    assert task.lease_expires_at is None and task.lease_owner is None
    live = sql.execute(
        "SELECT count(*) FROM task_runs WHERE state = 'RUNNING' OR lease_expires_at > now()"
    ).fetchone()
    assert live == (0,)
    assert queue_depth(stack) == 0
    assert executions(sql, task_id) == [(1, worker.pid)]
    assert sql.execute(
        "SELECT count(*) FROM processes WHERE pid = %s", (worker.pid,)
    ).fetchone() == (0,)


def test_a_handler_longer_than_three_heartbeat_intervals_succeeds_once(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    worker = stack.start("worker", broker={"heartbeat_s": 1})
    _, task_id = trigger_one(repo, "e2e.sleep", {"seconds": 4})
    wait_task(repo, task_id, TaskState.SUCCEEDED, timeout=30)
    assert executions(sql, task_id) == [(1, worker.pid)]
    assert [(a.attempt, a.outcome) for a in repo.attempts(task_id)] == [(1, "succeeded")]

    # the same connection still consumes
    _, next_task = trigger_one(repo, "e2e.record")
    wait_task(repo, next_task, TaskState.SUCCEEDED)
    assert executions(sql, next_task) == [(1, worker.pid)]
    log = worker.log()
    assert "reconnecting" not in log and "connection lost" not in log, log


def test_a_handler_over_its_timeout_fails_with_reason_timeout_and_the_worker_is_replaced(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    worker = stack.start("worker")
    _, task_id = trigger_one(repo, "e2e.hang", timeout=1.0, retry=ONE_ATTEMPT)
    assert exit_code(worker, timeout=30) == exitcodes.CHILD_RECYCLE
    task = wait_task(repo, task_id, TaskState.DEAD)
    # the attempt says why it failed; the task says why it will not be retried
    assert task.failure_reason is FailureReason.MAX_ATTEMPTS_EXCEEDED
    [attempt] = repo.attempts(task_id)
    assert (attempt.outcome, attempt.failure_reason) == ("failed", FailureReason.TIMEOUT)
    assert attempt.finished_at is not None
    assert executions(sql, task_id) == [(1, worker.pid)]
    assert "overran its timeout" in worker.log()
    gone = sql.execute("SELECT count(*) FROM processes WHERE pid = %s", (worker.pid,)).fetchone()
    assert gone == (0,), "the recycled worker did not deregister"


def test_cancelling_a_run_sets_ctx_cancelled_and_the_task_ends_cancelled(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start_all(workers=1)
    run_id, task_id = trigger_one(repo, "e2e.honour_cancel")
    wait_executions(sql, task_id, 1)
    wait_task(repo, task_id, TaskState.RUNNING)

    repo.cancel_run(run_id)
    task = wait_task(repo, task_id, TaskState.CANCELLED)
    assert task.result == {"stopped": True}, "the handler did not see ctx.cancelled"
    assert task.failure_reason is FailureReason.CANCELLED
    wait_run(repo, run_id, RunState.CANCELLED)
    assert [(a.outcome, a.failure_reason) for a in repo.attempts(task_id)] == [
        ("cancelled", FailureReason.CANCELLED)
    ]
    assert len(executions(sql, task_id)) == 1


# ------------------------------------------------------------------ retries and failure reasons


def test_a_flaky_handler_is_retried_until_it_succeeds(stack: Stack, repo: Store, sql: Sql) -> None:
    stack.start_all(workers=1)
    run_id, task_id = trigger_one(repo, "e2e.flaky", {"succeed_on": 3})
    task = wait_task(repo, task_id, TaskState.SUCCEEDED)
    assert task.attempt == 3 and task.result == {"attempt": 3}
    assert [(a.attempt, a.outcome, a.failure_reason) for a in repo.attempts(task_id)] == [
        (1, "failed", FailureReason.HANDLER_ERROR),
        (2, "failed", FailureReason.HANDLER_ERROR),
        (3, "succeeded", None),
    ]
    assert [a for a, _ in executions(sql, task_id)] == [1, 2, 3]
    wait_run(repo, run_id, RunState.SUCCEEDED)


def test_a_handler_that_always_fails_goes_dead_after_max_attempts(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start_all(workers=1)
    run_id, task_id = trigger_one(repo, "e2e.fail")
    task = wait_task(repo, task_id, TaskState.DEAD)
    assert task.attempt == 3
    assert task.failure_reason is FailureReason.MAX_ATTEMPTS_EXCEEDED
    attempts = repo.attempts(task_id)
    assert [(a.attempt, a.outcome, a.failure_reason) for a in attempts] == [
        (n, "failed", FailureReason.HANDLER_ERROR) for n in (1, 2, 3)
    ]
    for attempt in attempts:
        assert attempt.error == "RuntimeError: this handler always fails"
        assert attempt.traceback and "this handler always fails" in attempt.traceback
        assert attempt.finished_at is not None and attempt.worker
    assert [a for a, _ in executions(sql, task_id)] == [1, 2, 3]
    wait_run(repo, run_id, RunState.FAILED)


@pytest.mark.parametrize(
    ("handler", "reason", "executed"),
    [
        ("e2e.permanent", FailureReason.PERMANENT_ERROR, 1),
        ("e2e.not_registered_anywhere", FailureReason.UNKNOWN_HANDLER, 0),
        ("e2e.unserializable", FailureReason.UNSERIALIZABLE_RESULT, 1),
    ],
)
def test_a_non_retryable_failure_goes_dead_after_one_attempt(
    stack: Stack, repo: Store, sql: Sql, handler: str, reason: FailureReason, executed: int
) -> None:
    stack.start_all(workers=1)
    run_id, task_id = trigger_one(repo, handler)  # three attempts allowed, one used
    task = wait_task(repo, task_id, TaskState.DEAD)
    assert (task.attempt, task.failure_reason) == (1, reason)
    [attempt] = repo.attempts(task_id)
    assert (attempt.outcome, attempt.failure_reason) == ("failed", reason)
    assert attempt.error
    assert len(executions(sql, task_id)) == executed
    wait_run(repo, run_id, RunState.FAILED)


# ------------------------------------------------------------------ idempotency keys


def test_two_runs_sharing_an_idempotency_key_execute_the_handler_once(
    stack: Stack, repo: Store, sql: Sql, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    workflow = WorkflowDef(
        "pay",
        (TaskDef("charge", "e2e.gate", idempotency_key="pay-{order_id}", retry=FAST_RETRY),),
    )
    run_input = {"order_id": 42, "gate": str(gate)}
    runs = [repo.trigger(workflow, run_input).run_id for _ in range(2)]
    tasks = [repo.get_run(r).tasks[0].id for r in runs]
    stack.start_all(workers=2)

    wait_for(lambda: executions(sql), what="one execution to hold the key")
    [(executing_task,)] = sql.execute("SELECT task_run_id FROM test_executions").fetchall()
    [waiting] = [t for t in tasks if t != executing_task]
    # the other worker met the held key and deferred its task (no attempt used)
    wait_for(lambda: repo.get_task(waiting).fencing_token > 0, what="the other claim to defer")
    assert repo.get_task(waiting).attempt == 0
    gate.touch()

    done = [wait_task(repo, t, TaskState.SUCCEEDED) for t in tasks]
    assert len(executions(sql)) == 1
    assert done[0].result == done[1].result == {"gated": True}
    outcomes = {t: [(a.attempt, a.outcome) for a in repo.attempts(t)] for t in tasks}
    assert outcomes[executing_task] == [(1, "succeeded")]
    assert outcomes[waiting] == [(1, "reused")]


# ------------------------------------------------------------------ topology and registry


def test_a_queue_of_the_wrong_type_stops_the_role_with_the_operators_steps(
    stack: Stack, sql: Sql
) -> None:
    with broker_channel(stack) as channel:
        channel.queue_declare(stack.queue, durable=True)  # a classic queue
    started = time.monotonic()
    roles = [stack.start("worker"), stack.start("publisher")]
    for role in roles:
        assert exit_code(role) == exitcodes.CHILD_BOOT_FAILURE, role.log()
    assert time.monotonic() - started < 10, "a boot failure must not be retried"
    for role in roles:
        log = role.log()
        assert "cannot start" in log and f"delete_queue {stack.queue}" in log, log
        assert "reconnecting" not in log, log
    pids = [role.pid for role in roles]
    left = sql.execute("SELECT count(*) FROM processes WHERE pid = ANY(%s)", (pids,)).fetchone()
    assert left == (0,)


def test_processes_register_refresh_and_deregister(stack: Stack, sql: Sql) -> None:
    roles = {p.role: p for p in stack.start_all(workers=1)}

    def all_registered() -> dict[str, tuple[str, int, datetime, datetime]] | None:
        seen = registered_roles(sql)
        return seen if set(seen) == set(roles) else None

    first = wait_for(all_registered, what="every role to register")
    for role, (host, pid, started_at, last_seen_at) in first.items():
        assert (host, pid) == (socket.gethostname(), roles[role].pid)
        assert started_at <= last_seen_at

    def refreshed() -> bool:
        now = registered_roles(sql)
        return set(now) == set(roles) and all(now[r][3] > first[r][3] for r in roles)

    wait_for(refreshed, timeout=12, interval=0.2, what="every registration to be refreshed")

    for process in roles.values():
        stop_cleanly(process)
    assert registered_roles(sql) == {}
