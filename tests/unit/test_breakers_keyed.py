"""A circuit breaker per key (``circuit_breaker.key``, docs/flow-control.md "A breaker per key"),
the parts without services: bad key templates refused by class on every path (the class,
``TaskDef(...)``, YAML, a schedule's input), the key rendered into the plan (never '': that is
the handler's breaker), a map's items rendering theirs per item, the digest only when set, the
key an operator types, and /metrics' bound on keyed series.
"""

from __future__ import annotations

from typing import Any

import pytest

from flowforge.api.metrics import MAX_KEYED_SERIES, _gate_metrics
from flowforge.definitions import workflow_from_mapping
from flowforge.domain.breakers import (
    BreakerGauge,
    BreakerState,
    CircuitBreaker,
    GateGauges,
    breaker_name,
    check_breaker_key,
)
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.maps import ItemKeys, MapFailure, plan_items
from flowforge.domain.plan import plan_runs
from flowforge.domain.reasons import FailureReason
from flowforge.domain.schedule import ScheduleDef, ScheduleError
from flowforge.domain.values import MAX_KEY_BYTES
from flowforge.errors import DefinitionError, InputError

#: key templates refused, one per class: malformed braces (open, stray close), a field that is
#: not an input lookup (positional, empty, attribute, call), a nested field in a format spec
#: that is not one either, a NUL in the literal text, not text at all.
BAD_TEMPLATES: list[Any] = [
    "partner-{region",
    "partner-}",
    "partner-{0}",
    "partner-{}",
    "partner-{region.__class__}",
    "partner-{region()}",
    "partner-{region:{width.x}}",
    "partner-\x00",
    5,
    b"partner",
]


def keyed(key: Any = "partner-{region}") -> CircuitBreaker:
    return CircuitBreaker(3, 60, 30, key=key)


@pytest.mark.parametrize("template", BAD_TEMPLATES, ids=repr)
def test_the_class_refuses_a_bad_key_template(template: Any) -> None:
    with pytest.raises(DefinitionError, match=r"circuit_breaker\.key"):
        keyed(template)


@pytest.mark.parametrize("template", BAD_TEMPLATES, ids=repr)
def test_a_taskdef_with_a_bad_key_template_is_never_built(template: Any) -> None:
    with pytest.raises(DefinitionError, match=r"circuit_breaker\.key"):
        TaskDef("call", "partner.call", circuit_breaker=keyed(template))


@pytest.mark.parametrize("template", BAD_TEMPLATES, ids=repr)
def test_yaml_refuses_a_bad_key_template_at_its_key(template: Any) -> None:
    data = {
        "name": "calls",
        "tasks": [
            {
                "name": "call",
                "handler": "partner.call",
                "circuit_breaker": {
                    "failures": 3,
                    "window": "60s",
                    "cooldown": "30s",
                    "key": template,
                },
            }
        ],
    }
    with pytest.raises(DefinitionError, match=r"wf\.yaml: tasks\[0\]\.circuit_breaker"):
        workflow_from_mapping(data, "wf.yaml")


def test_yaml_takes_a_key() -> None:
    data = {
        "name": "calls",
        "tasks": [
            {
                "name": "call",
                "handler": "partner.call",
                "circuit_breaker": {"failures": 3, "window": "1m", "cooldown": 30, "key": "p-{r}"},
            }
        ],
    }
    task = workflow_from_mapping(data, "wf.yaml").tasks[0]
    assert task.circuit_breaker == CircuitBreaker(3, 60.0, 30.0, key="p-{r}")


def test_the_digest_has_the_key_only_when_set() -> None:
    def workflow(breaker: CircuitBreaker) -> WorkflowDef:
        return WorkflowDef("calls", (TaskDef("call", "partner.call", circuit_breaker=breaker),))

    plain, keyed_one = workflow(CircuitBreaker(3, 60, 30)), workflow(keyed())
    assert "key" not in plain.to_dict()["tasks"][0]["circuit_breaker"]
    assert keyed_one.to_dict()["tasks"][0]["circuit_breaker"]["key"] == "partner-{region}"
    assert keyed_one.digest != plain.digest
    assert workflow(keyed("partner-{zone}")).digest != keyed_one.digest


def test_the_plan_renders_the_key_over_the_run_input() -> None:
    wf = WorkflowDef(
        "calls",
        (
            TaskDef("call", "partner.call", circuit_breaker=keyed()),
            TaskDef("other", "partner.call", circuit_breaker=CircuitBreaker(3, 60, 30)),
            TaskDef("free", "partner.call"),
        ),
    )
    planned = {t.name: t.breaker_key for t in plan_runs(wf, [{"region": "eu"}]).tasks}
    assert planned == {"call": "partner-eu", "other": None, "free": None}


