"""``flowforge.testing.LocalRunner``: a workflow's handlers in-process, no services. The example
workflows (config/workflows) with their example handlers first, then each engine rule the
runner follows, through small workflows and stand-in handlers that count their calls."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from flowforge import PermanentError, RetryPolicy, RunIf, TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.policy import Jitter
from flowforge.domain.reasons import FailureReason as R
from flowforge.domain.states import CancelCause, RunState, TaskState
from flowforge.errors import InputError, UnstorableValueError
from flowforge.testing import REUSED, LocalRunner

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "flowforge.example.yaml"
ORDER = {"order_id": 1, "customer_id": 7, "amount": 1999}


@pytest.fixture
def examples() -> LocalRunner:
    return LocalRunner.from_config(EXAMPLE)


class Calls:
    """Stand-in handlers by name that count their calls (and see their contexts)."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.seen: dict[str, Any] = {}

    def handler(self, name: str, body: Any = None) -> Any:
        def call(ctx: Any) -> Any:
            self.count[ctx.name] += 1
            self.seen[ctx.name] = ctx
            return body(ctx) if callable(body) else body

        return call


# --- the example workflows with their example handlers ----------------------------------------


def test_order_fulfilment_runs_in_dependency_order_and_hands_results_downstream(
    examples: LocalRunner,
) -> None:
    run = examples.run("order-fulfilment", ORDER).assert_succeeded()
    assert list(run.tasks) == ["charge", "reserve", "ship", "notify"]
    assert run.results["ship"] == {"shipped": 1, "charge": {"charged": 1999, "order": 1}}
    assert run["notify"].result == {"notified": 7}
    assert all(t.attempt == 1 and not t.given for t in run)
    assert run["charge"].idempotency_key == "charge-1"


def test_catalogue_import_with_its_event_maps_waits_starts_a_child_and_skips_the_undo(
    examples: LocalRunner,
) -> None:
    run = examples.run(
        "catalogue-import", {"batch": "b1", "files": 2}, events={"catalogue.approved": {"by": "a"}}
    ).assert_succeeded()
    imported = run["import_file"]
    assert [i.name for i in imported.items] == ["import_file[0]", "import_file[1]"]
    assert imported.result == [
        {"file": "b1/part-0.csv", "index": 0, "rows": 100},
        {"file": "b1/part-1.csv", "index": 1, "rows": 101},
    ]
    assert [i.idempotency_key for i in imported.items] == ["import-b1-0", "import-b1-1"]
    assert run["approve"].result == {"by": "a"}
    # the child run of `hello`, its input rendered from the template: the leaves' results
    assert run["announce"].result == {"greet": {"greeting": "hello, catalogue batch b1"}}
    assert run["announce"].children[0].state is RunState.SUCCEEDED
    assert run["undo"].state is TaskState.CANCELLED and run["undo"].skipped
    assert run.compensated == ()


def test_catalogue_import_without_its_event_fails_as_the_wait_would_time_out(
    examples: LocalRunner,
) -> None:
    run = examples.run("catalogue-import", {"batch": "b2"})
    approve = run.assert_failed("approve", "event_timeout")
    assert approve is not None and "catalogue.approved" in (approve.error or "")
    assert run["announce"].cancel_cause is CancelCause.UPSTREAM
    assert run["undo"].skipped  # a cancelled dependency is not a failure to compensate


def test_an_event_can_be_given_for_one_rendered_key_only(examples: LocalRunner) -> None:
    events = {("catalogue.approved", "b3"): {"by": "b"}}
    assert examples.run("catalogue-import", {"batch": "b3"}, events=events).state == "SUCCEEDED"
    assert examples.run("catalogue-import", {"batch": "b4"}, events=events).state == "FAILED"


