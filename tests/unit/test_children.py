"""Sub-workflows in the domain (``domain/children.py``, ``TaskDef.workflow``): what a
definition may say about its child, how the child's input is rendered, and which sets of
workflows are refused (unknown children, recursion)."""

from __future__ import annotations

from typing import Any

import pytest

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.children import referenced, render_input, unknown_children
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import RetryPolicy
from flowforge.errors import DefinitionError, InputError

RUN_INPUT = {"order": {"id": 7, "lines": [1, 2]}, "n": 3, "name": "bob"}
UPSTREAM = {"approve": {"total": 42.5, "by": None}}


def child(**task: Any) -> WorkflowDef:
    return WorkflowDef(
        "parent",
        (TaskDef("approve", "x.y"), TaskDef("invoice", workflow="invoicing", **task)),
    )


@pytest.mark.parametrize(
    ("template", "rendered"),
    [
        ({"o": "{order}"}, {"o": {"id": 7, "lines": [1, 2]}}),  # one field: its value, its type
        ({"n": "{n}"}, {"n": 3}),
        ({"t": "{upstream[approve][total]}"}, {"t": 42.5}),
        ({"b": "{upstream[approve][by]}"}, {"b": None}),
        ({"all": "{upstream}"}, {"all": UPSTREAM}),
        ({"s": "order {order[id]} of {name}"}, {"s": "order 7 of bob"}),  # else: text
        ({"first": "{order[lines][0]}"}, {"first": 1}),
        ({"lit": "{{n}}"}, {"lit": "{n}"}),  # doubled braces are literal
        ({"n": "{n!r}"}, {"n": "3"}),  # a conversion makes text
        (
            {"deep": [1, {"x": "{name}"}], "k": True, "none": None},
            {"deep": [1, {"x": "bob"}], "k": True, "none": None},
        ),
        ({}, {}),
    ],
)
def test_render_input_keeps_one_field_typed_and_formats_the_rest(
    template: dict[str, Any], rendered: dict[str, Any]
) -> None:
    assert render_input(template, RUN_INPUT, UPSTREAM, "task 'invoice'") == rendered


@pytest.mark.parametrize(
    "template",
    [{"x": "{missing}"}, {"x": "{order[nope]}"}, {"x": "{n[0]}"}, {"x": "{upstream[other]}"}],
)
def test_render_input_names_what_it_cannot_render(template: dict[str, Any]) -> None:
    with pytest.raises(InputError, match="task 'invoice': cannot render"):
        render_input(template, RUN_INPUT, UPSTREAM, "task 'invoice'")


def test_upstream_shadows_a_run_input_key_of_that_name() -> None:
    assert render_input({"u": "{upstream}"}, {"upstream": 1}, {}, "t") == {"u": {}}


@pytest.mark.parametrize(
    ("task", "fragment"),
    [
        ({"handler": "x.y"}, "both workflow and handler"),
        ({"sleep": 5.0}, "both workflow and sleep"),
        ({"timeout": 5.0}, "takes no timeout"),
        ({"idempotency_key": "k"}, "takes no idempotency_key"),
        ({"ordering_key": "k"}, "takes no ordering_key"),
        ({"input": {"x": "{a.b}"}}, "template field {a.b}"),
        ({"input": {"x": "{"}}, "malformed template"),
        ({"input": {"x": "{upstream[nope]}"}}, "not one of its dependencies"),
        ({"input": {"x": "{upstream[approve]}"}}, "not one of its dependencies"),  # no depends_on
        ({"input": {"x": float("nan")}}, "input"),
        ({"input": {"x": "\x00"}}, "input"),
        ({"input": [1]}, "input must be a mapping"),
    ],
)
def test_a_bad_child_task_is_refused_naming_the_field(task: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DefinitionError, match="invoice") as raised:
        child(**task)
    assert fragment in str(raised.value)


def test_input_without_workflow_and_a_workflow_starting_itself_are_refused() -> None:
    with pytest.raises(DefinitionError, match="input is only for a workflow: task"):
        TaskDef("t", "x.y", input={"a": 1})
    with pytest.raises(DefinitionError, match="cannot recurse into itself"):
        WorkflowDef("loop", (TaskDef("t", workflow="loop"),))
    with pytest.raises(DefinitionError, match="workflow 'bad name' is invalid"):
        TaskDef("t", workflow="bad name")


def test_retry_and_run_if_apply_to_a_child_task() -> None:
    task = TaskDef(
        "t",
        workflow="c",
        depends_on=("a",),
        retry=RetryPolicy(max_attempts=5),
        run_if="all_done",  # type: ignore[arg-type]
        input={"x": "{upstream[a]}"},
    )
    assert task.retry.max_attempts == 5 and task.handler == ""


def test_the_canonical_form_round_trips_and_leaves_other_digests_alone() -> None:
    wf = child(depends_on=("approve",), input={"t": "{upstream[approve][total]}", "k": [1]})
    again = workflow_from_mapping(wf.to_dict())
    assert again == wf and again.digest == wf.digest
    [_, invoice] = wf.to_dict()["tasks"]
    assert invoice["workflow"] == "invoicing" and "handler" not in invoice
    plain = WorkflowDef("p", (TaskDef("a", "x.y"),))
    assert "workflow" not in plain.to_dict()["tasks"][0]  # existing digests stay


def test_yaml_accepts_a_child_task_without_a_handler() -> None:
    wf = workflow_from_mapping(
        {"name": "p", "tasks": [{"name": "i", "workflow": "c", "input": {"a": "{b}"}}]}
    )
    assert wf.task("i").workflow == "c" and wf.task("i").input == {"a": "{b}"}


def test_unknown_children_names_each_unknown_child_and_each_cycle_once() -> None:
    a = WorkflowDef("a", (TaskDef("t", workflow="b"),))
    b = WorkflowDef("b", (TaskDef("t", workflow="c"), TaskDef("u", workflow="zz")))
    c = WorkflowDef("c", (TaskDef("t", workflow="a"),))
    d = WorkflowDef("d", (TaskDef("t", workflow="c"),))  # reaches the cycle, is not in it
    problems = unknown_children({"a": a, "b": b, "c": c, "d": d})
    assert ("b", "task 'u': workflow 'zz' is not defined (no loaded workflow has that name)") in (
        problems
    )
    cycles = [p for p in problems if "recurse" in p[1]]
    assert cycles == [("a", "workflows recurse into themselves: a -> b -> c -> a")]
    e = WorkflowDef("e", (TaskDef("t", workflow="f"), TaskDef("u", workflow="f")))
    f = WorkflowDef("f", (TaskDef("t", "x.y"),))
    assert unknown_children({"e": e, "f": f}) == []  # the same child twice is no cycle


def test_referenced_is_every_known_child_transitively() -> None:
    a = WorkflowDef("a", (TaskDef("t", workflow="b"), TaskDef("u", workflow="gone")))
    b = WorkflowDef("b", (TaskDef("t", workflow="c"),))
    c = WorkflowDef("c", (TaskDef("t", "x.y"),))
    assert [w.name for w in referenced(a, {"a": a, "b": b, "c": c})] == ["b", "c"]
    assert referenced(c, {"c": c}) == []
