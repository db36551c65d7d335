"""Real races against real PostgreSQL: every role must be safe to run many times at once.

Racers are either threads (each with its own Database pool, so each is its own session) or
separate processes (spawned, each opening its own Database from the URL). They start behind a
barrier; where the raced statement updates one row, a "gate" transaction holds that row's lock
until every racer is provably waiting on it (pg_stat_activity), so all of them really contend.

Proven here, by counting rows in the database:

- of many claims of one READY generation exactly one executes, and the token moves once;
- of many reapers of one expired lease exactly one reclaims it;
- a stale token can neither renew nor finish, even racing the current holder;
- of many finishes with one token exactly one lands;
- concurrent scheduler passes never duplicate an outbox row, in any generation;
- concurrent triggers with one idempotency key create one run;
- a late finish racing the reaper: exactly one of them wins;
- cancelling racing a claim never leaves a task running unasked to stop;
- two executions of one task idempotency key never both run the handler;
- lease arithmetic uses the database clock: a worker whose Python clock is an hour off is
  neither reaped early nor late.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.store.db import Database
from tests.helpers import (
    FAST_RETRY,
    claim_task,
    dispatch,
    drain,
    expire_lease,
    outbox_token,
    single,
    task_ids,
    wait_for,
)
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
Call = tuple[str, tuple[Any, ...]]

N_THREADS = 16
N_PROCESSES = 4
RACE_TIMEOUT_S = 30.0

# ------------------------------------------------------------------ what racers can do
# Module-level functions so a spawned process can look them up by name; results are plain,
# picklable values.


def _claim(
    repo: Store, task_id: uuid.UUID, token: int, worker: str, key_wait_s: float = 0.0
) -> tuple[str, int | None, int | None]:
    result = repo.claim(task_id, token, worker, 30.0, key_wait_s=key_wait_s)
    claim = result.claim
    return str(result.outcome), claim and claim.fencing_token, claim and claim.attempt


def _timed_claim(
    repo: Store, task_id: uuid.UUID, token: int, worker: str, key_wait_s: float = 0.0
) -> tuple[str, int | None, int | None, float, float]:
    """A claim with its start and end on CLOCK_MONOTONIC, which all processes share."""
    started = time.monotonic()
    outcome = _claim(repo, task_id, token, worker, key_wait_s)
    return (*outcome, started, time.monotonic())


def _reap_repeatedly(repo: Store, times: int) -> int:
    return sum(repo.reap_expired(100) for _ in range(times))


def _promote_until_idle(repo: Store, limit: int, max_passes: int = 50) -> int:
    """Promotion passes until one finds nothing unlocked to promote; the total promoted."""
    total = 0
    for _ in range(max_passes):
        promoted = repo.promote_ready(limit)
        if not promoted:
            return total
        total += promoted
    raise AssertionError(f"promotion did not settle within {max_passes} passes")


def _renew(repo: Store, task_id: uuid.UUID, token: int) -> bool:
    return repo.renew_lease(task_id, token, 30.0).held


def _finish(repo: Store, task_id: uuid.UUID, token: int, state: str, payload: Any = None) -> bool:
    target = TaskState(state)
    if target is TaskState.FAILED:
        return repo.finish(
            task_id, token, target, reason=FailureReason.HANDLER_ERROR, error=str(payload)
        )
    return repo.finish(task_id, token, target, result=payload)


def _trigger(
    repo: Store, workflow: WorkflowDef, run_input: dict[str, Any], key: str
) -> tuple[str, bool]:
    result = repo.trigger(workflow, run_input, idempotency_key=key)
    return str(result.run_id), result.created


def _cancel(repo: Store, run_id: uuid.UUID) -> str:
    return str(repo.cancel_run(run_id).state)


OPS: dict[str, Callable[..., Any]] = {
    "noop": lambda repo: None,
    "claim": _claim,
    "timed_claim": _timed_claim,
    "reap": _reap_repeatedly,
    "promote": _promote_until_idle,
    "renew": _renew,
    "finish": _finish,
    "trigger": _trigger,
    "cancel": _cancel,
}


def _open_repo(url: str, name: str) -> tuple[Database, Store]:
    db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1), application_name=name)
    db.open()
    db.run(lambda cur: cur.execute("SELECT 1"))  # connected before any race starts
    return db, Store(db, rand=lambda: 0.5)


def _racer_main(url: str, index: int, barrier: Any, inbox: Any, results: Any) -> None:
    """A racer process: its own Database; runs each command as soon as all racers are ready."""
    db, repo = _open_repo(url, f"flowforge-test-racer-{index}")
    results.put((0, index, "ready", os.getpid()))
    try:
        while (message := inbox.get()) is not None:
            seq, op, args = message
            try:
                barrier.wait(timeout=RACE_TIMEOUT_S)
                results.put((seq, index, "ok", OPS[op](repo, *args)))
            except Exception as exc:  # reported to the test, which fails with it
                results.put((seq, index, "error", repr(exc)))
    finally:
        db.close()


class ProcessRacers:
    """N spawned processes that run one call each per race, released together."""

    kind = "processes"

    def __init__(self, url: str, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.n = n
        self._seq = 0
        self._barrier = ctx.Barrier(n)
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(n)]
        self._procs = [
            ctx.Process(
                target=_racer_main,
                args=(url, i, self._barrier, self._inboxes[i], self._results),
                daemon=True,
            )
            for i in range(n)
        ]
        for proc in self._procs:
            proc.start()
        ready = [self._results.get(timeout=RACE_TIMEOUT_S) for _ in range(n)]
        assert sorted(r[1] for r in ready) == list(range(n)), ready

    def submit(self, calls: list[Call]) -> Callable[[], list[Any]]:
        assert len(calls) <= self.n, f"{len(calls)} calls for {self.n} racers"
        self._seq += 1
        seq = self._seq
        padded = calls + [("noop", ())] * (self.n - len(calls))
        for inbox, (op, args) in zip(self._inboxes, padded, strict=True):
            inbox.put((seq, op, args))

        def collect() -> list[Any]:
            got: dict[int, tuple[str, Any]] = {}
            deadline = time.monotonic() + RACE_TIMEOUT_S
            while len(got) < self.n:
                r_seq, index, status, value = self._results.get(
                    timeout=max(0.1, deadline - time.monotonic())
                )
                if r_seq == seq:  # results of an earlier, failed race are dropped
                    got[index] = (status, value)
            errors = [v for s, v in got.values() if s == "error"]
            assert not errors, errors
            return [got[i][1] for i in range(len(calls))]

        return collect

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


class ThreadRacers:
    """N threads, each with its own Database (its own session), released together."""

    kind = "threads"

    def __init__(self, url: str, n: int) -> None:
        self.n = n
        opened = [_open_repo(url, f"flowforge-test-thread-{i}") for i in range(n)]
        self._dbs = [db for db, _ in opened]
        self._repos = [repo for _, repo in opened]

    def submit(self, calls: list[Call]) -> Callable[[], list[Any]]:
        assert len(calls) <= self.n, f"{len(calls)} calls for {self.n} racers"
        barrier = threading.Barrier(len(calls))
        results: list[Any] = [None] * len(calls)
        errors: list[BaseException] = []

        def run(i: int, op: str, args: tuple[Any, ...]) -> None:
            try:
                barrier.wait(timeout=RACE_TIMEOUT_S)
                results[i] = OPS[op](self._repos[i], *args)
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(i, op, args), daemon=True)
            for i, (op, args) in enumerate(calls)
        ]
        for thread in threads:
            thread.start()

        def collect() -> list[Any]:
            deadline = time.monotonic() + RACE_TIMEOUT_S
            for thread in threads:
                thread.join(timeout=max(0.1, deadline - time.monotonic()))
            assert not any(t.is_alive() for t in threads), "a racer thread hung"
            if errors:
                raise errors[0]
            return results

        return collect

    def close(self) -> None:
        for db in self._dbs:
            db.close()


Racers = ProcessRacers | ThreadRacers


@pytest.fixture(scope="module")
def thread_racers(database_url: str) -> Iterator[ThreadRacers]:
    racers = ThreadRacers(database_url, N_THREADS)
    yield racers
    racers.close()


@pytest.fixture(scope="module")
def process_racers(database_url: str) -> Iterator[ProcessRacers]:
    racers = ProcessRacers(database_url, N_PROCESSES)
    yield racers
    racers.close()


# PostgreSQL sees one session per racer either way; the processes (spawned interpreters, seconds
# to start) are in the full suite, the threads in the fast loop too.
@pytest.fixture(params=["threads", pytest.param("processes", marks=pytest.mark.slow)])
def racers(request: pytest.FixtureRequest, clean_database_url: str) -> Racers:
    fixture = "thread_racers" if request.param == "threads" else "process_racers"
    return request.getfixturevalue(fixture)  # type: ignore[no-any-return]


def race(racers: Racers, calls: list[Call]) -> list[Any]:
    """Run ``calls`` at once, one per racer; their results in call order."""
    return racers.submit(calls)()


def waiting_on_locks(sql: Sql) -> int:
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def gated_race(
    url: str, sql: Sql, racers: Racers, task_id: uuid.UUID, calls: list[Call]
) -> list[Any]:
    """Race ``calls`` that all update the task row, releasing them only once all are queued.

    A separate transaction locks the row; the racers start and block on it; when
    pg_stat_activity shows every one of them waiting, the lock is released and they contend.
    """
    with psycopg.connect(url) as gate:
        gate.execute("SELECT 1 FROM task_runs WHERE id = %s FOR UPDATE", (task_id,))
        collect = racers.submit(calls)
        try:
            wait_for(
                lambda: waiting_on_locks(sql) >= len(calls),
                timeout=RACE_TIMEOUT_S,
                what=f"{len(calls)} racers to queue on the row lock",
            )
        finally:
            gate.rollback()
        return collect()


def scalar(sql: Sql, query: str, params: tuple[Any, ...] = ()) -> Any:
    row = sql.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def ready_task(repo: Store, sql: Sql) -> uuid.UUID:
    """A fresh single-task run whose task is READY (its outbox row published)."""
    run_id = repo.trigger(single(retry=FAST_RETRY)).run_id
    drain(repo)
    dispatch(sql)
    return task_ids(repo, run_id)["only"]


def reaped_and_reclaimed(repo: Store, sql: Sql) -> tuple[uuid.UUID, int, int]:
    """A task whose first claim was reaped and that a second worker now holds.

    Returns (task id, the stale token, the current token).
    """
    task_id = ready_task(repo, sql)
    stale = claim_task(repo, sql, task_id, worker="worker-a")
    expire_lease(sql, task_id)
    assert repo.reap_expired(10) == 1
    drain(repo)
    current = claim_task(repo, sql, task_id, worker="worker-b")
    assert current.fencing_token == stale.fencing_token + 2  # reap + claim
    return task_id, stale.fencing_token, current.fencing_token


# ------------------------------------------------------------------ claims


def test_exactly_one_of_many_claims_wins(
    racers: Racers, repo: Store, sql: Sql, clean_database_url: str
) -> None:
    task_id = ready_task(repo, sql)
    token = outbox_token(sql, task_id)
    calls: list[Call] = [("claim", (task_id, token, f"worker-{i}")) for i in range(racers.n)]
    results = gated_race(clean_database_url, sql, racers, task_id, calls)

    outcomes = Counter(outcome for outcome, _, _ in results)
    assert outcomes == {"execute": 1, "lost": racers.n - 1}
    winner = next(i for i, r in enumerate(results) if r[0] == "execute")
    assert results[winner][1:] == (token + 1, 1)
    task = repo.get_task(task_id)
    assert (task.state, task.fencing_token, task.attempt) == (TaskState.RUNNING, token + 1, 1)
    assert task.lease_owner == f"worker-{winner}"
    assert [(a.attempt, a.worker) for a in repo.attempts(task_id)] == [(1, f"worker-{winner}")]


def test_exactly_one_reaper_reclaims_an_expired_lease(
    racers: Racers, repo: Store, sql: Sql
) -> None:
    task_id = ready_task(repo, sql)
    claim = claim_task(repo, sql, task_id, worker="presumed-dead")
    expire_lease(sql, task_id)
    # SKIP LOCKED reapers do not queue on a lock, so they race by repetition instead.
    reclaimed = race(racers, [("reap", (10,))] * racers.n)

    assert sum(reclaimed) == 1
    task = repo.get_task(task_id)
    assert task.state is TaskState.RETRYING and task.failure_reason is FailureReason.LEASE_EXPIRED
    assert task.fencing_token == claim.fencing_token + 1
    assert task.lease_owner is None and task.lease_expires_at is None
    [attempt] = repo.attempts(task_id)
    assert (attempt.outcome, attempt.failure_reason, attempt.worker) == (
        "lease_expired",
        FailureReason.LEASE_EXPIRED,
        "presumed-dead",
    )
    assert attempt.finished_at is not None


# ------------------------------------------------------------------ fencing tokens


def test_a_stale_token_cannot_renew_or_finish(repo: Store, sql: Sql) -> None:
    task_id = ready_task(repo, sql)
    stale = claim_task(repo, sql, task_id, worker="worker-a")
    expire_lease(sql, task_id)
    assert repo.reap_expired(10) == 1
    # Reaped, not yet re-claimed: the old holder is already fenced off.
    assert repo.renew_lease(task_id, stale.fencing_token, 30).held is False
    assert not repo.finish(task_id, stale.fencing_token, TaskState.SUCCEEDED, result="late")
    assert repo.get_task(task_id).state is TaskState.RETRYING
    drain(repo)
    current = claim_task(repo, sql, task_id, worker="worker-b")
    # Re-claimed by someone else: still fenced off, and the holder is untouched.
    assert repo.renew_lease(task_id, stale.fencing_token, 30).held is False
    assert not repo.finish(task_id, stale.fencing_token, TaskState.SUCCEEDED, result="late")
    assert not repo.finish(
        task_id, stale.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
    )
    task = repo.get_task(task_id)
    assert (task.state, task.lease_owner, task.result) == (TaskState.RUNNING, "worker-b", None)
    assert repo.renew_lease(task_id, current.fencing_token, 30).held
    assert repo.finish(task_id, current.fencing_token, TaskState.SUCCEEDED, result="fresh")
    assert repo.get_task(task_id).result == "fresh"
    assert [a.outcome for a in repo.attempts(task_id)] == ["lease_expired", "succeeded"]


def test_a_stale_token_loses_even_under_concurrency(racers: Racers, repo: Store, sql: Sql) -> None:
    task_id, stale, current = reaped_and_reclaimed(repo, sql)
    stale_calls: list[Call] = [
        ("renew", (task_id, stale))
        if i % 3 == 0
        else ("finish", (task_id, stale, "SUCCEEDED", {"by": "stale"}))
        if i % 3 == 1
        else ("finish", (task_id, stale, "FAILED", "stale failure"))
        for i in range(racers.n - 1)
    ]
    middle = len(stale_calls) // 2
    calls = [
        *stale_calls[:middle],
        ("finish", (task_id, current, "SUCCEEDED", {"by": "worker-b"})),
        *stale_calls[middle:],
    ]
    # No gate here: a stale write does not even wait for the row lock, its token no longer
    # matches the row version it reads.
    results = race(racers, calls)

    assert results[middle] is True
    assert not any(results[:middle] + results[middle + 1 :])
    task = repo.get_task(task_id)
    assert (task.state, task.result) == (TaskState.SUCCEEDED, {"by": "worker-b"})
    assert task.fencing_token == current
    assert [(a.outcome, a.worker) for a in repo.attempts(task_id)] == [
        ("lease_expired", "worker-a"),
        ("succeeded", "worker-b"),
    ]


def test_only_one_writer_can_finish_with_the_same_token(
    racers: Racers, repo: Store, sql: Sql, clean_database_url: str
) -> None:
    task_id = ready_task(repo, sql)
    claim = claim_task(repo, sql, task_id)
    calls: list[Call] = [
        ("finish", (task_id, claim.fencing_token, "SUCCEEDED" if i % 2 else "FAILED", i))
        for i in range(racers.n)
    ]
    results = gated_race(clean_database_url, sql, racers, task_id, calls)

    assert results.count(True) == 1
    winner = results.index(True)
    task = repo.get_task(task_id)
    [attempt] = repo.attempts(task_id)
    if winner % 2:
        assert (task.state, task.result, attempt.outcome) == (
            TaskState.SUCCEEDED,
            winner,
            "succeeded",
        )
    else:
        assert (task.state, task.last_error, attempt.outcome) == (
            TaskState.FAILED,
            str(winner),
            "failed",
        )
        assert attempt.error == str(winner)


# ------------------------------------------------------------------ the outbox


def test_repeated_advance_passes_never_duplicate_an_outbox_row(
    racers: Racers, repo: Store, sql: Sql
) -> None:
    runs = 30
    # each task waits on a stream of its own, so the scheduler's promote pass makes it READY
    streamed = single(retry=FAST_RETRY, ordering_key="stream-{n}")
    for n in range(runs):
        repo.trigger(streamed, {"n": n})
    promoted = race(racers, [("promote", (7,))] * racers.n)

    assert sum(promoted) == runs
    assert scalar(sql, "SELECT count(*) FROM outbox") == runs
    assert scalar(sql, "SELECT count(DISTINCT (task_run_id, fencing_token)) FROM outbox") == runs
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE state = 'READY'") == runs
    assert sum(race(racers, [("promote", (100,))] * racers.n)) == 0
    assert scalar(sql, "SELECT count(*) FROM outbox") == runs

    # A new generation (reaped, due for retry at once) gets exactly one new row.
    task_id = dispatch(sql)[0][0]
    claim = claim_task(repo, sql, task_id)
    expire_lease(sql, task_id)
    assert repo.reap_expired(10) == 1
    assert sum(race(racers, [("promote", (100,))] * racers.n)) == 1
    rows = sql.execute(
        "SELECT fencing_token FROM outbox WHERE task_run_id = %s ORDER BY id", (task_id,)
    ).fetchall()
    assert [r[0] for r in rows] == [claim.fencing_token - 1, claim.fencing_token + 1]
    assert scalar(sql, "SELECT count(*) FROM outbox") == runs + 1


# ------------------------------------------------------------------ triggers, reaper, cancel


def test_concurrent_triggers_with_one_key_create_one_run(
    racers: Racers, repo: Store, sql: Sql
) -> None:
    calls: list[Call] = [("trigger", (single(), {"order": 1}, "order-1"))] * racers.n
    results = race(racers, calls)

    assert len({run_id for run_id, _ in results}) == 1
    assert [created for _, created in results].count(True) == 1
    assert scalar(sql, "SELECT count(*) FROM workflow_runs") == 1
    assert scalar(sql, "SELECT count(*) FROM task_runs") == 1


def test_a_late_finish_racing_the_reaper_has_exactly_one_winner(
    thread_racers: ThreadRacers, repo: Store, sql: Sql
) -> None:
    for _ in range(8):
        task_id = ready_task(repo, sql)
        claim = claim_task(repo, sql, task_id)
        expire_lease(sql, task_id)
        finished, *reaped = race(
            thread_racers,
            [
                ("finish", (task_id, claim.fencing_token, "SUCCEEDED", "late")),
                *[("reap", (3,))] * 3,
            ],
        )
        task = repo.get_task(task_id)
        assert finished + sum(reaped) == 1
        expected = TaskState.SUCCEEDED if finished else TaskState.RETRYING
        assert task.state is expected
        assert [a.outcome for a in repo.attempts(task_id)] == [
            "succeeded" if finished else "lease_expired"
        ]


def test_a_cancel_racing_a_claim_never_leaves_a_task_running_unasked(
    thread_racers: ThreadRacers, repo: Store, sql: Sql
) -> None:
    for _ in range(8):
        task_id = ready_task(repo, sql)
        run_id = repo.get_task(task_id).run_id
        token = outbox_token(sql, task_id)
        (outcome, _, _), _ = race(
            thread_racers, [("claim", (task_id, token, "worker")), ("cancel", (run_id,))]
        )
        task = repo.get_task(task_id)
        if outcome == "execute":
            assert task.state is TaskState.RUNNING and task.cancel_requested
        else:
            assert outcome == "lost" and task.state is TaskState.CANCELLED


# ------------------------------------------------------------------ idempotency keys


def charge_workflow() -> WorkflowDef:
    return single("charge", idempotency_key="charge-{order_id}", retry=FAST_RETRY)


def test_two_concurrent_executions_of_one_idempotency_key_never_both_run(
    process_racers: ProcessRacers, repo: Store, sql: Sql
) -> None:
    rounds = 12
    overlapping = 0
    for n in range(rounds):
        order = f"order-{n}"
        pair = [
            task_ids(repo, repo.trigger(charge_workflow(), {"order_id": order, "copy": c}).run_id)[
                "only"
            ]
            for c in (1, 2)
        ]
        drain(repo)
        tokens = [outbox_token(sql, t) for t in pair]
        results = race(
            process_racers,
            [
                ("timed_claim", (t, tok, f"proc-{i}", 0.0))
                for i, (t, tok) in enumerate(zip(pair, tokens, strict=True))
            ],
        )
        assert sorted(r[0] for r in results) == ["deferred", "execute"], results
        (_, _, _, start_a, end_a), (_, _, _, start_b, end_b) = results
        overlapping += start_a < end_b and start_b < end_a
        winner = [r[0] for r in results].index("execute")
        holder, other = pair[winner], pair[1 - winner]

        # At most one execution holds the key; the other used no attempt.
        running = "SELECT count(*) FROM task_runs WHERE id = ANY(%s) AND state = 'RUNNING'"
        assert scalar(sql, running, (pair,)) == 1
        key = sql.execute(
            "SELECT state, task_run_id, fencing_token FROM idempotency_keys WHERE key = %s",
            (f"charge-{order}",),
        ).fetchall()
        assert key == [("RUNNING", holder, results[winner][1])]
        deferred = repo.get_task(other)
        assert (deferred.state, deferred.attempt) == (TaskState.RETRYING, 0)
        assert repo.attempts(other) == []

        holder_token = results[winner][1]
        if n % 2 == 0:  # the holder succeeds: the other reuses its result
            assert repo.finish(holder, holder_token, TaskState.SUCCEEDED, result={"paid": order})
            drain(repo)
            reused = repo.claim(other, outbox_token(sql, other), "late", 30)
            assert reused.outcome == "reused"
            task = repo.get_task(other)
            assert (task.state, task.result) == (TaskState.SUCCEEDED, {"paid": order})
            assert [a.outcome for a in repo.attempts(other)] == ["reused"]
        else:  # the holder fails: the key is released and the other may execute
            assert repo.finish(
                holder, holder_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR
            )
            released = "SELECT count(*) FROM idempotency_keys WHERE key = %s"
            assert scalar(sql, released, (f"charge-{order}",)) == 0
            drain(repo)
            claim_task(repo, sql, other, worker="late")
            assert repo.get_task(holder).state is TaskState.READY
            retried = repo.claim(holder, outbox_token(sql, holder), "again", 30, key_wait_s=60)
            assert retried.outcome == "deferred"  # now the other one holds the key
        executed = scalar(
            sql,
            "SELECT count(*) FROM task_attempts WHERE task_run_id = ANY(%s)"
            " AND outcome IN ('running', 'succeeded', 'failed')",
            (pair,),
        )
        assert executed == (1 if n % 2 == 0 else 2)
    assert overlapping >= 3, f"the claims overlapped in only {overlapping} of {rounds} rounds"


# ------------------------------------------------------------------ the database clock

SKEWED_CLAIM = r"""
import datetime as _dt
import json
import sys
import time

