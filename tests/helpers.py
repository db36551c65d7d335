"""Small helpers shared by tests: polling with a deadline, ready-made workflows."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.store.db import Database

T = TypeVar("T")

FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)


def wait_for(
    probe: Callable[[], T | None],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def single(name: str = "single", handler: str = "tests.noop", **task: object) -> WorkflowDef:
    """A one-task workflow."""
    return WorkflowDef(name, (TaskDef("only", handler, **task),))  # type: ignore[arg-type]


def chain(name: str = "chain", length: int = 3, retry: RetryPolicy = FAST_RETRY) -> WorkflowDef:
    """t0 → t1 → … → t(n-1)."""
    tasks = [
        TaskDef(f"t{i}", "tests.noop", depends_on=(f"t{i - 1}",) if i else (), retry=retry)
        for i in range(length)
    ]
    return WorkflowDef(name, tuple(tasks))


def diamond(
    name: str = "diamond", retry: RetryPolicy = FAST_RETRY, fail_fast: bool = True
) -> WorkflowDef:
    """a → (b, c) → d."""
    return WorkflowDef(
        name,
        (
            TaskDef("a", "tests.noop", retry=retry),
            TaskDef("b", "tests.noop", depends_on=("a",), retry=retry),
            TaskDef("c", "tests.noop", depends_on=("a",), retry=retry),
            TaskDef("d", "tests.noop", depends_on=("b", "c"), retry=retry),
        ),
        fail_fast=fail_fast,
    )


# ------------------------------------------------------------------ scheduler and dispatch
# Imports for this block live here so it could be appended without touching the lines above.
from uuid import UUID  # noqa: E402

import psycopg  # noqa: E402

from flowforge.domain.model import Claim, ClaimOutcome  # noqa: E402
from flowforge.domain.reasons import FailureReason  # noqa: E402
from flowforge.domain.states import TaskState  # noqa: E402
from tests.store import Store  # noqa: E402

SCHEDULER_LIMIT = 100
#: events.retention in the passes tests run (seconds): the default, 7 days.
EVENT_RETENTION_S = 7 * 86_400.0


def scheduler_pass(repo: Store, limit: int = SCHEDULER_LIMIT) -> int:
    """One scheduler pass in the scheduler's order; returns how many rows it changed."""
    return (
        repo.reap_expired(limit)
        + repo.route_failed(limit)
        + repo.propagate(limit)
        + repo.expire_deadlines(limit)
        + repo.start_due_runs(limit)
        + repo.wake_timers(limit)
        + repo.start_timers(limit)
        + repo.expand_maps(limit)
        + repo.settle_maps(limit)
        + repo.open_item_slots(limit)
        + repo.expire_event_waits(limit)
        + repo.start_event_waits(limit, EVENT_RETENTION_S)
        + repo.settle_children(limit)
        + repo.start_children(limit)
        + repo.evaluate_conditions(limit)
        + repo.pass_gates(limit).unparked
        + repo.promote_ready(limit)
        + repo.admit_gated(limit)
    )


def drain(repo: Store, max_passes: int = 50) -> int:
    """Run scheduler passes until one changes nothing; fail if it never settles."""
    total = 0
    for _ in range(max_passes):
        changed = scheduler_pass(repo)
        if not changed:
            return total
        total += changed
    raise AssertionError(f"the scheduler did not settle within {max_passes} passes")


def dispatch(sql: psycopg.Connection[tuple[object, ...]]) -> list[tuple[UUID, int]]:
    """Pending outbox rows as (task_run_id, fencing_token), oldest first, stamped published."""
    rows = sql.execute(
        "WITH sent AS (UPDATE outbox SET published_at = now() WHERE published_at IS NULL"
        " RETURNING id, task_run_id, fencing_token)"
        " SELECT task_run_id, fencing_token FROM sent ORDER BY id"
    ).fetchall()
    return [(UUID(str(r[0])), int(str(r[1]))) for r in rows]


def outbox_token(sql: psycopg.Connection[tuple[object, ...]], task_run_id: UUID) -> int:
    """The token carried by the newest outbox row of one task run (what its message names)."""
    row = sql.execute(
        "SELECT fencing_token FROM outbox WHERE task_run_id = %s ORDER BY id DESC LIMIT 1",
        (task_run_id,),
    ).fetchone()
    assert row is not None, f"task run {task_run_id} has no outbox row"
    return int(str(row[0]))


def task_ids(repo: Store, run_id: UUID) -> dict[str, UUID]:
    """Task run ids of one run, by task name."""
    return {t.name: t.id for t in repo.get_run(run_id).tasks}


def claim_task(
    repo: Store,
    sql: psycopg.Connection[tuple[object, ...]],
    task_run_id: UUID,
    worker: str = "worker-1",
    lease_s: float = 30.0,
) -> Claim:
    """Claim a READY task with the token of its newest outbox row; it must be EXECUTE."""
    result = repo.claim(task_run_id, outbox_token(sql, task_run_id), worker, lease_s)
    assert result.outcome is ClaimOutcome.EXECUTE, result
    assert result.claim is not None
    return result.claim


