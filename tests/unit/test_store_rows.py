"""The store's object → parameter mappings against the named queries they feed (no database)."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from flowforge.api.app import ApiStatements
from flowforge.cli.statements import CliStatements
from flowforge.client import ClientStatements
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Finish
from flowforge.domain.plan import plan_runs, request_digest
from flowforge.domain.policy import RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.roles.publisher import PublisherStatements
from flowforge.roles.scheduler import SchedulerStatements
from flowforge.roles.worker import WorkerStatements
from flowforge.store import queries, rows
from flowforge.store.part import Part
from tests.store import PARTS, Store

#: Each caller's part of the store (what it may run is what it imports).
CALLERS = (
    WorkerStatements,
    SchedulerStatements,
    PublisherStatements,
    ClientStatements,
    ApiStatements,
    CliStatements,
)

PLACEHOLDER = re.compile(r"%\((?P<name>[a-z_][a-z0-9_]*)\)s")


def placeholders(name: str) -> set[str]:
    return set(PLACEHOLDER.findall(queries.load()[name].decode()))


def diamond() -> WorkflowDef:
    return WorkflowDef(
        name="wf",
        tasks=(
            TaskDef(name="a", handler="h.a", retry=RetryPolicy(max_attempts=4, base_delay=2.0)),
            TaskDef(name="b", handler="h.b", depends_on=("a",), ordering_key="k-{n}"),
            TaskDef(name="c", handler="h.c", depends_on=("a",), timeout=30.0),
            TaskDef(name="d", handler="h.d", depends_on=("b", "c")),
        ),
    )


def test_task_records_are_exactly_the_columns_insert_tasks_reads() -> None:
    plan = plan_runs(diamond(), [{"n": 1}, {"n": 2}])
    assert set(rows.task_records(plan.tasks)) == placeholders("insert_tasks") == {"tasks"}
    insert = queries.load()["insert_tasks"].decode()
    declared = insert.split("jsonb_to_recordset(%(tasks)s::jsonb)")[1].split("AS t(")[1]
    columns = {c.split()[0] for c in declared.split(")")[0].split(",")}
    assert set(rows.task_record(plan.tasks[0])) == columns


def test_task_records_carry_each_planned_task_in_order() -> None:
    plan = plan_runs(diamond(), [{"n": 1}, {"n": 2}])
    records = rows.task_records(plan.tasks, [False] * 7 + [True])["tasks"].obj
    assert len(records) == 8  # 2 runs x 4 tasks
    assert [r["name"] for r in records[:4]] == ["a", "b", "c", "d"]
    assert [r["pending_deps"] for r in records[:4]] == [0, 1, 1, 2]
    assert records[0]["max_attempts"] == 4 and records[0]["base_delay_s"] == 2.0
    assert [r["timeout_s"] for r in records[:4]] == [None, None, 30.0, None]
    assert [r["ordering_key"] for r in records] == [
        None,
        "k-1",
        None,
        None,
        None,
        "k-2",
        None,
        None,
    ]
    assert [r["run_id"] for r in records] == [str(plan.run_ids[0])] * 4 + [str(plan.run_ids[1])] * 4
    assert [r["admitted"] for r in records] == [False] * 7 + [True]
    assert json.loads(json.dumps(records)) == records  # plain JSON: text, numbers, null
    assert plan.ordering_keys() == ["k-1", "k-2"]


def test_tasks_of_keeps_only_the_runs_inserted() -> None:
    plan = plan_runs(diamond(), [{"n": 1}, {"n": 2}])
    assert plan.tasks_of(set(plan.run_ids)) is plan.tasks
    kept = plan.tasks_of({plan.run_ids[1]})
    assert [t.run_id for t in kept] == [plan.run_ids[1]] * 4
    edges = plan.edges_of({t.id for t in kept})
    assert len(edges.upstream) == len(edges.downstream) == 4  # a→b, a→c, b→d, c→d of run 2
    names = {t.id: t.name for t in kept}
    assert [names[u] for u in edges.upstream] == edges.names == ["a", "a", "b", "c"]


def test_finish_and_claim_parameters_are_those_of_their_queries() -> None:
    tid = uuid.uuid4()
    failed = Finish(TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="x\x00y")
    finish = rows.finish_columns([(tid, 3, failed)])
    assert set(finish) | {"offer", "queue", "min_priority", "publish"} == placeholders("finish")
    assert finish["outcomes"] == ["failed"] and finish["errors"] == ["x\ufffdy"]
    claim = rows.claim_params([(tid, 3)], "w1", 30.0, local=False)
    assert set(claim) == placeholders("claim")


def test_the_parts_share_no_name() -> None:
    """A name two parts both defined would silently resolve to one of them in a caller's
    composition (``WorkerStatements``, ``ApiStatements``, ... and tests/store.py's ``Store``)."""
    parts = [c for c in Store.__mro__ if c.__module__.startswith("flowforge.store.")]
    parts = [c for c in parts if c is not Part]
    assert {c.__name__ for c in parts} == {
        "Triggers",
        "Passes",
        "Claims",
        "Outbox",
        "Processes",
        "Operator",
        "Reads",
        "Schedules",
        "Maps",
        "Events",
        "Children",
        "Control",
        "Limits",
        "Gates",
        "Timelines",
    }
    owners: dict[str, list[str]] = {}
    for part in parts:
        for name in vars(part):
            if not name.startswith("__"):
                owners.setdefault(name, []).append(part.__name__)
    assert {name: who for name, who in owners.items() if len(who) > 1} == {}


@pytest.mark.parametrize("statements", CALLERS, ids=lambda c: c.__name__)
def test_a_callers_statements_compose_parts_and_add_no_statement(statements: type) -> None:
    """All SQL stays in the parts: a caller's class only names the parts it uses, and no
    caller is handed the whole store."""
    assert statements.__bases__ and all(
        issubclass(base, Part) and base.__module__.startswith("flowforge.store.")
        for base in statements.__bases__
    )
    own = [name for name, value in vars(statements).items() if callable(value)]
    assert own == []
    assert not set(PARTS) <= set(statements.__mro__)


def test_only_a_run_with_an_idempotency_key_carries_a_request_digest() -> None:
    workflow = diamond()
    plan = plan_runs(workflow, [{"n": 1}, {"n": 1}], ["k", None])
    assert plan.digests == [request_digest(workflow.name, plan.inputs[0]), None]
