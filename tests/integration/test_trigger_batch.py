"""Batch triggering: many runs in one transaction, with the semantics of single triggers."""

from __future__ import annotations

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.errors import InputError, TriggerConflictError
from tests.helpers import diamond
from tests.store import Store

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]


def count(sql: Conn, table: str) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table}").fetchone()  # table names are literals here
    assert row is not None
    return int(str(row[0]))


def test_a_batch_creates_every_run_with_its_tasks_and_edges_in_input_order(
    repo: Store, sql: Conn
) -> None:
    results = repo.trigger_many(diamond(), [{"i": i} for i in range(100)])
    assert len(results) == 100 and all(r.created for r in results)
    assert len({r.run_id for r in results}) == 100
    assert count(sql, "workflow_runs") == 100
    assert count(sql, "task_runs") == 400
    assert count(sql, "task_edges") == 400  # a→b, a→c, b→d, c→d per run
    for index in (0, 57, 99):
        assert repo.get_run(results[index].run_id).input == {"i": index}


def test_keys_in_a_batch_replay_existing_runs_and_collapse_duplicates(
    repo: Store, sql: Conn
) -> None:
    wf = diamond()
    first = repo.trigger(wf, {"n": 1}, "k-1")
    results = repo.trigger_many(
        wf, [{"n": 1}, {"n": 2}, {"n": 2}, {"n": 3}], ["k-1", "k-2", "k-2", None]
    )
    assert results[0].run_id == first.run_id and not results[0].created
    assert results[1].created and not results[2].created
    assert results[1].run_id == results[2].run_id
    assert results[3].created
    assert count(sql, "workflow_runs") == 3
    assert count(sql, "task_runs") == 12


def test_one_conflicting_key_fails_the_whole_batch(repo: Store, sql: Conn) -> None:
    wf = diamond()
    repo.trigger(wf, {"n": 1}, "k-1")
    with pytest.raises(TriggerConflictError):
        repo.trigger_many(wf, [{"n": 9}, {"n": 2}], [None, "k-1"])
    assert count(sql, "workflow_runs") == 1
    assert count(sql, "task_runs") == 4


def test_a_bad_input_is_named_and_nothing_is_written(repo: Store, sql: Conn) -> None:
    wf = WorkflowDef("keyed", (TaskDef("t", "h", ordering_key="c-{customer}"),))
    with pytest.raises(InputError, match="input 1"):
        repo.trigger_many(wf, [{"customer": 1}, {"other": 2}])
    with pytest.raises(InputError, match="input 0"):
        repo.trigger_many(wf, [[1, 2], {"customer": 1}])  # type: ignore[list-item]
    assert count(sql, "workflow_runs") == 0


def test_an_empty_batch_does_nothing(repo: Store, sql: Conn) -> None:
    assert repo.trigger_many(diamond(), []) == []
    assert count(sql, "workflow_definitions") == 0