def test_a_failed_import_is_compensated_and_fail_fast_cancels_the_rest() -> None:
    calls = Calls()

    def import_file(ctx: Any) -> Any:
        if ctx.index == 1:
            raise PermanentError("corrupt file")
        return {"ok": ctx.index}

    runner = LocalRunner.from_config(EXAMPLE)
    runner = LocalRunner(
        runner.workflows.values(),
        [runner.handlers, {"catalogue.import_file": calls.handler("import", import_file)}],
    )
    run = runner.run("catalogue-import", {"batch": "b5", "files": 4})
    run.assert_failed("import_file", "item_failed")
    items = run["import_file"].items
    assert [i.state for i in items] == ["SUCCEEDED", "DEAD", "CANCELLED", "CANCELLED"]
    assert items[1].failure_reason is R.PERMANENT_ERROR and items[1].attempt == 1
    assert calls.count == {"import_file[0]": 1, "import_file[1]": 1}
    assert run["approve"].cancel_cause is CancelCause.UPSTREAM
    assert run["undo"].state is TaskState.SUCCEEDED and run.compensated == ("undo",)


def test_the_same_idempotency_key_reuses_the_result_across_runs(examples: LocalRunner) -> None:
    first = examples.run("order-fulfilment", ORDER)
    again = examples.run("order-fulfilment", ORDER)
    assert [a.outcome for a in again["charge"].attempts] == [REUSED]
    assert again["charge"].result == first["charge"].result
    examples.forget_keys()
    assert examples.run("order-fulfilment", ORDER)["charge"].attempts[0].outcome == "SUCCEEDED"


def test_given_upstream_results_replace_those_tasks(examples: LocalRunner) -> None:
    charged = {"charged": 5, "order": 9}
    run = examples.run(
        "order-fulfilment", ORDER, upstream={"charge": charged, "reserve": {"reserved": []}}
    ).assert_succeeded()
    assert run["charge"].given and run["charge"].attempts == []
    assert run["ship"].result["charge"] == charged


# --- the engine's rules, one by one -----------------------------------------------------------


def _one(handler: Any, **task: Any) -> tuple[LocalRunner, WorkflowDef]:
    workflow = WorkflowDef("w", (TaskDef("t", "h.t", **task),))
    return LocalRunner(workflow, {"h.t": handler}), workflow


def test_a_failing_handler_is_retried_with_the_policys_backoff_until_it_succeeds() -> None:
    def flaky(ctx: Any) -> Any:
        if ctx.attempt < 3:
            raise RuntimeError(f"try {ctx.attempt}")
        return ctx.attempt

    slept: list[float] = []
    workflow = WorkflowDef(
        "w", (TaskDef("t", "h.t", retry=RetryPolicy(5, 2.0, 60.0, Jitter.NONE)),)
    )
    runner = LocalRunner(workflow, {"h.t": flaky}, sleep=slept.append)
    task = runner.run("w").assert_succeeded()["t"]
    assert task.result == 3
    assert [(a.outcome, a.reason, a.retry_delay_s) for a in task.attempts] == [
        ("FAILED", R.HANDLER_ERROR, 2.0),
        ("FAILED", R.HANDLER_ERROR, 4.0),
        ("SUCCEEDED", None, None),
    ]
    assert slept == [2.0, 4.0]
    assert "RuntimeError: try 1" in (task.attempts[0].error or "")
    assert "Traceback" in (task.attempts[0].traceback or "")


def test_retries_run_out_as_max_attempts_exceeded_without_sleeping_by_default() -> None:
    def fail(ctx: Any) -> Any:
        raise ValueError("no")

    runner, _ = _one(fail, retry=RetryPolicy(4, 3600, 3600))
    run = runner.run("w")
    task = run.assert_failed("t", "max_attempts_exceeded")
    assert task is not None and task.attempt == 4 and task.error == "ValueError: no"
    assert [a.retry_delay_s is not None for a in task.attempts] == [True, True, True, False]


def test_a_permanent_error_is_dead_after_one_attempt() -> None:
    def refuse(ctx: Any) -> Any:
        raise PermanentError("never")

    runner, _ = _one(refuse)
    task = runner.run("w").assert_failed("t", "permanent_error")
    assert task is not None and task.attempt == 1


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (object(), "unserializable_result"),
        ({"x": math.nan}, "unserializable_result"),
        ("a\x00b", "unserializable_result"),
        ("\ud800", "unserializable_result"),
        ({"deep": "x" * 2000}, "result_too_large"),
    ],
    ids=["object", "nan", "nul", "surrogate", "too-large"],
)
def test_a_result_the_database_cannot_store_is_dead_without_retry(result: Any, reason: str) -> None:
    workflow = WorkflowDef("w", (TaskDef("t", "h.t"),))
    runner = LocalRunner(workflow, {"h.t": lambda ctx: result}, max_result_bytes=1000)
    task = runner.run("w").assert_failed("t", reason)
    assert task is not None and task.attempt == 1