@pytest.mark.parametrize(
    ("run_input", "problem"),
    [
        ({"zone": "eu"}, "cannot format"),  # the field is missing
        ({"region": ""}, "empty"),  # '' would be the handler's own breaker
        ({"region": "x" * (MAX_KEY_BYTES + 1)}, "over the limit"),
    ],
    ids=["missing", "empty", "too long"],
)
def test_a_key_that_cannot_render_refuses_the_trigger(run_input: Any, problem: str) -> None:
    template = "{region}" if problem == "empty" else "p-{region}"
    wf = WorkflowDef("calls", (TaskDef("call", "partner.call", circuit_breaker=keyed(template)),))
    with pytest.raises(InputError, match=rf"task 'call' circuit_breaker\.key.*{problem}"):
        plan_runs(wf, [run_input])


def test_a_schedule_whose_input_cannot_render_the_key_is_refused_at_definition() -> None:
    task = TaskDef("call", "partner.call", circuit_breaker=keyed("{region}"))
    for schedule_input, problem in (({"zone": "eu"}, "cannot format"), ({"region": ""}, "empty")):
        schedule = ScheduleDef(every="1h", input=schedule_input)
        with pytest.raises(ScheduleError, match=rf"circuit_breaker\.key.*{problem}"):
            WorkflowDef("calls", (task,), schedules=(schedule,))


def test_a_maps_items_render_their_key_per_item_and_a_bad_one_buries_the_map() -> None:
    wf = WorkflowDef(
        "mapped",
        (
            TaskDef("list", "tests.noop"),
            TaskDef(
                "process", "partner.call", for_each="list", circuit_breaker=keyed("p-{item[r]}")
            ),
        ),
    )
    assert {t.name: t.breaker_key for t in plan_runs(wf, [{}]).tasks}["process"] is None
    definition = wf.to_dict()["tasks"][1]
    planned = plan_items([{"r": "eu"}, {"r": "us"}], {}, definition, None)
    assert isinstance(planned, ItemKeys) and planned.breaker_keys == ["p-eu", "p-us"]
    for bad in ([{"r": "eu"}, {"x": 1}], [{"r": ""}]):
        failed = plan_items(bad, {}, {"circuit_breaker": {"key": "{item[r]}"}}, None)
        assert isinstance(failed, MapFailure) and failed.reason is FailureReason.ITEM_KEY_ERROR
    nothing = [None, None]
    assert plan_items([1, 2], {}, {}, None) == ItemKeys(nothing, nothing, nothing, nothing, nothing)


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "empty"),
        (5, "must be text"),
        (None, "must be text"),
        ("a\x00b", "NUL"),
        ("x" * (MAX_KEY_BYTES + 1), "over the limit"),
    ],
    ids=["empty", "int", "none", "nul", "too long"],
)
def test_an_operators_key_is_checked_like_a_rendered_one(key: Any, problem: str) -> None:
    with pytest.raises(InputError, match=rf"--key.*{problem}"):
        check_breaker_key(key, "--key")


def test_messages_name_the_key_only_for_a_keyed_breaker() -> None:
    assert breaker_name("p.call", "") == "breaker of handler 'p.call'"
    assert breaker_name("p.call", None) == "breaker of handler 'p.call'"
    assert breaker_name("p.call", "eu") == "breaker of handler 'p.call' key 'eu'"


def _gauge(key: str, state: BreakerState) -> BreakerGauge:
    return BreakerGauge("p.call", key, state, {BreakerState.OPEN: 1})


def test_metrics_show_keyed_breakers_not_closed_bounded_and_count_them_all() -> None:
    extra = 7
    gauges = GateGauges(
        (
            _gauge("", BreakerState.CLOSED),
            *(_gauge(f"k{i}", BreakerState.OPEN) for i in range(MAX_KEYED_SERIES + extra)),
            _gauge("shut", BreakerState.CLOSED),
        ),
        {},
    )
    families = {m.name: m for m in _gate_metrics(gauges)}
    shown = families["flowforge_breaker_state"].samples
    assert [s.labels["key"] for s in shown][:2] == ["", "k0"]
    assert len(shown) == 1 + MAX_KEYED_SERIES  # the handler's own, then the bound
    assert "shut" not in {s.labels["key"] for s in shown}  # a closed keyed one reads absent
    (count,) = families["flowforge_breakers_keyed_not_closed"].samples
    assert count.value == MAX_KEYED_SERIES + extra
    moved = {
        s.labels["to_state"]: s.value
        for s in families["flowforge_breaker_transitions"].samples
        if s.name.endswith("_total")
    }
    assert moved == {"open": MAX_KEYED_SERIES + extra + 2}  # summed over the handler's keys
