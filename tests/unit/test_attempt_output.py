"""An attempt's captured output and progress, without services (SPEC 7.5): the bounded tail
(flowforge/domain/output.py), progress refused class by class, ``ctx.log``, the per-attempt
sink (flowforge/roles/attemptlog.py), attribution through a context variable, the lease
keeper's live writes (none for a silent handler) and ``flowforge logs``' printing.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from flowforge.cli import logs
from flowforge.cli.commands import progress_text
from flowforge.domain.model import Claim
from flowforge.domain.output import (
    MAX_PROGRESS_MESSAGE_CHARS,
    AttemptLog,
    Output,
    Progress,
    ProgressError,
    Tail,
    check_progress,
    parse_attempt,
)
from flowforge.domain.states import TaskState
from flowforge.errors import InputError
from flowforge.roles import output
from flowforge.roles.attemptlog import AttemptOutput
from flowforge.roles.context import TaskContext
from flowforge.roles.lease import Leases
from tests.stubs import FakeStore

# ------------------------------------------------------------------ the tail


def test_the_tail_keeps_the_last_bytes_and_counts_the_dropped_ones() -> None:
    tail = Tail(100)
    for i in range(1000):
        tail.add(f"line {i:04d}")  # 10 bytes with the newline
    kept = tail.output()
    assert len(kept.text.encode()) == 100
    assert kept.text.splitlines() == [f"line {i:04d}" for i in range(990, 1000)]
    assert kept.dropped == 9900 and tail.written == 10_000


def test_a_line_longer_than_the_limit_keeps_its_end_on_a_character_boundary() -> None:
    tail = Tail(10)
    tail.add("é" * 20)  # 40 bytes and a newline; a cut at 10 bytes from the end splits a "é"
    kept = tail.output()
    assert kept.text == "é" * 4 + "\n"
    assert kept.dropped + len(kept.text.encode()) == 41


def test_the_tail_holds_only_storable_text() -> None:
    tail = Tail(1000)
    tail.add("nul \x00 and a lone \ud800 surrogate")
    assert "\x00" not in tail.output().text and "\ud800" not in tail.output().text
    assert tail.output().text.count("\ufffd") == 2


def test_a_tail_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Tail(0)


# ------------------------------------------------------------------ progress


@pytest.mark.parametrize(
    ("fraction", "problem"),
    [
        (math.nan, "NaN"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (True, "bool"),
        (False, "bool"),
        ("0.5", "str"),
        (None, "NoneType"),
        (1 + 0j, "complex"),
        (1.0000001, "from 0 to 1"),
        (2, "from 0 to 1"),
        (-0.01, "from 0 to 1"),
        (-1, "from 0 to 1"),
    ],
)
def test_a_progress_that_is_not_a_fraction_is_refused_naming_it(
    fraction: Any, problem: str
) -> None:
    with pytest.raises(ProgressError, match="progress fraction") as raised:
        check_progress(fraction)
    assert problem in str(raised.value)
    assert isinstance(raised.value, ValueError)  # what a handler would expect to catch


@pytest.mark.parametrize("fraction", [0, 1, 0.0, 1.0, 0.5, 1e-300])
def test_a_fraction_from_0_to_1_is_kept_as_a_float(fraction: float) -> None:
    found = check_progress(fraction, "msg")
    assert found == Progress(float(fraction), "msg") and type(found.fraction) is float


def test_a_progress_message_is_cleaned_and_cut() -> None:
    long = "x" * 1000
    assert check_progress(0.1, long).message == "x" * MAX_PROGRESS_MESSAGE_CHARS
    assert check_progress(0.1, "a\x00b").message == "a\ufffdb"
    assert check_progress(0.1, None).message == ""
    with pytest.raises(ProgressError, match="message must be a string"):
        check_progress(0.1, b"bytes")


def test_ctx_progress_raises_inside_the_handler_and_keeps_the_last_good_value() -> None:
    ctx = TaskContext({}, {}, 1, uuid.uuid4(), uuid.uuid4(), "t")
    ctx.progress(0.3, "third")
    with pytest.raises(ValueError, match="NaN"):
        ctx.progress(math.nan)
    found = ctx.output.final()
    assert found is not None and found.progress == Progress(0.3, "third")


@pytest.mark.parametrize("raw", [0, -1, 2**31, True, "", " 1", "+1", "1.0", "x", "\uff11", 1.5])
def test_an_attempt_number_that_is_not_1_to_2_31_is_refused(raw: Any) -> None:
    with pytest.raises(InputError, match="attempt must be an integer from 1"):
        parse_attempt(raw)


def test_an_attempt_number_may_be_given_as_digits() -> None:
    assert parse_attempt("12") == 12 and parse_attempt(2**31 - 1) == 2**31 - 1
    assert parse_attempt(None) is None


# ------------------------------------------------------------------ the sink and ctx.log


def test_a_silent_attempt_has_nothing_to_write() -> None:
    sink = AttemptOutput(1000)
    assert sink.take_live() is None and sink.final() is None


def test_a_live_take_returns_only_what_changed_since_the_last() -> None:
    sink = AttemptOutput(1000)
    sink.line("one")
    first = sink.take_live()
    assert first is not None and first.output == Output("one\n", 0) and first.progress is None
    assert sink.take_live() is None
    sink.report(0.5, "half")
    second = sink.take_live()
    assert second is not None and second.progress == Progress(0.5, "half")
    assert second.output == Output("one\n", 0)  # the whole tail again: a write replaces it
    final = sink.final()
    assert final is not None and final.output == Output("one\n", 0)


@pytest.fixture
def handler_records() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("flowforge.handler")
    keep, level = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(keep)
        log.setLevel(level)


def test_ctx_log_keeps_each_record_and_sends_it_to_the_tree_s_log(
    handler_records: list[logging.LogRecord],
) -> None:
    ctx = TaskContext({}, {}, 1, uuid.uuid4(), uuid.uuid4(), "load")
    ctx.log.info("read %d rows", 3)
    ctx.log.warning("two\nlines")
    ctx.log.debug("below the tree's level")
    ctx.log.error("%d is not %s", "x")  # a bad format: kept as written, never raised
    try:
        raise KeyError("k")
    except KeyError:
        ctx.log.exception("failed")
    ctx.log.critical("the end")
    found = ctx.output.final()
    assert found is not None and found.output is not None
    lines = found.output.text.splitlines()
    assert lines[:3] == ["INFO read 3 rows", "WARNING two", "lines"]
    assert lines[3] == "ERROR '%d is not %s' % ('x',)"
    assert lines[4] == "ERROR failed" and "KeyError: 'k'" in lines
    assert lines[-1] == "CRITICAL the end"
    assert not any("below" in line for line in lines)
    tagged = [(r.levelname, r.task_run_id, r.stream) for r in handler_records]  # type: ignore[attr-defined]
    assert len(tagged) == 5
    assert all(t == str(ctx.task_run_id) and s == "log" for _, t, s in tagged)


# ------------------------------------------------------------------ attribution


def test_records_in_a_handler_call_are_attributed_through_its_context() -> None:
    """What concurrent async handlers rely on: an asyncio Task started inside the call, and a
    thread run in a copy of its context, see the call; the caller's context after it does not."""
    task_run_id = uuid.uuid4()

    def record() -> logging.LogRecord:
        made = logging.LogRecord("x", logging.INFO, "f", 1, "m", None, None)
        output._attribute(made)
        return made

    async def in_a_task() -> logging.LogRecord:
        return await asyncio.create_task(asyncio.sleep(0, result=record()))

    found: list[logging.LogRecord] = []
    with output.attributed("t", task_run_id, uuid.uuid4()):
        from_task = asyncio.run(in_a_task())
        import contextvars

        context = contextvars.copy_context()
        other = threading.Thread(target=lambda: found.append(context.run(record)))
        other.start()
        other.join(5)
    assert from_task.task_run_id == str(task_run_id)  # type: ignore[attr-defined]
    assert found[0].task_run_id == str(task_run_id)  # type: ignore[attr-defined]
    assert not hasattr(record(), "task_run_id")


