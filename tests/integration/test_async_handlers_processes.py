"""``async def`` handlers on real role processes (SPEC 7.5, issue 21), counted in the database.

Workers import only tests/e2e_async_handlers.py (async handlers only: each opens its window to
``async_concurrency`` at once). ``e2e.async_sleep`` records each execution in
``test_executions`` with its attempt and pid, and a second row when
:class:`asyncio.CancelledError` reached it.

- A worker SIGKILLed with a batch of async calls in flight: its tasks are reaped when their
  leases lapse and run again elsewhere; no attempt is executed twice, nothing runs on the dead
  worker after the kill, every run ends SUCCEEDED.
- A cancel of every run while one worker holds a batch of async calls and more wait queued:
  each running call sees CancelledError, the queued tasks never run, every run ends CANCELLED,
  and the same worker process goes on to run the next run.
- A worker whose async slots are all held takes no new work (a second worker runs it), its
  registration stays fresh while the calls run, and it consumes again once they end.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState
from tests.e2e import Stack
from tests.helpers import FAST_RETRY, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]
ASYNC_ONLY = {"handlers": ["tests.e2e_async_handlers"]}
SLEEP = WorkflowDef("async-sleep", (TaskDef("only", "e2e.async_sleep", retry=FAST_RETRY),))
CONCURRENCY = 8


def count(sql: Sql, query: str, *args: Any) -> int:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return int(row[0])


def run_states(repo: Store, runs: Sequence[UUID]) -> list[RunState]:
    return [repo.get_run(r).state for r in runs]


def cancel_all(repo: Store, runs: Sequence[UUID]) -> None:
    """Cancel ``runs`` in this order, and wait until every one is CANCELLED."""
    for run_id in runs:
        repo.cancel_run(run_id)
    wait_for(
        lambda: run_states(repo, runs) == [RunState.CANCELLED] * len(runs),
        timeout=30,
        interval=0.2,
        what="every run cancelled",
    )


def executions_per_attempt(sql: Sql) -> list[int]:
    return [
        int(r[0])
        for r in sql.execute(
            "SELECT count(*) FROM test_executions WHERE handler = 'e2e.async_sleep'"
            " GROUP BY task_run_id, attempt"
        ).fetchall()
    ]


def test_a_worker_killed_with_async_calls_in_flight_loses_and_repeats_no_attempt(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    settings = {**ASYNC_ONLY, "worker": {"async_concurrency": CONCURRENCY}}
    stack.start("scheduler", **settings)
    stack.start("publisher", **settings)
    victim = stack.start("worker", **settings)
    runs = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 1.5} for _ in range(40)])]
    query = "SELECT count(*) FROM test_executions WHERE pid = %s AND handler = 'e2e.async_sleep'"
    # a whole batch started on it (the window opens at CONCURRENCY at once), none finished
    wait_for(
        lambda: count(sql, query, victim.pid) >= CONCURRENCY,
        timeout=60,
        what="a batch of async calls running on the first worker",
    )
    survivor = stack.start("worker", **settings)
    victim.signal(signal.SIGKILL)
    victim.wait()
    killed_at = sql.execute("SELECT clock_timestamp()").fetchone()
    assert killed_at is not None

    wait_for(
        lambda: run_states(repo, runs) == [RunState.SUCCEEDED] * len(runs),
        timeout=120,
        interval=0.2,
        what="every run to succeed after the kill",
    )
    assert set(executions_per_attempt(sql)) == {1}  # at most once per lease (attempt)
    late = "SELECT count(*) FROM test_executions WHERE pid = %s AND at > %s"
    assert count(sql, late, victim.pid, killed_at[0]) == 0
    # the calls the kill cut short: attempt 1 lapsed, attempt 2 ran on the survivor
    repeated = sql.execute(
        "SELECT task_run_id, array_agg(pid ORDER BY attempt) FROM test_executions"
        " WHERE handler = 'e2e.async_sleep' GROUP BY 1 HAVING count(*) > 1"
    ).fetchall()
    assert repeated, "the kill cut no call short: it proved nothing"
    assert {tuple(pids) for _, pids in repeated} == {(victim.pid, survivor.pid)}
    lapsed = {
        r[0]
        for r in sql.execute(
            "SELECT task_run_id FROM task_attempts WHERE failure_reason = 'lease_expired'"
        ).fetchall()
    }
    # each call cut short lapsed (a claim cut before its call started may have lapsed too)
    assert {task for task, _ in repeated} <= lapsed
    assert count(sql, "SELECT count(*) FROM task_runs WHERE state = 'SUCCEEDED'") == len(runs)


def test_cancelling_runs_raises_cancelled_error_in_their_running_async_calls(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    settings = {**ASYNC_ONLY, "worker": {"async_concurrency": CONCURRENCY}}
    [_, _, worker] = stack.start_all(workers=1, **settings)
    runs = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 60} for _ in range(12)])]
    started = "SELECT count(*) FROM test_executions WHERE handler = 'e2e.async_sleep'"
    wait_for(
        lambda: count(sql, started) == CONCURRENCY,
        timeout=60,
        what="a batch of async calls running",
    )
    running = {r[0] for r in sql.execute("SELECT DISTINCT run_id FROM test_executions").fetchall()}
    # the queued runs first: cancelled later, one could start in a slot a cancel freed
    cancel_all(repo, sorted(runs, key=lambda r: r in running))
    seen = "SELECT count(*) FROM test_executions WHERE handler = 'e2e.async_sleep:cancelled'"
    assert count(sql, seen) == CONCURRENCY  # each running call saw CancelledError
    assert count(sql, started) == CONCURRENCY  # the queued ones never ran
    assert set(executions_per_attempt(sql)) == {1}
    outcomes = sql.execute(
        "SELECT outcome, count(*) FROM task_attempts GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert outcomes == [("cancelled", CONCURRENCY)]

    # the worker was not replaced: the same process runs the next run
    [after] = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 0.1}])]
    wait_for(
        lambda: repo.get_run(after).state is RunState.SUCCEEDED,
        timeout=30,
        what="the next run to succeed",
    )
    ran = "SELECT count(*) FROM test_executions WHERE run_id = %s AND pid = %s"
    assert count(sql, ran, after, worker.pid) == 1 and worker.alive()


def test_work_that_trickles_in_fills_the_slots_beside_a_long_call(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """One long call starts alone; runs triggered one at a time while it runs (each after the
    one before started) run beside it on the same worker, all at once, not after it."""
    settings = {**ASYNC_ONLY, "worker": {"async_concurrency": CONCURRENCY}}
    [_, _, worker] = stack.start_all(workers=1, **settings)
    started = "SELECT count(*) FROM test_executions WHERE handler = 'e2e.async_sleep'"
    # long enough to outlast the test on a loaded machine: the tree's teardown ends them
    [first] = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 120}])]
    runs = [first]
    wait_for(lambda: count(sql, started) == 1, timeout=60, what="the long call running")
    for n in range(2, CONCURRENCY + 1):  # each after the first's batch went slow and rolled
        runs += [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 120}])]
        wait_for(lambda n=n: count(sql, started) == n, timeout=30, what=f"call {n} running")
    assert repo.get_run(first).state is RunState.RUNNING  # they all ran beside it
    pids = "SELECT count(DISTINCT pid) FROM test_executions WHERE pid = %s"
    assert count(sql, pids, worker.pid) == 1
    assert count(sql, "SELECT count(*) FROM test_executions WHERE pid <> %s", worker.pid) == 0
    cancel_all(repo, runs)  # the calls end now, not at the drain's deadline


def test_a_worker_with_every_slot_busy_leaves_new_work_to_others_and_resumes_after(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    """With both of its async slots held by long calls, a worker takes no more work: runs
    triggered then run on a second worker, while the busy one's registration stays fresh (the
    lease keeper refreshes it; no call has ended); once its calls end it consumes again."""
    settings = {**ASYNC_ONLY, "worker": {"async_concurrency": 2, "heartbeat_s": 1, "lease_s": 5}}
    stack.start("scheduler", **settings)
    stack.start("publisher", **settings)
    busy = stack.start("worker", **settings)
    started = "SELECT count(*) FROM test_executions WHERE handler = 'e2e.async_sleep'"
    long_runs = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 120}] * 2)]
    wait_for(lambda: count(sql, started) == 2, timeout=60, what="both slots busy")

    def last_seen() -> Any:
        row = sql.execute(
            "SELECT max(last_seen_at) FROM processes WHERE pid = %s AND role = 'worker'",
            (busy.pid,),
        ).fetchone()
        assert row is not None and row[0] is not None, "the busy worker is not registered"
        return row[0]

    first_seen = last_seen()

    other = stack.start("worker", **settings)
    registered = "SELECT count(*) FROM processes WHERE pid = %s"
    wait_for(lambda: count(sql, registered, other.pid) == 1, timeout=60, what="a second worker")
    short = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 0.05}] * 4)]
    wait_for(
        lambda: run_states(repo, short) == [RunState.SUCCEEDED] * 4,
        timeout=60,
        what="the short runs to succeed beside the busy worker",
    )
    where = "SELECT count(*) FROM test_executions WHERE run_id = ANY(%s) AND pid = %s"
    assert count(sql, where, short, other.pid) == 4  # none waited in the busy worker
    # the busy worker's registration refreshed while its two calls ran (none has ended)
    wait_for(
        lambda: last_seen() > first_seen,
        timeout=30,
        interval=0.5,
        what="the busy worker's registration to refresh",
    )
    assert run_states(repo, long_runs) == [RunState.RUNNING] * 2

    other.stop()
    cancel_all(repo, long_runs)  # frees both slots
    after = [r.run_id for r in repo.trigger_many(SLEEP, [{"seconds": 0.05}] * 2)]
    wait_for(
        lambda: run_states(repo, after) == [RunState.SUCCEEDED] * 2,
        timeout=60,
        what="the worker to consume again once its slots are free",
    )
    assert count(sql, where, after, busy.pid) == 2 and busy.alive()
    assert set(executions_per_attempt(sql)) == {1}
