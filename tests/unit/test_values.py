"""flowforge.domain.values: every value is made storable or refused, text is cleaned (SPEC 7.1).

Property tests against an independent oracle (tests/values.py), then the named cases a reader
looks for: the JSON path in a refusal, the bounds, classify's reasons, finishing apart.
"""

from __future__ import annotations

import json
import logging
import math
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.config import WorkerConfig, load_config
from flowforge.domain.model import Claim, Finish, Finished
from flowforge.domain.reasons import RETRYABLE_REASONS, FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import (
    MAX_DEPTH,
    MAX_KEY_BYTES,
    MAX_NOTE_BYTES,
    REPLACEMENT,
    JsonText,
    _nesting,
    check_note,
    check_text,
    clean_text,
    to_json,
)
from flowforge.errors import (
    ConfigError,
    DatabaseUnavailableError,
    InputError,
    PermanentError,
    StoreError,
    UnstorableValueError,
    ValueTooLargeError,
)
from flowforge.roles.apart import finish_apart
from flowforge.roles.context import TaskContext
from flowforge.roles.execution import Job, classify
from tests.values import canonical, cleaned, json_values, non_json, size, storable, text_ok, texts

EXAMPLES = settings(max_examples=300, deadline=None)


# ------------------------------------------------------------------ properties


@EXAMPLES
@given(st.one_of(json_values, non_json))
def test_to_json_stores_exactly_what_the_oracle_allows_and_it_round_trips(value: Any) -> None:
    if storable(value):
        text = to_json(value, "v")
        assert isinstance(text, JsonText)
        assert json.loads(text) == canonical(value)
        assert "\\u0000" not in text.replace("\\\\", "")  # no NUL escape PostgreSQL refuses
        text.encode()  # valid UTF-8: no lone surrogate
        assert len(text.encode()) == size(value)
    else:
        with pytest.raises(UnstorableValueError, match=r"^v: \$.*: ") as refused:
            to_json(value, "v")
        assert not isinstance(refused.value, ValueTooLargeError)
        assert isinstance(refused.value, InputError)  # exit 2 / HTTP 400 wherever it surfaces


@EXAMPLES
@given(json_values, st.integers(1, 4000))
def test_the_size_bound_refuses_exactly_what_is_over_it(value: Any, bound: int) -> None:
    if not storable(value):
        return
    if size(value) <= bound:
        assert json.loads(to_json(value, "v", max_bytes=bound)) == canonical(value)
    else:
        with pytest.raises(ValueTooLargeError, match=f"over the limit of {bound} bytes"):
            to_json(value, "v", max_bytes=bound)


@EXAMPLES
@given(texts, st.integers(0, 50), st.booleans())
def test_clean_text_never_refuses_and_leaves_only_storable_text(
    text: str, bound: int, keep_end: bool
) -> None:
    out = clean_text(text, bound, keep_end=keep_end)
    assert text_ok(out)
    out.encode()
    assert len(out) == min(len(text), bound)
    part = text[len(text) - len(out) :] if keep_end else text[: len(out)]
    assert out == cleaned(part)
    if text_ok(text) and len(text) <= bound:
        assert out == text  # clean text is left alone


@EXAMPLES
@given(texts)
def test_check_text_refuses_exactly_what_text_cannot_hold(text: str) -> None:
    if text_ok(text) and len(text.encode()) <= MAX_KEY_BYTES:
        assert check_text(text, "key") == text
    else:
        with pytest.raises(UnstorableValueError, match=r"^key: "):
            check_text(text, "key")


# ------------------------------------------------------------------ named cases


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"v": math.nan}, "r: $.v: nan is not a JSON number"),
        ([1, [2, -math.inf]], "r: $[1][1]: -inf is not a JSON number"),
        ({"items": [{}, {}, {}, {"name": "a\x00b"}]}, "r: $.items[3].name: NUL character at"),
        ({"a b": "\ud800"}, 'r: $["a b"]: lone surrogate U+D800 at offset 0'),
        ({"k": {"\udfff": 1}}, 'r: $.k: key "\\udfff": lone surrogate U+DFFF'),
        ({math.nan: 1}, 'r: $: key "nan": nan is not a JSON number'),
        ({"s": {1, 2}}, "r: $.s: set is not a JSON type"),
        ({(1, 2): 1}, 'r: $: key "(1, 2)": a key of type tuple is not JSON'),
    ],
)
def test_a_refusal_says_what_and_where(value: Any, message: str) -> None:
    with pytest.raises(UnstorableValueError) as refused:
        to_json(value, "r")
    assert str(refused.value).startswith(message), str(refused.value)


