"""The worker's batches through real role processes, real RabbitMQ and real signals.

A worker takes up to ``window`` deliveries at once (1, then doubling after every batch of fast
handlers, up to ``broker.prefetch``), claims them in one statement and finishes them in one
statement. A handler slower than ``worker.fast_handler_ms`` makes it hand back the claims queued
behind it, so other workers run them. Executions are counted in ``test_executions``
(tests/e2e_handlers.py); waits poll with a deadline, and the only fixed-length wait proves an
absence (a queue that stays empty once its consumer has gone).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import psycopg
import pytest

from flowforge.config import BrokerConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Dispatch
from flowforge.domain.states import FINISHED_TASK_STATES, RunState, TaskState
from tests.delivery import (
    BROKER_POLL_S,
    executions,
    publish_raw,
    queue_depth,
    stale_completions,
    stays_empty,
    stop_cleanly,
    worker_pid,
)
from tests.e2e import RoleProcess, Stack
from tests.helpers import FAST_RETRY, single, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

#: The workers' default broker.prefetch: the largest batch a worker claims.
DEFAULT_PREFETCH = BrokerConfig().prefetch
AMQP_PORT = 5672


# ------------------------------------------------------------------ helpers


def trigger(
    repo: Store, handler: str, inputs: Sequence[dict[str, Any]], name: str = "batches"
) -> list[UUID]:
    """One one-task run per input, in one ``trigger_many`` call; task run ids in input order."""
    workflow = single(name, handler, retry=FAST_RETRY)
    return [repo.get_run(r.run_id).tasks[0].id for r in repo.trigger_many(workflow, inputs)]


def states(sql: Sql, tasks: Sequence[UUID]) -> dict[UUID, str]:
    found = sql.execute(
        "SELECT id, state FROM task_runs WHERE id = ANY(%s)", (list(tasks),)
    ).fetchall()
    return {r[0]: r[1] for r in found}


def wait_all(sql: Sql, tasks: Sequence[UUID], state: TaskState, timeout: float = 30.0) -> None:
    """Poll until every task is in ``state``; fail at once if one finished otherwise."""

    def probe() -> bool:
        now = states(sql, tasks)
        wrong = {t: s for t, s in now.items() if s in FINISHED_TASK_STATES and s != state}
        assert not wrong, f"tasks finished in another state than {state}: {wrong}"
        return len(now) == len(tasks) and all(s == state for s in now.values())

    wait_for(probe, timeout=timeout, interval=0.05, what=f"{len(tasks)} task(s) to be {state}")


def executions_per_task(sql: Sql) -> dict[UUID, int]:
    found = sql.execute("SELECT task_run_id, count(*) FROM test_executions GROUP BY 1")
    return {r[0]: int(r[1]) for r in found.fetchall()}


def outbox_rows(sql: Sql, task_id: UUID) -> list[tuple[int, int, bool]]:
    """(outbox id, token, published) of one task run, oldest first."""
    found = sql.execute(
        "SELECT id, fencing_token, published_at IS NOT NULL FROM outbox"
        " WHERE task_run_id = %s ORDER BY id",
        (task_id,),
    ).fetchall()
    return [(int(i), int(t), bool(p)) for i, t, p in found]


def claim_groups(sql: Sql, tasks: Sequence[UUID]) -> list[int]:
    """How many of ``tasks`` each claim statement took, in claim order: started_at is the
    claim's now(), which the tasks claimed together share."""
    found = sql.execute(
        "SELECT count(*) FROM task_runs WHERE id = ANY(%s) GROUP BY started_at ORDER BY started_at",
        (list(tasks),),
    )
    return [int(r[0]) for r in found.fetchall()]


def one_worker_on_a_full_queue(stack: Stack, sql: Sql, tasks: Sequence[UUID]) -> RoleProcess:
    """Start one worker once every dispatch of ``tasks`` waits on the queue (so its batches
    can fill up) and wait until all of them SUCCEEDED; the worker's process. The tests that
    use it are about batches, not slow handlers or lapsed leases: on a loaded machine a 50 ms
    handler threshold or a 3 s lease could hand a claim back or let it lapse (both
    legitimate, both tested elsewhere), so both get room here."""
    wait_for(
        lambda: queue_depth(stack) == len(tasks),
        timeout=20,
        interval=BROKER_POLL_S,
        what="every dispatch on the queue",
    )
    worker = stack.start("worker", worker={"fast_handler_ms": 2000, "lease_s": 30.0})
    wait_all(sql, tasks, TaskState.SUCCEEDED, timeout=60)
    return worker


