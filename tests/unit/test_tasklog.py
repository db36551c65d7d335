"""The task event log lines (flowforge.roles.tasklog) and the worker's seam that writes them."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.domain.model import Claim, Finish, Routed
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.roles import tasklog
from flowforge.roles.concerns import TaskLog
from supervisor.logs import LineFormatter

TASK = uuid.UUID("00000000-0000-0000-0000-00000000000a")
RUN = uuid.UUID("00000000-0000-0000-0000-00000000000b")
HEAD = f"task run {TASK} (run {RUN}, orders/charge, attempt 2)"
CLAIM = Claim(TASK, RUN, "charge", "pay.charge", 2, 5, {}, workflow="orders")
LOGGER = "flowforge.roles.worker"


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("plain text, with spaces", "plain text, with spaces"),
        ("red\x1b[31mtext", "red\\x1b[31mtext"),
        ("a\nb\rc\td", "a\\nb\\rc\\td"),
        ("csi\x9b2J del\x7f", "csi\\x9b2J del\\x7f"),
        ("bidi\u202eevil", "bidi\\u202eevil"),
        ("line\u2028sep", "line\\u2028sep"),
        ("lone \udc80 surrogate", "lone \\udc80 surrogate"),
        ("naïve — ok ✓", "naïve — ok ✓"),
    ],
)
def test_escape_writes_non_printable_characters_as_escapes(text: str, escaped: str) -> None:
    assert tasklog.escape(text) == escaped


@settings(database=None, deadline=None, max_examples=300)
@given(st.text())
def test_escaped_text_is_printable_and_one_line(text: str) -> None:
    out = tasklog.escape(text)
    assert all(c.isprintable() or c == " " for c in out)
    assert len(out.splitlines()) <= 1


def test_first_line_keeps_only_the_first_line_escaped() -> None:
    assert tasklog.first_line("ValueError: bad\x1b[0m\nTraceback (most recent call last):") == (
        "ValueError: bad\\x1b[0m"
    )


def test_first_line_of_nothing_is_empty() -> None:
    assert tasklog.first_line(None) == tasklog.first_line("") == ""


def test_first_line_is_capped() -> None:
    line = tasklog.first_line("x" * 10_000)
    assert line == "x" * tasklog.MAX_LOGGED_ERROR_CHARS + tasklog.ELLIPSIS


def test_a_failed_attempt_is_one_info_line_with_its_facts(caplog: Any) -> None:
    finish = Finish(
        TaskState.FAILED,
        reason=FailureReason.HANDLER_ERROR,
        error="KeyError: 'card'\nsecond line",
        traceback="Traceback (most recent call last):\n  ...",
    )
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        tasklog.attempt_ended(logging.getLogger(LOGGER), CLAIM, finish)
    [record] = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == f"{HEAD} failed: handler_error: KeyError: 'card'"
    fields = {k: record.__dict__[k] for k in ("action", "task_run_id", "run_id", "reason")}
    assert fields == {
        "action": "task_failed",
        "task_run_id": str(TASK),
        "run_id": str(RUN),
        "reason": "handler_error",
    }
    assert (record.__dict__["workflow"], record.__dict__["task"], record.__dict__["attempt"]) == (
        "orders",
        "charge",
        2,
    )


def test_an_attempt_finished_straight_to_dead_is_a_warning(caplog: Any) -> None:
    finish = Finish(TaskState.DEAD, reason=FailureReason.PERMANENT_ERROR, error="too large")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        tasklog.attempt_ended(logging.getLogger(LOGGER), CLAIM, finish)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == f"{HEAD} is DEAD: permanent_error: too large"


@pytest.mark.parametrize(
    ("state", "delay", "level", "tail", "action"),
    [
        (TaskState.RETRYING, 12.5, logging.INFO, "will retry in 12.50s: lease_expired", "retrying"),
        (TaskState.DEAD, 0.0, logging.WARNING, "is DEAD: lease_expired", "dead"),
        (TaskState.CANCELLED, 0.0, logging.INFO, "cancelled: lease_expired", "cancelled"),
    ],
)
def test_each_scheduler_decision_is_one_line(
    caplog: Any, state: TaskState, delay: float, level: int, tail: str, action: str
) -> None:
    event = Routed(
        TASK,
        RUN,
        "orders",
        "charge",
        2,
        TaskState.RUNNING,
        state,
        FailureReason.LEASE_EXPIRED,
        delay,
    )
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        tasklog.routed(logging.getLogger(LOGGER), event)
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (level, f"{HEAD} {tail}")
    assert record.__dict__["action"] == f"task_{action}"
    assert record.__dict__["from_state"] == "RUNNING"


def test_the_worker_logs_failures_and_cancellations_never_successes(caplog: Any) -> None:
    hook = TaskLog()  # the worker's hook for these lines (flowforge.roles.concerns)
    outcomes = [
        Finish(TaskState.SUCCEEDED, result={"ok": True}),
        Finish(TaskState.FAILED, reason=FailureReason.TIMEOUT, error="ran too long"),
        Finish(TaskState.CANCELLED),
        Finish(TaskState.SUCCEEDED, result=1),
    ]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for finish in outcomes:
            hook.after_finish([(CLAIM, finish)], committed=frozenset({TASK}))
    assert [r.getMessage() for r in caplog.records] == [
        f"{HEAD} failed: timeout: ran too long",
        f"{HEAD} stopped: cancelled",
    ]


def test_a_json_log_line_carries_the_facts_as_fields(caplog: Any) -> None:
    """With ``logging.format: json`` the tree's formatter keeps the extras as fields."""
    finish = Finish(TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error="boom\nline 2")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        tasklog.attempt_ended(logging.getLogger(LOGGER), CLAIM, finish)
    [record] = caplog.records
    line = LineFormatter("worker", "json").format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["msg"] == f"{HEAD} failed: handler_error: boom"
    assert {k: data[k] for k in ("action", "task_run_id", "run_id", "attempt", "error")} == {
        "action": "task_failed",
        "task_run_id": str(TASK),
        "run_id": str(RUN),
        "attempt": 2,
        "error": "boom",
    }
