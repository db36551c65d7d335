"""Bad input to issue 19's constructs, by class, one table per kind of input; every path that
takes that input is tested with its whole table:

- definitions: ``flowforge workflows validate`` (tests/integration/test_dynamic_bad_input.py),
  the mapping a file is read into and Python's ``TaskDef``/``WorkflowDef``
  (tests/unit/test_dynamic_bad_input.py);
- events: ``POST /api/v1/events``, ``flowforge event send``, ``Client.send_event``;
- run inputs that cannot fill an event key: ``POST /api/v1/runs``, ``flowforge trigger``;
- results a map cannot expand (run time): the map DEAD with its reason.

(A child workflow unknown to the loaded set, or workflows recursing through each other, are
problems of a set of files: tests/integration/test_children_interfaces.py.)

Each case is ``pytest.param(..., fragment, id=...)``: ``fragment`` is what the one-line error
must hold (the field it names).
"""

from __future__ import annotations

from typing import Any

import pytest

from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.reasons import FailureReason

#: A workflow file whose second task is ``{{name: process, {process}}}``, with ``{top}``
#: lines before ``tasks:``; ``list`` and ``merge`` are around it.
FILE = (
    "name: etl\n{top}tasks:\n"
    "  - {{name: list, handler: e2e.items}}\n"
    "  - {{name: process, {process}}}\n"
    "  - {{name: merge, handler: e2e.record, depends_on: [process]}}\n"
)
WAIT = "wait_for_event: {{name: {name}, key: {key}, timeout: {timeout}}}"


def wait(name: str = "e", key: str = "k", timeout: str = "1d") -> str:
    return WAIT.format(name=name, key=key, timeout=timeout)