def test_results_reach_downstream_as_json_reads_them_back() -> None:
    calls = Calls()
    workflow = WorkflowDef("w", (TaskDef("a", "h.a"), TaskDef("b", "h.b", depends_on=("a",))))
    runner = LocalRunner(
        workflow, {"h.a": lambda ctx: {1: (2, 3)}, "h.b": calls.handler("b", lambda c: None)}
    )
    run = runner.run("w", {"when": "now"}).assert_succeeded()
    assert run["a"].result == {"1": [2, 3]}
    assert dict(calls.seen["b"].upstream) == {"a": {"1": [2, 3]}}
    assert run["b"].result is None


def test_an_unknown_handler_is_dead_as_in_a_worker() -> None:
    workflow = WorkflowDef("w", (TaskDef("t", "h.missing"),))
    run = LocalRunner(workflow, {}).run("w")
    task = run.assert_failed("t", "unknown_handler")
    assert task is not None and "h.missing" in (task.error or "")


def test_a_handler_past_its_timeout_fails_its_attempt_as_timeout() -> None:
    ticks = iter([0.0, 5.0, 10.0, 11.0])  # the first call takes 5 s, the second 1 s
    workflow = WorkflowDef("w", (TaskDef("t", "h.t", timeout=2),))
    runner = LocalRunner(workflow, {"h.t": lambda ctx: "done"}, clock=lambda: next(ticks))
    task = runner.run("w").assert_succeeded()["t"]
    assert [(a.outcome, a.reason) for a in task.attempts] == [
        ("FAILED", R.TIMEOUT),
        ("SUCCEEDED", None),
    ]


def _boom(ctx: Any) -> Any:
    raise PermanentError("x")


def test_without_fail_fast_siblings_go_on_and_all_done_runs_after_a_death() -> None:
    calls = Calls()
    workflow = WorkflowDef(
        "w",
        (
            TaskDef("a", "h.boom"),
            TaskDef("b", "h.ok"),
            TaskDef("after_a", "h.ok", depends_on=("a",)),
            TaskDef("tidy", "h.ok", depends_on=("a", "b"), run_if=RunIf.ALL_DONE),
        ),
        fail_fast=False,
    )
    runner = LocalRunner(workflow, {"h.boom": _boom, "h.ok": calls.handler("ok", "fine")})
    run = runner.run("w")
    assert run.state is RunState.FAILED
    assert run["b"].state is TaskState.SUCCEEDED
    assert run["after_a"].cancel_cause is CancelCause.UPSTREAM
    assert run["tidy"].state is TaskState.SUCCEEDED
    assert dict(calls.seen["tidy"].upstream) == {"a": None, "b": "fine"}


def test_fail_fast_cancels_what_has_not_started_but_spares_compensation() -> None:
    calls = Calls()
    workflow = WorkflowDef(
        "w",
        (
            TaskDef("a", "h.boom"),
            TaskDef("b", "h.ok"),
            TaskDef("refund", "h.ok", depends_on=("a",), run_if=RunIf.ANY_FAILED),
            TaskDef("notify", "h.ok", depends_on=("refund",)),
        ),
    )
    run = LocalRunner(workflow, {"h.boom": _boom, "h.ok": calls.handler("ok", 1)}).run("w")
    assert run.state is RunState.FAILED
    assert run["b"].cancel_cause is CancelCause.UPSTREAM and "b" not in calls.count
    assert calls.count == {"refund": 1, "notify": 1}
    assert run.compensated == ("refund",)