# ------------------------------------------------------------------ batching


def test_a_worker_claims_in_growing_batches_and_runs_every_task_once(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    # more than the window's ramp to the prefetch (1 + 2 + … + prefetch) holds, so a batch
    # that outgrew the prefetch would show
    tasks = trigger(repo, "e2e.record", [{"n": n} for n in range(2 * DEFAULT_PREFETCH + 30)])
    worker = one_worker_on_a_full_queue(stack, sql, tasks)

    assert executions_per_task(sql) == dict.fromkeys(tasks, 1)
    assert {pid for t in tasks for _, pid in executions(sql, t)} == {worker.pid}
    attempts = {t: [(a.attempt, a.outcome) for a in repo.attempts(t)] for t in tasks}
    assert attempts == {t: [(1, "succeeded")] for t in tasks}
    assert all(len(outbox_rows(sql, t)) == 1 for t in tasks)  # nothing was handed back

    groups = claim_groups(sql, tasks)
    assert sum(groups) == len(tasks)
    assert groups[0] == 1, f"the first batch of a fresh worker is one task: {groups}"
    assert max(groups) >= 2, f"no two tasks were claimed in one statement: {groups}"
    assert max(groups) <= DEFAULT_PREFETCH, f"a batch outgrew the prefetch: {groups}"

    stop_cleanly(worker)
    assert stays_empty(stack), "a batch was not acked: its messages came back to the queue"
    assert stale_completions(repo) == 0


def test_a_worker_takes_large_inputs_in_small_batches_even_when_they_compress_well(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """A worker holds a whole batch's inputs decoded (docs/failure-model.md, mode 101): 600 KB
    inputs of repeated text, which TOAST stores in a few KB, count as 600 KB each against the
    batch's 2 MiB, so the window stops at 4 (0.3 of the budget a task; 4 are 1.2) where
    small inputs reach the prefetch (the test above)."""
    stack.start("scheduler")
    stack.start("publisher")
    blob = "ab" * 300_000
    tasks = trigger(repo, "e2e.record", [{"n": n, "blob": blob} for n in range(24)])
    stored = sql.execute(
        "SELECT max(pg_column_size(r.input)) FROM workflow_runs r JOIN task_runs t"
        " ON t.run_id = r.id WHERE t.id = ANY(%s)",
        (tasks,),
    ).fetchone()
    assert stored and stored[0] < len(blob) // 20  # what a stored size would have counted
    worker = one_worker_on_a_full_queue(stack, sql, tasks)
    assert executions_per_task(sql) == dict.fromkeys(tasks, 1)
    groups = claim_groups(sql, tasks)
    assert sum(groups) == len(tasks)
    assert groups[:3] == [1, 2, 4] and max(groups) == 4, groups
    stop_cleanly(worker)


# ------------------------------------------------------------------ slow handlers


def test_a_slow_handler_hands_back_the_tasks_batched_behind_it_to_another_worker(
    stack: Stack, repo: Store, sql: Sql, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    stack.start("scheduler")
    stack.start("publisher")
    # A generous fast_handler_ms keeps the warm-up's window at its cap even on a loaded
    # machine (one slow e2e.record would drop it to 1); the gated handler is slow regardless.
    first = stack.start("worker", broker={"prefetch": 8}, worker={"fast_handler_ms": 500})
    warm_up = trigger(repo, "e2e.record", [{"n": n} for n in range(40)], name="warm-up")
    wait_all(sql, warm_up, TaskState.SUCCEEDED, timeout=60)  # the window grew to 8

    first.signal(signal.SIGSTOP)
    try:
        tasks = trigger(
            repo,
            "e2e.gate_first",
            [{"gate": str(gate)}] + [{"n": n} for n in range(7)],
            name="gated",
        )
        gated, behind = tasks[0], tasks[1:]

        def all_with_the_frozen_worker() -> bool:
            rows = [outbox_rows(sql, t) for t in tasks]
            published = all(len(r) == 1 and r[0][2] for r in rows)
            return published and queue_depth(stack) == 0

        # all 8 published and none ready: they sit unacked in the frozen worker's socket
        wait_for(
            all_with_the_frozen_worker,
            timeout=20,
            interval=BROKER_POLL_S,
            what="the 8 dispatches to be pushed to the frozen worker",
        )
        first_outbox_id = outbox_rows(sql, gated)[0][0]
        assert all(outbox_rows(sql, t)[0][0] > first_outbox_id for t in behind), (
            "the gated task must be dispatched first"
        )

        first.signal(signal.SIGCONT)
        second = stack.start("worker")
        wait_all(sql, behind, TaskState.SUCCEEDED, timeout=30)
        assert not gate.exists()
        first.wait_for_log("handed back 7 claimed task(s)", timeout=5)

        for task_id in behind:
            assert executions(sql, task_id) == [(1, second.pid)]
            task = repo.get_task(task_id)
            assert task.attempt == 1
            [attempt] = repo.attempts(task_id)
            assert (attempt.attempt, attempt.outcome) == (1, "succeeded")
            assert worker_pid(attempt.worker) == second.pid
            tokens = [token for _, token, _ in outbox_rows(sql, task_id)]
            assert len(tokens) == 2 and tokens[0] < tokens[1], (
                f"task run {task_id} was not handed back once: outbox tokens {tokens}"
            )

        held = repo.get_task(gated)
        assert (held.state, held.attempt) == (TaskState.RUNNING, 1)
        assert worker_pid(held.lease_owner) == first.pid
        assert executions(sql, gated) == [(1, first.pid)]

        gate.touch()
        wait_all(sql, [gated], TaskState.SUCCEEDED, timeout=20)
        finished = repo.get_task(gated)
        assert (finished.attempt, finished.result) == (1, {"gated": True})
        assert [(a.attempt, a.outcome) for a in repo.attempts(gated)] == [(1, "succeeded")]
        assert executions(sql, gated) == [(1, first.pid)]
        assert len(outbox_rows(sql, gated)) == 1
        assert stale_completions(repo) == 0
    finally:
        first.signal(signal.SIGCONT)  # a stopped process cannot be stopped by the teardown
        gate.touch()


def test_a_slow_handler_alone_in_its_batch_finishes_and_the_worker_goes_on(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    stack.start("publisher")
    worker = stack.start("worker")  # a fresh worker: its first batch is one task
    [slow] = trigger(repo, "e2e.sleep", [{"seconds": 0.3}], name="slow")

    wait_all(sql, [slow], TaskState.SUCCEEDED, timeout=20)

    task = repo.get_task(slow)
    assert (task.attempt, task.result) == (1, {"slept": 0.3})
    assert [(a.attempt, a.outcome) for a in repo.attempts(slow)] == [(1, "succeeded")]
    assert executions(sql, slow) == [(1, worker.pid)]
    assert len(outbox_rows(sql, slow)) == 1, "the running task itself was handed back"

    # the slow handler stopped the consumer; the worker must start it again for more work
    [after] = trigger(repo, "e2e.record", [{}], name="after")
    wait_all(sql, [after], TaskState.SUCCEEDED, timeout=20)
    assert executions(sql, after) == [(1, worker.pid)]
    assert stale_completions(repo) == 0


# ------------------------------------------------------------------ duplicates


def test_a_duplicate_delivery_within_one_batch_runs_the_handler_once(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    stack.start("scheduler")
    publisher = stack.start("publisher")
    worker = stack.start("worker", worker={"fast_handler_ms": 500})
    warm_up = trigger(repo, "e2e.record", [{"n": n} for n in range(40)], name="warm-up")
    wait_all(sql, warm_up, TaskState.SUCCEEDED, timeout=60)  # the window grew past 2
    stop_cleanly(publisher)  # this test publishes by hand

    worker.signal(signal.SIGSTOP)
    try:
        [task_id] = trigger(repo, "e2e.record", [{}], name="twice")
        wait_for(lambda: outbox_rows(sql, task_id), what="the scheduler's outbox row")
        [(outbox_id, token, _)] = outbox_rows(sql, task_id)
        for _ in range(2):  # e.g. a publisher that re-published after a lost confirm
            publish_raw(stack, Dispatch(outbox_id, task_id, token))
        wait_for(
            lambda: queue_depth(stack) == 0,
            timeout=20,
            interval=BROKER_POLL_S,
            what="both copies to be pushed to the frozen worker",
        )
        worker.signal(signal.SIGCONT)
        wait_all(sql, [task_id], TaskState.SUCCEEDED, timeout=20)
        stop_cleanly(worker)  # whatever it was going to run has run

        assert executions(sql, task_id) == [(1, worker.pid)]
        assert stale_completions(repo) == 0
    finally:
        worker.signal(signal.SIGCONT)


# ------------------------------------------------------------------ continuations


def test_a_chain_continues_on_the_worker_that_released_each_step(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """The next step of a DAG is claimed by the worker whose finish made it READY, without a
    broker round trip; with two workers consuming, a hop through the queue would land on
    either of them.

    The finish claims the step in its own transaction, so no publisher sees it pending. A hop
    may still go through the broker when the worker owes the broker its turn (a second
    without taking deliveries: a loaded machine), so the test allows one hop in six to
    leave; hops through the broker alternate workers about half the time."""
    stack.start("scheduler")
    stack.start("publisher")
    workers = [stack.start("worker"), stack.start("worker")]
    length = 12
    steps = tuple(
        TaskDef(f"s{i}", "e2e.record", depends_on=(f"s{i - 1}",) if i else ())
        for i in range(length)
    )
    run_id = repo.trigger(WorkflowDef("continued", steps)).run_id
    wait_for(
        lambda: repo.get_run(run_id).state is RunState.SUCCEEDED,
        timeout=30,
        what="the chain to succeed",
    )
    rows = sql.execute(
        "SELECT e.pid, t.attempt FROM test_executions e JOIN task_runs t ON t.id = e.task_run_id"
        " WHERE e.run_id = %s ORDER BY t.seq",
        (run_id,),
    ).fetchall()
    assert len(rows) == length  # every step ran exactly once
    assert {attempt for _, attempt in rows} == {1}
    pids = [pid for pid, _ in rows]
    stayed = sum(1 for before, after in pairwise(pids) if before == after)
    assert stayed >= (length - 1) - (length - 1) // 6, pids
    assert set(pids) <= {w.pid for w in workers}
    assert stale_completions(repo) == 0


def test_a_finish_after_the_broker_connection_dropped_leaves_the_next_step_to_the_outbox(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """The broker connection drops while step a runs: the worker finds out when it next uses
    it — its look for a higher band's delivery after the task, or its ack — and reconnects
    after the batch. Its finish must not claim step b for itself (the reconnect
    would strand the claim until its lease lapsed and a reaper took it back): b goes out
    through the outbox and runs at once, on attempt 1. No scheduler runs, so nothing but
    the outbox could bring b back."""
    stack.start("publisher")
    worker = stack.start("worker")
    steps = (
        TaskDef("a", "e2e.cut_broker"),
        TaskDef("b", "e2e.record", depends_on=("a",)),
    )
    broker_port = urlsplit(stack.broker_url).port or AMQP_PORT
    run_id = repo.trigger(WorkflowDef("cut", steps), {"broker_port": broker_port}).run_id
    tasks = [t.id for t in repo.get_run(run_id).tasks]
    wait_all(sql, tasks, TaskState.SUCCEEDED)
    # where the loss shows first depends on when the broker's close reaches the socket
    found = ("ack after claim failed", "broker connection lost while a batch runs")
    wait_for(lambda: any(text in worker.log() for text in found), what="the loss logged")
    worker.wait_for_log("Worker recovered")
    log = worker.log()  # the role reports the loss once, as a warning; pika's narration is off
    assert " ERROR " not in log and "Traceback" not in log, log
    assert sql.execute(
        "SELECT t.name, t.attempt, count(e.*) FROM task_runs t"
        " LEFT JOIN test_executions e ON e.task_run_id = t.id WHERE t.run_id = %s"
        " GROUP BY t.name, t.attempt ORDER BY t.name",
        (run_id,),
    ).fetchall() == [("a", 1, 1), ("b", 1, 1)]