#: (the process task's keys, lines before ``tasks:``, fragment)
BAD_FILES = [
    # for_each naming a task that is not upstream, or not a task name
    pytest.param(
        "handler: e2e.item, for_each: nowhere", "", "for_each names unknown task", id="fe-unknown"
    ),
    pytest.param(
        "handler: e2e.item, for_each: merge", "", "which is not upstream of it", id="fe-downstream"
    ),
    pytest.param(
        "handler: e2e.item, for_each: process", "", "for_each names the task itself", id="fe-self"
    ),
    pytest.param("handler: e2e.item, for_each: 5", "", "tasks[1].for_each", id="fe-int"),
    pytest.param("handler: e2e.item, for_each: [list]", "", "tasks[1].for_each", id="fe-list"),
    pytest.param("handler: e2e.item, for_each: ''", "", "for_each '' is invalid", id="fe-empty"),
    pytest.param(
        f"for_each: list, {wait()}", "", "a wait_for_event task cannot have for_each", id="fe-wait"
    ),
    pytest.param(
        "for_each: list, sleep: 1m", "", "a sleep task cannot have for_each", id="fe-sleep"
    ),
    # max_items / max_parallel
    pytest.param("handler: e2e.item, for_each: list", "max_items: 0\n", "max_items", id="mi-zero"),
    pytest.param(
        "handler: e2e.item, for_each: list", "max_items: -3\n", "max_items", id="mi-negative"
    ),
    pytest.param(
        "handler: e2e.item, for_each: list", "max_items: 2000000\n", "max_items", id="mi-over"
    ),
    pytest.param(
        "handler: e2e.item, for_each: list", "max_items: lots\n", "max_items", id="mi-text"
    ),
    pytest.param(
        "handler: e2e.item, for_each: list", "max_items: 2.5\n", "max_items", id="mi-float"
    ),
    pytest.param(
        "handler: e2e.item, for_each: list", "max_items: true\n", "max_items", id="mi-bool"
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, max_parallel: 0", "", "max_parallel", id="mp-zero"
    ),
    pytest.param(
        "handler: e2e.item, max_parallel: 3",
        "",
        "max_parallel is only for a for_each",
        id="mp-no-map",
    ),
    # key templates (a map's, rendered per item; a wait's, rendered from the run input)
    pytest.param(
        "handler: e2e.item, for_each: list, idempotency_key: '{item.x}'",
        "",
        "idempotency_key",
        id="key-attr",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, idempotency_key: '{item'",
        "",
        "malformed template",
        id="key-malformed",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, idempotency_key: '{}'",
        "",
        "idempotency_key",
        id="key-positional",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, idempotency_key: 5", "", "idempotency_key", id="key-int"
    ),
    pytest.param(
        'handler: e2e.item, for_each: list, idempotency_key: "a\\0{item}"',
        "",
        "idempotency_key",
        id="key-nul",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, ordering_key: '{index.real}'",
        "",
        "ordering_key",
        id="okey-attr",
    ),
    pytest.param(wait(key="'{a.b}'"), "", "wait_for_event.key", id="wkey-attr"),
    pytest.param(wait(key="'{a'"), "", "malformed template", id="wkey-malformed"),
    pytest.param(wait(key="5"), "", "wait_for_event.key", id="wkey-int"),
    pytest.param(wait(key="null"), "", "wait_for_event.key", id="wkey-null"),
    pytest.param(wait(key="'" + "k" * 1100 + "'"), "", "wait_for_event.key", id="wkey-long"),
    # the event a wait names
    pytest.param(
        "wait_for_event: {key: k, timeout: 1d}", "", "wait_for_event.name", id="wname-missing"
    ),
    pytest.param(wait(name="''"), "", "wait_for_event.name", id="wname-empty"),
    pytest.param(wait(name="null"), "", "wait_for_event.name", id="wname-null"),
    pytest.param(wait(name="5"), "", "wait_for_event.name", id="wname-int"),
    pytest.param(wait(name="[a]"), "", "wait_for_event.name", id="wname-list"),
    pytest.param(wait(name="a" * 129), "", "wait_for_event.name", id="wname-long"),
    pytest.param(wait(name='"a\\0b"'), "", "wait_for_event.name", id="wname-nul"),
    pytest.param(wait(name="'a b'"), "", "wait_for_event.name", id="wname-space"),
    pytest.param(wait(timeout="0"), "", "wait_for_event.timeout", id="wtimeout-zero"),
    pytest.param(wait(timeout="soon"), "", "wait_for_event.timeout", id="wtimeout-text"),
    # run_if
    pytest.param(
        "handler: e2e.item, depends_on: [list], run_if: sometimes", "", "run_if", id="ri-word"
    ),
    pytest.param(
        "handler: e2e.item, depends_on: [list], run_if: ANY_FAILED", "", "run_if", id="ri-case"
    ),
    pytest.param("handler: e2e.item, depends_on: [list], run_if: ''", "", "run_if", id="ri-empty"),
    pytest.param("handler: e2e.item, depends_on: [list], run_if: null", "", "run_if", id="ri-null"),
    pytest.param("handler: e2e.item, depends_on: [list], run_if: 3", "", "run_if", id="ri-int"),
    pytest.param("handler: e2e.item, depends_on: [list], run_if: true", "", "run_if", id="ri-bool"),
    pytest.param(
        "handler: e2e.item, depends_on: [list], run_if: [any_failed]", "", "run_if", id="ri-list"
    ),
    pytest.param(
        "handler: e2e.item, depends_on: [list], run_if: {a: 1}", "", "run_if", id="ri-map"
    ),
    pytest.param(
        "handler: e2e.item, run_if: any_failed",
        "",
        "run_if: any_failed needs depends_on",
        id="ri-no-deps",
    ),
    # a child workflow (workflow:) with what it cannot be, and its input:
    pytest.param(
        "workflow: bill, handler: e2e.item", "", "both workflow and handler", id="wf-handler"
    ),
    pytest.param(
        "workflow: bill, for_each: list", "", "both workflow and for_each", id="wf-for-each"
    ),
    pytest.param("workflow: bill, sleep: 1m", "", "both workflow and sleep", id="wf-sleep"),
    pytest.param(f"workflow: bill, {wait()}", "", "both workflow and wait_for_event", id="wf-wait"),
    pytest.param("workflow: bill, timeout: 5", "", "takes no timeout", id="wf-timeout"),
    pytest.param("workflow: bill, ordering_key: k", "", "takes no ordering_key", id="wf-okey"),
    pytest.param("workflow: 'a b'", "", "workflow 'a b' is invalid", id="wf-name-space"),
    pytest.param("workflow: 5", "", "tasks[1].workflow", id="wf-name-int"),
    pytest.param("workflow: etl", "", "cannot recurse into itself", id="wf-self"),
    pytest.param("workflow: bill, input: [1]", "", "tasks[1].input", id="in-list"),
    pytest.param("workflow: bill, input: 5", "", "tasks[1].input", id="in-int"),
    pytest.param("workflow: bill, input: {a: '{a.b}'}", "", "template field {a.b}", id="in-attr"),
    pytest.param("workflow: bill, input: {a: '{a'}", "", "malformed template", id="in-malformed"),
    pytest.param("workflow: bill, input: {a: .nan}", "", "input", id="in-nan"),
    pytest.param(
        "workflow: bill, input: {a: '{upstream[list]}'}",
        "",
        "not one of its dependencies",
        id="in-upstream-not-dep",
    ),
    pytest.param("handler: e2e.item, input: {a: 1}", "", "input is only for", id="in-no-workflow"),
    # a map's concurrency and rate keys (issue 20): rendered per item, as its other keys
    pytest.param(
        "handler: e2e.item, for_each: list, concurrency: {key: 't-{index[0]}', limit: 2}",
        "",
        "index is the item's position",
        id="ckey-index",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, concurrency: {key: '{item.tenant}', limit: 2}",
        "",
        "concurrency.key",
        id="ckey-attr",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, concurrency: {key: '{item', limit: 2}",
        "",
        "malformed template",
        id="ckey-malformed",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, concurrency: {key: t, limit: 0}",
        "",
        "concurrency.limit",
        id="climit-zero",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, concurrency: {limit: 2}",
        "",
        "concurrency.key",
        id="ckey-missing",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, rate_limit: {limit: 5, per: 1s, key: '{index[1]}'}",
        "",
        "index is the item's position",
        id="rkey-index",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, rate_limit: {limit: 5, per: 0, key: '{item}'}",
        "",
        "rate_limit.per",
        id="rper-zero",
    ),
    pytest.param(
        "handler: e2e.item, for_each: list, idempotency_key: '{index[0]}'",
        "",
        "index is the item's position",
        id="key-index",
    ),
]


