"""Map tasks (``for_each``) through real role processes, with a SIGKILL mid-expansion (issue 19).

The expansion is made to stop half-way deterministically: the test holds, in an open
transaction, an uncommitted row with the (map, index) of the map's last item, so the
scheduler's ``expand_map`` — map RUNNING, every other item inserted, uncommitted — waits on
that unique key. The scheduler is SIGKILLed while it waits (pg_stat_activity shows the wait),
the test's transaction is rolled back, and a new scheduler expands the map again: every item
exists once and runs once, and the map's dependents see the results in item order.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import RunState, TaskState
from tests.e2e import Stack
from tests.helpers import kill_scheduler_while_it_waits, task_ids, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]
N = 200

MAP = WorkflowDef(
    "map-e2e",
    (
        TaskDef("list", "e2e.items"),
        TaskDef("process", "e2e.item", for_each="list", max_parallel=50),
        TaskDef("merge", "e2e.record", depends_on=("process",)),
    ),
)


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def test_killing_the_scheduler_mid_expansion_neither_duplicates_nor_loses_an_item(
    stack: Stack, repo: Store, sql: Sql, clean_database_url: str
) -> None:
    scheduler = stack.start("scheduler")
    stack.start("publisher")
    run_id: UUID = repo.trigger(MAP, {"n": N}).run_id
    map_id = task_ids(repo, run_id)["process"]
    with psycopg.connect(clean_database_url) as blocker:
        blocker.execute(
            "INSERT INTO task_runs (id, run_id, name, handler, pending_deps, max_attempts,"
            " base_delay_s, max_delay_s, jitter, map_id, item_index)"
            " VALUES (gen_random_uuid(), %s, 'blocker', 'none', 1, 1, 0, 0, 'none', %s, %s)",
            (run_id, map_id, N - 1),
        )
        stack.start("worker")  # runs "list"; the scheduler then starts expanding and waits
        kill_scheduler_while_it_waits(scheduler, sql, blocker, "the expansion")
    # the killed expansion committed nothing: the map waits, with no item
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE map_id = %s", map_id) == 0
    assert repo.get_task(map_id).state is TaskState.PENDING
    stack.start("scheduler")
    wait_for(lambda: repo.get_run(run_id).state is RunState.SUCCEEDED, timeout=120)
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE map_id = %s", map_id) == N
    assert (
        scalar(sql, "SELECT count(DISTINCT item_index) FROM task_runs WHERE map_id = %s", map_id)
        == N
    )
    executed = sql.execute(
        "SELECT task, count(*) FROM test_executions WHERE run_id = %s AND handler = 'e2e.item'"
        " GROUP BY task",
        (run_id,),
    ).fetchall()
    assert len(executed) == N and {n for _, n in executed} == {1}  # each item ran once
    process = repo.get_task(map_id)
    assert process.result == [{"item": i, "index": i} for i in range(N)]
    merge = repo.get_run(run_id).task("merge")
    assert merge.result["upstream"]["process"] == process.result


def test_two_schedulers_expand_each_map_once(stack: Stack, repo: Store, sql: Sql) -> None:
    stack.start("scheduler")
    stack.start_all(workers=2)  # a second scheduler, a publisher and two workers
    runs = [repo.trigger(MAP, {"n": 60}).run_id for _ in range(6)]
    wait_for(
        lambda: all(repo.get_run(r).state is RunState.SUCCEEDED for r in runs),
        timeout=120,
        what="every mapped run to succeed",
    )
    for run_id in runs:
        map_id = task_ids(repo, run_id)["process"]
        assert scalar(sql, "SELECT count(*) FROM task_runs WHERE map_id = %s", map_id) == 60
        assert repo.get_task(map_id).result == [{"item": i, "index": i} for i in range(60)]
    executed = sql.execute(
        "SELECT count(*), count(DISTINCT task_run_id) FROM test_executions"
        " WHERE handler = 'e2e.item' AND run_id = ANY(%s)",
        (runs,),
    ).fetchone()
    assert executed == (6 * 60, 6 * 60)  # every item ran, once
