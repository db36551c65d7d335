"""Events and ``wait_for_event`` as values (issue 19): definitions, files, plans, what a sender
gives, the config, and what ``flowforge status`` shows of a waiting task. No database."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from flowforge.cli.commands import _task_reason
from flowforge.config import load_config
from flowforge.definitions import workflow_from_mapping
from flowforge.domain import transitions
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import MAX_EVENT_DATA_BYTES, EventWait, check_event
from flowforge.domain.model import TaskRun
from flowforge.domain.plan import plan_runs
from flowforge.domain.policy import RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.schedule import ScheduleDef
from flowforge.domain.states import TaskState
from flowforge.domain.timing import MAX_SPAN_S
from flowforge.errors import ConfigError, DefinitionError, InputError, UnstorableValueError

WAIT = EventWait("order.approved", "order-{order_id}", 86_400.0)
ORDER = WorkflowDef(
    "order",
    (
        TaskDef("approve", wait_for_event=WAIT),
        TaskDef("ship", "h.ship", depends_on=("approve",)),
    ),
)
TWO = WorkflowDef("two", (TaskDef("a", "h.a"), TaskDef("b", "h.b", depends_on=("a",))))


# ------------------------------------------------------------------ definitions


def test_a_wait_task_has_no_handler_and_its_canonical_form_parses_back() -> None:
    task = ORDER.task("approve")
    assert task.handler == "" and task.wait_for_event == WAIT
    assert ORDER.to_dict()["tasks"][0] == {
        "name": "approve",
        "depends_on": [],
        "wait_for_event": {"name": "order.approved", "key": "order-{order_id}", "timeout": 86400.0},
    }
    assert workflow_from_mapping(ORDER.to_dict()) == ORDER


def test_definitions_without_a_wait_keep_their_digests() -> None:
    """The digest of this definition before issue 19 (the same as before issue 18)."""
    assert all("wait_for_event" not in t for t in TWO.to_dict()["tasks"])
    assert TWO.digest == "d292fb46669f18a78e94bac1320fa5de403cb2011781898057c4de78f8aada4f"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"handler": "h.x", "wait_for_event": WAIT}, "both a handler and wait_for_event"),
        ({"sleep": 5.0, "wait_for_event": WAIT}, "both sleep and wait_for_event"),
        ({"wait_for_event": WAIT, "timeout": 3.0}, "no timeout"),
        ({"wait_for_event": WAIT, "idempotency_key": "k"}, "no idempotency_key"),
        ({"wait_for_event": WAIT, "ordering_key": "k"}, "no ordering_key"),
        ({"wait_for_event": WAIT, "retry": RetryPolicy(max_attempts=5)}, "no retry"),
        ({"wait_for_event": {"name": "x"}}, "must be an EventWait"),
    ],
)
def test_a_bad_wait_task_is_refused(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DefinitionError, match=fragment):
        TaskDef("approve", **kwargs)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("", "k", 60.0), "wait_for_event.name"),
        (("bad name", "k", 60.0), "wait_for_event.name"),
        (("e", "{a.b}", 60.0), "wait_for_event.key"),
        (("e", "{", 60.0), "malformed template"),
        (("e", "a\x00b", 60.0), "wait_for_event.key"),
        (("e", "k", 0.0), "timeout"),
        (("e", "k", -1.0), "timeout"),
        (("e", "k", math.nan), "timeout"),
        (("e", "k", MAX_SPAN_S * 2), "timeout"),
        (("e", "k", True), "timeout"),
    ],
)
def test_a_bad_event_wait_is_refused(args: tuple[Any, ...], fragment: str) -> None:
    with pytest.raises(DefinitionError, match=fragment):
        EventWait(*args)


def test_a_schedule_whose_input_cannot_render_a_wait_key_is_refused() -> None:
    with pytest.raises(DefinitionError, match=r"wait_for_event\.key"):
        WorkflowDef(
            "order",
            ORDER.tasks,
            schedules=(ScheduleDef(every="1h", input={"other": 1}),),
        )


def test_a_wait_in_a_yaml_mapping_takes_its_timeout_as_a_duration() -> None:
    data = {
        "name": "order",
        "tasks": [
            {
                "name": "approve",
                "wait_for_event": {
                    "name": "order.approved",
                    "key": "order-{order_id}",
                    "timeout": "1d",
                },
            },
            {"name": "ship", "handler": "h.ship", "depends_on": "approve"},
        ],
    }
    assert workflow_from_mapping(data) == ORDER


@pytest.mark.parametrize(
    ("wait", "fragment"),
    [
        ({"name": "e", "key": "k", "timeout": "soon"}, "tasks[0].wait_for_event.timeout"),
        ({"name": "e", "key": "k"}, "tasks[0].wait_for_event.timeout: required key is missing"),
        ({"key": "k", "timeout": 5}, "tasks[0].wait_for_event.name: required key is missing"),
        ({"name": "e", "key": "k", "timeout": 5, "extra": 1}, "unknown key"),
        ({"name": "e", "key": 5, "timeout": 5}, "tasks[0].wait_for_event.key"),
        ("order.approved", "tasks[0].wait_for_event"),
    ],
)
def test_a_bad_wait_in_a_workflow_file_names_its_key(wait: Any, fragment: str) -> None:
    data = {"name": "w", "tasks": [{"name": "approve", "wait_for_event": wait}]}
    with pytest.raises(DefinitionError) as caught:
        workflow_from_mapping(data, "wf.yaml")
    assert fragment in str(caught.value)


def test_a_file_with_both_a_handler_and_a_wait_is_refused() -> None:
    wait = {"name": "e", "key": "k", "timeout": "1h"}
    data = {"name": "w", "tasks": [{"name": "t", "handler": "h.x", "wait_for_event": wait}]}
    with pytest.raises(DefinitionError, match="both a handler and wait_for_event"):
        workflow_from_mapping(data, "wf.yaml")


# ------------------------------------------------------------------ plans


def test_a_wait_is_planned_with_its_rendered_key_and_timeout() -> None:
    plan = plan_runs(ORDER, [{"order_id": 17}, {"order_id": "x"}])
    waits = [(t.event_name, t.event_key, t.event_timeout_s) for t in plan.tasks if t.event_name]
    assert waits == [
        ("order.approved", "order-17", 86_400.0),
        ("order.approved", "order-x", 86_400.0),
    ]
    assert all(t.event_name is None for t in plan.tasks if t.name == "ship")


@pytest.mark.parametrize(
    ("run_input", "fragment"),
    [({}, "cannot format"), ({"order_id": "a\x00b"}, "NUL"), ({"order_id": "k" * 2000}, "bytes")],
)
def test_a_wait_key_that_cannot_render_or_be_stored_refuses_the_trigger(
    run_input: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(InputError, match=fragment):
        plan_runs(ORDER, [run_input])


# ------------------------------------------------------------------ what a sender gives


def test_a_good_event_is_returned_ready_to_store() -> None:
    assert check_event("order.approved", "order-1") == ("order.approved", "order-1", None)
    name, key, data = check_event("e", "", {"b": [1, 2.5]})
    assert (name, key, data) == ("e", "", '{"b":[1,2.5]}')


@pytest.mark.parametrize(
    ("name", "key", "data", "fragment"),
    [
        ("", "k", None, "event name: required"),
        (None, "k", None, "event name: required"),
        (7, "k", None, "event name: required"),
        ("a b", "k", None, "event name"),
        ("x" * 200, "k", None, "event name"),
        ("e", None, None, "event key: required"),
        ("e", 7, None, "event key: must be text"),
        ("e", "a\x00b", None, "event key"),
        ("e", "\ud800", None, "event key"),
        ("e", "k" * 1025, None, "event key"),
        ("e", "k", math.nan, "event data"),
        ("e", "k", {"a": math.inf}, "event data"),
        ("e", "k", {"a": "\x00"}, "event data"),
        ("e", "k", {1j: 1}, "event data"),
        ("e", "k", "x" * (MAX_EVENT_DATA_BYTES + 1), "event data"),
    ],
)
def test_a_bad_event_is_refused_naming_its_field(
    name: Any, key: Any, data: Any, fragment: str
) -> None:
    with pytest.raises(InputError, match=fragment) as caught:
        check_event(name, key, data)
    if fragment == "event data":
        assert isinstance(caught.value, UnstorableValueError)


# ------------------------------------------------------------------ states, reasons, config


def test_a_wait_may_succeed_straight_from_pending_and_die_of_its_timeout() -> None:
    assert transitions.is_legal(TaskState.PENDING, TaskState.SUCCEEDED)  # an early event
    assert transitions.is_legal(TaskState.RUNNING, TaskState.DEAD)
    assert FailureReason("event_timeout") is FailureReason.EVENT_TIMEOUT


def test_events_retention_defaults_to_seven_days_and_takes_a_duration(tmp_path: Path) -> None:
    assert load_config(None, env={}).events.retention == 7 * 86_400.0
    config = tmp_path / "c.yaml"
    config.write_text("events:\n  retention: 36h\n")
    assert load_config(config, env={}).events.retention == 36 * 3600.0


@pytest.mark.parametrize("value", ["soon", "0", "-1", "[1]"])
def test_a_bad_events_retention_is_one_line_naming_it(tmp_path: Path, value: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"events:\n  retention: {value}\n")
    with pytest.raises(ConfigError, match="retention"):
        load_config(config, env={})


def _task(**changes: Any) -> TaskRun:
    base: dict[str, Any] = {
        "id": uuid4(),
        "run_id": uuid4(),
        "name": "approve",
        "handler": "",
        "state": TaskState.RUNNING,
        "attempt": 0,
        "max_attempts": 1,
        "fencing_token": 0,
        "failure_reason": None,
        "last_error": None,
        "result": None,
        "idempotency_key": None,
        "ordering_key": None,
        "lease_owner": None,
        "lease_expires_at": None,
        "retry_at": None,
        "cancel_requested": False,
        "created_at": datetime(2026, 12, 1, tzinfo=UTC),
        "ready_at": None,
        "started_at": None,
        "finished_at": None,
    }
    return TaskRun(**{**base, **changes})


def test_status_says_what_a_task_waits_for_and_until_when() -> None:
    waiting = _task(
        event_name="order.approved",
        event_key="order-17",
        wake_at=datetime(2026, 12, 2, 9, tzinfo=UTC),
    )
    assert _task_reason(waiting) == (
        "waits for event order.approved key 'order-17' until 2026-12-02T09:00:00+00:00"
    )
    timed_out = _task(
        state=TaskState.DEAD,
        event_name="order.approved",
        event_key="order-17",
        failure_reason=FailureReason.EVENT_TIMEOUT,
    )
    assert _task_reason(timed_out) == "event_timeout"
