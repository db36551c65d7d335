"""``async def`` handlers (SPEC 7.5, docs/handlers.md) against real PostgreSQL and RabbitMQ.

A worker runs in a thread of this process with the real consumer, claims, leases and finishes
(as tests/integration/test_priorities.py does); a publisher in this process sends the dispatches.
What is proven here: a worker's async calls overlap (up to ``worker.async_concurrency``) while
every task is claimed, executed and finished once; a run cancel raises
:class:`asyncio.CancelledError` in the handler and the task ends CANCELLED; a timeout fails the
attempt with ``timeout`` and keeps the worker; leases renew under an async call longer than a
lease while a reaper sweeps. The same under SIGKILL and cancel with real role processes:
test_async_handlers_processes.py (``slow``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.config import load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.states import TaskState
from flowforge.roles.context import TaskContext
from flowforge.roles.publisher import Publisher
from flowforge.roles.worker import Worker
from flowforge.store.db import Database
from flowforge.store.passes import Passes
from tests.e2e import Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
ONE_ATTEMPT = RetryPolicy(max_attempts=1, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
#: A bound on every wait of this module (seconds), never a wait itself.
DEADLINE_S = 30.0


@contextmanager
def serving(
    stack: Stack, handlers: Mapping[str, Callable[..., Any]], **worker: Any
) -> Iterator[Callable[[WorkflowDef, Sequence[dict[str, Any]]], list[UUID]]]:
    """A worker (in a thread) and a publisher on ``stack``'s queue; yields ``trigger(wf,
    inputs)``, which triggers one run per input, publishes them and returns their task ids."""
    config = load_config(stack.config_path(worker=worker), env={})
    db = Database(config.database, "flowforge-test")
    db.open()
    repo = Store(db)
    publisher = Publisher(config)
    publisher.initialize()
    node = Worker(config, handlers=dict(handlers))
    stop = threading.Event()

    def run() -> None:
        node.initialize()
        try:
            node.loop(stop, lambda: None)
        finally:
            node.shutdown()

    def trigger(workflow: WorkflowDef, inputs: Sequence[dict[str, Any]]) -> list[UUID]:
        runs = repo.trigger_many(workflow, list(inputs), queue=stack.queue)
        while publisher.sweep()[0]:
            pass
        return [repo.get_run(r.run_id).tasks[0].id for r in runs]

    thread = threading.Thread(target=run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield trigger
    finally:
        stop.set()
        thread.join(DEADLINE_S)
        publisher.shutdown()
        db.close()
        stack.delete_queue()
    assert not node.recycle, "no async handler here may get its worker replaced"


def states(sql: Sql, tasks: Sequence[UUID]) -> list[str]:
    found = dict(
        sql.execute("SELECT id, state FROM task_runs WHERE id = ANY(%s)", (list(tasks),)).fetchall()
    )
    return [str(found.get(t)) for t in tasks]


def attempts(sql: Sql, tasks: Sequence[UUID]) -> list[tuple[UUID, int, str, str | None]]:
    return [
        (r[0], int(r[1]), str(r[2]), r[3])
        for r in sql.execute(
            "SELECT task_run_id, attempt, outcome, failure_reason FROM task_attempts"
            " WHERE task_run_id = ANY(%s) ORDER BY task_run_id, attempt",
            (list(tasks),),
        ).fetchall()
    ]


def ended(sql: Sql, tasks: Sequence[UUID], state: TaskState) -> None:
    wait_for(
        lambda: states(sql, tasks) == [str(state)] * len(tasks),
        timeout=DEADLINE_S,
        what=f"{len(tasks)} task(s) {state}",
    )


def most_at_once(spans: Sequence[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_workers_async_calls_overlap_and_every_task_runs_once(stack: Stack, sql: Sql) -> None:
    spans: list[tuple[float, float]] = []
    calls: list[UUID] = []

    async def nap(ctx: TaskContext) -> dict[str, int]:
        calls.append(ctx.task_run_id)
        began = time.monotonic()
        await asyncio.sleep(0.3)
        spans.append((began, time.monotonic()))
        return {"n": ctx.input["n"]}

    workflow = WorkflowDef("async-nap", (TaskDef("only", "nap", retry=ONE_ATTEMPT),))
    with serving(stack, {"nap": nap}, async_concurrency=16) as trigger:
        tasks = trigger(workflow, [{"n": n} for n in range(48)])
        ended(sql, tasks, TaskState.SUCCEEDED)
    assert sorted(calls) == sorted(tasks)  # each called once
    assert [a[1:] for a in attempts(sql, tasks)] == [(1, "succeeded", None)] * len(tasks)
    # the window ramps 1, 2, 4, 8, 16: its batches of 16 run at once, never more
    assert most_at_once(spans) == 16
    row = sql.execute(
        "SELECT bool_and(t.result->>'n' = r.input->>'n') FROM task_runs t"
        " JOIN workflow_runs r ON r.id = t.run_id WHERE t.id = ANY(%s)",
        (tasks,),
    ).fetchone()
    assert row == (True,)


def test_a_run_cancel_raises_cancelled_error_in_the_running_async_handler(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    seen: list[str] = []
    started = threading.Event()

    async def waits(ctx: TaskContext) -> None:
        started.set()
        try:
            await asyncio.sleep(DEADLINE_S)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    workflow = WorkflowDef("async-cancel", (TaskDef("only", "waits", retry=ONE_ATTEMPT),))
    with serving(stack, {"waits": waits}) as trigger:
        [task] = trigger(workflow, [{}])
        assert started.wait(DEADLINE_S), "the handler never started"
        run_id = repo.get_task(task).run_id
        began = time.monotonic()
        repo.cancel_run(run_id)
        ended(sql, [task], TaskState.CANCELLED)
        took = time.monotonic() - began
    assert seen == ["cancelled"]
    assert attempts(sql, [task]) == [(task, 1, "cancelled", "cancelled")]
    # by NOTIFY once the call is slow (1 s), else the renewal (heartbeat 0.5 s): never the
    # call's own 30 s
    assert took < DEADLINE_S / 3


def test_an_async_timeout_fails_the_attempt_and_the_worker_goes_on(stack: Stack, sql: Sql) -> None:
    async def hangs(ctx: TaskContext) -> None:
        await asyncio.sleep(DEADLINE_S)

    async def quick(ctx: TaskContext) -> str:
        return "after"

    hanging = WorkflowDef(
        "async-timeout", (TaskDef("only", "hangs", retry=ONE_ATTEMPT, timeout=0.5),)
    )
    later = WorkflowDef("async-after", (TaskDef("only", "quick", retry=ONE_ATTEMPT),))
    with serving(stack, {"hangs": hangs, "quick": quick}) as trigger:
        [task] = trigger(hanging, [{}])
        ended(sql, [task], TaskState.FAILED)
        [next_task] = trigger(later, [{}])
        ended(sql, [next_task], TaskState.SUCCEEDED)
    assert attempts(sql, [task]) == [(task, 1, "failed", "timeout")]


def test_leases_renew_under_an_async_call_longer_than_a_lease(
    stack: Stack, db: Database, sql: Sql
) -> None:
    """lease_s 1 s, the call 2.5 s, a reaper sweeping every 50 ms: nothing is reaped."""
    reaped: list[int] = []
    sweeping = threading.Event()

    def reaper() -> None:
        passes = Passes(db, rand=lambda: 0.5)
        while not sweeping.wait(0.05):
            reaped.append(passes.reap_expired(100))

    async def long(ctx: TaskContext) -> str:
        await asyncio.sleep(2.5)
        return "done"

    workflow = WorkflowDef("async-lease", (TaskDef("only", "long", retry=ONE_ATTEMPT),))
    sweeper = threading.Thread(target=reaper, name="reaper", daemon=True)
    sweeper.start()
    try:
        with serving(stack, {"long": long}, lease_s=1.0, heartbeat_s=0.2) as trigger:
            tasks = trigger(workflow, [{}, {}, {}])
            ended(sql, tasks, TaskState.SUCCEEDED)
    finally:
        sweeping.set()
        sweeper.join(DEADLINE_S)
    assert len(reaped) > 20 and sum(reaped) == 0
    assert [a[1:] for a in attempts(sql, tasks)] == [(1, "succeeded", None)] * 3
