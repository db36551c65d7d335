"""The supervisor's pure parts: restart backoff, the intensity limit, exit descriptions and the
log line format (text, JSON, one atomic write of at most PIPE_BUF bytes)."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
from collections.abc import Iterator

import pytest

from supervisor import logs
from supervisor.logs import TRUNCATED, AtomicLineHandler, LineFormatter
from supervisor.restart import IntensityLimit, SlotBackoff
from supervisor.tree import describe_exit

# ------------------------------------------------------------------ SlotBackoff


def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    backoff = SlotBackoff(base_s=0.5, cap_s=4.0, healthy_after_s=10.0)
    delays = [backoff.next_delay(uptime_s=0.0) for _ in range(7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_backoff_stays_at_the_cap_after_very_many_failures() -> None:
    backoff = SlotBackoff(base_s=0.5, cap_s=30.0, healthy_after_s=10.0)
    delays = [backoff.next_delay(uptime_s=1.0) for _ in range(200)]
    assert max(delays) == 30.0
    assert delays[-1] == 30.0


def test_a_child_that_stayed_up_long_enough_resets_the_backoff() -> None:
    backoff = SlotBackoff(base_s=0.5, cap_s=30.0, healthy_after_s=10.0)
    for _ in range(4):
        backoff.next_delay(uptime_s=0.1)
    assert backoff.next_delay(uptime_s=9.9) == 8.0  # short of healthy: keeps doubling
    assert backoff.next_delay(uptime_s=10.0) == 0.5  # healthy uptime: back to the base
    assert backoff.next_delay(uptime_s=0.0) == 1.0  # and doubling starts again from there


def test_a_healthy_child_that_dies_again_at_once_is_backed_off_again() -> None:
    backoff = SlotBackoff(base_s=1.0, cap_s=60.0, healthy_after_s=5.0)
    assert backoff.next_delay(uptime_s=100.0) == 1.0
    assert backoff.next_delay(uptime_s=100.0) == 1.0
    assert backoff.next_delay(uptime_s=0.0) == 2.0


# ------------------------------------------------------------------ IntensityLimit


def test_exactly_max_restarts_within_the_period_is_allowed_one_more_trips() -> None:
    limit = IntensityLimit(max_restarts=3, period_s=10.0)
    assert [limit.record(now) for now in (100.0, 101.0, 102.0)] == [False, False, False]
    assert limit.record(103.0) is True


def test_restarts_older_than_the_period_age_out() -> None:
    limit = IntensityLimit(max_restarts=3, period_s=10.0)
    for now in (100.0, 101.0, 102.0):
        assert not limit.record(now)
    # More than 10 s after 102.0 all three have aged out: three more fit, a fourth trips.
    assert [limit.record(now) for now in (112.5, 112.6, 112.7)] == [False, False, False]
    assert limit.record(112.8) is True


def test_only_the_restarts_inside_the_window_count() -> None:
    limit = IntensityLimit(max_restarts=3, period_s=10.0)
    for now in (100.0, 101.0, 102.0):
        assert not limit.record(now)
    # At 111.5, 100.0 and 101.0 are out of the window; 102.0 is still in it.
    assert limit.record(111.5) is False  # 102.0, 111.5
    assert limit.record(111.6) is False  # 102.0, 111.5, 111.6
    assert limit.record(111.7) is True  # 102.0, 111.5, 111.6, 111.7: four within 10 s


def test_the_window_slides_with_now() -> None:
    limit = IntensityLimit(max_restarts=2, period_s=5.0)
    assert not limit.record(0.0)
    assert not limit.record(4.0)
    assert limit.record(4.5)  # three within 5 s
    # Spaced restarts never trip, however many there are.
    spaced = IntensityLimit(max_restarts=2, period_s=5.0)
    assert not any(spaced.record(3.0 * i) for i in range(100))


def test_a_burst_after_a_quiet_spell_is_judged_on_its_own() -> None:
    limit = IntensityLimit(max_restarts=2, period_s=5.0)
    assert not limit.record(0.0)
    assert not limit.record(1.0)
    assert not limit.record(50.0)
    assert not limit.record(51.0)
    assert limit.record(52.0)


# ------------------------------------------------------------------ describe_exit


def test_describe_exit_names_codes_and_signals() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(78) == "exited with code 78"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(-signal.SIGABRT) == "killed by SIGABRT"


def test_describe_exit_suggests_the_oom_killer_for_sigkill() -> None:
    text = describe_exit(-signal.SIGKILL)
    assert text.startswith("killed by SIGKILL")
    assert "out of memory?" in text
    assert "out of memory" not in describe_exit(-signal.SIGSEGV)


@pytest.mark.parametrize("signum", [signal.SIGRTMIN + 1, signal.SIGRTMAX - 1])
def test_describe_exit_handles_signals_that_have_no_name(signum: int) -> None:
    # Real-time signals other than SIGRTMIN/SIGRTMAX are not members of signal.Signals.
    text = describe_exit(-signum)
    assert text.startswith("killed by ")
    assert str(int(signum)) in text


# ------------------------------------------------------------------ LineFormatter


def _record(
    msg: str = "hello %s", args: tuple[object, ...] = ("world",), **extra: object
) -> logging.LogRecord:
    record = logging.LogRecord("flowforge.test", logging.WARNING, __file__, 1, msg, args, None)
    record.created, record.msecs = 1_700_000_000.125, 125.0  # fixed: lines of known length
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_text_lines_carry_time_level_role_pid_logger_and_message() -> None:
    line = LineFormatter("worker-2", "text").format(_record())
    stamp, clock, rest = line.split(" ", 2)
    assert len(stamp) == 10 and stamp[4] == "-" and stamp[7] == "-"
    assert len(clock) == 12 and clock[2] == ":" and clock[8] == "."
    assert rest == f"WARNING worker-2[{os.getpid()}] flowforge.test: hello world"


FORGED = "done\n2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \x1b[31mforged\x1b[0m"


def test_a_message_with_a_newline_stays_one_text_line_with_its_controls_escaped() -> None:
    line = LineFormatter("scheduler", "text").format(_record("%s", (FORGED,)))
    assert "\n" not in line and "\x1b" not in line
    assert line.endswith(
        ": done\\n2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \\x1b[31mforged\\x1b[0m"
    )


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b", "\\x1b"),
        ("\r", "\\r"),
        ("\t", "\\t"),
        ("\x00", "\\x00"),
        ("\x07", "\\x07"),
        ("\x7f", "\\x7f"),
        ("\x9b", "\\x9b"),  # C1 CSI: an escape sequence's start on some terminals
        ("\u2028", "\\u2028"),
        ("é€😀 plain", "é€😀 plain"),  # printable text stays readable
    ],
)
def test_escape_shows_every_control_character_as_text(raw: str, shown: str) -> None:
    assert logs.escape(f"a{raw}b") == f"a{shown}b"


@pytest.mark.parametrize("style", ["text", "json"])
def test_logger_names_labels_and_extras_are_escaped_too(style: str) -> None:
    record = _record(action="x\x1b[2J", label="task\n2026 forged")
    record.name = "evil\nlogger\x1b"
    line = LineFormatter("worker-1", style).format(record)
    assert "\n" not in line and "\x1b" not in line
    if style == "json":
        data = json.loads(line)
        assert (data["logger"], data["action"]) == ("evil\\nlogger\\x1b", "x\\x1b[2J")
        assert "label" not in data  # a text-only rendering of fields JSON has anyway
    else:
        assert "evil\\nlogger\\x1b [task\\n2026 forged]: hello world" in line


def test_a_forged_message_is_one_json_object_whose_msg_has_no_control_character() -> None:
    line = LineFormatter("worker-1", "json").format(_record("%s", (FORGED + "\x9b\x7f",)))
    assert "\n" not in line
    msg = json.loads(line)["msg"]
    assert msg == (
        "done\\n2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \\x1b[31mforged\\x1b[0m"
        "\\x9b\\x7f"
    )
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in msg)


def test_a_traceback_stays_on_indented_continuation_lines_in_text() -> None:
    try:
        raise ValueError("boom\n2026-01-01 INFO forged\x1b[0m")
    except ValueError:
        record = _record("failed", ())
        record.exc_info = sys.exc_info()
    line = LineFormatter("scheduler", "text").format(record)
    first, *rest = line.split("\n")
    assert first.endswith(": failed")
    assert rest and all(part.startswith("    ") for part in rest)  # none can pass for a record
    assert "\x1b" not in line and "    2026-01-01 INFO forged\\x1b[0m" in rest


def test_json_lines_carry_the_fields_and_plain_extras() -> None:
    line = LineFormatter("publisher", "json").format(
        _record(action="published", count=3, ratio=0.5, flag=True, nothing=None, obj=object())
    )
    assert "\n" not in line
    data = json.loads(line)
    assert data["level"] == "WARNING"
    assert data["role"] == "publisher"
    assert data["pid"] == os.getpid()
    assert data["logger"] == "flowforge.test"
    assert data["msg"] == "hello world"
    assert isinstance(data["ts"], float)
    assert data["action"] == "published"
    assert (data["count"], data["ratio"], data["flag"], data["nothing"]) == (3, 0.5, True, None)
    assert "obj" not in data  # not a plain value: left out
    assert "args" not in data and "levelno" not in data  # standard attributes are not repeated


def test_json_puts_the_traceback_inside_the_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed", ())
        record.exc_info = sys.exc_info()
    line = LineFormatter("worker-1", "json").format(record)
    assert "\n" not in line
    msg = json.loads(line)["msg"]
    assert msg.startswith("failed\nTraceback")
    assert "ValueError: boom" in msg


# ------------------------------------------------------------------ AtomicLineHandler


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    yield read_fd, write_fd
    os.close(read_fd)
    os.close(write_fd)


def _drain(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


class _CountingWrite:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._write = os.write

    def __call__(self, fd: int, data: bytes) -> int:
        self.sizes.append(len(data))
        return self._write(fd, data)


def test_a_normal_record_is_one_write_of_one_line(
    pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = _CountingWrite()
    monkeypatch.setattr(logs.os, "write", writes)
    handler = AtomicLineHandler(LineFormatter("worker-1", "json"), fd=pipe[1])
    handler.handle(_record(action="x"))
    data = _drain(pipe[0])
    assert writes.sizes == [len(data)]
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert json.loads(data)["msg"] == "hello world"


@pytest.mark.parametrize("style", ["text", "json"])
@pytest.mark.parametrize("char", ["x", "é", "€", "😀"])
def test_a_huge_record_is_truncated_to_pipe_buf_in_one_write(
    pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch, style: str, char: str
) -> None:
    writes = _CountingWrite()
    monkeypatch.setattr(logs.os, "write", writes)
    handler = AtomicLineHandler(LineFormatter("worker-1", style), fd=pipe[1])
    handler.handle(_record("%s", (char * 100_000,)))
    data = _drain(pipe[0])
    assert writes.sizes == [len(data)], "the record must be written with exactly one write"
    assert len(data) <= select.PIPE_BUF
    assert len(data) > select.PIPE_BUF - 64  # truncated, not emptied
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    text = data.decode("utf-8")  # cut on a character boundary: still valid UTF-8
    assert TRUNCATED in text


def test_a_huge_text_record_ends_with_the_truncation_mark(pipe: tuple[int, int]) -> None:
    handler = AtomicLineHandler(LineFormatter("worker-1", "text"), fd=pipe[1])
    handler.handle(_record("%s", ("z" * 100_000,)))
    data = _drain(pipe[0])
    assert len(data) <= select.PIPE_BUF
    assert data.decode().endswith(TRUNCATED + "\n")


@pytest.mark.parametrize("size", [5_000, 100_000])
def test_a_huge_json_record_is_still_one_json_object(pipe: tuple[int, int], size: int) -> None:
    # "json: one object per line" — a line cut in the middle of a string is not one.
    handler = AtomicLineHandler(LineFormatter("worker-1", "json"), fd=pipe[1])
    handler.handle(_record("%s", ("q" * size,), action="big"))
    data = _drain(pipe[0])
    assert len(data) <= select.PIPE_BUF
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    try:
        parsed = json.loads(data)
    except ValueError:
        pytest.fail(f"a truncated JSON record is not valid JSON: ...{data[-60:]!r}")
    assert parsed["role"] == "worker-1" and parsed["action"] == "big"
    assert parsed["msg"].startswith("qqq") and TRUNCATED in parsed["msg"]


def test_a_record_of_exactly_pipe_buf_bytes_is_not_truncated(
    pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    formatter = LineFormatter("worker-1", "json")
    overhead = len(formatter.format(_record("%s", ("",))).encode()) + 1  # + the newline
    handler = AtomicLineHandler(formatter, fd=pipe[1])
    handler.handle(_record("%s", ("y" * (select.PIPE_BUF - overhead),)))
    data = _drain(pipe[0])
    assert len(data) == select.PIPE_BUF
    assert TRUNCATED.encode() not in data
    assert json.loads(data)["msg"] == "y" * (select.PIPE_BUF - overhead)
