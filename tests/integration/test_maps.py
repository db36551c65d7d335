"""Map tasks (``for_each``, issue 19, SPEC 7.3) against real PostgreSQL, counting in the database.

The tests play the worker statement by statement (claim, finish) and the scheduler pass by pass
(tests/helpers.py ``drain``), so every count is of rows the engine committed.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.store import queries
from flowforge.store.db import Database
from flowforge.store.maps import _expand
from flowforge.store.part import Tx
from tests.helpers import claim_task, dispatch, drain, mapped, race, run_list, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def scalar(sql: Sql, query: str, *args: Any) -> Any:
    row = sql.execute(query, args).fetchone()
    assert row is not None
    return row[0]


def items(sql: Sql, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    """(item_index, state, item, result, idempotency_key) of a run's map items, in item order."""
    return sql.execute(
        "SELECT item_index, state, item, result, idempotency_key FROM task_runs"
        " WHERE run_id = %s AND map_id IS NOT NULL ORDER BY item_index",
        (run_id,),
    ).fetchall()


def test_a_map_runs_once_per_item_and_its_dependent_sees_the_results_in_item_order(
    repo: Store, sql: Sql
) -> None:
    run_id = run_list(repo, sql, [5, 1, 4, 2, 3], mapped())
    rows = items(sql, run_id)
    assert [(r[0], r[2]) for r in rows] == [(0, 5), (1, 1), (2, 4), (3, 2), (4, 3)]
    # finish them in reverse order: the map's result is still in item order
    sent = dispatch(sql)
    claims = [repo.claim(tid, tok, "w", 30.0).claim for tid, tok in sent]
    assert sorted(c.index for c in claims if c is not None) == [0, 1, 2, 3, 4]
    for c in reversed([c for c in claims if c is not None]):
        assert c.upstream == {}  # the list mapped over is the item, not an upstream result
        repo.finish(c.task_run_id, c.fencing_token, TaskState.SUCCEEDED, result=c.item * 10)
    drain(repo)
    ids = task_ids(repo, run_id)
    assert set(ids) == {"list", "process", "merge"}  # items are not tasks of the run view
    process = repo.get_task(ids["process"])
    assert process.state is TaskState.SUCCEEDED and process.result == [50, 10, 40, 20, 30]
    merge = claim_task(repo, sql, ids["merge"])
    assert merge.upstream == {"process": [50, 10, 40, 20, 30]}
    repo.finish(ids["merge"], merge.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    run = repo.get_run(run_id)
    assert run.state is RunState.SUCCEEDED
    by_name = {t.name: t for t in run.tasks}
    assert by_name["process"].item_counts == {"SUCCEEDED": 5}
    assert by_name["process"].for_each == "list"


def test_an_empty_list_completes_the_map_at_once_and_its_dependents_proceed(
    repo: Store, sql: Sql
) -> None:
    run_id = run_list(repo, sql, [], mapped())
    ids = task_ids(repo, run_id)
    process = repo.get_task(ids["process"])
    assert process.state is TaskState.SUCCEEDED and process.result == []
    assert items(sql, run_id) == []
    assert repo.get_task(ids["merge"]).state is TaskState.READY
    assert repo.get_run(run_id).tasks[1].item_counts == {}


@pytest.mark.parametrize("result", [{"a": 1}, "text", 7, None])
def test_a_result_that_is_not_a_list_buries_the_map_with_a_clear_reason(
    repo: Store, sql: Sql, result: Any
) -> None:
    run_id = run_list(repo, sql, result, mapped())
    ids = task_ids(repo, run_id)
    process = repo.get_task(ids["process"])
    assert process.state is TaskState.DEAD
    assert process.failure_reason is FailureReason.NOT_A_LIST
    assert process.last_error is not None and "must be a JSON list" in process.last_error
    assert items(sql, run_id) == []
    assert repo.get_task(ids["merge"]).state is TaskState.CANCELLED
    assert repo.get_run(run_id).state is RunState.FAILED


def test_more_items_than_max_items_buries_the_map_as_too_many_items(repo: Store, sql: Sql) -> None:
    run_id = run_list(repo, sql, list(range(4)), mapped(max_items=3))
    process = repo.get_task(task_ids(repo, run_id)["process"])
    assert process.state is TaskState.DEAD
    assert process.failure_reason is FailureReason.TOO_MANY_ITEMS
    assert items(sql, run_id) == []
    run_id = run_list(repo, sql, list(range(3)), mapped(max_items=3))  # the bound itself is fine
    assert len(items(sql, run_id)) == 3


def test_item_keys_render_from_item_index_and_item_fields(repo: Store, sql: Sql) -> None:
    wf = mapped(idempotency_key="{tenant}-{index}-{item[id]}")
    run_id = run_list(repo, sql, [{"id": "x"}, {"id": "y"}], wf, {"tenant": "t1"})
    assert [r[4] for r in items(sql, run_id)] == ["t1-0-x", "t1-1-y"]
    # an item that cannot fill the template: the map is DEAD, no item is created
    run_id = run_list(repo, sql, [{"id": "x"}, {"other": 1}], wf, {"tenant": "t1"})
    process = repo.get_task(task_ids(repo, run_id)["process"])
    assert process.failure_reason is FailureReason.ITEM_KEY_ERROR
    assert items(sql, run_id) == []


def test_max_parallel_bounds_the_items_in_play_and_dispatches_in_item_order(
    repo: Store, sql: Sql
) -> None:
    run_id = run_list(repo, sql, list(range(7)), mapped(max_parallel=3))
    seen: list[int] = []
    for _ in range(10):
        in_play = scalar(
            sql,
            "SELECT count(*) FROM task_runs WHERE run_id = %s AND map_id IS NOT NULL"
            " AND state IN ('READY', 'RUNNING', 'RETRYING', 'FAILED')",
            run_id,
        )
        assert in_play <= 3
        sent = dispatch(sql)
        if not sent:
            break
        # the slots go to the lowest indices not yet run (the outbox rows of one promote
        # statement carry no order among themselves: a round is compared as a set)
        round_: list[int] = []
        for tid, tok in sent:
            claim = repo.claim(tid, tok, "w", 30.0).claim
            assert claim is not None
            if claim.index is None:  # merge, once every item is done
                assert claim.name == "merge" and sorted(seen) == list(range(7))
                continue
            round_.append(claim.index)
            repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED, result=claim.index)
        lowest = [i for i in range(7) if i not in seen][: len(round_)]
        assert sorted(round_) == lowest, (seen, round_)
        seen += round_
        drain(repo)
    assert sorted(seen) == list(range(7)) and len(seen) == 7  # every item once
    process = repo.get_task(task_ids(repo, run_id)["process"])
    assert process.state is TaskState.SUCCEEDED and process.result == list(range(7))