def test_nesting_is_bounded_and_a_cycle_is_refused_not_a_crash() -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert to_json(deep, "v").count("[") == MAX_DEPTH
    with pytest.raises(UnstorableValueError, match=f"nested deeper than {MAX_DEPTH} levels"):
        to_json([deep], "v")
    very_deep: Any = 1
    for _ in range(5000):  # deeper than Python's recursion limit
        very_deep = {"x": very_deep}
    with pytest.raises(UnstorableValueError, match="nested deeper"):
        to_json(very_deep, "v")
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnstorableValueError, match="nested deeper"):
        to_json(loop, "v")


def test_a_literal_backslash_u0000_is_text_not_a_nul() -> None:
    assert json.loads(to_json({"s": "\\u0000"}, "v")) == {"s": "\\u0000"}


def test_keys_are_refused_over_the_index_bound() -> None:
    assert check_text("k" * MAX_KEY_BYTES, "key")
    with pytest.raises(ValueTooLargeError, match="over the limit"):
        check_text("é" * MAX_KEY_BYTES, "key")  # two bytes each
    with pytest.raises(UnstorableValueError, match="must be text"):
        check_text(5, "key")


# ------------------------------------------------------------------ classify


def job(result: Any = None, error: BaseException | None = None, cancelled: bool = False) -> Job:
    ctx = TaskContext({}, {}, 1, uuid4(), uuid4(), "t")
    if cancelled:
        ctx.cancelled.set()
    done = Job(lambda _ctx: result, ctx)
    done.result, done.error = result, error
    done.traceback = None if error is None else f"Traceback\x00 \ud800 {error!r}"
    return done


@pytest.mark.parametrize(
    "result",
    [
        {"v": math.nan},
        {"v": math.inf},
        "a\x00b",
        {"\ud800": 1},
        ["\udc00"],
        {1, 2},
        b"x",
        {"d": Decimal("NaN")},
    ],
    ids=["nan", "inf", "nul", "surrogate-key", "surrogate", "set", "bytes", "decimal-nan"],
)
def test_an_unstorable_result_fails_the_task_unserializable_and_not_retried(result: Any) -> None:
    finish = classify(job(result), 1024)
    assert (finish.state, finish.reason) == (TaskState.FAILED, FailureReason.UNSERIALIZABLE_RESULT)
    assert finish.result is None and finish.error and text_ok(finish.error)
    assert FailureReason.UNSERIALIZABLE_RESULT not in RETRYABLE_REASONS


def test_a_result_over_max_result_bytes_is_result_too_large_and_not_retried() -> None:
    assert classify(job({"s": "x" * 90}), 100).state is TaskState.SUCCEEDED
    finish = classify(job({"s": "x" * 100}), 100)
    assert (finish.state, finish.reason) == (TaskState.FAILED, FailureReason.RESULT_TOO_LARGE)
    assert finish.error is not None and "over the limit of 100 bytes" in finish.error
    assert FailureReason.RESULT_TOO_LARGE not in RETRYABLE_REASONS
    assert str(FailureReason.RESULT_TOO_LARGE) == "result_too_large"


def test_a_cancelled_tasks_unstorable_result_is_dropped() -> None:
    assert classify(job({"v": math.nan}, cancelled=True), 1024) == Finish(TaskState.CANCELLED)
    kept = classify(job({"v": 1}, cancelled=True), 1024)
    assert kept.state is TaskState.CANCELLED and json.loads(kept.result) == {"v": 1}


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_error_text_and_traceback_are_cleaned_never_refused() -> None:
    finish = classify(job(error=PermanentError("bad \x00 and \ud800 " + "x" * 9000)), 1024)
    assert finish.reason is FailureReason.PERMANENT_ERROR
    assert finish.error is not None and finish.traceback is not None
    assert finish.error.startswith(f"PermanentError: bad {REPLACEMENT} and {REPLACEMENT} ")
    assert len(finish.error) == 4000
    assert text_ok(finish.error) and text_ok(finish.traceback)
    broken = classify(job(error=Unprintable()), 1024)
    assert broken.error == "Unprintable: <str() of the exception failed>"


