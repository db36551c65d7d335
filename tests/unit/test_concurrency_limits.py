"""Concurrency limits (issue 20, SPEC 7.4; docs/flow-control.md "Concurrency and rate limits"),
the parts without services: ``concurrency: {key, limit}`` validated by class of bad value, its
key template checked at validate time (and against every schedule's input), the digest only when
set, a trigger renders the key per input, every statement that makes a task READY by itself
leaves a task with a concurrency key alone, and ``waiting_on`` / ``keys show``'s reasons.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.control import why_holds_slot, why_waits_slot
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.limits import MAX_CONCURRENCY, Concurrency
from flowforge.domain.plan import plan_runs
from flowforge.domain.schedule import ScheduleDef
from flowforge.domain.states import TaskState
from flowforge.errors import DefinitionError, InputError
from flowforge.store import queries

SQL = Path(queries.__file__).with_name("queries.sql").read_text()

#: Limits refused, one per class: zero, negative, over the bound, a bool, a float, text, None.
BAD_LIMITS: list[Any] = [0, -1, MAX_CONCURRENCY + 1, True, 2.5, "3", None]
#: Key templates refused, one per class.
BAD_KEYS: list[Any] = [
    "tenant-{",  # malformed
    "{a.b}",  # attribute access
    "{0}",  # positional
    "a\x00b",  # NUL: PostgreSQL cannot store it
    7,  # not text
]


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
def test_a_limit_is_a_whole_number_in_range(limit: Any) -> None:
    with pytest.raises(DefinitionError, match=r"concurrency\.limit must be a whole number"):
        Concurrency("partner", limit)


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_a_key_is_a_template_over_the_run_input(key: Any) -> None:
    with pytest.raises(DefinitionError, match=r"concurrency\.key"):
        Concurrency(key, 3)


def test_limits_at_the_bounds_are_accepted() -> None:
    assert Concurrency("partner", 1).limit == 1
    assert Concurrency("tenant-{tenant[id]}", MAX_CONCURRENCY).limit == MAX_CONCURRENCY


def test_a_task_that_never_executes_takes_no_concurrency_but_a_map_does() -> None:
    limit = Concurrency("partner", 2)
    with pytest.raises(DefinitionError, match="a sleep task takes no concurrency"):
        TaskDef("nap", sleep=5, concurrency=limit)
    with pytest.raises(DefinitionError, match="a wait_for_event task takes no concurrency"):
        TaskDef("w", wait_for_event=EventWait("paid", "k", 60), concurrency=limit)
    with pytest.raises(DefinitionError, match="a workflow task takes no concurrency"):
        TaskDef("child", workflow="other", concurrency=limit)
    # a map's items each take it (tests/unit/test_map_limits.py)
    assert TaskDef("each", "h.a", for_each="list", concurrency=limit).concurrency == limit
    with pytest.raises(DefinitionError, match="concurrency must be a Concurrency"):
        TaskDef("a", "h.a", concurrency={"key": "k", "limit": 1})  # type: ignore[arg-type]


def test_concurrency_enters_the_digest_only_when_set() -> None:
    plain = WorkflowDef("wf", (TaskDef("a", "h.a"),))
    assert "concurrency" not in plain.to_dict()["tasks"][0]
    limited = WorkflowDef("wf", (TaskDef("a", "h.a", concurrency=Concurrency("k", 2)),))
    assert limited.to_dict()["tasks"][0]["concurrency"] == {"key": "k", "limit": 2}
    assert limited.digest != plain.digest
    wider = WorkflowDef("wf", (TaskDef("a", "h.a", concurrency=Concurrency("k", 3)),))
    assert wider.digest != limited.digest


def test_a_workflow_file_names_a_concurrency_and_a_bad_one_is_refused_at_its_key() -> None:
    data = {
        "name": "wf",
        "tasks": [
            {"name": "a", "handler": "h.a", "concurrency": {"key": "t-{tenant}", "limit": 3}}
        ],
    }
    assert workflow_from_mapping(data).tasks[0].concurrency == Concurrency("t-{tenant}", 3)
    for bad, message in (
        ({"key": "t", "limit": 0}, "concurrency.limit must be a whole number"),
        ({"key": "t-{", "limit": 1}, "malformed template"),
        ({"key": "t"}, "limit"),
        ({"key": "t", "limit": 1, "per": "1s"}, "per"),
    ):
        task = {"name": "a", "handler": "h.a", "concurrency": bad}
        with pytest.raises(DefinitionError, match=message):
            workflow_from_mapping({"name": "wf", "tasks": [task]}, "wf.yaml")


def test_a_schedule_whose_input_cannot_render_the_key_is_refused() -> None:
    task = TaskDef("a", "h.a", concurrency=Concurrency("t-{tenant}", 1))
    with pytest.raises(DefinitionError, match=r"concurrency\.key"):
        WorkflowDef("wf", (task,), schedules=(ScheduleDef(cron="* * * * *", input={}),))


def test_a_trigger_renders_the_key_per_input_and_refuses_a_missing_field() -> None:
    wf = WorkflowDef("wf", (TaskDef("a", "h.a", concurrency=Concurrency("t-{tenant}", 4)),))
    planned = plan_runs(wf, [{"tenant": "x"}, {"tenant": "y"}]).tasks
    assert [(t.concurrency_key, t.concurrency_limit) for t in planned] == [("t-x", 4), ("t-y", 4)]
    with pytest.raises(InputError, match=r"concurrency\.key"):
        plan_runs(wf, [{}])
    free = plan_runs(WorkflowDef("wf", (TaskDef("a", "h.a"),)), [{}]).tasks[0]
    assert (free.concurrency_key, free.concurrency_limit) == (None, None)


def test_nothing_but_the_admission_pass_makes_a_limited_task_ready() -> None:
    """Every statement that sets a task READY by itself either leaves a task with a
    concurrency key alone or is a path that keeps a held slot (a claim handed back keeps its
    task READY-or-RUNNING; redispatch_lost re-sends a READY one)."""
    named = queries.readable()
    for name in ("promote_ready", "retry_task_now", "finish", "wake_timers"):
        assert "ready_by_itself" in named[name].decode(), name
    # insert_tasks repeats ready_by_itself's expression (tests/unit/test_queries.py checks it)
    assert "t.concurrency_key IS NULL AND t.rate_key IS NULL" in named["insert_tasks"].decode()
    # the release fragment is in every statement that makes a task SUCCEEDED
    fragment = SQL.split("-- fragment: release_dependents(source)")[1].split("-- name:")[0]
    assert fragment.count("t.ready_by_itself") == 2  # state and ready_at
    assert "needs_worker" not in fragment
    setters = {
        name
        for name, body in named.items()
        if re.search(r"(SET\s+state\s*=|THEN|ELSE)\s*'READY'", body.decode())
    }
    code = {n: re.sub(r"--[^\n]*", "", named[n].decode()) for n in setters}
    gated = {
        n
        for n in setters
        if any(not neg for neg in re.findall(r"(NOT\s+)?(?:t\.)?ready_by_itself\b", code[n]))
        or "(t.admitted OR (" in code[n]  # insert_tasks: ready_by_itself spelled out
    }
    # admit_gated is the gate; release_claims hands a RUNNING task back READY: its slot stays
    # held (and its attempt row is deleted: no start counted, the READY task counts instead)
    assert setters - gated == {"admit_gated", "release_claims"}
    assert {"insert_tasks", "promote_ready", "retry_task_now", "finish"} <= gated


def test_the_admission_locks_keys_in_order_and_counts_after_the_lock() -> None:
    named = queries.readable()
    assert "ORDER BY k" in named["lock_concurrency_keys"].decode()
    assert "ORDER BY 1" in named["concurrency_keys_waiting"].decode()
    admit = named["admit_gated"].decode()
    assert "FOR UPDATE OF t SKIP LOCKED" in admit
    assert "h.state IN ('READY', 'RUNNING')" in admit


def test_why_a_task_holds_or_waits_for_a_slot() -> None:
    assert why_holds_slot(TaskState.RUNNING, False) == "running"
    assert why_holds_slot(TaskState.RUNNING, True) == "running; asked to stop"
    assert why_holds_slot(TaskState.READY, False) == "READY: admitted, waiting for a worker"
    assert why_waits_slot(TaskState.PENDING, 2, 0) == "waiting for 2 dependencies"
    assert why_waits_slot(TaskState.PENDING, 0, 1) == "next to run: the scheduler admits it"
    assert why_waits_slot(TaskState.PENDING, 0, 0) == "waits for a free slot of the key"
    assert why_waits_slot(TaskState.RETRYING, 0, 0) == "its retry waits for a free slot of the key"


def test_waiting_on_names_only_the_spec_values() -> None:
    fragment = SQL.split("-- fragment: waiting_on(task)")[1].split("\n-- name:")[0]
    assert set(re.findall(r"(?:THEN|ELSE) '([a-z_]+)'", fragment)) == {
        "start_at",
        "timer",
        "event",
        "concurrency",
        "rate_limit",
    }  # and a parked task's parked_on: circuit_open or paused (tests/unit/test_breakers.py)
