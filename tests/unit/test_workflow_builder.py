"""flowforge.Workflow (SPEC 7.5): the builder and the workflow file are one definition.

Every feature written both ways builds an equal definition with the same digest; every class
of bad value is refused by both with the same ``key.path: message``; ``export`` writes YAML
that loads back to the same digest, for the example workflows and one using every feature.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowforge import (
    CircuitBreaker,
    Concurrency,
    EventWait,
    Jitter,
    OnDead,
    RateLimit,
    RetryPolicy,
    RunIf,
    ScheduleDef,
    Workflow,
    WorkflowDef,
    task,
    workflow_from_mapping,
)
from flowforge.definitions import check_file, document, export_yaml, load_paths
from flowforge.domain.schedule import CatchUp, Overlap
from flowforge.errors import DefinitionError

REPO = Path(__file__).resolve().parents[2]

#: One workflow using every feature a workflow file has (README, docs/time.md, dynamic.md,
#: flow-control.md, schedules.md), each key away from its default.
EVERY_FEATURE = """\
name: every-feature
fail_fast: false
deadline: 2h
max_items: 500
tasks:
  - name: charge
    handler: payments.charge
    retry: {max_attempts: 5, base_delay: 0.5, max_delay: 60, jitter: equal}
    timeout: 30
    idempotency_key: "charge-{order_id}"
    ordering_key: "customer-{customer_id}"
    on_dead: block
    queue: payments
    priority: 7
    concurrency: {key: "tenant-{tenant}", limit: 3}
    rate_limit: {limit: 100, per: 1s, key: partner}
    circuit_breaker: {failures: 5, window: 60s, cooldown: 30s, key: "partner-{region}"}
  - name: cool_off
    sleep: 10m
    depends_on: charge
  - name: list_files
    handler: etl.list_files
    depends_on: [cool_off]
  - name: process
    handler: etl.process
    for_each: list_files
    max_parallel: 50
    idempotency_key: "file-{item[id]}-{index}"
    concurrency: {key: "file-{item[tenant]}", limit: 2}
  - name: approve
    depends_on: [process]
    wait_for_event: {name: order.approved, key: "{order_id}", timeout: 1d}
  - name: invoice
    workflow: invoicing
    depends_on: [approve]
    input: {order: "{order_id}", approved_by: "{upstream[approve][by]}", fixed: [1, 2.5, null]}
    retry: {max_attempts: 2, base_delay: 1, max_delay: 10, jitter: none}
  - name: refund
    handler: payments.refund
    depends_on: [charge, invoice]
    run_if: any_failed
  - name: report
    handler: reports.write
    depends_on: [refund]
    run_if: all_done
schedules:
  - cron: "0 3 * * *"
    timezone: Europe/Berlin
    input: {order_id: 1, customer_id: 2, tenant: t, region: eu}
    catch_up: all
    max_catch_up: 10
    overlap: cancel_previous
    name: nightly
  - every: 30s
    input: {order_id: 3, customer_id: 4, tenant: u, region: us}
