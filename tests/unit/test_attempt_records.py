"""A handler's own ``logging`` records kept with its attempt (SPEC 7.5, issue 21), through the
seam (flowforge/roles/output.py ``AttemptRecords`` on the root logger, as ``capture`` puts it),
without a child process: which records an attempt keeps — the call's, of the handler's
loggers, at levels its logging config lets through, in ``ctx.log``'s line format — and which
it does not: FlowForge's own (``flowforge.*``: ``ctx.log`` and stdout lines are not kept twice),
another call's, none outside a call. tests/unit/test_handler_output.py proves the same in a
process whose descriptors ``capture`` took over.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import uuid
from collections.abc import Iterator

import pytest

from flowforge.roles import output
from flowforge.roles.attemptlog import AttemptOutput
from flowforge.roles.context import TaskContext


@pytest.fixture
def records_kept() -> Iterator[None]:
    """The root logger as a worker's (INFO), with the attempts' handler on it."""
    root = logging.getLogger()
    level, kept = root.level, output.AttemptRecords()
    root.setLevel(logging.INFO)
    root.addHandler(kept)
    try:
        yield
    finally:
        root.removeHandler(kept)
        root.setLevel(level)


def lines(sink: AttemptOutput) -> list[str]:
    found = sink.final()
    return [] if found is None or found.output is None else found.output.text.splitlines()


def context(name: str = "load") -> TaskContext:
    return TaskContext({}, {}, 1, uuid.uuid4(), uuid.uuid4(), name, output=AttemptOutput(100_000))


def test_a_sync_call_keeps_its_records_in_the_format_of_ctx_log(records_kept: None) -> None:
    ctx = context()
    loud = logging.getLogger("myapp.loud")
    loud.setLevel(logging.DEBUG)  # the user's config lets DEBUG through for this one
    try:
        with output.attributed(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
            logging.getLogger("myapp").info("read %d rows", 3)
            logging.getLogger("myapp").debug("below the effective level")
            loud.debug("a debug record let through")
            ctx.log.warning("from ctx.log")
            logging.getLogger("myapp").warning("from logging")
            logging.warning("two\nlines")  # the root logger's own
            # a bad format (pytest's own log handler would raise on it: the record goes to
            # the attempts' handler alone)
            bad = logging.getLogger("myapp").makeRecord(
                "myapp", logging.ERROR, "f", 1, "%d is not %s", ("x",), None
            )
            output.AttemptRecords().handle(bad)
            output.AttemptRecords().handle(logging.makeLogRecord({"msg": "no level"}))
            try:
                raise KeyError("k")
            except KeyError:
                logging.getLogger("httpx").exception("failed")
    finally:
        loud.setLevel(logging.NOTSET)
    kept = lines(ctx.output)
    assert kept[:7] == [
        "INFO read 3 rows",
        "DEBUG a debug record let through",
        "WARNING from ctx.log",  # once: its flowforge.handler record is not kept again
        "WARNING from logging",  # the same line ctx.log makes
        "WARNING two",
        "lines",
        "ERROR '%d is not %s' % ('x',)",
    ]
    assert kept[7] == "ERROR failed" and kept[8] == "Traceback (most recent call last):"
    assert kept[-1] == "KeyError: 'k'"
    assert not any("below" in line for line in kept)


def test_flowforge_s_own_records_and_records_outside_a_call_are_not_kept(
    records_kept: None,
) -> None:
    ctx = context()
    with output.attributed(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
        logging.getLogger("flowforge.roles.worker").warning("the worker's own")
        logging.getLogger("flowforge").error("the engine's root logger")
        logging.getLogger("flowforge.handler").warning("a stdout line's record")
        logging.getLogger("flowforge_extras").warning("not FlowForge's: kept")
        # a printed line: _emit adds it once, not its flowforge.handler record again
        output._emit("stdout", b"printed", output._owner.get())
    logging.getLogger("myapp").warning("after the call")
    assert lines(ctx.output) == ["WARNING not FlowForge's: kept", "printed"]


def test_a_record_below_its_logger_s_level_is_left_out_even_when_handled_directly(
    records_kept: None,
) -> None:
    """``Logger.handle`` skips the level check that ``Logger.info`` makes: the attempt makes it
    (only records the user's logging config lets through)."""
    ctx = context()
    quiet = logging.getLogger("myapp.quiet")
    quiet.setLevel(logging.WARNING)
    try:
        with output.attributed(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
            for level in (logging.INFO, logging.ERROR):
                quiet.handle(quiet.makeRecord(quiet.name, level, "f", 1, "handled", (), None))
            quiet.info("logged below")
    finally:
        quiet.setLevel(logging.NOTSET)
    assert lines(ctx.output) == ["ERROR handled"]


def test_threads_keep_records_only_in_a_copy_of_the_call_s_context(records_kept: None) -> None:
    """A thread does not inherit the context (before Python 3.14); one run in a copy of it
    (``contextvars.copy_context().run``, ``asyncio.to_thread``) is the call's."""
    ctx = context()
    with output.attributed(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
        copied = contextvars.copy_context()
        say = logging.getLogger("myapp").warning
        for target in (lambda: say("plain thread"), lambda: copied.run(say, "copied context")):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join(5)
    assert lines(ctx.output) == ["WARNING copied context"]


def test_concurrent_async_calls_each_keep_their_own_records(records_kept: None) -> None:
    calls = [context("a"), context("b")]

    async def call(ctx: TaskContext) -> None:
        with output.attributed_async(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
            for step in range(3):
                logging.getLogger("myapp").info("%s step %d", ctx.name, step)
                await asyncio.sleep(0.001)  # the other call logs meanwhile
            # a Task the call starts inherits its context
            await asyncio.create_task(asyncio.to_thread(logging.warning, f"{ctx.name} thread"))

    async def both() -> None:
        await asyncio.gather(*(call(ctx) for ctx in calls))

    asyncio.run(both())
    for ctx in calls:
        assert lines(ctx.output) == [
            *(f"INFO {ctx.name} step {step}" for step in range(3)),
            f"WARNING {ctx.name} thread",
        ]


def test_a_sink_that_fails_fails_neither_the_call_nor_the_other_handlers(
    records_kept: None, capsys: pytest.CaptureFixture[str]
) -> None:
    class Broken(AttemptOutput):
        def record(self, record: logging.LogRecord) -> None:
            raise RuntimeError("cannot keep it")

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    keep = Keep()
    logging.getLogger().addHandler(keep)
    try:
        with output.attributed("t", uuid.uuid4(), uuid.uuid4(), Broken()):
            logging.getLogger("myapp").warning("still logged")
    finally:
        logging.getLogger().removeHandler(keep)
    assert got == ["still logged"]
    assert "cannot keep it" not in capsys.readouterr().err  # nothing printed, nothing logged
