"""Batch triggering: many runs in one transaction, with the semantics of single triggers."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from flowforge import views
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.plan import RunRequest
from flowforge.errors import InputError, TriggerConflictError, UnknownWorkflowError
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


# ------------------------------------------------------------------ trigger_batch (issue 22)


def _known(*workflows: WorkflowDef) -> Any:
    by_name = {w.name: w for w in workflows}

    def definition(name: str) -> tuple[WorkflowDef, tuple[WorkflowDef, ...]]:
        if name not in by_name:
            raise UnknownWorkflowError(f"unknown workflow {name!r}")
        return by_name[name], ()

    return definition


ONE = WorkflowDef("one", (TaskDef("t", "x"),))


def test_a_batch_of_several_workflows_answers_in_the_requests_order(repo: Store, sql: Conn) -> None:
    requests = [
        RunRequest("one", {"n": 0}),
        RunRequest(diamond().name, {"n": 1}, "k"),
        RunRequest("one", {"n": 2}, priority=9),
        RunRequest("one", {"n": 3}),
        RunRequest(diamond().name, {"n": 1}, "k"),  # the same key and body: the same run
    ]
    results = repo.trigger_batch(requests, _known(ONE, diamond()), queue="q")
    assert [r.created for r in results] == [True, True, True, True, False]
    assert results[1].run_id == results[4].run_id
    runs = [repo.get_run(r.run_id) for r in results]
    assert [r.input for r in runs] == [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}, {"n": 1}]
    assert [r.workflow for r in runs] == ["one", diamond().name, "one", "one", diamond().name]
    assert runs[2].tasks[0].priority == 9 and runs[0].tasks[0].priority == 0
    assert count(sql, "workflow_runs") == 4 and count(sql, "task_runs") == 7


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        (RunRequest("one", [1]), InputError, "runs[2]: the run input must be a JSON object"),  # type: ignore[arg-type]
        (RunRequest("nope"), UnknownWorkflowError, "runs[2]: unknown workflow 'nope'"),
        (RunRequest("one", priority=10), InputError, "runs[2]: priority"),
        (RunRequest("one", delay=-5), InputError, "runs[2]: "),
        (RunRequest("one", start_at=datetime(2020, 1, 1, tzinfo=UTC)), InputError, "runs[2]: "),
        (RunRequest("one", delay=[1]), InputError, "runs[2]: start_at, delay"),  # type: ignore[arg-type]
    ],
    ids=["input", "workflow", "priority", "delay", "past", "unhashable"],
)
def test_a_bad_request_is_named_by_its_place_and_nothing_is_written(
    repo: Store, sql: Conn, bad: RunRequest, error: type[Exception], words: str
) -> None:
    requests = [RunRequest("one", {"n": 0}), RunRequest("one", {"n": 1}), bad]
    with pytest.raises(error) as raised:
        repo.trigger_batch(requests, _known(ONE))
    assert str(raised.value).startswith(words), raised.value
    assert count(sql, "workflow_runs") == 0


def test_a_key_used_for_another_request_fails_the_whole_batch_naming_it(
    repo: Store, sql: Conn
) -> None:
    repo.trigger(ONE, {"n": 1}, "k")
    requests = [RunRequest("one", {"n": 0}), RunRequest("one", {"n": 2}, "k")]
    with pytest.raises(TriggerConflictError, match=r"^runs\[1\]: idempotency key 'k'"):
        repo.trigger_batch(requests, _known(ONE))
    assert count(sql, "workflow_runs") == 1


def test_a_runs_json_is_what_asdict_made_of_it(repo: Store) -> None:
    """views.run_dict converts without deep copies (issue 22): the same JSON as before."""
    run = repo.get_run(repo.trigger(diamond(), {"deep": {"list": [1, {"x": None}]}}).run_id)
    before = {k: v for k, v in asdict(run).items() if k != "tasks"}
    before["tasks"] = [
        {**asdict(t), "duration_s": views.duration_s(t.started_at, t.finished_at)}
        for t in run.tasks
    ]
    before["compensated"] = list(run.compensated)
    assert views.dumps(views.run_dict(run)) == views.dumps(before)