# ------------------------------------------------------------------ finishing apart


def claim() -> Claim:
    return Claim(uuid4(), uuid4(), "t", "h", 1, 7, {}, {}, None)


def test_finish_apart_affects_only_the_culprit_and_logs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcomes = [(claim(), Finish(TaskState.SUCCEEDED, result=JsonText(str(i)))) for i in range(4)]
    culprit = outcomes[2][0].task_run_id
    statements: list[list[UUID]] = []

    def commit(batch: Any) -> Finished:
        statements.append([tid for tid, _, _ in batch])
        (tid, _, finish), *_ = batch
        if tid == culprit and finish.state is TaskState.SUCCEEDED:
            raise StoreError("database error: invalid input syntax for type json")
        return Finished(frozenset({tid}), ((uuid4(), 1),))

    with caplog.at_level(logging.WARNING, logger="flowforge.roles.apart"):
        finished = finish_apart(outcomes, commit)
    assert finished.committed == {c.task_run_id for c, _ in outcomes}
    assert len(finished.ready) == 4
    assert [len(s) for s in statements] == [1, 1, 1, 1, 1]  # each alone, the culprit twice
    replaced = outcomes[2][1]
    assert (replaced.state, replaced.reason) == (
        TaskState.FAILED,
        FailureReason.UNSERIALIZABLE_RESULT,
    )
    assert replaced.error is not None and "invalid input syntax" in replaced.error
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(culprit) in warnings[0].getMessage()


def test_finish_apart_lets_an_outage_through() -> None:
    def commit(_batch: Any) -> Finished:
        raise DatabaseUnavailableError("database unavailable: gone")

    with pytest.raises(DatabaseUnavailableError):
        finish_apart([(claim(), Finish(TaskState.SUCCEEDED))], commit)


@EXAMPLES
@given(json_values)
def test_nesting_measured_on_the_text_is_the_values_own(value: Any) -> None:
    """Brackets and quotes inside strings never count: the text's nesting is the value's."""
    if not storable(value):
        return

    def depth(v: Any) -> int:
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        if isinstance(v, list | tuple):
            return 1 + max(map(depth, v), default=0)
        return 0

    assert _nesting(to_json(value, "v").encode()) == depth(value)
    tricky = {'a]]"\\': ["[[", {"}\\\\": ['"]]']}]}
    assert _nesting(to_json(tricky, "v").encode()) == 4


def test_worker_max_result_bytes_is_one_mib_by_default_and_must_be_positive(
    tmp_path: Path,
) -> None:
    assert WorkerConfig().max_result_bytes == 1024 * 1024
    example = Path(__file__).resolve().parents[2] / "config" / "flowforge.example.yaml"
    assert load_config(example, env={}).worker.max_result_bytes == 1048576
    for bad in ("0", "-5", "1.5", "lots"):
        path = tmp_path / "c.yaml"
        path.write_text(f"worker:\n  max_result_bytes: {bad}\n")
        with pytest.raises(ConfigError, match="max_result_bytes"):
            load_config(path, env={})


@pytest.mark.parametrize(
    ("requested_by", "reason", "error", "named"),
    [
        ("ops\x00", None, UnstorableValueError, "requested_by"),
        ("ops", "a\ud800b", UnstorableValueError, "the bury reason"),
        (7, None, UnstorableValueError, "requested_by"),
        ("ops", ["why"], UnstorableValueError, "the bury reason"),
        ("ops", "x" * (MAX_NOTE_BYTES + 1), ValueTooLargeError, "the bury reason"),
        ("é" * (MAX_NOTE_BYTES // 2 + 1), None, ValueTooLargeError, "requested_by"),
    ],
)
def test_an_operator_note_is_refused_by_class_naming_its_field(
    requested_by: Any, reason: Any, error: type[Exception], named: str
) -> None:
    """One check for every audited action (task control, requeue, rerun, breakers, pauses)."""
    with pytest.raises(error, match=named):
        check_note(requested_by, reason, "the bury reason")


def test_an_operator_note_may_leave_out_the_reason() -> None:
    check_note("ops", None, "the bury reason")
    check_note("ops", "x" * MAX_NOTE_BYTES, "the bury reason")
