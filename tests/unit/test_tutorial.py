"""The tutorial (docs/tutorial.md, examples/tutorial) and the handler guide (docs/handlers.md)
stay true: the tutorial's workflow in Python is its workflow file, it runs end to end (the map,
the async handler), the files the tutorial shows are the files that run, and every ``ctx``
attribute the guide names is TaskContext's and every one TaskContext has is in the guide."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from flowforge import FailureReason, RunState, TaskContext, TaskState, load_config
from flowforge.handlers import import_module
from flowforge.testing import LocalRunner

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "examples" / "tutorial"
CONFIG = TUTORIAL / "flowforge.yaml"
SKUS = ["kettle", "toaster", "lamp", "desk", "chair", "mug"]


@pytest.fixture(scope="module")
def runner() -> LocalRunner:
    return LocalRunner.from_config(CONFIG)


def expected_price(sku: str) -> int:
    """The tutorial's stand-in price, computed here on its own (not by calling the handler)."""
    return 100 + int.from_bytes(hashlib.sha256(sku.encode()).digest()[:2], "big") % 10_000


def test_the_tutorials_config_loads_with_its_handlers_and_workflow(runner: LocalRunner) -> None:
    config = load_config(CONFIG)
    assert config.handlers == ("pricewatch.handlers",)
    assert set(runner.workflows) == {"price-check"}
    assert set(runner.handlers) == {
        "pricewatch.list_products",
        "pricewatch.check_price",
        "pricewatch.report",
    }
    assert inspect.iscoroutinefunction(runner.handlers["pricewatch.check_price"])
    assert not inspect.iscoroutinefunction(runner.handlers["pricewatch.report"])


def test_the_python_builder_version_equals_the_workflow_file(runner: LocalRunner) -> None:
    flows = import_module("pricewatch.flows", str(TUTORIAL), "workflow_modules")
    built = flows.price_check.build()
    loaded = runner.workflows["price-check"]
    assert built == loaded
    assert built.digest == loaded.digest
    assert built.schedules == loaded.schedules  # not part of the digest: compared on their own
    # what the tutorial teaches is really there (an equal pair could both have lost it)
    check = loaded.task("check_price")
    assert check.for_each == "list_products" and check.max_parallel == 4
    assert check.retry.max_attempts == 5 and check.timeout == 20
    assert loaded.task("report").depends_on == ("check_price",)
    (schedule,) = loaded.schedules
    assert schedule.name == "price-check-minutely" and schedule.every is not None
    assert schedule.input == {"store": "demo", "skus": SKUS}


def test_the_scheduled_input_runs_end_to_end_through_the_map_and_the_async_handler(
    runner: LocalRunner,
) -> None:
    (schedule,) = runner.workflows["price-check"].schedules
    run = runner.run("price-check", schedule.input).assert_succeeded()
    items = run["check_price"].items
    assert [item.state for item in items] == [TaskState.SUCCEEDED] * len(SKUS)
    assert run["check_price"].result == [
        {"sku": sku, "price_cents": expected_price(sku), "position": index}
        for index, sku in enumerate(SKUS)
    ]
    cheapest = min(SKUS, key=expected_price)
    assert run["report"].result == {
        "store": "demo",
        "checked": len(SKUS),
        "cheapest": cheapest,
        "total_cents": sum(expected_price(sku) for sku in SKUS),
    }


def test_an_empty_or_bad_product_list_fails_permanently_without_retry(
    runner: LocalRunner,
) -> None:
    for bad in ({"store": "demo"}, {"store": "demo", "skus": []}, {"store": "x", "skus": ["A!"]}):
        run = runner.run("price-check", bad)
        dead = run.assert_failed("list_products", FailureReason.PERMANENT_ERROR)
        assert dead is not None and dead.attempt == 1
        assert run["check_price"].state is TaskState.CANCELLED
        assert run.state is RunState.FAILED


def test_a_failing_price_lookup_is_retried_by_the_tasks_policy(runner: LocalRunner) -> None:
    calls: list[int] = []
    real = runner.handlers["pricewatch.check_price"]

    async def flaky(ctx: TaskContext) -> Any:
        calls.append(ctx.attempt)
        if ctx.item["sku"] == "lamp" and ctx.attempt < 3:
            raise ConnectionError("partner api down")
        return await real(ctx)

    stand_in = LocalRunner.from_config(CONFIG)
    stand_in.handlers = {**runner.handlers, "pricewatch.check_price": flaky}
    run = stand_in.run("price-check", {"store": "demo", "skus": ["kettle", "lamp"]})
    run.assert_succeeded()
    lamp = run["check_price"].items[1]
    assert (
        lamp.attempt == 3
        and [a.reason for a in lamp.attempts[:2]] == [FailureReason.HANDLER_ERROR] * 2
    )
    assert sorted(calls) == [1, 1, 2, 3]


def test_the_files_the_tutorial_shows_are_the_files_that_run() -> None:
    """Each block of docs/tutorial.md that starts with ``# examples/tutorial/PATH`` is that
    file as it is in the repository (the comment line aside)."""
    text = (REPO / "docs" / "tutorial.md").read_text()
    shown = re.findall(r"```(?:python|yaml)\n# (examples/tutorial/\S+)\n(.*?)```", text, re.S)
    assert {path for path, _ in shown} >= {
        "examples/tutorial/flowforge.yaml",
        "examples/tutorial/pricewatch/handlers.py",
        "examples/tutorial/workflows/price-check.yaml",
        "examples/tutorial/pricewatch/flows.py",
    }
    for path, body in shown:
        assert _without_header((REPO / path).read_text()) == body, path


def _without_header(text: str) -> str:
    """The file without the comment or docstring lines the tutorial leaves out: from its
    first line that is neither blank nor a ``#`` comment, after a leading docstring."""
    if text.startswith('"""'):
        text = text[text.index('"""', 3) + 3 :].lstrip("\n")
    lines = text.splitlines(keepends=True)
    while lines and (not lines[0].strip() or lines[0].startswith("#")):
        lines.pop(0)
    return "".join(lines)


# --- the handler guide cannot drift from TaskContext -----------------------------------------


def _public_attributes() -> set[str]:
    fields = {f.name for f in dataclasses.fields(TaskContext)}
    members = {name for name in vars(TaskContext) if not name.startswith("_")}
    return (fields | members) - {"__dataclass_fields__"}


def test_every_ctx_attribute_the_guide_names_exists_on_task_context() -> None:
    guide = (REPO / "docs" / "handlers.md").read_text()
    named = set(re.findall(r"\bctx\.([A-Za-z_]\w*)", guide))
    assert named, "the guide names no ctx attribute"
    ctx = TaskContext({}, {}, 1, uuid4(), uuid4(), "t")
    assert {name for name in named if not hasattr(ctx, name)} == set()
    assert named <= _public_attributes()


def test_every_public_task_context_attribute_has_a_row_in_the_guides_table() -> None:
    guide = (REPO / "docs" / "handlers.md").read_text()
    rows = set(re.findall(r"^\| `ctx\.([A-Za-z_]\w*)", guide, re.M))
    attributes = _public_attributes()
    assert {"input", "upstream", "attempt", "cancelled", "item", "index", "log", "progress"} <= (
        attributes
    )
    assert attributes - rows == set(), "TaskContext attributes the guide does not document"
    assert rows - attributes == set(), "guide rows for attributes TaskContext does not have"
