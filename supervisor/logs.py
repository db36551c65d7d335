"""One log stream for the whole tree: every line written with a single ``write(2)``.

A multiprocessing queue (what multiprocessing-logging uses) is guarded by a lock shared
between processes; a child SIGKILLed while holding it wedges every sibling that logs. Here
nothing is shared: each process formats a record into one line of at most ``PIPE_BUF`` bytes
and writes it with one ``os.write`` to the inherited stderr. POSIX makes such writes to a pipe
atomic, and an O_APPEND file gets whole lines too, so lines never interleave and a killed
process can hold nothing that others wait for.
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
_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class LineFormatter(logging.Formatter):
    """``text``: ``time level role[pid] logger: message``; ``json``: one object per line."""

    def __init__(self, role: str, style: str = "text") -> None:
        super().__init__()
        self.role = role
        self.style = style

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if self.style == "json":
            return self._json(record, message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        text = message.replace("\n", "\n    ")
        return (
            f"{stamp}.{int(record.msecs):03d} {record.levelname} {self.role}[{record.process}] "
            f"{record.name}: {text}"
        )

    def _json(self, record: logging.LogRecord, message: str) -> str:
        """One JSON object that fits in a line: an oversized message is shortened inside it."""
        data: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "msg": message,
        }
        data.update(
            (k, v) for k, v in vars(record).items() if k not in _STANDARD_ATTRS and _plain(v)
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