skew = float(sys.argv[1])
_real_time = time.time
time.time = lambda: _real_time() + skew
time.time_ns = lambda: int((_real_time() + skew) * 1e9)


class _SkewedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls.fromtimestamp(time.time(), tz)

    @classmethod
    def utcnow(cls):
        return cls.fromtimestamp(time.time(), _dt.timezone.utc).replace(tzinfo=None)


_dt.datetime = _SkewedDatetime

from uuid import UUID  # noqa: E402  (after the clock is skewed, on purpose)

from flowforge.config import DatabaseConfig  # noqa: E402
from flowforge.store.claims import Claims  # noqa: E402
from flowforge.store.db import Database  # noqa: E402

url, task_id, token, lease_s = sys.argv[2:6]
db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1))
db.open()
try:
    wanted = [(UUID(task_id), int(token))]
    [result] = Claims(db).claim_many(wanted, f"skewed{skew:+.0f}", float(lease_s))
    print(json.dumps({
        "outcome": str(result.outcome),
        "python_now": time.time(),
        "datetime_now": _dt.datetime.now(_dt.timezone.utc).timestamp(),
    }))
finally:
    db.close()
"""


def test_clock_skew_does_not_reap_early_or_late(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    lease_s = 4.0  # room for at least a few reaper passes before expiry on a loaded machine
    skews = {3600.0: ready_task(repo, sql), -3600.0: ready_task(repo, sql)}
    workers = {
        skew: subprocess.Popen(
            [
                sys.executable,
                "-c",
                SKEWED_CLAIM,
                str(skew),
                clean_database_url,
                str(task_id),
                str(outbox_token(sql, task_id)),
                str(lease_s),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for skew, task_id in skews.items()
    }
    for skew, proc in workers.items():
        out, _ = proc.communicate(timeout=RACE_TIMEOUT_S)
        assert proc.returncode == 0
        report = json.loads(out)
        assert report["outcome"] == "execute"
        db_time = scalar(sql, "SELECT extract(epoch FROM now())")
        for clock in ("python_now", "datetime_now"):  # the worker's clock really is skewed
            assert abs(report[clock] - float(db_time) - skew) < 60

    leases = {}
    for task_id in skews.values():
        expires, started = sql.execute(
            "SELECT lease_expires_at, started_at FROM task_runs WHERE id = %s", (task_id,)
        ).fetchone()
        assert expires - started == timedelta(seconds=lease_s)  # both from the claim's now()
        leases[task_id] = expires

    # Poll the reaper; judge every pass by the database clock after it.
    reaped_at = {}
    checks_before_expiry = 0
    deadline = time.monotonic() + lease_s + 10
    while len(reaped_at) < len(skews) and time.monotonic() < deadline:
        repo.reap_expired(100)
        now = scalar(sql, "SELECT now()")
        for task_id, expires in leases.items():
            state, updated = sql.execute(
                "SELECT state, updated_at FROM task_runs WHERE id = %s", (task_id,)
            ).fetchone()
            if now < expires:
                assert state == "RUNNING", "reaped before the database clock passed its lease"
                checks_before_expiry += 1
            elif state != "RUNNING" and task_id not in reaped_at:
                reaped_at[task_id] = updated
        time.sleep(0.05)
    assert set(reaped_at) == set(leases), "a lease was not reaped after it expired"
    assert checks_before_expiry >= 5
    for task_id, when in reaped_at.items():
        assert timedelta(0) < when - leases[task_id] < timedelta(seconds=1.5)