def test_an_item_dead_makes_the_map_dead_and_fail_fast_cancels_the_rest(
    repo: Store, sql: Sql
) -> None:
    run_id = run_list(repo, sql, [1, 2, 3], mapped(max_parallel=1))
    ((tid, tok),) = dispatch(sql)
    claim = repo.claim(tid, tok, "w", 30.0).claim
    assert claim is not None
    repo.finish(
        tid, claim.fencing_token, TaskState.FAILED, reason=FailureReason.PERMANENT_ERROR, error="x"
    )
    drain(repo)
    states = [r[1] for r in items(sql, run_id)]
    assert states == ["DEAD", "CANCELLED", "CANCELLED"]
    ids = task_ids(repo, run_id)
    process = repo.get_task(ids["process"])
    assert process.state is TaskState.DEAD and process.failure_reason is FailureReason.ITEM_FAILED
    assert process.last_error == "1 item(s) DEAD" and process.result is None  # counted once
    assert repo.get_task(ids["merge"]).state is TaskState.CANCELLED
    assert repo.get_run(run_id).state is RunState.FAILED


def test_a_cancelled_run_cancels_its_map_and_items(repo: Store, sql: Sql) -> None:
    run_id = run_list(repo, sql, [1, 2, 3], mapped())
    repo.cancel_run(run_id)
    drain(repo)
    assert {r[1] for r in items(sql, run_id)} == {"CANCELLED"}
    assert repo.get_task(task_ids(repo, run_id)["process"]).state is TaskState.CANCELLED
    assert repo.get_run(run_id).state is RunState.CANCELLED


def test_racing_expansions_create_each_item_exactly_once(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    wf = mapped()
    runs = []
    for _ in range(6):
        run_id = repo.trigger(wf, {}).run_id
        ids = task_ids(repo, run_id)
        claim = claim_task(repo, sql, ids["list"])
        repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=list(range(500)))
        runs.append(run_id)

    def expand(store: Store) -> int:
        return sum(store.expand_maps(100) for _ in range(10))

    counts = race(clean_database_url, *[expand] * 4)
    assert sum(counts) == 6  # each map expanded by exactly one of the racers
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE map_id IS NOT NULL") == 6 * 500
    assert (
        scalar(
            sql,
            "SELECT count(*) FROM (SELECT map_id, item_index FROM task_runs"
            " WHERE map_id IS NOT NULL GROUP BY 1, 2 HAVING count(*) > 1) d",
        )
        == 0
    )
    assert repo.expand_maps(100) == 0  # nothing left: a repeat expands nothing