"""


def every_feature_in_python() -> Workflow:
    """:data:`EVERY_FEATURE` written with the builder, Python's own values where it has them
    (timedelta, enums, the definition classes, a step function) and text where a file has."""
    flow = Workflow("every-feature", fail_fast=False, deadline=timedelta(hours=2), max_items=500)
    charge = flow.task(
        "charge",
        "payments.charge",
        retry=RetryPolicy(5, 0.5, 60, Jitter.EQUAL),
        timeout=timedelta(seconds=30),
        idempotency_key="charge-{order_id}",
        ordering_key="customer-{customer_id}",
        on_dead=OnDead.BLOCK,
        queue="payments",
        priority=7,
        concurrency=Concurrency("tenant-{tenant}", 3),
        rate_limit={"limit": 100, "per": "1s", "key": "partner"},
        circuit_breaker=CircuitBreaker(5, 60, 30, key="partner-{region}"),
    )
    cool_off = flow.task("cool_off", sleep="10m", depends_on=charge)

    @flow.step(depends_on=[cool_off])
    @task("etl.list_files")
    def list_files(ctx: object) -> list[int]:
        return [1]

    flow.task(
        "process",
        "etl.process",
        for_each=list_files,
        max_parallel=50,
        idempotency_key="file-{item[id]}-{index}",
        concurrency={"key": "file-{item[tenant]}", "limit": 2},
    )
    flow.task(
        "approve",
        depends_on=["process"],
        wait_for_event=EventWait("order.approved", "{order_id}", timedelta(days=1).total_seconds()),
    )
    flow.task(
        "invoice",
        workflow=Workflow("invoicing"),
        depends_on=["approve"],
        input={
            "order": "{order_id}",
            "approved_by": "{upstream[approve][by]}",
            "fixed": [1, 2.5, None],
        },
        retry={
            "max_attempts": 2,
            "base_delay": 1,
            "max_delay": timedelta(seconds=10),
            "jitter": "none",
        },
    )
    flow.task("refund", "payments.refund", depends_on=[charge, "invoice"], run_if=RunIf.ANY_FAILED)
    flow.task("report", "reports.write", depends_on="refund", run_if="all_done")
    flow.schedule(
        cron="0 3 * * *",
        timezone="Europe/Berlin",
        input={"order_id": 1, "customer_id": 2, "tenant": "t", "region": "eu"},
        catch_up=CatchUp.ALL,
        max_catch_up=10,
        overlap="cancel_previous",
        name="nightly",
    )
    flow.schedule(
        ScheduleDef(every="30s"),
        input={"order_id": 3, "customer_id": 4, "tenant": "u", "region": "us"},
    )
    return flow


def from_yaml(text: str) -> WorkflowDef:
    return workflow_from_mapping(yaml.safe_load(text), "test")


def test_every_feature_built_in_python_equals_its_workflow_file() -> None:
    built = every_feature_in_python().build()
    loaded = from_yaml(EVERY_FEATURE)
    assert built == loaded
    assert built.digest == loaded.digest
    assert built.schedules == loaded.schedules  # not part of the digest: compared on their own
    # the definition really holds every feature (a builder that dropped one would still be
    # equal to a file that lost it too)
    charge, process, invoice = built.task("charge"), built.task("process"), built.task("invoice")
    assert charge.on_dead is OnDead.BLOCK and charge.priority == 7 and charge.queue == "payments"
    assert charge.rate_limit == RateLimit(100, 1.0, "partner")
    assert charge.circuit_breaker == CircuitBreaker(5, 60.0, 30.0, "partner-{region}")
    assert built.task("cool_off").sleep == 600.0
    assert process.for_each == "list_files" and process.max_parallel == 50
    assert built.task("approve").wait_for_event == EventWait(
        "order.approved", "{order_id}", 86400.0
    )
    assert invoice.workflow == "invoicing" and invoice.retry.jitter is Jitter.NONE
    assert built.task("refund").run_if is RunIf.ANY_FAILED
    assert built.task("list_files").handler == "etl.list_files"  # the @task name it already had
    assert (built.deadline, built.max_items, built.fail_fast) == (7200.0, 500, False)
    assert [s.overlap for s in built.schedules] == [Overlap.CANCEL_PREVIOUS, Overlap.SKIP]


def test_the_builder_holds_what_the_file_holds() -> None:
    mapping = every_feature_in_python().to_mapping()
    assert workflow_from_mapping(yaml.safe_load(yaml.safe_dump(mapping))) == from_yaml(
        EVERY_FEATURE
    )


def test_a_step_is_a_task_and_a_marked_handler() -> None:
    flow = Workflow("steps")

    @flow.step(retry={"max_attempts": 1})
    def fetch(ctx: object) -> int:
        return 1

    @flow.step("store", handler="shop.store", depends_on=[fetch])
    def save(ctx: object) -> int:
        return 2

    built = flow.build()
    assert [(t.name, t.handler, t.depends_on) for t in built.tasks] == [
        ("fetch", "steps.fetch", ()),
        ("store", "shop.store", ("fetch",)),
    ]
    assert fetch(None) == 1 and save(None) == 2  # still the functions
    assert fetch.__flowforge_task__ == "steps.fetch"  # type: ignore[attr-defined]
    assert save.__flowforge_task__ == "shop.store"  # type: ignore[attr-defined]


def _file_problem(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=False))
    workflow, problems = check_file(path)
    assert workflow is None and len(problems) == 1, problems
    match = re.fullmatch(rf"{re.escape(str(path))}:\d+: (.*)", problems[0])
    assert match, problems[0]
    return match.group(1)


def _builder_problem(name: Any, tasks: list[dict[str, Any]], head: dict[str, Any]) -> str:
    schedules = head.pop("schedules", [])
    flow = Workflow(name, **head)
    for entry in tasks:
        options = dict(entry)
        flow.task(options.pop("name"), options.pop("handler", ""), **options)
    for schedule in schedules:
        flow.schedule(**schedule)
    with pytest.raises(DefinitionError) as caught:
        flow.build()
    prefix = f"workflow {name!r}: "
    message = str(caught.value)
    assert message.startswith(prefix), message
    return message[len(prefix) :]


OK_TASK = {"name": "a", "handler": "h.a"}
#: One class of bad value per row: (what the row is, workflow-level keys, the tasks). The
#: first task is ``a`` (handler ``h.a``) unless a row gives its own.
BAD = [
    ("workflow name", {"name": "bad name"}, [OK_TASK]),
    ("no tasks", {}, []),
    ("deadline text", {"deadline": "soon"}, [OK_TASK]),
    ("deadline zero", {"deadline": 0}, [OK_TASK]),
    ("max_items zero", {"max_items": 0}, [OK_TASK]),
    ("fail_fast text", {"fail_fast": "yes"}, [OK_TASK]),
    ("handler missing", {}, [{"name": "a"}]),
    ("handler bad name", {}, [{"name": "a", "handler": "no spaces"}]),
    ("handler NUL", {}, [{"name": "a", "handler": "h\x00a"}]),
    ("handler lone surrogate", {}, [{"name": "a", "handler": "h\ud800"}]),
    ("handler not text", {}, [{"name": "a", "handler": 5}]),
    ("task name", {}, [{"name": "a b", "handler": "h.a"}]),
    ("duplicate task", {}, [OK_TASK, OK_TASK]),
    ("unknown dependency", {}, [{**OK_TASK, "depends_on": ["zz"]}]),
    ("dependency twice", {}, [OK_TASK, {"name": "b", "handler": "h", "depends_on": ["a", "a"]}]),
    (
        "cycle",
        {},
        [{**OK_TASK, "depends_on": ["b"]}, {"name": "b", "handler": "h", "depends_on": ["a"]}],
    ),
    ("depends_on not a list", {}, [{**OK_TASK, "depends_on": 5}]),
    ("retry zero attempts", {}, [{**OK_TASK, "retry": {"max_attempts": 0}}]),
    ("retry text attempts", {}, [{**OK_TASK, "retry": {"max_attempts": "3"}}]),
    ("retry negative delay", {}, [{**OK_TASK, "retry": {"base_delay": -1}}]),
    ("retry max below base", {}, [{**OK_TASK, "retry": {"base_delay": 5, "max_delay": 1}}]),
    ("retry jitter", {}, [{**OK_TASK, "retry": {"jitter": "wild"}}]),
    ("retry unknown key", {}, [{**OK_TASK, "retry": {"attempts": 3}}]),
    ("retry not a mapping", {}, [{**OK_TASK, "retry": 5}]),
    ("timeout negative", {}, [{**OK_TASK, "timeout": -1}]),
    ("timeout text", {}, [{**OK_TASK, "timeout": "30s"}]),
    ("timeout NaN", {}, [{**OK_TASK, "timeout": float("nan")}]),
    ("timeout infinite", {}, [{**OK_TASK, "timeout": float("inf")}]),
    ("timeout over a week", {}, [{**OK_TASK, "timeout": 8 * 86400}]),
    ("idempotency_key malformed", {}, [{**OK_TASK, "idempotency_key": "{a"}]),
    ("idempotency_key attribute", {}, [{**OK_TASK, "idempotency_key": "{a.__class__}"}]),
    ("idempotency_key not text", {}, [{**OK_TASK, "idempotency_key": 5}]),
    ("ordering_key positional", {}, [{**OK_TASK, "ordering_key": "{0}"}]),
    ("ordering_key NUL", {}, [{**OK_TASK, "ordering_key": "k\x00{a}"}]),
    ("on_dead", {}, [{**OK_TASK, "on_dead": "maybe"}]),
    ("sleep text", {}, [{"name": "a", "sleep": "forever"}]),
    ("sleep zero", {}, [{"name": "a", "sleep": 0}]),
    ("sleep with handler", {}, [{**OK_TASK, "sleep": "1m"}]),
    ("sleep with timeout", {}, [{"name": "a", "sleep": "1m", "timeout": 5}]),
    ("for_each unknown", {}, [{**OK_TASK, "for_each": "zz"}]),
    ("for_each itself", {}, [{**OK_TASK, "for_each": "a"}]),
    ("max_parallel alone", {}, [{**OK_TASK, "max_parallel": 3}]),
    (
        "max_parallel zero",
        {},
        [OK_TASK, {"name": "b", "handler": "h", "for_each": "a", "max_parallel": 0}],
    ),
    (
        "index has no fields",
        {},
        [OK_TASK, {"name": "b", "handler": "h", "for_each": "a", "idempotency_key": "{index[0]}"}],
    ),
    (
        "wait timeout zero",
        {},
        [{"name": "a", "wait_for_event": {"name": "e", "key": "k", "timeout": 0}}],
    ),
    (
        "wait timeout text",
        {},
        [{"name": "a", "wait_for_event": {"name": "e", "key": "k", "timeout": "long"}}],
    ),
    ("wait key missing", {}, [{"name": "a", "wait_for_event": {"name": "e", "timeout": "1d"}}]),
    (
        "wait bad event name",
        {},
        [{"name": "a", "wait_for_event": {"name": "e e", "key": "k", "timeout": "1d"}}],
    ),
    (
        "wait with handler",
        {},
        [{**OK_TASK, "wait_for_event": {"name": "e", "key": "k", "timeout": "1d"}}],
    ),
    ("run_if", {}, [{**OK_TASK, "run_if": "sometimes"}]),
    ("run_if without dependencies", {}, [{**OK_TASK, "run_if": "any_failed"}]),
    ("workflow itself", {"name": "w"}, [{"name": "a", "workflow": "w"}]),
    ("workflow with handler", {}, [{**OK_TASK, "workflow": "child"}]),
    ("workflow input not a mapping", {}, [{"name": "a", "workflow": "child", "input": [1]}]),
    ("workflow input NaN", {}, [{"name": "a", "workflow": "child", "input": {"x": float("nan")}}]),
    (
        "workflow input reads a non-dependency",
        {},
        [{"name": "a", "workflow": "child", "input": {"x": "{upstream[b]}"}}],
    ),
    ("input without workflow", {}, [{**OK_TASK, "input": {"x": 1}}]),
    ("queue empty", {}, [{**OK_TASK, "queue": ""}]),
    ("queue reserved", {}, [{**OK_TASK, "queue": "amq.mine"}]),
    ("queue too long", {}, [{**OK_TASK, "queue": "q" * 300}]),
    ("priority over 9", {}, [{**OK_TASK, "priority": 10}]),
    ("priority boolean", {}, [{**OK_TASK, "priority": True}]),
    ("concurrency zero", {}, [{**OK_TASK, "concurrency": {"key": "k", "limit": 0}}]),
    ("concurrency bad key", {}, [{**OK_TASK, "concurrency": {"key": "{k", "limit": 1}}]),
    ("concurrency missing limit", {}, [{**OK_TASK, "concurrency": {"key": "k"}}]),
    ("rate_limit zero window", {}, [{**OK_TASK, "rate_limit": {"limit": 1, "per": "0s"}}]),
    ("rate_limit window text", {}, [{**OK_TASK, "rate_limit": {"limit": 1, "per": "1 parsec"}}]),
    ("rate_limit zero", {}, [{**OK_TASK, "rate_limit": {"limit": 0, "per": 1}}]),
    (
        "breaker zero failures",
        {},
        [{**OK_TASK, "circuit_breaker": {"failures": 0, "window": "1m", "cooldown": "1m"}}],
    ),
    (
        "breaker window too long",
        {},
        [{**OK_TASK, "circuit_breaker": {"failures": 1, "window": "2d", "cooldown": "1m"}}],
    ),
    (
        "breaker key",
        {},
        [
            {
                **OK_TASK,
                "circuit_breaker": {
                    "failures": 1,
                    "window": "1m",
                    "cooldown": "1m",
                    "key": "{a.b}",
                },
            }
        ],
    ),
    ("unknown task key", {}, [{**OK_TASK, "retries": 3}]),
    ("schedule cron", {"schedules": [{"cron": "61 * * * *"}]}, [OK_TASK]),
    ("schedule cron and every", {"schedules": [{"cron": "@daily", "every": "1m"}]}, [OK_TASK]),
    ("schedule timezone", {"schedules": [{"cron": "@daily", "timezone": "Mars/Base"}]}, [OK_TASK]),
    ("schedule overlap", {"schedules": [{"every": "1m", "overlap": "never"}]}, [OK_TASK]),
    (
        "schedule name twice",
        {"schedules": [{"every": "1m", "name": "s"}, {"every": "2m", "name": "s"}]},
        [OK_TASK],
    ),
    (
        "schedule input cannot fill a key",
        {"schedules": [{"every": "1m"}]},
        [{**OK_TASK, "idempotency_key": "{order_id}"}],
    ),
    ("schedule unknown key", {"schedules": [{"every": "1m", "when": "now"}]}, [OK_TASK]),
]


@pytest.mark.parametrize(("head", "tasks"), [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_every_bad_value_gets_the_same_error_from_the_builder_and_the_file(
    tmp_path: Path, head: dict[str, Any], tasks: list[dict[str, Any]]
) -> None:
    name = head.get("name", "w")
    in_file = _file_problem(tmp_path, {"name": name, **head, "tasks": tasks})
    from_builder = _builder_problem(name, tasks, {k: v for k, v in head.items() if k != "name"})
    assert from_builder == in_file


@pytest.mark.parametrize(
    ("python", "text"),
    [
        ({"timeout": timedelta(seconds=-1)}, {"timeout": -1.0}),
        ({"timeout": timedelta(weeks=2)}, {"timeout": 14 * 86400.0}),
        ({"sleep": timedelta(0)}, {"sleep": 0.0}),
        ({"run_if": RunIf.ALL_DONE}, {"run_if": "all_done"}),
        (
            {"rate_limit": {"limit": 1, "per": timedelta(days=2)}},
            {"rate_limit": {"limit": 1, "per": "2d"}},
        ),
    ],
)
def test_pythons_own_values_are_judged_as_their_file_form(
    tmp_path: Path, python: dict[str, Any], text: dict[str, Any]
) -> None:
    """A timedelta is its seconds and an enum its value, so a bad one is refused with the
    message its file form gets (a definition class, RetryPolicy, refuses a bad value when it
    is made, before any builder sees it)."""
    in_file = _file_problem(tmp_path, {"name": "w", "tasks": [{**OK_TASK, **text}]})
    assert _builder_problem("w", [{**OK_TASK, **python}], {}) == in_file


def test_a_handler_function_without_a_name_is_refused_when_added() -> None:
    def anonymous(ctx: object) -> None:
        return None

    with pytest.raises(DefinitionError, match=r"anonymous' is not marked with @flowforge\.task"):
        Workflow("w").task("a", anonymous)


def test_a_function_that_is_no_step_of_the_workflow_is_refused_as_a_dependency() -> None:
    other = Workflow("other")

    @other.step()
    def elsewhere(ctx: object) -> None:
        return None

    with pytest.raises(DefinitionError, match=r"elsewhere' is not a step of this workflow"):
        Workflow("w").task("a", "h.a", depends_on=[elsewhere])
    with pytest.raises(DefinitionError, match=r"for_each: .*elsewhere' is not a step"):
        Workflow("w").task("a", "h.a", for_each=elsewhere)


def test_a_step_without_parentheses_is_refused_not_lost() -> None:
    flow = Workflow("w")

    def fetch(ctx: object) -> None:
        return None

    with pytest.raises(DefinitionError, match=r"step needs its parentheses"):
        flow.step(fetch)  # type: ignore[arg-type]  # what @flow.step without () does


def test_a_step_whose_handler_name_is_bad_is_refused_at_its_key_and_left_unmarked() -> None:
    flow = Workflow("w")

    @flow.step(handler="no spaces")
    def bad(ctx: object) -> None:
        return None

    with pytest.raises(
        DefinitionError, match=r"tasks\[0\]: task 'bad': handler 'no spaces' is invalid"
    ):
        flow.build()
    assert not hasattr(bad, "__flowforge_task__")  # no worker registers a name never valid


def _round_trip(workflow: WorkflowDef) -> WorkflowDef:
    return workflow_from_mapping(yaml.safe_load(export_yaml(workflow)), "export")


#: The shipped example workflows, read together (one starts another as a child run).
EXAMPLES = load_paths([REPO / "config" / "workflows"])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_export_of_each_example_workflow_loads_back_to_the_same_digest(name: str) -> None:
    workflow = EXAMPLES[name]
    again = _round_trip(workflow)
    assert again == workflow and again.digest == workflow.digest
    assert again.schedules == workflow.schedules


def test_export_of_every_feature_loads_back_equal_and_leaves_defaults_out() -> None:
    workflow = every_feature_in_python().build()
    again = _round_trip(workflow)
    assert again == workflow and again.digest == workflow.digest
    assert again.schedules == workflow.schedules
    text = export_yaml(workflow)
    assert text.startswith(f"# workflow every-feature, digest {workflow.digest}\n")
    data = document(workflow)
    assert data["tasks"][2] == {  # a step: name, handler, dependency, nothing at its default
        "name": "list_files",
        "handler": "etl.list_files",
        "depends_on": ["cool_off"],
    }
    assert data["schedules"][1] == {
        "every": "30s",
        "input": {"order_id": 3, "customer_id": 4, "tenant": "u", "region": "us"},
    }


def test_export_writes_only_printable_ascii_whatever_the_definition_holds() -> None:
    flow = Workflow("w")
    flow.task("a", "h.a", idempotency_key="k-\u202e-é-{a}")
    flow.schedule(every="1m", input={"a": "\x1b[31m\u0085"})
    workflow = flow.build()
    text = export_yaml(workflow)
    assert all(" " <= c <= "~" or c == "\n" for c in text), text
    assert _round_trip(workflow) == workflow


def test_a_minimal_workflow_exports_to_its_minimal_file() -> None:
    flow = Workflow("hello")
    flow.task("greet", "hello.greet")
    assert document(flow.build()) == {
        "name": "hello",
        "tasks": [{"name": "greet", "handler": "hello.greet"}],
    }


def test_the_guides_example_builds_and_exports_to_the_same_digest() -> None:
    """docs/workflows-in-python.md's first example, run as written: the guide cannot drift."""
    guide = (REPO / "docs" / "workflows-in-python.md").read_text()
    match = re.search(r"```python\n(.*?)```", guide, re.S)
    assert match
    namespace: dict[str, Any] = {}
    exec(compile(match.group(1), "workflows-in-python.md", "exec"), namespace)
    workflow = namespace["orders"].build()
    assert [t.name for t in workflow.tasks] == ["charge", "cool_off", "ship", "refund", "invoice"]
    assert workflow.task("ship").handler == "order-fulfilment.ship"
    assert _round_trip(workflow).digest == workflow.digest
