"""Workflow DAG validation, ordering, digest, key templates and cycle detection."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.domain.dag import OnDead, TaskDef, WorkflowDef, find_cycle
from flowforge.domain.keys import check_template, render_key
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.errors import DefinitionError, InputError

FAST = settings(database=None, deadline=None, max_examples=200)


def t(name: str, *deps: str, **kwargs: object) -> TaskDef:
    return TaskDef(name=name, handler=f"h.{name}", depends_on=deps, **kwargs)  # type: ignore[arg-type]


def wf(*tasks: TaskDef, name: str = "wf") -> WorkflowDef:
    return WorkflowDef(name=name, tasks=tasks)


# ------------------------------------------------------------------ validation


def test_valid_workflow_is_built() -> None:
    w = wf(t("a"), t("b", "a"), t("c", "a", "b"))
    assert [x.name for x in w.tasks] == ["a", "b", "c"]
    assert w.task("c").depends_on == ("a", "b")


def test_task_lookup_raises_key_error_for_unknown_name() -> None:
    with pytest.raises(KeyError):
        wf(t("a")).task("zzz")


def test_unknown_dependency_is_refused_naming_it() -> None:
    with pytest.raises(DefinitionError, match=r"'b' depends on unknown task 'ghost'"):
        wf(t("a"), t("b", "ghost"))


def test_dependency_declared_after_dependent_is_accepted() -> None:
    w = wf(t("b", "a"), t("a"))
    assert [x.name for x in w.topological_order()] == ["a", "b"]


def test_two_task_cycle_is_refused_with_its_path() -> None:
    with pytest.raises(DefinitionError, match=r"dependency cycle a -> b -> a"):
        wf(t("a", "b"), t("b", "a"))


def test_longer_cycle_is_refused_with_its_path() -> None:
    with pytest.raises(DefinitionError, match=r"dependency cycle b -> c -> d -> b"):
        wf(t("a"), t("b", "c"), t("c", "d"), t("d", "b", "a"))


def test_self_dependency_is_refused_as_cycle() -> None:
    with pytest.raises(DefinitionError, match=r"dependency cycle a -> a"):
        wf(t("a", "a"))


def test_duplicate_task_names_are_refused() -> None:
    with pytest.raises(DefinitionError, match=r"duplicate task name 'a'"):
        wf(t("a"), t("b"), t("a"))


def test_empty_workflow_is_refused() -> None:
    with pytest.raises(DefinitionError, match="has no tasks"):
        WorkflowDef(name="wf", tasks=())


@pytest.mark.parametrize(
    "name", ["", "has space", "slash/name", "x" * 129, "-leading-dash", ".dot", "é"]
)
def test_bad_workflow_name_is_refused(name: str) -> None:
    with pytest.raises(DefinitionError, match="workflow name"):
        WorkflowDef(name=name, tasks=(t("a"),))


@pytest.mark.parametrize("name", ["", "a b", "a/b", "x" * 129, "{a}"])
def test_bad_task_name_is_refused(name: str) -> None:
    with pytest.raises(DefinitionError, match="task name"):
        TaskDef(name=name, handler="h")


@pytest.mark.parametrize("handler", ["", "a b", "pkg/mod", "x" * 129])
def test_bad_handler_name_is_refused(handler: str) -> None:
    with pytest.raises(DefinitionError, match="handler"):
        TaskDef(name="a", handler=handler)


def test_name_of_max_length_with_allowed_punctuation_is_accepted() -> None:
    name = "A" + "b_.-9" * 25 + "xx"
    assert len(name) == 128
    assert TaskDef(name=name, handler="payments.charge-v2").name == name


@pytest.mark.parametrize("name", ["charge\n", "order-fulfilment\n"])
def test_name_with_trailing_newline_is_refused(name: str) -> None:
    # BUG: NAME_PATTERN ends with `$`, which also matches just before a trailing "\n";
    # `re.match` therefore accepts "charge\n". Use `\Z` or `fullmatch`.
    with pytest.raises(DefinitionError):
        TaskDef(name=name, handler="h")
    with pytest.raises(DefinitionError):
        WorkflowDef(name=name, tasks=(t("a"),))


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_non_positive_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(DefinitionError, match="timeout"):
        t("a", timeout=timeout)


def test_nan_timeout_is_refused() -> None:
    # BUG: `timeout <= 0` is False for NaN, so a NaN timeout passes validation.
    with pytest.raises(DefinitionError, match="timeout"):
        t("a", timeout=float("nan"))


# ------------------------------------------------------------------ key templates


@pytest.mark.parametrize(
    "template",
    ["charge-{order_id}", "{a}-{b_2}", "{items[0]}", "{order[id]}", "plain", "{{literal}}"],
)
def test_valid_templates_are_accepted(template: str) -> None:
    check_template(template, "key")
    t("a", idempotency_key=template, ordering_key=template)


@pytest.mark.parametrize(
    "template",
    ["{x.__class__}", "{order.id}", "{x[0].__class__}", "{0}", "{}", "{x[0]__class__}"],
)
def test_template_with_attribute_access_or_positional_field_is_refused(template: str) -> None:
    with pytest.raises(DefinitionError, match="template field"):
        check_template(template, "task 'a': idempotency_key")


@pytest.mark.parametrize("template", ["charge-{order_id", "charge-}", "{", "a}b{"])
def test_template_with_malformed_braces_is_refused(template: str) -> None:
    with pytest.raises(DefinitionError, match="malformed template"):
        check_template(template, "key")


def test_task_def_refuses_bad_ordering_key_template_naming_field() -> None:
    with pytest.raises(DefinitionError, match="ordering_key"):
        t("a", ordering_key="customer-{c.__dict__}")


def test_template_with_attribute_access_in_nested_format_spec_is_refused() -> None:
    # BUG: check_template only inspects top-level field names; a replacement field nested
    # in the format spec ("{x:{y.__class__}}") is never checked, yet str.format evaluates it.
    with pytest.raises(DefinitionError):
        check_template("{x:{y.__class__}}", "key")


def test_render_key_formats_from_input() -> None:
    run_input = {"order_id": 42, "items": ["a", "b"], "c": {"id": "x"}}
    assert render_key("charge-{order_id}", run_input, "k") == "charge-42"
    assert render_key("{items[1]}/{c[id]}", run_input, "k") == "b/x"


def test_render_key_raises_input_error_naming_missing_key() -> None:
    with pytest.raises(InputError) as info:
        render_key("charge-{order_id}", {"customer": 1}, "task 'charge' idempotency_key")
    message = str(info.value)
    assert "order_id" in message and "task 'charge' idempotency_key" in message


def test_render_key_raises_input_error_for_missing_index() -> None:
    with pytest.raises(InputError, match="items"):
        render_key("{items[5]}", {"items": [1]}, "key")


def test_render_key_never_leaks_a_non_input_error() -> None:
    # Follows from the nested-format-spec gap: the AttributeError escapes render_key instead
    # of becoming an InputError (a raw exception in trigger, i.e. a 500 / a traceback).
    with pytest.raises(InputError):
        render_key("{x:{y.missing}}", {"x": 1, "y": 2}, "key")


# ------------------------------------------------------------------ ordering and digest


def test_topological_order_puts_dependencies_first() -> None:
    w = wf(t("ship", "pack"), t("pack", "charge"), t("charge"))
    assert [x.name for x in w.topological_order()] == ["charge", "pack", "ship"]


def test_topological_order_keeps_declaration_order_for_independent_tasks() -> None:
    w = wf(t("z"), t("m"), t("a"), t("q"))
    assert [x.name for x in w.topological_order()] == ["z", "m", "a", "q"]


def test_topological_order_keeps_declaration_order_among_ready_tasks() -> None:
    w = wf(t("d", "a"), t("c", "a"), t("a"), t("b"))
    assert [x.name for x in w.topological_order()] == ["a", "b", "d", "c"]


def test_digest_is_stable_for_equal_definitions() -> None:
    first = wf(t("a"), t("b", "a", idempotency_key="k-{x}"))
    second = wf(t("a"), t("b", "a", idempotency_key="k-{x}"))
    assert first.digest == second.digest
    assert len(first.digest) == 64 and int(first.digest, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"handler": "h.other"},
        {"depends_on": ()},
        {"retry": RetryPolicy(max_attempts=5)},
        {"retry": RetryPolicy(jitter=Jitter.EQUAL)},
        {"timeout": 30.0},
        {"idempotency_key": "k-{y}"},
        {"ordering_key": "o-{x}"},
        {"on_dead": OnDead.BLOCK},
    ],
)
def test_digest_changes_when_a_task_changes(change: dict[str, object]) -> None:
    base = wf(t("a"), t("b", "a", idempotency_key="k-{x}"))
    changed_b = dataclasses.replace(base.task("b"), **change)  # type: ignore[arg-type]
    changed = wf(t("a"), changed_b)
    assert changed.digest != base.digest


def test_digest_changes_with_workflow_name_and_fail_fast() -> None:
    base = wf(t("a"))
    assert wf(t("a"), name="other").digest != base.digest
    assert WorkflowDef(name="wf", tasks=(t("a"),), fail_fast=False).digest != base.digest


def test_equal_definitions_have_equal_digests_across_int_and_float() -> None:
    # BUG: to_dict() copies numbers as given, so base_delay=1 (Python API) and 1.0 (YAML,
    # where the schema converts to float) serialise as "1" vs "1.0": the definitions
    # compare equal but their digests differ, so one workflow registers twice.
    as_int = wf(t("a", retry=RetryPolicy(base_delay=1, max_delay=60), timeout=30))
    as_float = wf(t("a", retry=RetryPolicy(base_delay=1.0, max_delay=60.0), timeout=30.0))
    assert as_int == as_float
    assert as_int.digest == as_float.digest


# ------------------------------------------------------------------ find_cycle


def test_find_cycle_returns_none_for_dag_and_ignores_unknown_targets() -> None:
    assert find_cycle({"a": [], "b": ["a"], "c": ["a", "b", "elsewhere"]}) is None


def test_find_cycle_returns_closed_path() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]


@st.composite
def dags(draw: st.DrawFn) -> dict[str, list[str]]:
    n = draw(st.integers(1, 12))
    edges: dict[str, list[str]] = {}
    for i in range(n):
        lower = draw(st.lists(st.integers(0, i - 1), unique=True)) if i else []
        edges[f"n{i}"] = [f"n{j}" for j in lower]
    return edges


@FAST
@given(dags())
def test_find_cycle_finds_none_when_edges_go_only_to_lower_indexes(
    edges: dict[str, list[str]],
) -> None:
    assert find_cycle(edges) is None


@FAST
@given(dags(), st.data())
def test_find_cycle_finds_a_real_cycle_after_adding_a_back_edge(
    edges: dict[str, list[str]], data: st.DataObject
) -> None:
    forward = [(src, dst) for src, dsts in edges.items() for dst in dsts]
    if forward:
        src, dst = data.draw(st.sampled_from(forward))
        edges[dst] = [*edges[dst], src]
    else:
        node = data.draw(st.sampled_from(sorted(edges)))
        edges[node] = [*edges[node], node]
    cycle = find_cycle(edges)
    assert cycle is not None
    assert cycle[0] == cycle[-1]
    assert len(cycle) >= 2
    for a, b in itertools.pairwise(cycle):
        assert b in edges[a]


@FAST
@given(dags())
def test_topological_order_of_random_dag_respects_every_dependency(
    edges: dict[str, list[str]],
) -> None:
    w = WorkflowDef(name="wf", tasks=tuple(t(name, *deps) for name, deps in edges.items()))
    order = [x.name for x in w.topological_order()]
    assert sorted(order) == sorted(edges)
    position = {name: i for i, name in enumerate(order)}
    for name, deps in edges.items():
        for dep in deps:
            assert position[dep] < position[name]


def test_a_dependency_listed_twice_is_refused() -> None:
    with pytest.raises(DefinitionError, match="twice"):
        WorkflowDef("w", (TaskDef("a", "h"), TaskDef("b", "h", depends_on=("a", "a"))))