def bury(
    repo: Store,
    sql: psycopg.Connection[tuple[object, ...]],
    task_run_id: UUID,
    error: str = "boom",
    traceback: str | None = None,
) -> None:
    """Claim a READY task and fail it with a permanent error; after the scheduler's passes it
    must be DEAD."""
    claim = claim_task(repo, sql, task_run_id)
    assert repo.finish(
        task_run_id,
        claim.fencing_token,
        TaskState.FAILED,
        reason=FailureReason.PERMANENT_ERROR,
        error=error,
        traceback=traceback,
    )
    drain(repo)
    assert repo.get_task(task_run_id).state is TaskState.DEAD


def expire_lease(sql: psycopg.Connection[tuple[object, ...]], task_run_id: UUID) -> None:
    """Move a RUNNING task's lease one second into the database's past."""
    changed = sql.execute(
        "UPDATE task_runs SET lease_expires_at = now() - interval '1 second'"
        " WHERE id = %s AND state = 'RUNNING'",
        (task_run_id,),
    ).rowcount
    assert changed == 1, f"task run {task_run_id} is not RUNNING"


def modules_after_importing(*modules: str) -> set[str]:
    """``sys.modules`` of a fresh interpreter that imported ``modules`` (memory levers)."""
    code = f"import sys, json, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


# ------------------------------------------------------------------ racing schedulers
# Imports for this block live here so it could be appended without touching the lines above.
import threading  # noqa: E402

#: How long :func:`race` waits for its racers, together (seconds).
RACE_TIMEOUT_S = 60.0


def race(database_url: str, *racers: Callable[[Store], T]) -> list[T]:
    """Each of ``racers`` on a thread of its own with its own connection pool (two
    connections) and :class:`Store`, all released at once by a barrier: schedulers or senders
    of separate processes, racing on real PostgreSQL. Their results in the order given; the
    first exception of any is raised here; a racer not done within ``RACE_TIMEOUT_S`` fails."""
    results: dict[int, T] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(racers))

    def run(index: int, racer: Callable[[Store], T]) -> None:
        database = Database(DatabaseConfig(url=database_url, pool_min=1, pool_max=2))
        database.open()
        try:
            store = Store(database)
            barrier.wait(timeout=RACE_TIMEOUT_S)
            results[index] = racer(store)
        except BaseException as exc:  # reported by the test's thread, below
            errors.append(exc)
            barrier.abort()  # the others stop waiting
        finally:
            database.close()

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(racers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RACE_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    running = sum(thread.is_alive() for thread in threads)
    assert not running, f"{running} racer(s) still running after {RACE_TIMEOUT_S}s"
    return [results[i] for i in range(len(racers))]


def until_idle(step: Callable[[Store], int]) -> Callable[[Store], int]:
    """A racer repeating ``step`` (a scheduler pass) until it changes nothing; its result is
    how many rows it changed in all."""

    def racer(store: Store) -> int:
        total = 0
        while changed := step(store):
            total += changed
        return total

    return racer


# ---------------------------------------------------- a scheduler held mid-transaction
import signal  # noqa: E402

# The process tests that SIGKILL a scheduler while its transaction waits on one the test holds
# (test_maps_processes, test_children_processes) find it by its lock wait, not by its query's
# text (pg_stat_activity keeps only its first kilobyte), and only in the test's own database:
# other tests' schedulers share the server.


def waits_on_a_lock(
    sql: psycopg.Connection[tuple[object, ...]], application: str, event: str | None = None
) -> bool:
    """Whether a session of this database whose application name is LIKE ``application``
    waits for a lock (of kind ``event``, e.g. ``transactionid``: another transaction's)."""
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE %s AND wait_event_type = 'Lock'"
        " AND (%s::text IS NULL OR wait_event = %s::text)",
        (application, event, event),
    ).fetchone()
    return bool(row and row[0])