# ------------------------------------------------------------------ live writes


def held(store: FakeStore, leases: Leases) -> TaskContext:
    task_id = store.add("h")[0]
    task = store.tasks[task_id]
    task.state, task.token, task.attempt = TaskState.RUNNING, 2, 1
    claim = Claim(task_id, task.run_id, "t", "h", 1, 2, {})
    ctx = TaskContext({}, {}, 1, task_id, task.run_id, "t", output=AttemptOutput(100))
    leases.hold([(claim, ctx)])
    return ctx


def test_the_keeper_writes_only_attempts_that_wrote_something() -> None:
    store = FakeStore()
    leases = Leases(store, lease_s=30, heartbeat_s=10, output_flush_s=0.01)
    silent, talking = held(store, leases), held(store, leases)
    assert leases.flush_output() == 0 and store.count("write_output") == 0
    talking.log.warning("hello")
    talking.progress(0.5)
    assert leases.flush_output() == 1 and store.count("write_output") == 1
    assert leases.flush_output() == 0 and store.count("write_output") == 1  # nothing new
    written = store.tasks[talking.task_run_id].live
    assert [c.progress for c in written] == [Progress(0.5, "")]
    assert store.tasks[silent.task_run_id].live == []


def test_the_keeper_thread_writes_while_the_handler_runs() -> None:
    store = FakeStore()
    leases = Leases(store, lease_s=30, heartbeat_s=10, output_flush_s=0.01)
    ctx = held(store, leases)
    leases.start()
    try:
        ctx.log.warning("live")
        for _ in range(500):  # a bound: 5 s
            if store.tasks[ctx.task_run_id].live:
                break
            threading.Event().wait(0.01)
    finally:
        leases.stop()
    assert store.tasks[ctx.task_run_id].live, "the keeper never wrote the output"
    assert store.count("renew_leases") == 0  # the flush does not renew before heartbeat_s


