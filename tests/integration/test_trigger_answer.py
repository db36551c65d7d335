"""A trigger's run built from what it wrote (``with_run``) is the run read back right after it.

``POST /api/v1/runs`` answers with the run it created. It used to read the run back after the
trigger (a round trip, three statements planned); the trigger now builds it from the rows its
answered inserts return (store/triggers.py ``Written``). Proven here against real PostgreSQL,
nothing else moving the tasks between the trigger and the read: the run built equals the run
``get_run`` reads, as dataclasses and as the api's JSON text (field order included), for runs
of every kind of task a trigger answers — a multi-task run with edges whose names sort
differently by code point and by a collation, timers, event waits, child-workflow tasks,
ordering and idempotency keys, breakers, queues and priorities; a map; a keyed run; a delayed
run with a deadline; an input whose keys jsonb reorders. A replayed key, and a run with a task
under a concurrency or rate key, answer no run (the caller reads it back). A trigger that
answers is still one round trip (libpq's trace, as tests/integration/test_pipelined.py counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flowforge import views
from flowforge.domain.breakers import CircuitBreaker
from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.model import Run, TriggerResult
from flowforge.store.triggers import Triggers
from tests.integration.test_pipelined import Traced
from tests.store import Store

pytestmark = pytest.mark.integration

CHILD = WorkflowDef("answer-child", (TaskDef("only", "tests.noop"),))
#: Every kind of task a trigger answers from its write, and edges into one task from upstream
#: names whose code-point order ("B" < "a-b" < "a_b" < "ab") is not every collation's.
EVERY_KIND = WorkflowDef(
    "answer-kinds",
    (
        TaskDef("a", "tests.noop", timeout=2.5, queue="answers", priority=3),
        TaskDef("B", "tests.noop", depends_on=("a",), idempotency_key="b-{order}"),
        TaskDef("ab", "tests.noop", depends_on=("a",), ordering_key="o-{order}"),
        TaskDef("a_b", "tests.noop", depends_on=("a",), circuit_breaker=CircuitBreaker(3, 60, 30)),
        TaskDef("a-b", "tests.noop", depends_on=("a",)),
        TaskDef("join", "tests.noop", depends_on=("ab", "a_b", "a-b", "B")),
        TaskDef("nap", sleep=5),
        TaskDef("hear", wait_for_event=EventWait("paid", "{order}", 60.0)),
        TaskDef("call", workflow="answer-child", input={"o": "{order}"}),
        TaskDef("undo", "tests.noop", depends_on=("join",), run_if=RunIf.ANY_FAILED),
    ),
)
MAP = WorkflowDef(
    "answer-map",
    (
        TaskDef("list", "tests.noop"),
        TaskDef("each", "tests.noop", for_each="list", max_parallel=4),
        TaskDef("after", "tests.noop", depends_on=("each",)),
    ),
)
#: jsonb orders keys (shorter first) and keeps the numbers as written: the answer shows what
#: the database stored, not what was sent.
INPUT: dict[str, Any] = {"order": 7, "zz": 1.0, "a": [1, {"y": None, "x": "é"}], "big": 1e20}


def assert_answered_as_read(store: Store, result: TriggerResult) -> Run:
    """``result.run`` equals the run read back, as data and as the api's JSON text."""
    built = result.run
    assert built is not None
    read = store.get_run(result.run_id)
    assert built == read
    assert views.dumps(views.run_dict(built)) == views.dumps(views.run_dict(read))
    return built


def test_a_run_of_every_kind_of_task_is_answered_as_read_back(repo: Store) -> None:
    result = repo.trigger(EVERY_KIND, INPUT, children=[CHILD], priority=5, with_run=True)
    run = assert_answered_as_read(repo, result)
    assert result.created and run.id == result.run_id
    assert sorted(t.name for t in run.tasks) == sorted(t.name for t in EVERY_KIND.tasks)
    assert run.task("join").depends_on == repo.get_run(run.id).task("join").depends_on
    assert len(run.task("join").depends_on) == 4
    assert run.task("a").state == "READY" and run.task("B").state == "PENDING"


def test_a_map_is_answered_as_read_back_with_no_items_yet(repo: Store) -> None:
    run = assert_answered_as_read(repo, repo.trigger(MAP, {"n": 1}, with_run=True))
    assert run.task("each").item_counts == {}
    assert run.task("list").item_counts is None


def test_a_keyed_run_is_answered_when_created_and_read_back_when_replayed(repo: Store) -> None:
    created = repo.trigger(EVERY_KIND, INPUT, "answer-key", children=[CHILD], with_run=True)
    run = assert_answered_as_read(repo, created)
    assert run.idempotency_key == "answer-key"
    replayed = repo.trigger(EVERY_KIND, INPUT, "answer-key", children=[CHILD], with_run=True)
    assert replayed == TriggerResult(created.run_id, created=False)
    assert replayed.run is None  # not written here: the caller reads it back


def test_a_delayed_run_with_a_deadline_is_answered_as_read_back(repo: Store) -> None:
    start = datetime.now(UTC) + timedelta(minutes=5)
    at = repo.trigger(MAP, {"n": 2}, start_at=start, deadline=90.5, with_run=True)
    run = assert_answered_as_read(repo, at)
    assert run.state == "SCHEDULED" and run.start_at == start
    assert run.task("list").waiting_on == "start_at"
    later = repo.trigger(
        EVERY_KIND, INPUT, children=[CHILD], delay=12.25, deadline=1 / 3, with_run=True
    )
    assert assert_answered_as_read(repo, later).deadline_at is not None


def test_a_run_with_a_concurrency_or_rate_key_is_left_to_read_back(repo: Store) -> None:
    for task in (
        TaskDef("t", "tests.noop", concurrency=Concurrency("c-{order}", 1)),
        TaskDef("t", "tests.noop", rate_limit=RateLimit(2, 1.0)),
    ):
        result = repo.trigger(WorkflowDef("answer-limited", (task,)), INPUT, with_run=True)
        assert result.created and result.run is None
        assert repo.get_run(result.run_id).id == result.run_id


def test_without_with_run_a_trigger_builds_no_run(repo: Store) -> None:
    result = repo.trigger(MAP, {"n": 3})
    assert result.created and result.run is None


@pytest.fixture
def traced(clean_database_url: str, tmp_path: Path) -> Iterator[Traced]:
    found = Traced(clean_database_url, tmp_path / "trace")
    yield found
    found.close()


def test_a_trigger_that_answers_with_its_run_is_still_one_round_trip(traced: Traced) -> None:
    """The answered inserts' rows come back with the trigger's one round trip; nothing is read
    after it (the api's POST was a second round trip of three statements: get_run,
    get_run_tasks, run_children)."""
    triggers = Triggers(traced.db)
    triggers.trigger(MAP, {"warm": True}, with_run=True)  # the definition registered
    got: list[TriggerResult] = []
    assert (
        traced.round_trips(lambda: got.append(triggers.trigger(MAP, {"n": 4}, with_run=True))) == 1
    )
    assert got[0].run is not None and len(got[0].run.tasks) == 3
