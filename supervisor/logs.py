"""One log stream for the whole tree: every line written with a single ``write(2)``.

A multiprocessing queue (what multiprocessing-logging uses) is guarded by a lock shared
between processes; a child SIGKILLed while holding it wedges every sibling that logs. Here
nothing is shared: each process formats a record into one line of at most ``PIPE_BUF`` bytes
and writes it with one ``os.write`` to the inherited stderr. POSIX makes such writes to a pipe
atomic, and an O_APPEND file gets whole lines too, so lines never interleave and a killed
process can hold nothing that others wait for.

Every variable part of a line (message, logger name, extra strings) is escaped by
:func:`escape`: a control character from untrusted text (a handler's output, an error message,
an input echoed back) can neither end the line, so it cannot forge a record, nor reach an
operator's terminal as an escape sequence.
"""

from __future__ import annotations

import json
import logging
import os
import select
import time
from typing import Any

#: The largest write POSIX guarantees to be atomic on a pipe.
LINE_MAX_BYTES = select.PIPE_BUF
TRUNCATED = " …[truncated]"
#: ``label``: shown in text lines after the logger name, left out of JSON (whose own fields
#: carry what it says).
_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {
    "message",
    "asctime",
    "label",
}


def _escapes(keep: str = "") -> dict[int, str]:
    """C0 controls, DEL, C1 controls and the Unicode line/paragraph separators, as text."""
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    codes = [*range(0x20), *range(0x7F, 0xA0)]
    table = {c: named.get(chr(c), f"\\x{c:02x}") for c in codes if chr(c) not in keep}
    table.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
    return table


_ESCAPES = _escapes()
_ESCAPES_KEEPING_NEWLINES = _escapes(keep="\n")


def escape(text: str, keep_newlines: bool = False) -> str:
    """``text`` without a control character: ESC becomes ``\\x1b``, a newline ``\\n``, a
    carriage return ``\\r``, and so on (the rest stays as it was, readable).

    ``keep_newlines``: newlines stay (a traceback's lines; the text format indents them so
    none can pass for a record of its own).
    """
    return text.translate(_ESCAPES_KEEPING_NEWLINES if keep_newlines else _ESCAPES)


class LineFormatter(logging.Formatter):
    """``text``: ``time level role[pid] logger [label]: message``; ``json``: one object per
    line. The message is escaped (:func:`escape`), so it is one line whatever it holds; a
    traceback follows it (text: on lines indented by four spaces)."""

    def __init__(self, role: str, style: str = "text") -> None:
        super().__init__()
        self.role = role
        self.style = style

    def format(self, record: logging.LogRecord) -> str:
        message = escape(record.getMessage())
        if record.exc_info:
            trace = escape(self.formatException(record.exc_info), keep_newlines=True)
            message = f"{message}\n{trace}"
        if self.style == "json":
            return self._json(record, message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        text = message.replace("\n", "\n    ")
        name = escape(record.name)
        label = getattr(record, "label", None)
        if isinstance(label, str):
            name = f"{name} [{escape(label)}]"
        return (
            f"{stamp}.{int(record.msecs):03d} {record.levelname} {self.role}[{record.process}] "
            f"{name}: {text}"
        )

    def _json(self, record: logging.LogRecord, message: str) -> str:
        """One JSON object that fits in a line: an oversized message is shortened inside it."""
        data: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "role": self.role,
            "pid": record.process,
            "logger": escape(record.name),
            "msg": message,
        }
        data.update(
            (escape(k), escape(v) if isinstance(v, str) else v)
            for k, v in vars(record).items()
            if k not in _STANDARD_ATTRS and _plain(v)
        )
        line = json.dumps(data, default=str, ensure_ascii=False)
        if len(line.encode()) < LINE_MAX_BYTES:
            return line
        # the longest prefix of the message that still fits, found by bisection
        low, high = 0, min(len(message), LINE_MAX_BYTES)
        while low < high:
            middle = (low + high + 1) // 2
            data["msg"] = message[:middle] + TRUNCATED
            if len(json.dumps(data, default=str, ensure_ascii=False).encode()) < LINE_MAX_BYTES:
                low = middle
            else:
                high = middle - 1
        data["msg"] = message[:low] + TRUNCATED
        return json.dumps(data, default=str, ensure_ascii=False)


def _plain(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) or value is None


class AtomicLineHandler(logging.Handler):
    """Writes each record as one line with one ``os.write`` to ``fd`` (default stderr)."""

    def __init__(self, formatter: LineFormatter, fd: int = 2) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self._fd = fd

    @property
    def fd(self) -> int:
        """The descriptor every line goes to."""
        return self._fd

    def retarget(self, fd: int) -> None:
        """Write to ``fd`` from now on (a process that takes over its own stderr moves its
        log lines to a duplicate of it first)."""
        self._fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", "replace")
            if len(data) > LINE_MAX_BYTES:
                keep = LINE_MAX_BYTES - len(TRUNCATED.encode()) - 1
                data = data[:keep].decode("utf-8", "ignore").encode() + TRUNCATED.encode() + b"\n"
            os.write(self._fd, data)
        except Exception:
            self.handleError(record)


def configure(role: str, style: str = "text", level: str | int = "INFO", fd: int = 2) -> None:
    """Make the root logger of this process write atomic lines tagged with ``role``."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(AtomicLineHandler(LineFormatter(role, style), fd))
    root.setLevel(level if isinstance(level, int) else level.upper())