def test_an_expansion_rolled_back_mid_way_leaves_nothing_and_is_done_again(
    repo: Store, sql: Sql, db: Database
) -> None:
    run_id = repo.trigger(mapped(), {}).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=[1, 2, 3])

    class Died(Exception):
        """The expanding process dying after its statement, before its commit."""

    def expand_then_die(cur: Any) -> None:
        assert _expand(Tx(cur, queries.load()), 4, []) == 1
        inside = cur.execute(
            "SELECT count(*) AS n FROM task_runs WHERE map_id = %s", (ids["process"],)
        )
        assert inside.fetchone()["n"] == 3  # inserted, in this transaction only
        raise Died

    with pytest.raises(Died):
        db.run(expand_then_die)
    assert items(sql, run_id) == []
    assert repo.get_task(ids["process"]).state is TaskState.PENDING
    assert repo.expand_maps(100) == 1
    assert [r[0] for r in items(sql, run_id)] == [0, 1, 2]
    assert repo.expand_maps(100) == 0


def work(repo: Store, sql: Sql, bound: int | None = None) -> list[int]:
    """Claim and succeed every dispatched task until none is left; the item indexes, in the
    order they ran."""
    seen: list[int] = []
    for _ in range(20):
        sent = dispatch(sql)
        if not sent:
            break
        assert bound is None or len(sent) <= bound  # never more items at once
        for tid, tok in sent:
            claim = repo.claim(tid, tok, "w", 30.0).claim
            if claim is None:
                continue
            if claim.index is not None:
                seen.append(claim.index)
            repo.finish(tid, claim.fencing_token, TaskState.SUCCEEDED, result=claim.index)
        drain(repo)
    return seen


@pytest.mark.parametrize("requeued", ["item", "map"])
def test_requeuing_a_dead_item_or_its_map_reopens_the_map_and_finishes_the_run(
    repo: Store, sql: Sql, requeued: str
) -> None:
    run_id = run_list(repo, sql, [0, 1, 2], mapped(max_parallel=1))
    ((tid, tok),) = dispatch(sql)
    claim = repo.claim(tid, tok, "w", 30.0).claim
    assert claim is not None and claim.index == 0
    repo.finish(
        tid, claim.fencing_token, TaskState.FAILED, reason=FailureReason.PERMANENT_ERROR, error="x"
    )
    drain(repo)
    ids = task_ids(repo, run_id)
    assert repo.get_run(run_id).state is RunState.FAILED
    repo.requeue_dead(tid if requeued == "item" else ids["process"], "ops", "fixed")
    drain(repo)
    assert work(repo, sql, bound=1) == [0, 1, 2]  # still one at a time, in item order
    process = repo.get_task(ids["process"])
    assert process.state is TaskState.SUCCEEDED and process.result == [0, 1, 2]
    assert scalar(sql, "SELECT count(*) FROM task_runs WHERE map_id = %s", ids["process"]) == 3
    assert repo.get_task(ids["merge"]).state is TaskState.SUCCEEDED  # revived, then ran
    assert repo.get_run(run_id).state is RunState.SUCCEEDED


def test_an_item_sees_the_maps_other_upstream_results_but_not_the_list(
    repo: Store, sql: Sql
) -> None:
    wf = WorkflowDef(
        "mapped-config",
        (
            TaskDef("config", "tests.noop"),
            TaskDef("list", "tests.noop"),
            TaskDef("process", "tests.noop", for_each="list", depends_on=("config",)),
        ),
    )
    run_id = repo.trigger(wf, {}).run_id
    ids = task_ids(repo, run_id)
    for name, result in (("config", {"mode": "fast"}), ("list", ["a", "b"])):
        claim = claim_task(repo, sql, ids[name])
        repo.finish(ids[name], claim.fencing_token, TaskState.SUCCEEDED, result=result)
    dispatch(sql)
    drain(repo)
    claims = [repo.claim(tid, tok, "w", 30.0).claim for tid, tok in dispatch(sql)]
    # (the outbox rows of one statement carry no order among themselves: expand_map)
    seen = sorted((c.index, c.item, c.upstream) for c in claims if c is not None)
    assert seen == [
        (0, "a", {"config": {"mode": "fast"}}),
        (1, "b", {"config": {"mode": "fast"}}),
    ]
