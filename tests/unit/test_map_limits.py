"""Concurrency and rate limits on a map's items (issue 20, SPEC 7.3 and 7.4), without a database:
what a definition accepts and refuses, what a trigger plans for the map's own row (no key: its
items carry them), and the keys an expansion renders per item (``domain/maps.py``).

The gate itself (admission, max_parallel with it, retries, cancel, ``keys show``) is proven
against PostgreSQL in tests/integration/test_map_limits.py; bad definitions on every interface
are in tests/bad_dynamic.py's tables.
"""

from __future__ import annotations

from typing import Any

import pytest

from flowforge.definitions import workflow_from_mapping
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.maps import ItemKeys, MapFailure, plan_items
from flowforge.domain.plan import plan_runs
from flowforge.domain.reasons import FailureReason
from flowforge.domain.schedule import ScheduleDef
from flowforge.errors import DefinitionError, InputError
from flowforge.store import queries


def mapped(**process: Any) -> WorkflowDef:
    return WorkflowDef(
        "etl",
        (
            TaskDef("list", "etl.list"),
            TaskDef("process", "etl.process", for_each="list", **process),
        ),
    )


def stored(wf: WorkflowDef) -> dict[str, Any]:
    """The map task's stored definition, as lock_maps_to_expand hands it to plan_items."""
    found: dict[str, Any] = wf.to_dict()["tasks"][1]
    return found


def test_a_map_takes_both_limits_and_they_enter_its_digest() -> None:
    plain = mapped()
    limited = mapped(
        concurrency=Concurrency("t-{item[tenant]}", 2), rate_limit=RateLimit(100, 1.0, "partner")
    )
    task = stored(limited)
    assert task["concurrency"] == {"key": "t-{item[tenant]}", "limit": 2}
    assert task["rate_limit"] == {"limit": 100, "per": 1.0, "key": "partner"}
    assert "concurrency" not in stored(plain) and limited.digest != plain.digest


def test_a_workflow_file_names_them_on_a_map() -> None:
    data = {
        "name": "etl",
        "tasks": [
            {"name": "list", "handler": "etl.list"},
            {
                "name": "process",
                "handler": "etl.process",
                "for_each": "list",
                "max_parallel": 50,
                "concurrency": {"key": "t-{item[tenant]}", "limit": 3},
                "rate_limit": {"limit": 100, "per": "1s"},
            },
        ],
    }
    task = workflow_from_mapping(data).task("process")
    assert task.concurrency == Concurrency("t-{item[tenant]}", 3)
    assert task.rate_limit == RateLimit(100, 1.0)
    assert task.max_parallel == 50


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("concurrency.key", lambda t: {"concurrency": Concurrency(t, 2)}),
        ("rate_limit.key", lambda t: {"rate_limit": RateLimit(2, 1.0, t)}),
        ("idempotency_key", lambda t: {"idempotency_key": t}),
        ("ordering_key", lambda t: {"ordering_key": t}),
    ],
)
def test_index_has_no_fields_in_any_key_of_a_map(field: str, make: Any) -> None:
    """``index`` is a number: ``{index[0]}`` would fail for every item, so it is refused when
    the workflow is defined, not found when the map expands."""
    with pytest.raises(DefinitionError, match=rf"{field}: {{index\[0\]}}: index is the item's"):
        mapped(**make("k-{index[0]}"))
    assert mapped(**make("k-{index}-{index:04d}-{item[0]}")).task("process").for_each == "list"


def test_outside_a_map_index_is_a_run_input_field_like_any_other() -> None:
    """Only a map's items have ``item`` and ``index``; elsewhere they are run-input names."""
    task = TaskDef("a", "h.a", concurrency=Concurrency("{index[0]}", 1))
    planned = plan_runs(WorkflowDef("wf", (task,)), [{"index": ["x"]}]).tasks[0]
    assert planned.concurrency_key == "x"


def test_the_map_row_carries_no_key_its_items_do() -> None:
    wf = mapped(
        concurrency=Concurrency("t-{item[tenant]}", 2), rate_limit=RateLimit(5, 1.0, "{region}")
    )
    row = plan_runs(wf, [{"region": "eu"}]).tasks[1]
    assert row.for_each == "list"
    assert (row.concurrency_key, row.concurrency_limit) == (None, None)
    assert (row.rate_key, row.rate_limit, row.rate_per_s) == (None, None, None)


