"""Concurrency limits (issue 20, SPEC 7.4) against real PostgreSQL: the admission gate.

A task with ``concurrency: {key, limit}`` never becomes READY by itself; the scheduler's admission
pass admits up to ``limit`` READY-or-RUNNING tasks per rendered key, and a slot frees when its
task finishes, is reaped, deferred or cancelled. Every count is read from the database.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.control import HoldKind
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.limits import Concurrency
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.store import queries
from flowforge.store.limits import CONCURRENCY_LOCK_NAMESPACE
from tests.helpers import claim_task, drain, expire_lease, race, until_idle
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: Retries due at once: a failed task's retry goes back through admission in the next pass.
NOW_RETRY = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
#: A backoff only retry-now ends within a test.
SLOW_RETRY = RetryPolicy(max_attempts=3, base_delay=3600.0, max_delay=3600.0, jitter=Jitter.NONE)


def limited(limit: int, key: str = "partner", name: str = "limited", **task: Any) -> WorkflowDef:
    """One task of handler tests.noop with ``concurrency: {key, limit}``."""
    return WorkflowDef(
        name, (TaskDef("call", "tests.noop", concurrency=Concurrency(key, limit), **task),)
    )


def by_state(sql: Sql, key: str) -> dict[str, int]:
    """The tasks of concurrency key ``key`` counted by state."""
    rows = sql.execute(
        "SELECT state, count(*) FROM task_runs WHERE concurrency_key = %s GROUP BY state", (key,)
    ).fetchall()
    return {str(state): int(n) for state, n in rows}


def holders(sql: Sql, key: str) -> int:
    """READY + RUNNING tasks of ``key``: the slots held."""
    counts = by_state(sql, key)
    return counts.get("READY", 0) + counts.get("RUNNING", 0)


def ready_ids(sql: Sql, key: str) -> list[UUID]:
    rows = sql.execute(
        "SELECT id FROM task_runs WHERE concurrency_key = %s AND state = 'READY' ORDER BY seq",
        (key,),
    ).fetchall()
    return [UUID(str(r[0])) for r in rows]


def outbox_rows(sql: Sql, key: str) -> int:
    row = sql.execute(
        "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
        " WHERE t.concurrency_key = %s",
        (key,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_admits_up_to_the_limit_oldest_first_without_using_an_attempt(
    repo: Store, sql: Sql
) -> None:
    runs = [repo.trigger(limited(3)).run_id for _ in range(10)]
    # the triggers admitted while the key had room (no scheduler hop), then left the rest
    assert by_state(sql, "partner") == {"READY": 3, "PENDING": 7}
    drain(repo)
    assert by_state(sql, "partner") == {"READY": 3, "PENDING": 7}
    assert outbox_rows(sql, "partner") == 3
    admitted = {repo.get_run(r).tasks[0].id for r in runs[:3]}
    assert set(ready_ids(sql, "partner")) == admitted  # the oldest, in creation order
    waiting = repo.get_run(runs[5]).tasks[0]
    assert (waiting.state, waiting.attempt, waiting.waiting_on) == (
        TaskState.PENDING,
        0,
        "concurrency",
    )
    assert (waiting.concurrency_key, waiting.concurrency_limit) == ("partner", 3)
    assert repo.get_run(runs[0]).tasks[0].waiting_on is None  # admitted: READY, not waiting


def test_a_finish_frees_its_slot_for_the_next(repo: Store, sql: Sql) -> None:
    for _ in range(5):
        repo.trigger(limited(2))
    drain(repo)
    first, second = ready_ids(sql, "partner")
    claim = claim_task(repo, sql, first)
    claim_task(repo, sql, second)
    drain(repo)
    assert by_state(sql, "partner") == {"RUNNING": 2, "PENDING": 3}  # both slots held
    assert repo.finish(first, claim.fencing_token, TaskState.SUCCEEDED)
    # the finish's own release leaves a limited task alone: the admission pass admits it
    assert by_state(sql, "partner") == {"SUCCEEDED": 1, "RUNNING": 1, "PENDING": 3}
    drain(repo)
    assert by_state(sql, "partner") == {"SUCCEEDED": 1, "RUNNING": 1, "READY": 1, "PENDING": 2}


def test_a_dead_workers_slot_frees_with_its_lease(repo: Store, sql: Sql) -> None:
    for _ in range(3):
        repo.trigger(limited(1, retry=NOW_RETRY))
    drain(repo)
    (held,) = ready_ids(sql, "partner")
    claim_task(repo, sql, held)
    drain(repo)
    assert by_state(sql, "partner") == {"RUNNING": 1, "PENDING": 2}
    expire_lease(sql, held)  # its worker died
    drain(repo)  # reaped → RETRYING (slot freed) → the oldest waiting task admitted
    task = repo.get_task(held)
    assert task.state in (TaskState.RETRYING, TaskState.READY)
    assert holders(sql, "partner") == 1
    assert by_state(sql, "partner").get("READY") == 1


def test_a_retry_waits_for_a_slot_too(repo: Store, sql: Sql) -> None:
    for _ in range(2):
        repo.trigger(limited(1, retry=NOW_RETRY))
    drain(repo)
    (first,) = ready_ids(sql, "partner")
    claim = claim_task(repo, sql, first)
    assert repo.finish(
        first, claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="x"
    )
    drain(repo)  # FAILED → RETRYING (due now): slot freed; one of the two admitted, never both
    assert holders(sql, "partner") == 1
    assert sum(by_state(sql, "partner").values()) == 2
    (admitted,) = ready_ids(sql, "partner")
    other = repo.get_task(first if admitted != first else admitted)
    if admitted != first:  # the retry waits behind the older admission: not in its backoff
        assert (other.state, other.waiting_on, other.attempt) == (
            TaskState.RETRYING,
            "concurrency",
            1,
        )


def test_retry_now_of_a_limited_task_goes_through_admission(repo: Store, sql: Sql) -> None:
    blocker = repo.trigger(limited(1, retry=SLOW_RETRY)).run_id
    drain(repo)
    (held,) = ready_ids(sql, "partner")
    claim = claim_task(repo, sql, held)
    assert repo.finish(
        held, claim.fencing_token, TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="x"
    )
    drain(repo)
    assert repo.get_task(held).state is TaskState.RETRYING
    other = repo.trigger(limited(1)).run_id
    drain(repo)
    (other_id,) = ready_ids(sql, "partner")  # the slot the retry freed
    assert repo.get_run(other).tasks[0].id == other_id
    done = repo.retry_task_now(held, "ops", "partner is back")
    assert done.task.state is TaskState.RETRYING  # due now, but the slot is taken
    drain(repo)
    assert repo.get_task(held).waiting_on == "concurrency"
    assert holders(sql, "partner") == 1
    assert repo.get_run(blocker).tasks[0].state is TaskState.RETRYING


def test_keys_render_per_input_and_limit_each_key(repo: Store, sql: Sql) -> None:
    workflow = limited(1, key="tenant-{tenant}")
    for tenant in ("a", "b", "a", "b", "a"):
        repo.trigger(workflow, {"tenant": tenant})
    drain(repo)
    assert by_state(sql, "tenant-a") == {"READY": 1, "PENDING": 2}
    assert by_state(sql, "tenant-b") == {"READY": 1, "PENDING": 1}


def test_a_key_without_fields_is_shared_by_every_workflow_that_names_it(
    repo: Store, sql: Sql
) -> None:
    for name in ("one", "two", "three"):
        for _ in range(2):
            repo.trigger(limited(2, name=name))
    drain(repo)
    assert by_state(sql, "partner") == {"READY": 2, "PENDING": 4}


def test_unlimited_tasks_keep_their_path(repo: Store, sql: Sql) -> None:
    run = repo.trigger(WorkflowDef("free", (TaskDef("call", "tests.noop"),))).run_id
    task = repo.get_run(run).tasks[0]  # READY at creation: no scheduler pass involved
    assert (task.state, task.concurrency_key, task.waiting_on) == (TaskState.READY, None, None)


def test_dependents_wait_for_admission_after_their_upstream(repo: Store, sql: Sql) -> None:
    workflow = WorkflowDef(
        "chained",
        (
            TaskDef("first", "tests.noop"),
            TaskDef(
                "then", "tests.noop", depends_on=("first",), concurrency=Concurrency("partner", 1)
            ),
        ),
    )
    run = repo.trigger(workflow).run_id
    first = next(t for t in repo.get_run(run).tasks if t.name == "first")
    claim = claim_task(repo, sql, first.id)
    assert repo.finish(first.id, claim.fencing_token, TaskState.SUCCEEDED)
    then = next(t for t in repo.get_run(run).tasks if t.name == "then")
    assert (then.state, then.waiting_on) == (TaskState.PENDING, "concurrency")
    drain(repo)
    assert repo.get_task(then.id).state is TaskState.READY


def test_two_racing_schedulers_never_admit_over_the_limit(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    for key in ("k1", "k2", "k3"):
        for _ in range(30):
            repo.trigger(limited(4, key=key, name=f"wf-{key}"))
    for _ in range(5):  # rounds: race, check, free a few slots
        admitted = race(
            clean_database_url,
            until_idle(lambda s: s.admit_gated(100)),
            until_idle(lambda s: s.admit_gated(100)),
        )
        for key in ("k1", "k2", "k3"):
            assert holders(sql, key) == 4, (key, admitted, by_state(sql, key))
            for tid in ready_ids(sql, key)[:2]:  # two finish, freeing two slots of each key
                claim = claim_task(repo, sql, tid)
                assert repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED)
    assert sum(by_state(sql, "k1").values()) == 30


def test_waiting_on_names_every_wait(repo: Store, sql: Sql) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    delayed = repo.trigger(WorkflowDef("later", (TaskDef("x", "tests.noop"),)), start_at=later)
    assert repo.get_run(delayed.run_id).tasks[0].waiting_on == "start_at"
    timer = repo.trigger(WorkflowDef("nap", (TaskDef("nap", sleep=3600.0),))).run_id
    wait = repo.trigger(
        WorkflowDef("wait", (TaskDef("w", wait_for_event=EventWait("paid", "order-1", 3600)),))
    ).run_id
    drain(repo)
    assert repo.get_run(timer).tasks[0].waiting_on == "timer"
    assert repo.get_run(wait).tasks[0].waiting_on == "event"


def test_keys_show_lists_who_holds_the_slots_and_who_waits(repo: Store, sql: Sql) -> None:
    for _ in range(5):
        repo.trigger(limited(2))
    drain(repo)
    running = ready_ids(sql, "partner")[0]
    claim_task(repo, sql, running)
    (hold,) = repo.key_holds("partner")
    assert (hold.kind, hold.limit, hold.waiting) == (HoldKind.CONCURRENCY, 2, 3)
    assert {(t.state, t.why) for t in hold.holders} == {
        (TaskState.RUNNING, "running"),
        (TaskState.READY, "READY: admitted, waiting for a worker"),
    }
    assert [t.why for t in hold.next] == ["waits for a free slot of the key"] * 3
    assert repo.key_holds("nobody") == ()


def waits_on_advisory_lock(sql: Sql, pid: int) -> bool:
    row = sql.execute(
        "SELECT wait_event FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
        (pid,),
    ).fetchone()
    return row is not None and row[0] == "advisory"


def test_a_second_scheduler_waits_for_the_firsts_admissions_and_counts_them(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """The interleaving a free-running race rarely hits: scheduler A has admitted (uncommitted)
    when B counts. B must wait for A's commit and then see A's slots taken; without the key's
    lock B would count from a snapshot without them and admit 3 more (6 READY)."""
    for _ in range(10):
        repo.trigger(limited(3))
    # all ten waiting, none admitted (as dependents the release left PENDING would be)
    sql.execute("UPDATE task_runs SET state = 'PENDING', ready_at = NULL")
    sql.execute("DELETE FROM outbox")
    named = queries.load()
    with psycopg.connect(clean_database_url) as first:  # A: the product's statements, held open
        keys = [r[0] for r in first.execute(named["concurrency_keys_waiting"], {"limit": 10})]
        first.execute(
            named["lock_concurrency_keys"], {"namespace": CONCURRENCY_LOCK_NAMESPACE, "keys": keys}
        )
        first.execute(
            named["admit_gated"], {"ckeys": keys, "rkeys": [], "per_key": 100, "maps": []}
        )
        second: dict[str, int] = {}
        racer = threading.Thread(target=lambda: second.update(n=repo.admit_gated(100)))
        racer.start()
        deadline = time.monotonic() + 10
        blocked = False
        while not blocked and time.monotonic() < deadline:
            pids = [
                r[0]
                for r in sql.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid NOT IN (pg_backend_pid(), %s)",
                    (first.info.backend_pid,),
                )
            ]
            blocked = any(waits_on_advisory_lock(sql, pid) for pid in pids)
            if not blocked:
                time.sleep(0.02)
        assert blocked, "the second admission pass did not wait for the key's lock"
        first.commit()
    racer.join(timeout=30)
    assert not racer.is_alive()
    assert second == {"n": 0}
    assert by_state(sql, "partner") == {"READY": 3, "PENDING": 7}


def test_a_trigger_admits_only_into_room_and_never_ahead_of_waiting_tasks(
    repo: Store, sql: Sql
) -> None:
    first = [repo.trigger(limited(2)).run_id for _ in range(2)]
    assert by_state(sql, "partner") == {"READY": 2}  # created READY: the key had room
    later = [repo.trigger(limited(2)).run_id for _ in range(2)]
    assert by_state(sql, "partner") == {"READY": 2, "PENDING": 2}
    holder = repo.get_run(first[0]).tasks[0].id
    claim = claim_task(repo, sql, holder)
    assert repo.finish(holder, claim.fencing_token, TaskState.SUCCEEDED)  # a slot is free now
    newest = repo.trigger(limited(2)).run_id
    # the free slot is the oldest waiting task's: the trigger did not take it
    assert repo.get_run(newest).tasks[0].state is TaskState.PENDING
    drain(repo)
    assert repo.get_run(later[0]).tasks[0].state is TaskState.READY
    assert repo.get_run(newest).tasks[0].state is TaskState.PENDING
    assert holders(sql, "partner") == 2