def test_a_timer_succeeds_at_once_and_a_skip_downstream_of_skips_is_a_skip() -> None:
    workflow = WorkflowDef(
        "w",
        (
            TaskDef("nap", sleep=3600),
            TaskDef("fix", "h.ok", depends_on=("nap",), run_if=RunIf.ANY_FAILED),
            TaskDef("after", "h.ok", depends_on=("fix",)),
        ),
    )
    run = LocalRunner(workflow, {"h.ok": lambda ctx: 1}).run("w").assert_succeeded()
    assert run["nap"].state is TaskState.SUCCEEDED
    assert run["fix"].skipped and run["after"].skipped


@pytest.mark.parametrize(
    ("source", "reason"),
    [({"not": "a list"}, "not_a_list"), (None, "not_a_list"), (list(range(4)), "too_many_items")],
)
def test_a_map_over_what_cannot_expand_is_dead(source: Any, reason: str) -> None:
    workflow = WorkflowDef(
        "w",
        (TaskDef("src", "h.src"), TaskDef("each", "h.each", for_each="src")),
        max_items=3,
    )
    runner = LocalRunner(workflow, {"h.src": lambda ctx: source, "h.each": lambda ctx: 1})
    runner.run("w").assert_failed("each", reason)


def test_an_empty_map_succeeds_with_an_empty_list_and_items_see_their_item() -> None:
    calls = Calls()
    workflow = WorkflowDef(
        "w",
        (
            TaskDef("other", "h.src"),
            TaskDef("src", "h.src"),
            TaskDef("each", "h.each", for_each="src", depends_on=("other",)),
        ),
    )
    handlers = {"h.src": lambda ctx: [], "h.each": calls.handler("each", lambda c: c.item)}
    assert LocalRunner(workflow, handlers).run("w").assert_succeeded()["each"].result == []
    handlers["h.src"] = lambda ctx: ["x", "y"]
    run = LocalRunner(workflow, handlers).run("w").assert_succeeded()
    assert run["each"].result == ["x", "y"]
    # an item sees the map's other dependencies, not the list it maps over
    assert dict(calls.seen["each[1]"].upstream) == {"other": ["x", "y"]}
    assert calls.seen["each[1]"].index == 1


def test_a_child_run_that_fails_is_retried_as_a_new_child_then_dead() -> None:
    child = WorkflowDef("child", (TaskDef("c", "h.c"),))
    parent = WorkflowDef(
        "parent", (TaskDef("call", workflow="child", retry=RetryPolicy(max_attempts=2)),)
    )

    def fail(ctx: Any) -> Any:
        raise PermanentError("child fails")

    run = LocalRunner([child, parent], {"h.c": fail}).run("parent")
    task = run.assert_failed("call", "max_attempts_exceeded")
    assert task is not None and len(task.children) == 2
    assert [a.reason for a in task.attempts] == [R.CHILD_FAILED, R.CHILD_FAILED]


def test_a_child_of_an_unknown_workflow_or_unrenderable_input_is_dead() -> None:
    parent = WorkflowDef(
        "parent",
        (
            TaskDef("a", workflow="nowhere"),
            TaskDef("b", workflow="parent2", input={"x": "{missing}"}),
        ),
        fail_fast=False,
    )
    other = WorkflowDef("parent2", (TaskDef("c", "h.c"),))
    run = LocalRunner([parent, other], {"h.c": lambda ctx: 1}).run("parent")
    assert run["a"].failure_reason is R.CHILD_WORKFLOW_UNKNOWN
    assert run["b"].failure_reason is R.CHILD_INPUT_ERROR


def test_a_wait_for_event_takes_the_event_data_as_its_result() -> None:
    workflow = WorkflowDef("w", (TaskDef("wait", wait_for_event=EventWait("paid", "{order}", 60)),))
    run = LocalRunner(workflow).run("w", {"order": 3}, events={("paid", "3"): [1]})
    assert run.assert_succeeded()["wait"].result == [1]


