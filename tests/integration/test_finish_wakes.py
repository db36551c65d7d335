"""Which wake-ups a worker's finish sends, against real PostgreSQL.

A finish notifies the scheduler only when its pass has work from it (a failure to route, a
cancellation to propagate, a slot or stream freed, a dependent left for a pass, a run that may
be over and that the finish did not settle itself), and the publisher only for the outbox rows
the worker does not claim itself in the same transaction. Each test LISTENs on both channels,
finishes, then sends a marker on each channel from another session: notifications arrive in
commit order, so every one the finish sent is read before its marker, and a missing one is
proven missing without a sleep.
The chains still end SUCCEEDED, their tasks propagated, once a pass comes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency
from flowforge.domain.model import Continuation, Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.store.notify import OUTBOX_CHANNEL, SCHEDULER_CHANNEL
from tests.helpers import FAST_RETRY, chain, claim_task, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
CHANNELS = (SCHEDULER_CHANNEL, OUTBOX_CHANNEL)
MARKER = "marker"
#: Upper bound on waiting for the markers (they are sent before the wait starts).
MARKER_WAIT_S = 10.0
LEASE_S = 30.0


@pytest.fixture
def heard(clean_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A session LISTENing on the scheduler's and the publisher's channels."""
    with psycopg.connect(clean_database_url, autocommit=True) as conn:
        for channel in CHANNELS:
            conn.execute(f"LISTEN {channel}")
        yield conn


def wakes(listener: psycopg.Connection[Any], sql: Sql) -> set[str]:
    """The channels notified since the last call (a marker sent on each, then read up to)."""
    for channel in CHANNELS:
        sql.execute("SELECT pg_notify(%s, %s)", (channel, MARKER))
    woken: set[str] = set()
    markers = 0
    for note in listener.notifies(timeout=MARKER_WAIT_S):
        if note.payload == MARKER:
            markers += 1
            if markers == len(CHANNELS):
                break
        else:
            woken.add(note.channel)
    assert markers == len(CHANNELS), "the markers never came back"
    return woken


def succeed(
    repo: Store,
    sql: Sql,
    task_id: uuid.UUID,
    then: Continuation | None = None,
) -> set[uuid.UUID]:
    """Claim a READY task and finish it SUCCEEDED; the ids the finish's continuation claimed."""
    claim = claim_task(repo, sql, task_id)
    finished = repo.finish_many(
        [(task_id, claim.fencing_token, Finish(TaskState.SUCCEEDED, result={"ok": 1}))],
        offer=16,
        then=then,
    )
    assert finished.committed == {task_id}
    return {c.task_run_id for c in finished.claimed}


def propagated(sql: Sql, run_id: uuid.UUID) -> list[bool]:
    rows = sql.execute(
        "SELECT propagated FROM task_runs WHERE run_id = %s ORDER BY name", (run_id,)
    ).fetchall()
    return [bool(r[0]) for r in rows]


def test_a_success_that_releases_a_dependent_wakes_the_publisher_only(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    run_id = repo.trigger(chain(length=3)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    wakes(heard, sql)  # the trigger's and the pass's

    succeed(repo, sql, ids["t0"])

    assert wakes(heard, sql) == {OUTBOX_CHANNEL}
    assert repo.get_task(ids["t1"]).state is TaskState.READY
    # claimed through the broker (not local): t0 is left for a pass to propagate
    claim_task(repo, sql, ids["t1"])
    assert propagated(sql, run_id)[0] is False


def test_a_continuation_that_claims_the_next_step_wakes_nobody(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    run_id = repo.trigger(chain(length=3)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    wakes(heard, sql)

    claimed = succeed(repo, sql, ids["t0"], Continuation("w-next", LEASE_S, 16))

    assert claimed == {ids["t1"]}
    assert wakes(heard, sql) == set()


def test_the_last_step_wakes_the_scheduler_and_the_run_ends_with_every_task_propagated(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    run_id = repo.trigger(chain(length=3)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    then = Continuation("w-next", LEASE_S, 16)
    assert succeed(repo, sql, ids["t0"], then) == {ids["t1"]}
    wakes(heard, sql)
    t1 = repo.get_task(ids["t1"])
    repo.finish_many([(ids["t1"], t1.fencing_token, Finish(TaskState.SUCCEEDED))], then=then)
    assert wakes(heard, sql) == set()
    t2 = repo.get_task(ids["t2"])
    assert t2.state is TaskState.RUNNING
    # no pass came: each step was marked propagated by the claim of the next (its run has a
    # task RUNNING at that commit, so the run's state could not change)
    assert propagated(sql, run_id)[:2] == [True, True]

    repo.finish_many([(ids["t2"], t2.fencing_token, Finish(TaskState.SUCCEEDED))], then=then)

    assert wakes(heard, sql) == {SCHEDULER_CHANNEL}  # nothing left to release: its run may end
    drain(repo)
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    assert propagated(sql, run_id) == [True, True, True]


def test_a_one_task_run_its_finish_settles_wakes_nobody(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    """The finish settled the run itself (test_finish_settles): no pass has work from it."""
    run_id = repo.trigger(chain("one-step", length=1)).run_id
    (task_id,) = task_ids(repo, run_id).values()
    drain(repo)
    wakes(heard, sql)
    assert succeed(repo, sql, task_id) == set()
    assert wakes(heard, sql) == set()
    assert repo.get_run(run_id).state is RunState.SUCCEEDED
    assert propagated(sql, run_id) == [True]


def test_a_failure_wakes_the_scheduler(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    run_id = repo.trigger(chain(length=2)).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    claim = claim_task(repo, sql, ids["t0"])
    wakes(heard, sql)

    failed = Finish(TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="boom")
    repo.finish_many([(ids["t0"], claim.fencing_token, failed)])

    assert wakes(heard, sql) == {SCHEDULER_CHANNEL}


def test_a_dependent_left_for_the_admission_pass_wakes_the_scheduler(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    limited = WorkflowDef(
        "wake-admission",
        (
            TaskDef("first", "tests.noop", retry=FAST_RETRY),
            TaskDef(
                "then",
                "tests.noop",
                depends_on=("first",),
                concurrency=Concurrency("partner", 1),
            ),
        ),
    )
    ids = task_ids(repo, repo.trigger(limited).run_id)
    drain(repo)
    wakes(heard, sql)

    assert succeed(repo, sql, ids["first"], Continuation("w-next", LEASE_S, 16)) == set()

    assert wakes(heard, sql) == {SCHEDULER_CHANNEL}
    drain(repo)
    assert repo.get_task(ids["then"]).state is TaskState.READY


def test_a_dependent_the_continuation_leaves_wakes_the_publisher(
    repo: Store, sql: Sql, heard: psycopg.Connection[Any]
) -> None:
    """A keyed dependent (claimed on its own, with its key) and one past the limit go out as
    messages: the publisher hears of them, though the worker claimed a third."""
    fan = WorkflowDef(
        "wake-fan",
        (
            TaskDef("root", "tests.noop"),
            TaskDef("a", "tests.noop", depends_on=("root",)),
            TaskDef("k", "tests.noop", depends_on=("root",), idempotency_key="k-{n}"),
        ),
    )
    ids = task_ids(repo, repo.trigger(fan, {"n": 1}).run_id)
    drain(repo)
    wakes(heard, sql)

    claimed = succeed(repo, sql, ids["root"], Continuation("w-next", LEASE_S, 16))

    assert claimed == {ids["a"]}
    assert wakes(heard, sql) == {OUTBOX_CHANNEL}
    assert repo.get_task(ids["k"]).state is TaskState.READY
