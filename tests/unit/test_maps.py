"""Map tasks (``for_each``, SPEC 7.3): definitions, planning, item keys and bounds. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.dag import DEFAULT_MAX_ITEMS, TaskDef, WorkflowDef
from flowforge.domain.maps import ItemKeys, MapFailure, item_name, plan_items, summary
from flowforge.domain.plan import plan_runs
from flowforge.domain.reasons import FailureReason
from flowforge.domain.schedule import ScheduleDef
from flowforge.domain.states import TaskState
from flowforge.domain.transitions import is_legal
from flowforge.errors import DefinitionError
from flowforge.roles.context import TaskContext


def definition(**process: Any) -> dict[str, Any]:
    return {
        "name": "etl",
        "tasks": [
            {"name": "list", "handler": "etl.list"},
            {"name": "process", "handler": "etl.process", **process},
            {"name": "merge", "handler": "etl.merge", "depends_on": ["process"]},
        ],
    }


# ------------------------------------------------------------------ definitions


def test_for_each_makes_its_upstream_a_dependency_and_round_trips() -> None:
    wf = workflow_from_mapping(definition(for_each="list", max_parallel=5))
    process = wf.task("process")
    assert process.depends_on == ("list",) and process.for_each == "list"
    assert process.max_parallel == 5
    again = workflow_from_mapping(wf.to_dict())
    assert again == wf and again.digest == wf.digest
    listed = workflow_from_mapping(definition(for_each="list", depends_on=["list"]))
    assert listed.task("process").depends_on == ("list",)  # not listed twice


def test_definitions_without_maps_keep_their_digest() -> None:
    """No new key appears in the canonical form of a definition that does not use maps."""
    plain = workflow_from_mapping(definition(depends_on=["list"]))
    data = plain.to_dict()
    assert "max_items" not in data
    assert all("for_each" not in t and "max_parallel" not in t for t in data["tasks"])
    assert (
        plain.digest
        == WorkflowDef(
            "etl",
            (
                TaskDef("list", "etl.list"),
                TaskDef("process", "etl.process", depends_on=("list",)),
                TaskDef("merge", "etl.merge", depends_on=("process",)),
            ),
        ).digest
    )


@pytest.mark.parametrize(
    ("process", "message"),
    [
        ({"for_each": "nowhere"}, "for_each names unknown task 'nowhere'"),
        ({"for_each": "process"}, "for_each names the task itself"),
        ({"for_each": "merge"}, "for_each names 'merge', which is not upstream of it"),
        ({"max_parallel": 2}, "max_parallel is only for a for_each task"),
        ({"for_each": "list", "max_parallel": 0}, "max_parallel must be a whole number"),
        ({"for_each": "list", "max_parallel": 10**9}, "max_parallel must be a whole number"),
        ({"for_each": "list", "max_parallel": True}, "max_parallel"),
        ({"for_each": "list", "max_parallel": "3"}, "max_parallel"),
        ({"for_each": 7}, "for_each"),
        ({"for_each": "bad name!"}, "for_each"),
        ({"for_each": "li\x00st"}, "for_each"),
        ({"for_each": "list", "idempotency_key": "{item.__class__}"}, "idempotency_key"),
    ],
)
def test_bad_for_each_definitions_are_refused_naming_the_field(
    process: dict[str, Any], message: str
) -> None:
    with pytest.raises(DefinitionError, match=message.replace("(", r"\(")):
        workflow_from_mapping(definition(**process))


@pytest.mark.parametrize("bad", [0, -1, 10**7, 1.5, "10", True, None])
def test_max_items_must_be_a_whole_number_in_range(bad: Any) -> None:
    data = {**definition(for_each="list"), "max_items": bad}
    if bad is None:
        assert workflow_from_mapping(data).max_items is None
        return
    with pytest.raises(DefinitionError, match="max_items"):
        workflow_from_mapping(data)


def test_a_timer_cannot_map() -> None:
    with pytest.raises(DefinitionError, match="sleep task cannot have for_each"):
        TaskDef("nap", sleep=1.0, for_each="list")


def test_a_schedule_input_need_not_fill_a_map_template_with_item_fields() -> None:
    """A map's key templates are rendered per item, at expansion, not when a run is planned."""
    wf = WorkflowDef(
        "etl",
        (
            TaskDef("list", "etl.list"),
            TaskDef("process", "etl.process", for_each="list", idempotency_key="{item[id]}"),
        ),
        schedules=(ScheduleDef(cron="* * * * *"),),
    )
    assert wf.task("process").idempotency_key == "{item[id]}"


# ------------------------------------------------------------------ planning