def scheduler_waits_on_a_lock(sql: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Whether a scheduler session of this database waits for another transaction."""
    return waits_on_a_lock(sql, "flowforge-scheduler%", "transactionid")


def stored_run(sql: psycopg.Connection[tuple[object, ...]], run_id: UUID) -> tuple[str, bool]:
    """(state, finished_at IS NOT NULL) as the run's row says, not as any reader reshapes it."""
    row = sql.execute(
        "SELECT state, finished_at IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None
    return str(row[0]), bool(row[1])


def no_scheduler_session(sql: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Whether no scheduler session of this database is left (a killed one's has ended)."""
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'flowforge-scheduler%%'"
    ).fetchone()
    return row is not None and not row[0]


def kill_scheduler_while_it_waits(
    scheduler: Any,
    sql: psycopg.Connection[tuple[object, ...]],
    blocker: psycopg.Connection[Any],
    what: str,
) -> None:
    """Once ``scheduler`` (a tests/e2e.py ``RoleProcess``) waits on the open transaction of
    ``blocker``: SIGKILL it, roll ``blocker`` back, and wait until its session has ended (so
    its half-done transaction is gone: rolled back, nothing of it committed)."""
    wait_for(lambda: scheduler_waits_on_a_lock(sql), timeout=30, what=what)
    scheduler.signal(signal.SIGKILL)
    scheduler.wait()
    blocker.rollback()
    wait_for(
        lambda: no_scheduler_session(sql), timeout=30, what="the killed scheduler's session to end"
    )


def running_peaks(rows: Iterable[tuple[Any, Any, Any]]) -> dict[Any, int]:
    """Per key, the most intervals open at one instant. ``rows``: ``(key, start, end)``, every
    end set (an attempt still open fails the caller's proof); an end counts before a start at
    the same instant, so back-to-back intervals do not overlap."""
    events: dict[Any, list[tuple[Any, int]]] = defaultdict(list)
    for key, started, finished in rows:
        assert finished is not None, "every attempt is closed once its work settled"
        events[key] += [(started, 1), (finished, -1)]
    found = {}
    for key, changes in events.items():
        running = peak = 0
        for _, change in sorted(changes, key=lambda e: (e[0], e[1])):
            running += change
            peak = max(peak, running)
        found[key] = peak
    return found


def query_count(sql: psycopg.Connection[tuple[Any, ...]], query: str, *args: Any) -> int:
    """The whole number a ``SELECT count(*) …`` (with ``%s`` parameters ``args``) answers."""
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ harness modules
# Imports for this block live here so it could be appended without touching the lines above.
import os  # noqa: E402
from pathlib import Path  # noqa: E402

#: The checkout a harness module runs from (its working directory, as scripts/bench's).
CHECKOUT = Path(__file__).resolve().parents[1]
#: How long a harness module run by a test may take (s); the test's own pytest timeout is this
#: and a minute more, so that the subprocess's bound, which says what ran, is the one that fires.
HARNESS_TIMEOUT_S = 300.0


def run_harness_json(
    module: str, json_path: Path, *args: str, timeout_s: float = HARNESS_TIMEOUT_S
) -> tuple[dict[str, Any], str]:
    """Run ``python -m module --json json_path *args`` from the checkout, as scripts/bench does
    (no ``FLOWFORGE_*`` variable leaks into its trees), and return the JSON it wrote and its
    stdout; an AssertionError with the tail of its stderr if it did not exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", module, "--json", str(json_path), *args],
        cwd=CHECKOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(json_path.read_text()), result.stdout


def run_bench_json(
    json_path: Path, server_url: str, broker_url: str, *args: str
) -> tuple[dict[str, Any], str]:
    """:func:`run_harness_json` of ``scripts/bench`` with ``args``, two workers, on the test
    services (a database is created on ``server_url``)."""
    return run_harness_json(
        "tests.harness.bench",
        json_path,
        *args,
        "--workers",
        "2",
        "--database-url",
        server_url,
        "--broker-url",
        broker_url,
    )


def mapped(
    max_parallel: int | None = None, *, max_items: int | None = None, **extra: Any
) -> WorkflowDef:
    """list → process (a map over list's result) → merge."""
    return WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("process", "tests.noop", for_each="list", max_parallel=max_parallel, **extra),
            TaskDef("merge", "tests.noop", depends_on=("process",)),
        ),
        max_items=max_items,
    )


def run_list(
    repo: Store, sql: psycopg.Connection[Any], result: Any, wf: WorkflowDef, run_input: Any = None
) -> UUID:
    """Trigger ``wf`` and finish its ``list`` task with ``result``; the scheduler drained."""
    run_id = repo.trigger(wf, run_input or {}).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    assert repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=result)
    dispatch(sql)  # the list task's own message: already claimed
    drain(repo)
    return run_id


def heard(conn: psycopg.Connection[Any]) -> set[str]:
    """The channels ``conn`` (listening) was notified on since the last call: the first
    waited for up to 5 s (each notification is sent with its commit's round trip, so by the
    time the caller returned it is on its way), then what else arrives within 0.2 s."""
    channels = {n.channel for n in conn.notifies(timeout=5.0, stop_after=1)}
    return channels | {n.channel for n in conn.notifies(timeout=0.2)}


@contextmanager
def pool_of(url: str, size: int, name: str) -> Iterator[Database]:
    """A store :class:`Database` on ``url`` whose pool holds exactly ``size`` connections,
    open for the block."""
    db = Database(DatabaseConfig(url=url, pool_min=size, pool_max=size), name)
    db.open()
    try:
        yield db
    finally:
        db.close()