def _map(**process: Any) -> WorkflowDef:
    return WorkflowDef("etl", (TaskDef("list", "h.list"), TaskDef("process", **process)))


_WAIT = EventWait("e", "k", 60.0)

#: Python definitions: (a function building the definition, fragment)
BAD_PYTHON = [
    pytest.param(
        lambda: _map(handler="h.p", for_each="nowhere"),
        "for_each names unknown task",
        id="fe-unknown",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="process"),
        "for_each names the task itself",
        id="fe-self",
    ),
    pytest.param(
        lambda: WorkflowDef(
            "etl",
            (
                TaskDef("list", "h.l", depends_on=("process",)),
                TaskDef("process", "h.p", for_each="list"),
            ),
        ),
        "which is not upstream of it",
        id="fe-downstream",
    ),
    pytest.param(lambda: _map(handler="h.p", for_each=5), "for_each", id="fe-int"),
    pytest.param(lambda: _map(handler="h.p", for_each=["list"]), "for_each", id="fe-list"),
    pytest.param(lambda: _map(handler="h.p", for_each=""), "for_each", id="fe-empty"),
    pytest.param(
        lambda: _map(for_each="list", wait_for_event=_WAIT),
        "a wait_for_event task cannot have for_each",
        id="fe-wait",
    ),
    pytest.param(
        lambda: _map(for_each="list", sleep=60.0),
        "a sleep task cannot have for_each",
        id="fe-sleep",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", depends_on="list"),
        "depends_on must be a list",
        id="deps-text",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", depends_on=(5,)),
        "depends_on must be a list",
        id="deps-int",
    ),
    pytest.param(
        lambda: WorkflowDef("w", (TaskDef("l", "h.l"),), max_items=0), "max_items", id="mi-zero"
    ),
    pytest.param(
        lambda: WorkflowDef("w", (TaskDef("l", "h.l"),), max_items="5"), "max_items", id="mi-text"
    ),
    pytest.param(
        lambda: WorkflowDef("w", (TaskDef("l", "h.l"),), max_items=float("nan")),
        "max_items",
        id="mi-nan",
    ),
    pytest.param(
        lambda: WorkflowDef("w", (TaskDef("l", "h.l"),), max_items=True), "max_items", id="mi-bool"
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", max_parallel=0), "max_parallel", id="mp-zero"
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", max_parallel=2.0),
        "max_parallel",
        id="mp-float",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", idempotency_key="{item.x}"),
        "idempotency_key",
        id="key-attr",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", idempotency_key="{item"),
        "malformed template",
        id="key-malformed",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", idempotency_key=5),
        "idempotency_key: must be a template string",
        id="key-int",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", ordering_key=b"{item}"),
        "ordering_key: must be a template string",
        id="okey-bytes",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", idempotency_key="a\x00{item}"),
        "idempotency_key",
        id="key-nul",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", idempotency_key="{item:{x.y}}"),
        "idempotency_key",
        id="key-nested",
    ),
    pytest.param(
        lambda: EventWait("e", None, 60.0),
        "wait_for_event.key: must be a template string",
        id="wkey-none",
    ),
    pytest.param(
        lambda: EventWait("e", 5, 60.0),
        "wait_for_event.key: must be a template string",
        id="wkey-int",
    ),
    pytest.param(lambda: EventWait("e", "{a.b}", 60.0), "wait_for_event.key", id="wkey-attr"),
    pytest.param(lambda: EventWait("e", "\ud800", 60.0), "wait_for_event.key", id="wkey-surrogate"),
    pytest.param(lambda: EventWait(None, "k", 60.0), "wait_for_event.name", id="wname-none"),
    pytest.param(lambda: EventWait("", "k", 60.0), "wait_for_event.name", id="wname-empty"),
    pytest.param(lambda: EventWait(5, "k", 60.0), "wait_for_event.name", id="wname-int"),
    pytest.param(lambda: EventWait("a" * 129, "k", 60.0), "wait_for_event.name", id="wname-long"),
    pytest.param(lambda: EventWait("a\x00", "k", 60.0), "wait_for_event.name", id="wname-nul"),
    pytest.param(lambda: EventWait("e", "k", "1d"), "wait_for_event.timeout", id="wtimeout-text"),
    pytest.param(
        lambda: TaskDef("u", "h.u", depends_on=("a",), run_if="sometimes"),
        "run_if must be one of",
        id="ri-word",
    ),
    pytest.param(
        lambda: TaskDef("u", "h.u", depends_on=("a",), run_if=None),
        "run_if must be one of",
        id="ri-none",
    ),
    pytest.param(
        lambda: TaskDef("u", "h.u", depends_on=("a",), run_if=3),
        "run_if must be one of",
        id="ri-int",
    ),
    pytest.param(
        lambda: TaskDef("u", "h.u", depends_on=("a",), run_if=["any_failed"]),
        "run_if must be one of",
        id="ri-list",
    ),
    pytest.param(
        lambda: TaskDef("u", "h.u", depends_on=("a",), run_if={}),
        "run_if must be one of",
        id="ri-dict",
    ),
    pytest.param(
        lambda: TaskDef("u", "h.u", run_if=RunIf.ALL_DONE),
        "run_if: all_done needs depends_on",
        id="ri-no-deps",
    ),
    pytest.param(
        lambda: TaskDef("c", "h.c", workflow="bill"), "both workflow and handler", id="wf-handler"
    ),
    pytest.param(lambda: TaskDef("c", workflow=5), "workflow", id="wf-name-int"),
    pytest.param(
        lambda: WorkflowDef("etl", (TaskDef("c", workflow="etl"),)),
        "cannot recurse into itself",
        id="wf-self",
    ),
    pytest.param(lambda: TaskDef("c", workflow="b", input=[1]), "input", id="in-list"),
    pytest.param(
        lambda: TaskDef("c", workflow="b", input={"a": object()}), "input", id="in-object"
    ),
    pytest.param(
        lambda: TaskDef("c", workflow="b", input={"a": "{upstream[x]}"}),
        "not one of its dependencies",
        id="in-upstream-not-dep",
    ),
    pytest.param(lambda: TaskDef("c", "h.c", input={}), "input is only for", id="in-no-workflow"),
    # a map's concurrency and rate keys (issue 20)
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", concurrency=Concurrency("{index[0]}", 2)),
        "concurrency.key: {index[0]}: index is the item's position",
        id="ckey-index",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", rate_limit=RateLimit(5, 1.0, "{item.t}")),
        "rate_limit.key",
        id="rkey-attr",
    ),
    pytest.param(
        lambda: _map(
            handler="h.p", for_each="list", rate_limit=RateLimit(5, 1.0, "{item:{index[0]}}")
        ),
        "rate_limit.key: {index[0]}: index is the item's position",
        id="rkey-index-nested",
    ),
    pytest.param(
        lambda: _map(handler="h.p", for_each="list", concurrency=("k", 2)),
        "concurrency must be a Concurrency",
        id="c-tuple",
    ),
]

