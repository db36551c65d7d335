"""The constructs of issue 19 together, through real role processes: a map whose items feed an
event wait, with a ``run_if: any_failed`` compensation after the map; a worker SIGKILLed while
it runs items and the scheduler SIGKILLed while the maps are still running.

tests/integration/test_dynamic_together.py proves the same meeting statement by statement;
this proves it with real ``flowforge role`` processes (tests/e2e.py ``Stack``) and signals,
counting in the database: every handler execution (``test_executions``, with the worker's pid
and the attempt), every event delivery (``event_deliveries``).

What a SIGKILLed worker was running is run again (a lease expires, the reaper retries it: the
engine executes at least once, SPEC 2); so "at most once" is proven as: no (item, attempt) is
executed twice, and an item executed twice had its first execution on the killed worker.
"""

from __future__ import annotations

import signal
from typing import Any

import psycopg
import pytest

from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.states import RunState, TaskState
from tests.e2e import Stack
from tests.helpers import task_ids, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

ITEMS = 20
RETRY = RetryPolicy(max_attempts=3, base_delay=0.1, max_delay=0.2, jitter=Jitter.NONE)
ORDER = WorkflowDef(
    "order-map-e2e",
    (
        TaskDef("list", "e2e.items"),
        TaskDef("charge", "e2e.item_paced", for_each="list", max_parallel=8, retry=RETRY),
        TaskDef(
            "approve",
            wait_for_event=EventWait("order.approved", "{order}", 120.0),
            depends_on=("charge",),
        ),
        TaskDef("ship", "e2e.record", depends_on=("approve",)),
        TaskDef("refund", "e2e.record", depends_on=("charge",), run_if=RunIf.ANY_FAILED),
    ),
)
HAPPY = ("o-0", "o-1", "o-2")  # o-0's event is sent before its wait starts
DOOMED = "o-9"  # item 12 of its map dies: the map is DEAD, the refund runs


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def executed(sql: Sql) -> int:
    return int(scalar(sql, "SELECT count(*) FROM test_executions WHERE handler = 'e2e.item_paced'"))


def test_a_map_feeding_an_event_wait_and_a_compensation_survives_sigkilled_roles(
    stack: Stack, repo: Store, sql: Sql
) -> None:
    scheduler = stack.start("scheduler")
    stack.start("publisher")
    killed_worker = stack.start("worker")
    stack.start("worker")
    inputs: list[dict[str, Any]] = [{"n": ITEMS, "order": order, "item_s": 0.2} for order in HAPPY]
    inputs.append({"n": ITEMS, "order": DOOMED, "item_s": 0.2, "fail": [12]})
    triggered = repo.trigger_many(ORDER, inputs)
    runs = dict(zip((*HAPPY, DOOMED), (r.run_id for r in triggered), strict=True))
    repo.send_event("order.approved", "o-0", {"by": "early"})  # kept until its wait starts

    def running_on_killed_worker() -> Any:
        row = sql.execute(
            "SELECT e.task_run_id FROM test_executions e JOIN task_runs t ON t.id = e.task_run_id"
            " WHERE e.pid = %s AND t.state = 'RUNNING' AND e.attempt = t.attempt",
            (killed_worker.pid,),
        ).fetchone()
        return None if row is None or executed(sql) < 10 else row[0]

    interrupted = wait_for(running_on_killed_worker, timeout=60, what="an item on the worker")
    killed_worker.signal(signal.SIGKILL)  # mid-item: its lease expires, the item is retried
    killed_worker.wait()
    stack.start("worker")
    wait_for(lambda: executed(sql) >= 35, timeout=60, what="more items to run")
    scheduler.signal(signal.SIGKILL)  # mid-run: maps expanding, slots opening, settling
    scheduler.wait()
    stack.start("scheduler")

    def waiting() -> int:
        return int(
            scalar(
                sql,
                "SELECT count(*) FROM task_runs WHERE name = 'approve' AND state = 'RUNNING'",
            )
        )

    wait_for(lambda: waiting() == 2, timeout=60, what="o-1 and o-2 to wait for their events")
    for order in HAPPY[1:]:
        assert len(repo.send_event("order.approved", order, {"by": order}).woke) == 1
    wait_for(
        lambda: all(repo.get_run(r).finished_at is not None for r in runs.values()),
        timeout=60,
        what="every run to finish",
    )

    for order in HAPPY:
        run = repo.get_run(runs[order])
        assert run.state is RunState.SUCCEEDED and run.compensated == ()
        assert run.task("charge").result == [{"item": i, "index": i} for i in range(ITEMS)]
        assert run.task("approve").result == {"by": "early" if order == "o-0" else order}
        assert run.task("refund").skipped  # nothing died: nothing to compensate
    doomed = repo.get_run(runs[DOOMED])
    assert doomed.state is RunState.FAILED and doomed.compensated == ("refund",)
    assert doomed.task("charge").state is TaskState.DEAD
    assert doomed.task("approve").state is TaskState.CANCELLED  # never waited, never woken

    # each wait woken once; ship once per happy run, refund once for the doomed one
    assert scalar(sql, "SELECT count(*) FROM event_deliveries") == len(HAPPY)
    per_task = dict(
        sql.execute(
            "SELECT task, count(*) FROM test_executions WHERE handler = 'e2e.record' GROUP BY task"
        ).fetchall()
    )
    assert per_task == {"ship": len(HAPPY), "refund": 1}, per_task
    refunded = "SELECT run_id FROM test_executions WHERE task = 'refund'"
    assert sql.execute(refunded).fetchall() == [(runs[DOOMED],)]

    # items: each happy map has every index once; no attempt of an item ran twice; only the
    # item the killed worker was running ran twice
    for order in HAPPY:
        map_id = task_ids(repo, runs[order])["charge"]
        assert scalar(sql, "SELECT count(*) FROM task_runs WHERE map_id = %s", map_id) == ITEMS
        assert (
            scalar(
                sql,
                "SELECT count(*) FROM task_runs WHERE map_id = %s AND state = 'SUCCEEDED'",
                map_id,
            )
            == ITEMS
        )
    twice = sql.execute(
        "SELECT task_run_id, attempt FROM test_executions WHERE handler = 'e2e.item_paced'"
        " GROUP BY task_run_id, attempt HAVING count(*) > 1"
    ).fetchall()
    assert twice == []
    again = sql.execute(
        "SELECT task_run_id, array_agg(pid ORDER BY attempt) FROM test_executions"
        " WHERE handler = 'e2e.item_paced' GROUP BY task_run_id HAVING count(*) > 1"
    ).fetchall()
    # the item the killed worker was running, and only that one, ran again (a worker runs
    # one slow item at a time); unless fail-fast cancelled it first, in the doomed run
    assert [t for t, _ in again] in ([interrupted], []), again
    assert all(pids[0] == killed_worker.pid for _, pids in again), again
    if repo.get_task(interrupted).run_id != runs[DOOMED]:
        assert len(again) == 1 and repo.get_task(interrupted).attempt == 2
    happy_items = scalar(
        sql,
        "SELECT count(DISTINCT e.task_run_id) FROM test_executions e"
        " WHERE e.handler = 'e2e.item_paced' AND e.run_id = ANY(%s)",
        [runs[o] for o in HAPPY],
    )
    assert happy_items == len(HAPPY) * ITEMS  # nothing lost
