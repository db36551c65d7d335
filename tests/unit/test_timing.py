"""Delays, timers and deadlines as values (issue 18): parsing, bounds, definitions and plans.

No database: "past" is judged against a ``now`` the caller read from the database, so here a
fixed instant stands in for it.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.definitions import workflow_from_mapping
from flowforge.domain import timing
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.plan import plan_runs
from flowforge.domain.policy import RetryPolicy
from flowforge.errors import DefinitionError, InputError

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TWO = WorkflowDef("two", (TaskDef("a", "h.a"), TaskDef("b", "h.b", depends_on=("a",))))


# ------------------------------------------------------------------ start times


@pytest.mark.parametrize(
    "text",
    ["2026-12-24T09:00:00+01:00", "2026-12-24T08:00:00Z", "2026-12-24T08:00:00.5+00:00"],
)
def test_an_iso_time_with_an_offset_is_an_aware_instant(text: str) -> None:
    value = timing.parse_instant(text, "--at")
    assert value.utcoffset() is not None
    assert value.astimezone(UTC).replace(microsecond=0) == datetime(2026, 12, 24, 8, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("2026-12-24T09:00:00", "no UTC offset"),  # refused, never guessed
        ("2026-12-24", "no UTC offset"),
        ("tomorrow", "not an ISO 8601"),
        ("", "not an ISO 8601"),
        ("2026-13-01T00:00:00Z", "not an ISO 8601"),
        ("2026-12-24T09:00:00+01:00\x00", "not an ISO 8601"),
        ("99999-01-01T00:00:00Z", "not an ISO 8601"),
        ("x" * 10_000, "not an ISO 8601"),
        (12, "must be an ISO 8601"),
        (None, "must be an ISO 8601"),
        (["2026-12-24T09:00:00Z"], "must be an ISO 8601"),
    ],
)
def test_a_bad_start_time_is_one_line_naming_the_field(value: Any, fragment: str) -> None:
    with pytest.raises(InputError, match=fragment) as caught:
        timing.parse_instant(value, "--at")
    message = str(caught.value)
    assert message.startswith("--at") and "\n" not in message and len(message) < 300


@pytest.mark.parametrize("ahead_s", [-60.0, -1.0, 0.0, 1.0, timing.MAX_AHEAD_S])
def test_start_times_from_the_tolerance_to_the_horizon_are_accepted(ahead_s: float) -> None:
    timing.judge_start_at(NOW + timedelta(seconds=ahead_s), NOW)


@pytest.mark.parametrize(
    ("ahead_s", "fragment"),
    [(-61.0, "in the past"), (-86_400.0 * 365, "in the past"), (timing.MAX_AHEAD_S + 1, "ahead")],
)
def test_start_times_in_the_past_or_beyond_the_horizon_are_refused(
    ahead_s: float, fragment: str
) -> None:
    with pytest.raises(InputError, match=fragment):
        timing.judge_start_at(NOW + timedelta(seconds=ahead_s), NOW)


def test_the_past_is_judged_by_instant_not_by_the_offset_written() -> None:
    east = (NOW + timedelta(minutes=5)).astimezone(timezone(timedelta(hours=-11)))
    timing.judge_start_at(east, NOW)  # 01:05 at -11:00 is 12:05 UTC: the future


def test_start_at_and_delay_together_are_refused() -> None:
    with pytest.raises(InputError, match="not both"):
        timing.start(NOW, 10)


# ------------------------------------------------------------------ spans


@pytest.mark.parametrize("value", [1, 0.5, 600.0, timedelta(minutes=10), timing.MAX_SPAN_S])
def test_positive_spans_within_the_bound_are_seconds(value: Any) -> None:
    assert timing.seconds(value, "delay") > 0


@pytest.mark.parametrize(
    "value",
    [0, -1, math.nan, math.inf, -math.inf, timing.MAX_SPAN_S + 1, 10**30, True, "10m", None, []],
)
def test_bad_spans_are_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(InputError, match=r"^deadline"):
        timing.seconds(value, "deadline")


@settings(database=None, deadline=None, max_examples=200)
@given(st.one_of(st.floats(allow_nan=True), st.integers(), st.text(), st.none(), st.booleans()))
def test_a_span_is_a_bounded_positive_float_or_an_input_error(value: Any) -> None:
    try:
        found = timing.seconds(value, "delay")
    except InputError:
        return
    assert isinstance(found, float) and 0 < found <= timing.MAX_SPAN_S


# ------------------------------------------------------------------ timers, deadlines in files


def test_a_sleep_task_is_a_timer_without_a_handler() -> None:
    task = TaskDef("nap", sleep=600.0, depends_on=())
    assert task.handler == "" and task.sleep == 600.0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"handler": "h.x", "sleep": 5.0}, "both a handler and sleep"),
        ({"sleep": 0.0}, "more than 0"),
        ({"sleep": -1.0}, "more than 0"),
        ({"sleep": math.nan}, "more than 0"),
        ({"sleep": timing.MAX_SPAN_S * 2}, "at most"),
        ({"sleep": 5.0, "timeout": 3.0}, "no timeout"),
        ({"sleep": 5.0, "ordering_key": "k"}, "no ordering_key"),
        ({"sleep": 5.0, "idempotency_key": "k"}, "no idempotency_key"),
        ({"sleep": 5.0, "retry": RetryPolicy(max_attempts=5)}, "no retry"),
        ({}, "needs a handler"),
    ],
)
def test_a_bad_timer_definition_is_refused(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DefinitionError, match=fragment):
        TaskDef("nap", **kwargs)


@pytest.mark.parametrize("deadline", [0.0, -5.0, math.inf, timing.MAX_SPAN_S + 1])
def test_a_bad_workflow_deadline_is_refused(deadline: float) -> None:
    with pytest.raises(DefinitionError, match="deadline"):
        WorkflowDef("w", (TaskDef("a", "h.a"),), deadline=deadline)


def test_new_keys_appear_in_the_canonical_form_only_when_set() -> None:
    """Existing definitions keep their digests: no new key unless it is used."""
    plain = TWO.to_dict()
    assert "deadline" not in plain
    assert all("sleep" not in task for task in plain["tasks"])
    timed = WorkflowDef("t", (TaskDef("nap", sleep=60.0),), deadline=7200.0)
    assert timed.to_dict()["deadline"] == 7200.0
    assert timed.to_dict()["tasks"] == [{"name": "nap", "depends_on": [], "sleep": 60.0}]
    assert timed.digest != WorkflowDef("t", (TaskDef("nap", sleep=61.0),), deadline=7200.0).digest


def test_the_digest_of_a_definition_without_time_keys_is_unchanged() -> None:
    """The digest of this definition before issue 18 (computed on the parent commit)."""
    assert TWO.digest == "d292fb46669f18a78e94bac1320fa5de403cb2011781898057c4de78f8aada4f"


def test_yaml_durations_become_seconds_and_the_canonical_form_parses_back() -> None:
    data = {
        "name": "w",
        "deadline": "2h",
        "tasks": [
            {"name": "a", "handler": "h.a"},
            {"name": "nap", "sleep": "10m", "depends_on": "a"},
            {"name": "b", "handler": "h.b", "depends_on": ["nap"]},
        ],
    }
    workflow = workflow_from_mapping(data)
    assert workflow.deadline == 7200.0 and workflow.task("nap").sleep == 600.0
    assert workflow_from_mapping(workflow.to_dict()) == workflow


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"deadline": "0s"}, "deadline: '0s' is not a duration"),
        ({"deadline": "soon"}, "deadline: 'soon' is not a duration"),
        ({"deadline": [1]}, "deadline"),
        ({"tasks": [{"name": "nap", "sleep": "1h30m"}]}, "tasks[0].sleep"),
        ({"tasks": [{"name": "nap", "sleep": "5m", "handler": "h.x"}]}, "both a handler and sleep"),
        ({"tasks": [{"name": "nap"}]}, "tasks[0].handler: required key is missing"),
    ],
)
def test_bad_time_keys_in_a_workflow_file_name_their_key(
    change: dict[str, Any], fragment: str
) -> None:
    data = {"name": "w", "tasks": [{"name": "a", "handler": "h.a"}], **change}
    with pytest.raises(DefinitionError) as caught:
        workflow_from_mapping(data, "wf.yaml")
    assert fragment in str(caught.value)


# ------------------------------------------------------------------ plans


def test_a_delayed_plan_gates_only_the_root_tasks() -> None:
    plan = plan_runs(TWO, [{}, {}], delay=600)
    assert plan.delayed and plan.delay_s == 600.0 and plan.start_at is None
    gates = {(t.name, t.start_gate, t.pending) for t in plan.tasks}
    assert gates == {("a", True, 1), ("b", False, 1)}


def test_an_immediate_plan_has_no_gate_and_keeps_the_workflow_deadline_for_the_store() -> None:
    plan = plan_runs(TWO, [{}])
    assert not plan.delayed and plan.deadline_s is None
    assert all(not t.start_gate for t in plan.tasks)
    assert plan_runs(TWO, [{}], deadline=timedelta(minutes=30)).deadline_s == 1800.0


def test_a_timer_is_planned_with_its_sleep() -> None:
    workflow = WorkflowDef("t", (TaskDef("nap", sleep=60.0),))
    (task,) = plan_runs(workflow, [{}]).tasks
    assert task.sleep_s == 60.0 and task.handler == ""


def test_a_plan_refuses_a_naive_start_time() -> None:
    with pytest.raises(InputError, match="no UTC offset"):
        plan_runs(TWO, [{}], start_at=datetime(2030, 1, 1))