def test_a_planned_map_row_carries_for_each_and_no_rendered_keys() -> None:
    wf = WorkflowDef(
        "etl",
        (
            TaskDef("list", "etl.list"),
            TaskDef(
                "process",
                "etl.process",
                for_each="list",
                max_parallel=3,
                idempotency_key="{index}",
                ordering_key="{item}",
            ),
        ),
    )
    plan = plan_runs(wf, [{}])
    process = next(t for t in plan.tasks if t.name == "process")
    assert (process.for_each, process.max_parallel, process.pending) == ("list", 3, 1)
    assert process.idempotency_key is None and process.ordering_key is None
    listing = next(t for t in plan.tasks if t.name == "list")
    assert listing.for_each is None and listing.max_parallel is None


# ------------------------------------------------------------------ expansion judgement


@pytest.mark.parametrize(
    ("source", "kind"),
    [({"a": 1}, "dict"), ("abc", "str"), (3, "int"), (None, "null"), (True, "bool")],
)
def test_a_result_that_is_not_a_list_is_not_a_list(source: Any, kind: str) -> None:
    planned = plan_items(source, {}, {}, None, source_name="'list'")
    assert isinstance(planned, MapFailure)
    assert planned.reason is FailureReason.NOT_A_LIST
    assert planned.error == f"for_each: the result of 'list' must be a JSON list, not {kind}"


def test_max_items_bounds_the_list_inclusive_and_defaults_to_ten_thousand() -> None:
    assert isinstance(plan_items([0] * 3, {}, {}, 3), ItemKeys)
    too_many = plan_items([0] * 4, {}, {}, 3)
    assert isinstance(too_many, MapFailure)
    assert too_many.reason is FailureReason.TOO_MANY_ITEMS and "max_items (3)" in too_many.error
    assert DEFAULT_MAX_ITEMS == 10_000
    assert isinstance(plan_items([0] * 10_000, {}, {}, None), ItemKeys)
    over = plan_items([0] * 10_001, {}, {}, None)
    assert isinstance(over, MapFailure) and over.reason is FailureReason.TOO_MANY_ITEMS


def test_an_empty_list_plans_no_item() -> None:
    assert plan_items([], {}, {"idempotency_key": "{item}"}, None) == ItemKeys([], [], [], [], [])


def test_item_keys_render_item_index_item_fields_and_the_run_input() -> None:
    templates = {"idempotency_key": "{tenant}/{index}/{item[id]}", "ordering_key": "{item[k][0]}"}
    planned = plan_items(
        [{"id": "a", "k": ["x"]}, {"id": 2, "k": ["y"]}], {"tenant": "t"}, templates, None
    )
    assert planned == ItemKeys(
        ["t/0/a", "t/1/2"], ["x", "y"], [None, None], [None, None], [None, None]
    )
    # item and index shadow run-input keys of the same names
    shadowed = plan_items(
        ["v"], {"item": "input", "index": 9}, {"idempotency_key": "{item}{index}"}, None
    )
    assert shadowed == ItemKeys(["v0"], [None], [None], [None], [None])


@pytest.mark.parametrize(
    ("items", "template"),
    [
        ([{"id": 1}, {"other": 2}], "{item[id]}"),  # a missing field
        ([1], "{item[id]}"),  # a scalar has no field
        (["a\x00b"], "{item}"),  # PostgreSQL text cannot hold NUL
        (["x" * 5000], "{item}"),  # over the key size limit
        ([1], "{missing}"),  # not in the run input either
    ],
)
def test_an_item_that_cannot_fill_a_key_template_fails_the_map(
    items: list[Any], template: str
) -> None:
    planned = plan_items(items, {}, {"idempotency_key": template}, None)
    assert isinstance(planned, MapFailure) and planned.reason is FailureReason.ITEM_KEY_ERROR
    assert planned.error.startswith("item ")


def test_item_names_and_the_map_transitions() -> None:
    assert item_name("process", 12) == "process[12]"
    assert is_legal(TaskState.PENDING, TaskState.RUNNING)  # expansion
    assert is_legal(TaskState.PENDING, TaskState.DEAD)  # burial
    assert is_legal(TaskState.RUNNING, TaskState.SUCCEEDED)  # settled


def test_a_handler_context_has_no_item_unless_it_is_an_item() -> None:
    import uuid

    plain = TaskContext({}, {}, 1, uuid.uuid4(), uuid.uuid4(), "t")
    assert plain.item is None and plain.index is None
    item = TaskContext({}, {}, 1, uuid.uuid4(), uuid.uuid4(), "t[3]", item={"a": 1}, index=3)
    assert item.item == {"a": 1} and item.index == 3


def test_a_maps_items_are_summed_up_in_one_line_most_first() -> None:
    assert summary({"RUNNING": 50, "SUCCEEDED": 200}) == "250 items: 200 SUCCEEDED, 50 RUNNING"
    assert summary({"DEAD": 1}) == "1 item: 1 DEAD"
    assert summary({}) == "0 items"