# --- what is refused, by class -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "kwargs"),
    [
        ("not a mapping", {}),
        ({**ORDER, "amount": math.inf}, {}),
        ({"order_id": "\x00"}, {}),
        ({"customer_id": 1}, {}),  # the idempotency key charge-{order_id} cannot render
        (ORDER, {"upstream": {"nope": 1}}),
        (ORDER, {"upstream": {"charge": math.nan}}),
        (ORDER, {"upstream": {"charge": object()}}),
        (ORDER, {"events": {"catalogue.approved": math.nan}}),
    ],
    ids=["not-mapping", "inf", "nul", "key-field-missing", "unknown-upstream", "nan-upstream",
         "object-upstream", "nan-event-unused"],
)  # fmt: skip
def test_bad_input_is_refused_before_any_handler_runs(given: Any, kwargs: Any) -> None:
    calls = Calls()
    base = LocalRunner.from_config(EXAMPLE)
    stand_ins = {name: calls.handler(name, 1) for name in base.handlers}
    runner = LocalRunner(base.workflows.values(), stand_ins)
    if "events" in kwargs:  # an event nobody waits for is never read: nothing to refuse
        runner.run("order-fulfilment", given, **kwargs).assert_succeeded()
        return
    with pytest.raises(InputError):
        runner.run("order-fulfilment", given, **kwargs)
    assert not calls.count


def test_an_unknown_workflow_and_an_unstorable_event_are_input_errors(
    examples: LocalRunner,
) -> None:
    with pytest.raises(InputError, match="unknown workflow 'nope'"):
        examples.run("nope")
    with pytest.raises(UnstorableValueError):
        examples.run("catalogue-import", {"batch": "b"}, events={"catalogue.approved": math.nan})


def test_assert_succeeded_explains_with_each_failures_traceback() -> None:
    def fail(ctx: Any) -> Any:
        raise KeyError("missing field")

    runner, _ = _one(fail, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(AssertionError) as raised:
        runner.run("w").assert_succeeded()
    text = str(raised.value)
    assert "expected SUCCEEDED, got FAILED" in text and "t: DEAD" in text
    assert "KeyError: 'missing field'" in text and "Traceback" in text
    with pytest.raises(AssertionError, match="expected t DEAD handler_error"):
        runner.run("w").assert_failed("t", "handler_error")  # it is max_attempts_exceeded


def test_the_testers_ctrl_c_is_not_taken_for_a_handler_failure() -> None:
    def interrupted(ctx: Any) -> Any:
        raise KeyboardInterrupt

    runner, _ = _one(interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run("w")


def test_each_handler_gets_plain_copies_it_may_change_without_harm() -> None:
    def greedy(ctx: Any) -> Any:
        assert type(ctx.input) is dict and type(ctx.upstream) is dict
        ctx.input["order"] = "changed"
        for value in ctx.upstream.values():
            value.append("changed")
        return [1]

    workflow = WorkflowDef(
        "w",
        (
            TaskDef("a", "h.t"),
            TaskDef("b", "h.t", depends_on=("a",)),
            TaskDef("c", "h.t", depends_on=("a",)),
        ),
    )
    run = LocalRunner(workflow, {"h.t": greedy}).run("w", {"order": 1}).assert_succeeded()
    assert run.input == {"order": 1}
    assert run["a"].result == [1]  # b changed its copy; c got the result as stored


def test_handlers_come_from_module_names_on_a_search_path_or_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # the search path is put first on it
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "my_local_handlers.py").write_text(
        "from flowforge import task\n\n@task('mine.hello')\ndef hello(ctx):\n    return 'hi'\n"
    )
    workflow = WorkflowDef("w", (TaskDef("t", "mine.hello"),))
    by_name = LocalRunner(workflow, ["my_local_handlers"], search_path=tmp_path)
    assert by_name.run("w").assert_succeeded()["t"].result == "hi"
    import my_local_handlers  # type: ignore[import-not-found]

    by_module = LocalRunner(workflow, [my_local_handlers, {"other.x": lambda ctx: 1}])
    assert set(by_module.handlers) == {"mine.hello", "other.x"}


def test_importing_the_package_starts_nothing_and_pulls_in_no_services() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, threading, flowforge.testing; "
        "print(sorted(m for m in ('pytest', 'psycopg', 'pika') if m in sys.modules), "
        "threading.active_count())"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.split() == ["[]", "1"]
