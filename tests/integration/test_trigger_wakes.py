"""Whom a trigger wakes, decided from its plan.

After its commit a trigger notifies the publisher if it created a task READY and the scheduler
if it created one PENDING (queries.sql ``notify_new_tasks``). It knows which from the plan,
:meth:`PlannedTask.created_ready`, instead of reading the new tasks back — a read that was
planned at every call ("Submitting work, part 4" in docs/performance.md). The insert decides
the state in SQL (``new_tasks``' ``k.ready``), so the two are checked against each other here,
for every kind of task a trigger creates, limited tasks admitted and held back included.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.plan import PlannedTask
from flowforge.store import rows
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers
from tests.helpers import heard
from tests.integration.test_trigger_answer import CHILD, EVERY_KIND, INPUT, MAP

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[Any]
ONE = WorkflowDef("wakes-one", (TaskDef("only", "tests.noop"),))
TWO = WorkflowDef("wakes-two", (TaskDef("a", "tests.noop"), TaskDef("b", "tests.noop", ("a",))))
#: A first task that waits for its ordering stream (EVERY_KIND's keyed task has a dependency).
ORDERED = WorkflowDef("wakes-ordered", (TaskDef("t", "tests.noop", ordering_key="k-{n}"),))
LIMITED = (
    WorkflowDef("wakes-slots", (TaskDef("t", "tests.noop", concurrency=Concurrency("slot", 1)),)),
    WorkflowDef("wakes-rate", (TaskDef("t", "tests.noop", rate_limit=RateLimit(1, 3600.0)),)),
)


@pytest.fixture
def predicted(monkeypatch: pytest.MonkeyPatch) -> dict[UUID, bool]:
    """Every task a trigger inserts while the test runs: whether its plan says it is created
    READY (read where the trigger builds the insert's records, with the admissions)."""
    found: dict[UUID, bool] = {}
    original = rows.task_records

    def spy(tasks: Sequence[PlannedTask], admitted: Sequence[bool] | None = None) -> Any:
        flags = list(admitted) if admitted is not None else [False] * len(tasks)
        found.update({t.id: t.created_ready(a) for t, a in zip(tasks, flags, strict=True)})
        return original(tasks, admitted)

    monkeypatch.setattr(rows, "task_records", spy)
    return found


def test_the_plan_says_which_tasks_the_insert_creates_ready_for_every_kind(
    db: Database, sql: Conn, predicted: dict[UUID, bool]
) -> None:
    triggers = Triggers(db)
    triggers.trigger(EVERY_KIND, INPUT, children=[CHILD], priority=5)
    triggers.trigger(MAP, {"n": 1})
    triggers.trigger(ORDERED, {"n": 1})
    triggers.trigger(TWO, {"n": 1}, start_at=datetime.now(UTC) + timedelta(minutes=5))
    for workflow in LIMITED:  # the first run is admitted; the second waits for the first
        triggers.trigger(workflow, {"n": 1})
        triggers.trigger(workflow, {"n": 2})
    written = {row[0]: row[1] for row in sql.execute("SELECT id, state FROM task_runs")}
    assert set(written) == set(predicted)
    assert {i: s == "READY" for i, s in written.items()} == predicted
    assert sum(predicted.values()) == 4  # EVERY_KIND's "a", MAP's "list", two admitted
    assert set(written.values()) == {"READY", "PENDING"}


def test_a_trigger_wakes_the_publisher_for_ready_tasks_and_the_scheduler_for_pending_ones(
    db: Database, listening: Conn
) -> None:
    triggers = Triggers(db)
    triggers.trigger(ONE, {"n": 1})
    assert heard(listening) == {"flowforge_outbox"}
    triggers.trigger(ONE, {"n": 2}, delay=300.0)  # its one task waits behind its start gate
    assert heard(listening) == {"flowforge_scheduler"}
    triggers.trigger(TWO, {"n": 3})
    assert heard(listening) == {"flowforge_outbox", "flowforge_scheduler"}
    triggers.trigger_many(ONE, [{"n": n} for n in range(50)])
    assert heard(listening) == {"flowforge_outbox"}