#: An event as each sender gives it (None: left out): (name, key, fragment)
BAD_EVENTS = [
    pytest.param(None, "k", "event name", id="name-missing"),
    pytest.param("", "k", "event name", id="name-empty"),
    pytest.param(5, "k", "event name", id="name-int"),
    pytest.param(["order.approved"], "k", "event name", id="name-list"),
    pytest.param("a" * 129, "k", "event name", id="name-long"),
    pytest.param("order\x00approved", "k", "event name", id="name-nul"),
    pytest.param("order approved", "k", "event name", id="name-space"),
    pytest.param("order/approved", "k", "event name", id="name-slash"),
    pytest.param("a\ud800", "k", "event name", id="name-surrogate"),
    pytest.param("order.approved", None, "event key", id="key-missing"),
    pytest.param("order.approved", 5, "event key", id="key-int"),
    pytest.param("order.approved", ["k"], "event key", id="key-list"),
    pytest.param("order.approved", "a\x00b", "event key", id="key-nul"),
    pytest.param("order.approved", "k" * 1025, "event key", id="key-long"),
    pytest.param("order.approved", "\udc80", "event key", id="key-surrogate"),
]
#: ``flowforge event send`` arguments carrying what argv can of those (no NUL, only text)
CLI_EVENTS = [
    pytest.param(["", "--key", "k"], "event name", id="name-empty"),
    pytest.param(["a" * 129, "--key", "k"], "event name", id="name-long"),
    pytest.param(["order approved", "--key", "k"], "event name", id="name-space"),
    pytest.param(["order/approved", "--key", "k"], "event name", id="name-slash"),
    pytest.param([], "name", id="name-missing"),
    pytest.param(["order.approved", "--key", "k" * 1025], "event key", id="key-long"),
    pytest.param(["order.approved"], "--key", id="key-missing"),
]

