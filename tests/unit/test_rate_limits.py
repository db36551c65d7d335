"""Rate limits (issue 20, SPEC 7.4; docs/flow-control.md "Rate limits"), the parts without
services: ``rate_limit: {limit, per, key}`` refused by class of bad value on every path (the
Python API, a workflow file, a trigger's input, a schedule's input), on tasks that never execute
and on maps; the digest only when set; the key rendered per input or defaulting to the handler;
the trigger's admission decision (domain/gates.py) and ``keys show``'s reasons for a rate key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from flowforge.definitions import check_file, workflow_from_mapping
from flowforge.domain.control import why_holds_rate, why_waits_rate
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.gates import Room, admit_new
from flowforge.domain.limits import MAX_RATE_LIMIT, MAX_RATE_PER_S, Concurrency, RateLimit
from flowforge.domain.plan import PlannedTask, plan_runs
from flowforge.domain.schedule import ScheduleDef
from flowforge.domain.states import TaskState
from flowforge.errors import DefinitionError, InputError

#: Limits refused, one per class: zero, negative, over the bound, a bool, a float, text, None.
BAD_LIMITS: list[Any] = [0, -1, MAX_RATE_LIMIT + 1, True, 2.5, "3", None]
#: Windows refused, one per class: zero, negative, over a day, NaN, infinity, a bool, text.
BAD_PERS: list[Any] = [0, -1.0, MAX_RATE_PER_S + 1, math.nan, math.inf, True, "1s", None]
#: Key templates refused, one per class.
BAD_KEYS: list[Any] = ["p-{", "{a.b}", "{0}", "a\x00b", 7]


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
def test_a_limit_is_a_whole_number_in_range(limit: Any) -> None:
    with pytest.raises(DefinitionError, match=r"rate_limit\.limit must be a whole number"):
        RateLimit(limit, 1.0)


@pytest.mark.parametrize("per", BAD_PERS, ids=repr)
def test_a_window_is_a_positive_number_of_seconds_up_to_a_day(per: Any) -> None:
    with pytest.raises(DefinitionError, match=r"rate_limit\.per must be more than 0"):
        RateLimit(5, per)


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_a_key_is_a_template_over_the_run_input(key: Any) -> None:
    with pytest.raises(DefinitionError, match=r"rate_limit\.key"):
        RateLimit(5, 1.0, key)


def test_values_at_the_bounds_are_accepted() -> None:
    assert RateLimit(1, 0.001).limit == 1
    assert RateLimit(MAX_RATE_LIMIT, MAX_RATE_PER_S, "p-{p[id]}").per == MAX_RATE_PER_S
    assert RateLimit(3, 2).key is None  # a whole number of seconds is a number too


def test_a_task_that_never_executes_takes_no_rate_limit_but_a_map_does() -> None:
    rate = RateLimit(2, 1.0)
    with pytest.raises(DefinitionError, match="a sleep task takes no rate_limit"):
        TaskDef("nap", sleep=5, rate_limit=rate)
    with pytest.raises(DefinitionError, match="a wait_for_event task takes no rate_limit"):
        TaskDef("w", wait_for_event=EventWait("paid", "k", 60), rate_limit=rate)
    with pytest.raises(DefinitionError, match="a workflow task takes no rate_limit"):
        TaskDef("child", workflow="other", rate_limit=rate)
    # a map's items each take it (tests/unit/test_map_limits.py)
    assert TaskDef("each", "h.a", for_each="list", rate_limit=rate).rate_limit == rate
    with pytest.raises(DefinitionError, match="rate_limit must be a RateLimit"):
        TaskDef("a", "h.a", rate_limit={"limit": 1, "per": 1})  # type: ignore[arg-type]


def test_rate_limit_enters_the_digest_only_when_set() -> None:
    plain = WorkflowDef("wf", (TaskDef("a", "h.a"),))
    assert "rate_limit" not in plain.to_dict()["tasks"][0]
    rated = WorkflowDef("wf", (TaskDef("a", "h.a", rate_limit=RateLimit(20, 1)),))
    assert rated.to_dict()["tasks"][0]["rate_limit"] == {"limit": 20, "per": 1.0}
    keyed = WorkflowDef("wf", (TaskDef("a", "h.a", rate_limit=RateLimit(20, 1, "k")),))
    assert keyed.to_dict()["tasks"][0]["rate_limit"] == {"limit": 20, "per": 1.0, "key": "k"}
    slower = WorkflowDef("wf", (TaskDef("a", "h.a", rate_limit=RateLimit(20, 2)),))
    assert len({plain.digest, rated.digest, keyed.digest, slower.digest}) == 4


def task(rate: Any) -> dict[str, Any]:
    return {"name": "wf", "tasks": [{"name": "a", "handler": "h.a", "rate_limit": rate}]}


def test_a_workflow_file_names_a_rate_limit_with_a_duration() -> None:
    found = workflow_from_mapping(task({"limit": 100, "per": "1s", "key": "partner"}))
    assert found.tasks[0].rate_limit == RateLimit(100, 1.0, "partner")
    assert workflow_from_mapping(task({"limit": 5, "per": "10m"})).tasks[0].rate_limit == (
        RateLimit(5, 600.0)
    )
    assert workflow_from_mapping(task({"limit": 5, "per": 0.5})).tasks[0].rate_limit == (
        RateLimit(5, 0.5)
    )


@pytest.mark.parametrize(
    ("rate", "message"),
    [
        ({"limit": 0, "per": "1s"}, r"rate_limit\.limit must be a whole number"),
        ({"limit": -1, "per": "1s"}, r"rate_limit\.limit must be a whole number"),
        ({"limit": MAX_RATE_LIMIT + 1, "per": "1s"}, r"rate_limit\.limit must be a whole"),
        ({"limit": True, "per": "1s"}, r"rate_limit\.limit: expected an integer"),
        ({"limit": 1.5, "per": "1s"}, r"rate_limit\.limit: expected an integer"),
        ({"limit": "x", "per": "1s"}, r"rate_limit\.limit: expected an integer"),
        ({"limit": 1, "per": "0s"}, r"rate_limit\.per: '0s' is not a duration"),
        ({"limit": 1, "per": 0}, r"rate_limit\.per must be more than 0"),
        ({"limit": 1, "per": "2d"}, r"rate_limit\.per must be more than 0 and at most 86400"),
        ({"limit": 1, "per": "soon"}, r"rate_limit\.per: 'soon' is not a duration"),
        ({"limit": 1, "per": "1h30m"}, r"rate_limit\.per: '1h30m' is not a duration"),
        ({"limit": 1}, r"rate_limit\.per: required key is missing"),
        ({"per": "1s"}, r"rate_limit\.limit: required key is missing"),
        ({"limit": 1, "per": "1s", "key": "{a.b}"}, r"template field \{a\.b\}"),
        ({"limit": 1, "per": "1s", "key": 3}, r"rate_limit\.key: expected a string"),
        ({"limit": 1, "per": "1s", "burst": 2}, r"rate_limit\.burst: unknown key"),
        ("20/s", r"rate_limit"),
    ],
    ids=repr,
)
def test_a_bad_rate_limit_in_a_workflow_file_is_refused_at_its_key(rate: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        workflow_from_mapping(task(rate), "wf.yaml")


def test_validate_names_the_file_and_line_of_a_bad_rate_limit(tmp_path: Path) -> None:
    path = tmp_path / "wf.yaml"
    path.write_text(
        "name: wf\ntasks:\n  - name: a\n    handler: h.a\n"
        "    rate_limit: {limit: 20, per: 0s}\n"
        "  - name: nap\n    sleep: 5\n    rate_limit: {limit: 1, per: 1s}\n"
    )
    workflow, problems = check_file(path)
    assert workflow is None
    assert problems == [
        f"{path}:5: tasks[0].rate_limit.per: '0s' is not a duration: it must be longer than zero"
    ]
    path.write_text(
        "name: wf\ntasks:\n  - name: nap\n    sleep: 5\n    rate_limit: {limit: 1, per: 1s}\n"
    )
    _, problems = check_file(path)
    assert len(problems) == 1 and "takes no rate_limit (it never executes)" in problems[0]


def test_a_trigger_renders_the_key_per_input_or_uses_the_handler() -> None:
    wf = WorkflowDef(
        "wf",
        (
            TaskDef("a", "h.a", rate_limit=RateLimit(4, 2.5, "p-{partner}")),
            TaskDef("b", "h.b", rate_limit=RateLimit(9, 60)),
        ),
    )
    planned = plan_runs(wf, [{"partner": "x"}, {"partner": "y"}]).tasks
    assert [(t.rate_key, t.rate_limit, t.rate_per_s) for t in planned] == [
        ("p-x", 4, 2.5),
        ("h.b", 9, 60.0),
        ("p-y", 4, 2.5),
        ("h.b", 9, 60.0),
    ]
    with pytest.raises(InputError, match=r"rate_limit\.key"):
        plan_runs(wf, [{}])
    free = plan_runs(WorkflowDef("wf", (TaskDef("a", "h.a"),)), [{}]).tasks[0]
    assert (free.rate_key, free.rate_limit, free.rate_per_s) == (None, None, None)


def test_a_schedule_whose_input_cannot_render_the_key_is_refused() -> None:
    rated = TaskDef("a", "h.a", rate_limit=RateLimit(1, 1, "p-{partner}"))
    with pytest.raises(DefinitionError, match=r"rate_limit\.key"):
        WorkflowDef("wf", (rated,), schedules=(ScheduleDef(cron="* * * * *", input={}),))


def planned(
    ckey: str | None = None,
    climit: int | None = None,
    rkey: str | None = None,
    rlimit: int | None = None,
    pending: int = 0,
    ordering: str | None = None,
) -> PlannedTask:
    return PlannedTask(
        run_id=uuid4(),
        id=uuid4(),
        name="a",
        handler="h.a",
        pending=pending,
        max_attempts=3,
        base_delay_s=1.0,
        max_delay_s=1.0,
        jitter="none",
        timeout_s=None,
        idempotency_key=None,
        ordering_key=ordering,
        on_dead="release",
        concurrency_key=ckey,
        concurrency_limit=climit,
        rate_key=rkey,
        rate_limit=rlimit,
        rate_per_s=None if rkey is None else 1.0,
    )


def test_a_trigger_admits_into_each_keys_room_oldest_first() -> None:
    tasks = [planned(rkey="r", rlimit=3) for _ in range(5)]
    assert admit_new(tasks, {}, {"r": Room(used=1, waiting=0, waiting_limit=None)}) == [
        True,
        True,
        False,
        False,
        False,
    ]
    # waiting tasks go first; the smallest limit among the waiting ones applies
    assert admit_new(tasks, {}, {"r": Room(0, 1, 2)}) == [True, False, False, False, False]
    # not judged: no key; a dependency, a start gate or an ordering key to wait on
    other = [planned(), planned(rkey="r", rlimit=3, pending=1), planned("c", 1, "r", 3, 0, "o")]
    assert admit_new(other, {}, {}) == [False, False, False]


def test_a_task_with_both_keys_needs_room_in_both_and_takes_none_when_held() -> None:
    tasks = [planned("a", 1, "r", 3), planned("a", 1, "r", 3), planned("b", 1, "r", 3)]
    # a's second is held by its concurrency slot: it takes no rate room, b's task does
    assert admit_new(tasks, {}, {}) == [True, False, True]
    assert admit_new(tasks, {"b": Room(1, 0, None)}, {"r": Room(2, 0, None)}) == [
        True,
        False,
        False,
    ]


def test_why_a_task_of_a_rate_key_holds_or_waits() -> None:
    assert why_holds_rate(TaskState.READY, False) == (
        "READY: admitted, counts in the window until it starts"
    )
    assert why_holds_rate(TaskState.RUNNING, True) == (
        "running (its start counts in the window); asked to stop"
    )
    assert why_waits_rate(TaskState.PENDING, 1, 0) == "waiting for 1 dependency"
    assert why_waits_rate(TaskState.PENDING, 0, 2) == "next to run: the scheduler admits it"
    assert (
        why_waits_rate(TaskState.RETRYING, 0, 0) == "its retry waits for room in the key's window"
    )


def test_a_concurrency_and_a_rate_limit_on_one_task_are_both_kept() -> None:
    both = TaskDef("a", "h.a", concurrency=Concurrency("c", 2), rate_limit=RateLimit(5, 1))
    data = WorkflowDef("wf", (both,)).to_dict()["tasks"][0]
    assert (data["concurrency"], data["rate_limit"]) == (
        {"key": "c", "limit": 2},
        {"limit": 5, "per": 1.0},
    )