@pytest.mark.parametrize(
    ("template", "run_input", "fragment"),
    [
        ("{region}-{item[tenant]}", {}, "concurrency.key"),
        ("{region[id]}-{item}", {"region": 5}, "concurrency.key"),
        ("{region[id]}-{item}", {"region": {"name": "eu"}}, "concurrency.key"),
    ],
)
def test_a_trigger_whose_input_cannot_fill_a_map_key_is_refused(
    template: str, run_input: dict[str, Any], fragment: str
) -> None:
    """What a map's key reads of the run input is the same for every item: a trigger that
    lacks it is refused, naming the key, as for any task — not a map DEAD later."""
    wf = mapped(concurrency=Concurrency(template, 2))
    with pytest.raises(InputError, match=fragment):
        plan_runs(wf, [run_input])
    assert plan_runs(wf, [{"region": {"id": "eu"}}]).tasks[1].concurrency_key is None


def test_what_depends_on_the_item_is_not_judged_at_the_trigger() -> None:
    wf = mapped(
        concurrency=Concurrency("{item[a][b]:>8}-{index}", 2),
        rate_limit=RateLimit(5, 1.0, "{item!r}"),
    )
    assert len(plan_runs(wf, [{}]).tasks) == 2


def test_a_schedule_whose_input_cannot_fill_a_map_key_is_refused() -> None:
    task = TaskDef(
        "process", "etl.process", for_each="list", rate_limit=RateLimit(5, 1.0, "{region}")
    )
    with pytest.raises(DefinitionError, match=r"schedules\[0\]\.input.*rate_limit\.key"):
        WorkflowDef(
            "etl",
            (TaskDef("list", "etl.list"), task),
            schedules=(ScheduleDef(cron="* * * * *", input={}),),
        )
    ok = WorkflowDef(
        "etl",
        (TaskDef("list", "etl.list"), task),
        schedules=(ScheduleDef(cron="* * * * *", input={"region": "eu"}),),
    )
    assert ok.task("process").rate_limit == RateLimit(5, 1.0, "{region}")


def test_an_expansion_renders_each_items_keys_and_carries_the_limits() -> None:
    wf = mapped(
        concurrency=Concurrency("t-{item[tenant]}", 2),
        rate_limit=RateLimit(100, 0.5, "{region}-{index}"),
    )
    items = [{"tenant": "a"}, {"tenant": "b"}, {"tenant": "a"}]
    planned = plan_items(items, {"region": "eu"}, stored(wf), None)
    assert planned == ItemKeys(
        idempotency_keys=[None] * 3,
        ordering_keys=[None] * 3,
        concurrency_keys=["t-a", "t-b", "t-a"],
        rate_keys=["eu-0", "eu-1", "eu-2"],
        breaker_keys=[None] * 3,
        concurrency_limit=2,
        rate_limit=100,
        rate_per_s=0.5,
    )


def test_a_rate_limit_without_a_key_is_the_handlers_for_every_item() -> None:
    planned = plan_items([1, 2], {}, stored(mapped(rate_limit=RateLimit(7, 60.0))), None)
    assert isinstance(planned, ItemKeys)
    assert planned.rate_keys == ["etl.process", "etl.process"]
    assert (planned.concurrency_keys, planned.concurrency_limit) == ([None, None], None)
    assert (planned.rate_limit, planned.rate_per_s) == (7, 60.0)


def test_an_unlimited_map_renders_no_limit_key() -> None:
    planned = plan_items([1, 2], {}, stored(mapped()), None)
    assert planned == ItemKeys([None, None], [None, None], [None, None], [None, None], [None, None])


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([{"tenant": "a"}, {"name": "b"}], "item 1: concurrency.key"),
        ([7], "item 0: concurrency.key"),
        ([{"tenant": "k" * 1100}], "bytes"),
        ([{"tenant": "a\x00b"}], "NUL"),
    ],
)
def test_an_item_that_cannot_fill_its_key_buries_the_map_whole(
    items: list[Any], fragment: str
) -> None:
    """As for its other keys: nothing of the map is expanded, the map is DEAD item_key_error
    naming the item and the key."""
    wf = mapped(concurrency=Concurrency("t-{item[tenant]}", 2))
    failure = plan_items(items, {}, stored(wf), None)
    assert isinstance(failure, MapFailure)
    assert failure.reason is FailureReason.ITEM_KEY_ERROR and fragment in failure.error


def test_the_statements_that_create_or_open_items_never_make_one_ready() -> None:
    """An item becomes READY only through promote_ready (unlimited: ready_by_itself) or the
    admission pass (keyed): the expansion, opening a max_parallel slot and the map's requeue
    leave every item PENDING; the expansion writes the keys that make ready_by_itself false."""
    named = queries.load()
    for name in ("expand_map", "open_item_slots", "requeue_map_items", "reopen_map"):
        assert "'READY'" not in named[name].decode(), name
    expand = named["expand_map"].decode()
    for column in ("concurrency_key", "concurrency_limit", "rate_key", "rate_limit", "rate_per_s"):
        assert column in expand.split("INSERT INTO task_runs")[1].split("SELECT")[0], column