#: A wait whose key is ``order-{order[id]}``: run inputs that cannot fill it (fragment).
KEYED_WAIT = (
    "name: keyed\ntasks:\n"
    "  - name: approve\n"
    "    wait_for_event: {name: order.approved, key: 'order-{order[id]}', timeout: 1h}\n"
)
BAD_WAIT_INPUTS = [
    pytest.param({}, "cannot format", id="missing"),
    pytest.param({"order": 5}, "cannot format", id="not-indexable"),
    pytest.param({"order": {"number": 1}}, "cannot format", id="no-field"),
    pytest.param({"order": {"id": "a\x00b"}}, "NUL", id="nul"),
    pytest.param({"order": {"id": "k" * 1100}}, "bytes", id="long"),
]

#: What a map's upstream may return that the map cannot expand, with the map's bound and
#: key template: (result, max_items, idempotency_key, reason, fragment of last_error)
BAD_RESULTS = [
    pytest.param(
        {"a": 1}, None, None, FailureReason.NOT_A_LIST, "must be a JSON list, not dict", id="object"
    ),
    pytest.param(
        "a,b", None, None, FailureReason.NOT_A_LIST, "must be a JSON list, not str", id="text"
    ),
    pytest.param(
        3, None, None, FailureReason.NOT_A_LIST, "must be a JSON list, not int", id="number"
    ),
    pytest.param(
        True, None, None, FailureReason.NOT_A_LIST, "must be a JSON list, not bool", id="bool"
    ),
    pytest.param(
        None, None, None, FailureReason.NOT_A_LIST, "must be a JSON list, not null", id="null"
    ),
    pytest.param(
        [1, 2, 3], 2, None, FailureReason.TOO_MANY_ITEMS, "more than max_items (2)", id="too-many"
    ),
    pytest.param(
        [{"id": 1}, {}], None, "{item[id]}", FailureReason.ITEM_KEY_ERROR, "item 1", id="no-field"
    ),
    pytest.param(
        [1], None, "{item[id]}", FailureReason.ITEM_KEY_ERROR, "item 0", id="not-indexable"
    ),
    pytest.param(
        [{"id": "k" * 1100}], None, "{item[id]}", FailureReason.ITEM_KEY_ERROR, "bytes", id="long"
    ),
]