# ------------------------------------------------------------------ flowforge logs


def attempt_log(text: str, dropped: int = 0, finished: bool = False) -> AttemptLog:
    now = datetime.now(UTC)
    return AttemptLog(
        uuid.uuid4(),
        TaskState.SUCCEEDED if finished else TaskState.RUNNING,
        1,
        1,
        now,
        now if finished else None,
        "succeeded" if finished else "running",
        Output(text, dropped),
    )


def test_the_printer_marks_what_was_dropped_and_escapes_the_handler_s_text() -> None:
    out = io.StringIO()
    logs.Printer(out).show(attempt_log("\x1b[31mred\x1b[0m\nplain\n", dropped=120))
    assert out.getvalue() == "[… 120 bytes dropped …]\n\\x1b[31mred\\x1b[0m\nplain\n"


def test_follow_prints_each_line_once_and_stops_when_the_attempt_ends() -> None:
    reads = iter(
        [
            attempt_log("a\n"),
            attempt_log("a\nb\n"),
            attempt_log("b\nc\n", dropped=2),  # "a\n" dropped meanwhile: nothing lost
            attempt_log("c\nd\n", dropped=40),  # more dropped than was printed: marked
            attempt_log("c\nd\n", dropped=40, finished=True),
        ]
    )
    naps: list[float] = []
    out = io.StringIO()
    logs.follow(lambda _attempt: next(reads), None, sleep=naps.append, out=out)
    assert out.getvalue().splitlines() == [
        "a",
        "b",
        "c",
        "[… 34 bytes dropped …]",
        "c",
        "d",
    ]
    assert len(naps) == 4


def test_the_progress_column_shows_a_percentage_and_the_message() -> None:
    assert progress_text(Progress(0.404, "rows")) == "40% rows"
    assert progress_text(Progress(1.0, "")) == "100%"
    assert progress_text(None) is None
