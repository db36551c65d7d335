"""Events and ``wait_for_event`` (issue 19, SPEC 7.3) against real PostgreSQL.

Every guarantee is counted in the database: delivery rows (one per woken task, its primary
key), task states, results and outbox rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError
from tests.helpers import claim_task, drain, race, task_ids, until_idle, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: a → approve (waits for order.approved keyed by the order id) → ship
ORDER = WorkflowDef(
    "order",
    (
        TaskDef("a", "tests.noop"),
        TaskDef(
            "approve",
            wait_for_event=EventWait("order.approved", "{order_id}", 3600.0),
            depends_on=("a",),
        ),
        TaskDef("ship", "tests.noop", depends_on=("approve",)),
    ),
)
#: the wait is the root: it starts at the first pass
WAIT_FIRST = WorkflowDef(
    "wait-first",
    (
        TaskDef("approve", wait_for_event=EventWait("order.approved", "{order_id}", 3600.0)),
        TaskDef("ship", "tests.noop", depends_on=("approve",)),
    ),
)
#: Its wait's timeout outlasts the first drain on a loaded machine (0.5 s did not, once: the
#: drain's own passes expired the wait before the test saw it RUNNING).
SHORT = WorkflowDef(
    "short",
    (
        TaskDef("approve", wait_for_event=EventWait("order.approved", "{order_id}", 2.0)),
        TaskDef("ship", "tests.noop", depends_on=("approve",)),
    ),
)


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def deliveries(sql: Sql) -> int:
    return int(scalar(sql, "SELECT count(*) FROM event_deliveries"))


def outbox_rows(sql: Sql, task_run_id: uuid.UUID) -> int:
    return int(scalar(sql, "SELECT count(*) FROM outbox WHERE task_run_id = %s", task_run_id))


def test_a_wait_holds_no_worker_and_a_late_event_wakes_it_with_its_data(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(ORDER, {"order_id": "o-17"}).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    approve = repo.get_task(ids["approve"])
    assert approve.state is TaskState.RUNNING and approve.attempt == 0
    assert approve.lease_owner is None and approve.lease_expires_at is None
    assert (approve.event_name, approve.event_key) == ("order.approved", "o-17")
    assert approve.wake_at is not None and approve.started_at is not None
    timeout = (approve.wake_at - approve.started_at).total_seconds()
    assert 3599 <= timeout <= 3601  # the timeout, on the database clock
    assert outbox_rows(sql, ids["approve"]) == 0
    assert repo.reap_expired(100) == 0  # never taken for a lost lease

    sent = repo.send_event("order.approved", "o-17", {"by": "alice"})
    assert [(w.run_id, w.task) for w in sent.woke] == [(run_id, "approve")]
    approve = repo.get_task(ids["approve"])
    assert approve.state is TaskState.SUCCEEDED and approve.result == {"by": "alice"}
    assert repo.get_task(ids["ship"]).state is TaskState.READY  # released by the send
    assert outbox_rows(sql, ids["ship"]) == 1
    assert deliveries(sql) == 1
    drain(repo)
    claim = claim_task(repo, sql, ids["ship"])
    assert claim.upstream == {"approve": {"by": "alice"}}


def test_an_event_sent_before_the_wait_starts_is_delivered_when_it_starts(
    repo: Store, sql: Sql
) -> None:
    early = repo.send_event("order.approved", "o-1", [1, 2])
    assert early.woke == ()
    run_id = repo.trigger(ORDER, {"order_id": "o-1"}).run_id
    ids = task_ids(repo, run_id)
    drain(repo)
    assert repo.get_task(ids["approve"]).state is TaskState.PENDING  # its dependency first
    claim = claim_task(repo, sql, ids["a"])
    assert repo.finish(ids["a"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    approve = repo.get_task(ids["approve"])
    assert approve.state is TaskState.SUCCEEDED and approve.result == [1, 2]
    assert repo.get_task(ids["ship"]).state is TaskState.READY
    assert scalar(sql, "SELECT event_id FROM event_deliveries") == early.id
    assert deliveries(sql) == 1


def test_an_event_older_than_the_retention_is_not_delivered(repo: Store, sql: Sql) -> None:
    repo.send_event("order.approved", "o-2", "old")
    sql.execute("UPDATE events SET created_at = now() - interval '8 days'")
    run_id = repo.trigger(WAIT_FIRST, {"order_id": "o-2"}).run_id
    drain(repo)
    assert repo.get_run(run_id).task("approve").state is TaskState.RUNNING
    assert deliveries(sql) == 0
    assert repo.purge_events(7 * 86_400.0, 100) == 1  # housekeeping takes it
    assert scalar(sql, "SELECT count(*) FROM events") == 0


def test_one_event_wakes_every_matching_wait_and_no_other(repo: Store, sql: Sql) -> None:
    first = repo.trigger(WAIT_FIRST, {"order_id": "o-3"}).run_id
    second = repo.trigger(WAIT_FIRST, {"order_id": "o-3"}).run_id
    other = repo.trigger(WAIT_FIRST, {"order_id": "o-4"}).run_id
    drain(repo)
    sent = repo.send_event("order.approved", "o-3", {"ok": True})
    assert {w.run_id for w in sent.woke} == {first, second}
    assert repo.get_run(other).task("approve").state is TaskState.RUNNING
    assert repo.send_event("order.rejected", "o-4").woke == ()  # another name: not it
    assert repo.get_run(other).task("approve").state is TaskState.RUNNING
    assert deliveries(sql) == 2
    drain(repo)
    assert repo.get_run(first).state is RunState.RUNNING  # ship is READY


def test_one_wait_two_events_is_woken_once_by_the_first(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(WAIT_FIRST, {"order_id": "o-5"}).run_id
    drain(repo)
    assert len(repo.send_event("order.approved", "o-5", "first").woke) == 1
    assert repo.send_event("order.approved", "o-5", "second").woke == ()
    assert repo.get_run(run_id).task("approve").result == "first"
    assert deliveries(sql) == 1
    assert scalar(sql, "SELECT count(*) FROM events") == 2  # both kept for later waits
    ship = repo.get_run(run_id).task("ship")
    assert outbox_rows(sql, ship.id) == 1


def test_a_wait_whose_timeout_passes_is_dead_event_timeout_and_no_later_event_wakes_it(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(SHORT, {"order_id": "o-6"}).run_id
    drain(repo)
    approve = repo.get_run(run_id).task("approve")
    assert approve.state is TaskState.RUNNING
    wait_for(lambda: repo.expire_event_waits(100), timeout=10, what="the wait's timeout")
    assert scalar(sql, "SELECT finished_at >= wake_at FROM task_runs WHERE id = %s", approve.id)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.task("approve").state is TaskState.DEAD
    assert run.task("approve").failure_reason is FailureReason.EVENT_TIMEOUT
    assert run.task("ship").state is TaskState.CANCELLED
    assert run.state is RunState.FAILED
    assert repo.send_event("order.approved", "o-6").woke == ()
    assert deliveries(sql) == 0


def test_an_event_after_the_timeout_but_before_the_pass_wakes_nothing(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(WAIT_FIRST, {"order_id": "o-7"}).run_id
    drain(repo)
    sql.execute("UPDATE task_runs SET wake_at = now() - interval '1 second' WHERE name = 'approve'")
    assert repo.send_event("order.approved", "o-7").woke == ()
    assert repo.expire_event_waits(100) == 1
    assert repo.get_run(run_id).task("approve").state is TaskState.DEAD


def test_a_requeued_timed_out_wait_waits_again_and_takes_a_stored_event(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(WAIT_FIRST, {"order_id": "o-8"}).run_id
    drain(repo)
    sql.execute("UPDATE task_runs SET wake_at = now() - interval '1 second' WHERE name = 'approve'")
    drain(repo)
    approve = repo.get_run(run_id).task("approve")
    assert approve.state is TaskState.DEAD
    repo.send_event("order.approved", "o-8", "late")  # stored: nobody waits
    repo.requeue_dead(approve.id, "ops", "the approval came late")
    drain(repo)
    run = repo.get_run(run_id)
    assert run.task("approve").state is TaskState.SUCCEEDED
    assert run.task("approve").result == "late"
    assert run.task("ship").state is TaskState.READY


def test_cancelling_the_run_ends_a_waiting_task_at_once(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(WAIT_FIRST, {"order_id": "o-9"}).run_id
    drain(repo)
    run = repo.cancel_run(run_id)
    assert run.task("approve").state is TaskState.CANCELLED
    drain(repo)
    assert repo.get_run(run_id).state is RunState.CANCELLED
    assert repo.send_event("order.approved", "o-9").woke == ()
    assert deliveries(sql) == 0


@pytest.mark.parametrize(
    ("name", "key", "data", "fragment"),
    [
        ("", "k", None, "event name"),
        (None, "k", None, "event name"),
        ("bad name!", "k", None, "event name"),
        ("order.approved", None, None, "event key"),
        ("order.approved", 7, None, "event key"),
        ("order.approved", "a\x00b", None, "event key"),
        ("order.approved", "k" * 2000, None, "event key"),
        ("order.approved", "k", float("nan"), "event data"),
        ("order.approved", "k", {"a": "\x00"}, "event data"),
        ("order.approved", "k", {"a": object()}, "event data"),
    ],
)
def test_a_bad_event_is_an_input_error_and_nothing_is_stored(
    repo: Store, sql: Sql, name: Any, key: Any, data: Any, fragment: str
) -> None:
    run_id = repo.trigger(WAIT_FIRST, {"order_id": "k"}).run_id
    drain(repo)
    with pytest.raises(InputError, match=fragment):
        repo.send_event(name, key, data)
    assert scalar(sql, "SELECT count(*) FROM events") == 0
    assert repo.get_run(run_id).task("approve").state is TaskState.RUNNING


def test_fifty_events_from_four_threads_wake_fifty_waits_once_each_while_waits_start(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    """Half the waits are started before the sends, half start while the events arrive (a
    scheduler thread races the senders): each task is woken exactly once either way."""
    runs = [
        r.run_id for r in repo.trigger_many(WAIT_FIRST, [{"order_id": f"k{i}"} for i in range(25)])
    ]
    drain(repo)
    runs += [
        r.run_id
        for r in repo.trigger_many(WAIT_FIRST, [{"order_id": f"k{i}"} for i in range(25, 50)])
    ]

    def sender(part: int) -> Callable[[Store], list[int]]:
        def send(own: Store) -> list[int]:
            return [
                len(own.send_event("order.approved", f"k{i}", {"i": i}).woke)
                for i in range(part, 50, 4)
            ]

        return send

    starter = until_idle(lambda own: own.start_event_waits(3, 86_400.0))
    *sent, _ = race(clean_database_url, *(sender(p) for p in range(4)), starter)
    drain(repo)
    assert sum(len(woke) for woke in sent) == 50
    assert deliveries(sql) == 50
    assert scalar(sql, "SELECT count(DISTINCT task_run_id) FROM event_deliveries") == 50
    for index, run_id in enumerate(runs):
        approve = repo.get_run(run_id).task("approve")
        assert approve.state is TaskState.SUCCEEDED, (index, approve.state)
        assert approve.result == {"i": index}
    assert scalar(sql, "SELECT count(*) FROM outbox") == 50  # one ship each
