"""Circuit breakers and pauses (issue 20, SPEC 7.4; docs/flow-control.md "Circuit breakers and
pauses"), the parts without services: ``circuit_breaker: {failures, window, cooldown}`` refused by
class of bad value on every path (the Python API, YAML with numbers and with durations), the
digest only when set, the plan's columns, names an operator may pause, which failures count, and
the gate's place in queries.sql (the claim, and nowhere else on the way to READY).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.breakers import (
    COUNTED_FAILURES,
    MAX_BREAKER_FAILURES,
    MAX_BREAKER_SPAN_S,
    CircuitBreaker,
    PauseScope,
    Waiting,
    check_handler_name,
    check_pause_target,
)
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.plan import plan_runs
from flowforge.domain.reasons import FailureReason
from flowforge.errors import DefinitionError, InputError
from flowforge.store import queries

SQL = Path(queries.__file__).with_name("queries.sql").read_text()

#: failures refused, one per class: zero, negative, over the bound, a bool, a float, text, None.
BAD_FAILURES: list[Any] = [0, -1, MAX_BREAKER_FAILURES + 1, True, 2.5, "3", None]
#: window and cooldown refused from Python, one per class: zero, negative, over the bound (a
#: day), a bool, NaN, infinity, text (a duration is YAML's), None.
BAD_SPANS: list[Any] = [
    0,
    -5,
    MAX_BREAKER_SPAN_S + 1,
    True,
    float("nan"),
    float("inf"),
    "30s",
    None,
]
#: the same in YAML: text a duration parser refuses, and values past the bound.
BAD_YAML_SPANS: list[Any] = ["0s", "-5s", "30 s", "1h30m", "2d", "soon", "", 0, -1, False, 86_401]


@pytest.mark.parametrize("failures", BAD_FAILURES, ids=repr)
def test_failures_is_a_whole_number_in_range(failures: Any) -> None:
    with pytest.raises(DefinitionError, match=r"circuit_breaker\.failures must be a whole number"):
        CircuitBreaker(failures, 60.0, 30.0)


@pytest.mark.parametrize("label", ["window", "cooldown"])
@pytest.mark.parametrize("value", BAD_SPANS, ids=repr)
def test_window_and_cooldown_are_seconds_in_range(label: str, value: Any) -> None:
    spans = {"window": 60.0, "cooldown": 30.0, label: value}
    with pytest.raises(DefinitionError, match=rf"circuit_breaker\.{label} must be a number"):
        CircuitBreaker(5, spans["window"], spans["cooldown"])


def test_bounds_are_accepted_and_numbers_become_floats() -> None:
    low = CircuitBreaker(1, 1, 1)
    assert (low.failures, low.window, low.cooldown) == (1, 1.0, 1.0)
    assert isinstance(low.window, float)
    high = CircuitBreaker(MAX_BREAKER_FAILURES, MAX_BREAKER_SPAN_S, MAX_BREAKER_SPAN_S)
    assert high.window == MAX_BREAKER_SPAN_S


def _yaml(breaker: Any) -> dict[str, Any]:
    return {
        "name": "calls",
        "tasks": [{"name": "call", "handler": "partner.call", "circuit_breaker": breaker}],
    }


def test_yaml_takes_durations_and_numbers() -> None:
    workflow = workflow_from_mapping(
        _yaml({"failures": 5, "window": "1m", "cooldown": 30}), "wf.yaml"
    )
    assert workflow.tasks[0].circuit_breaker == CircuitBreaker(5, 60.0, 30.0)


@pytest.mark.parametrize("label", ["window", "cooldown"])
@pytest.mark.parametrize("value", BAD_YAML_SPANS, ids=repr)
def test_yaml_refuses_bad_durations_at_their_key(label: str, value: Any) -> None:
    breaker = {"failures": 5, "window": "60s", "cooldown": "30s", label: value}
    with pytest.raises(DefinitionError, match=r"wf\.yaml: tasks\[0\]\.circuit_breaker"):
        workflow_from_mapping(_yaml(breaker), "wf.yaml")


@pytest.mark.parametrize("failures", BAD_FAILURES[:-1], ids=repr)
def test_yaml_refuses_bad_failures(failures: Any) -> None:
    breaker = {"failures": failures, "window": "60s", "cooldown": "30s"}
    with pytest.raises(DefinitionError, match=r"tasks\[0\]\.circuit_breaker"):
        workflow_from_mapping(_yaml(breaker), "wf.yaml")


@pytest.mark.parametrize(
    "breaker",
    [
        {"failures": 5, "window": "60s"},  # no cooldown
        {"failures": 5, "window": "60s", "cooldown": "30s", "keys": "x"},  # unknown key
        "5/60s/30s",  # not a mapping
        [5, 60, 30],
    ],
    ids=repr,
)
def test_yaml_refuses_a_bad_shape(breaker: Any) -> None:
    with pytest.raises(DefinitionError, match=r"tasks\[0\]\.circuit_breaker"):
        workflow_from_mapping(_yaml(breaker), "wf.yaml")


def test_python_api_refuses_something_else_than_a_circuit_breaker() -> None:
    with pytest.raises(DefinitionError, match="circuit_breaker must be a CircuitBreaker"):
        TaskDef("call", "partner.call", circuit_breaker={"failures": 5})  # type: ignore[arg-type]


def test_a_task_that_never_executes_takes_no_breaker() -> None:
    breaker = CircuitBreaker(5, 60, 30)
    with pytest.raises(DefinitionError, match="a sleep task takes no circuit_breaker"):
        TaskDef("nap", sleep=5, circuit_breaker=breaker)
    with pytest.raises(DefinitionError, match="a workflow task takes no circuit_breaker"):
        TaskDef("child", workflow="other", circuit_breaker=breaker)


def test_the_digest_changes_only_when_a_breaker_is_set() -> None:
    plain = WorkflowDef("calls", (TaskDef("call", "partner.call"),))
    assert "circuit_breaker" not in str(plain.to_dict())
    guarded = WorkflowDef(
        "calls", (TaskDef("call", "partner.call", circuit_breaker=CircuitBreaker(5, 60, 30)),)
    )
    assert guarded.digest != plain.digest
    assert guarded.to_dict()["tasks"][0]["circuit_breaker"] == {
        "failures": 5,
        "window": 60.0,
        "cooldown": 30.0,
    }


def test_the_plan_carries_the_thresholds_to_the_task_row() -> None:
    guarded = WorkflowDef(
        "calls",
        (
            TaskDef("call", "partner.call", circuit_breaker=CircuitBreaker(5, 60, 30)),
            TaskDef("free", "partner.other", depends_on=("call",)),
        ),
    )
    tasks = {t.name: t for t in plan_runs(guarded, [{}]).tasks}
    assert (tasks["call"].breaker_failures, tasks["call"].breaker_window_s) == (5, 60.0)
    assert tasks["call"].breaker_cooldown_s == 30.0
    assert tasks["free"].breaker_failures is None


@pytest.mark.parametrize(
    "name", ["", " x", "a b", ".x", "-x", "x" * 129, 5, None, "a\x00"], ids=repr
)
def test_a_handler_name_is_refused_by_class(name: Any) -> None:
    with pytest.raises(InputError, match="handler name"):
        check_handler_name(name)


def test_pause_targets() -> None:
    assert check_pause_target("queue", "partner") == (PauseScope.QUEUE, "partner")
    assert check_pause_target("handler", "partner.call") == (PauseScope.HANDLER, "partner.call")
    with pytest.raises(InputError, match="scope"):
        check_pause_target("tenant", "x")
    for bad in ("", "amq.x", " x", "a\nb", "x" * 256):
        with pytest.raises(InputError, match="queue name"):
            check_pause_target("queue", bad)


def test_only_handler_errors_and_timeouts_count_and_a_finish_reads_no_breaker() -> None:
    """The worker's finish statement is unchanged: trip_breakers runs beside it (in its
    transaction) for a batch with a counted failure only."""
    assert {FailureReason.HANDLER_ERROR, FailureReason.TIMEOUT} == COUNTED_FAILURES
    named = queries.load()
    assert b"breakers" not in named["finish"]
    assert b"INSERT INTO breakers" in named["trip_breakers"]


def test_the_gate_is_at_the_claim_and_only_there() -> None:
    """The claim (the one way into execution) and the unpark pass read the gate; no statement
    that makes a task READY does (breakers and pauses cost them nothing)."""
    named = queries.load()
    uses = {name for name, sql in named.items() if b"flowforge_gate(" in sql}
    assert uses == {"claim", "park", "unpark_tasks"}
    assert b"(SELECT flowforge_gates_closed())" in named["claim"]  # once per statement
    for name in ("promote_ready", "insert_tasks", "admit_gated", "retry_task_now"):
        assert b"breakers" not in named[name] and b"pauses" not in named[name], name


def test_waiting_on_names_a_parked_task_before_concurrency() -> None:
    fragment = SQL[SQL.index("-- fragment: waiting_on") :]
    assert fragment.index("parked_on") < fragment.index("'concurrency'")
    migration = (Path(queries.__file__).parent / "migrations" / "0018_breakers.sql").read_text()
    assert "parked_on IN ('circuit_open', 'paused')" in migration
    assert {str(w) for w in Waiting} == {"circuit_open", "paused"}
