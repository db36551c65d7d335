"""One attempt's captured output and progress, as the worker holds them while it runs (SPEC 7.5).

An :class:`AttemptOutput` is the per-attempt sink: ``ctx.log`` (a :class:`HandlerLog`) adds
its records, :mod:`flowforge.roles.output` adds the handler's stdout and stderr lines and the
records it logs through :mod:`logging`, and ``ctx.progress`` sets the progress. Three threads
touch it (the handler's, the output reader, the lease keeper that writes it while the attempt
runs), so it has a lock; memory is bounded by ``worker.log_capture_bytes``
(:class:`~flowforge.domain.output.Tail`).

Nothing here does I/O: the lease keeper takes :meth:`AttemptOutput.take_live` (None for an
attempt that wrote nothing since the last take, so a silent handler costs no statement) and
the finish takes :meth:`AttemptOutput.final`.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from flowforge.domain.output import Captured, Progress, Tail, check_progress

#: ``worker.log_capture_bytes``' default: the tail of an attempt's output kept (bytes).
DEFAULT_CAPTURE_BYTES = 64 * 1024

#: The logger of ``ctx.log`` records (and of the handler's stdout/stderr lines).
HANDLER_LOGGER = "flowforge.handler"

_formatter = logging.Formatter()


class AttemptOutput:
    """The bounded output and the latest progress of one attempt (module docstring)."""

    def __init__(self, limit: int = DEFAULT_CAPTURE_BYTES) -> None:
        self._lock = threading.Lock()
        self._tail = Tail(limit)
        self._progress: Progress | None = None
        self._dirty = False

    def line(self, text: str) -> None:
        """Add one line (without its newline)."""
        with self._lock:
            self._tail.add(text)
            self._dirty = True

    def record(self, record: logging.LogRecord) -> None:
        """Add a log record as ``LEVEL message``, then the rest of its lines: the message's,
        its traceback's (``exc_info``, else ``exc_text``), its stack's (``stack_info``) — all
        together, so no other line falls between them. A message that cannot be formatted is
        kept as written (:func:`message`). Never logs: the output module's log handler calls
        it (a record logged here would come back)."""
        lines = message(record).split("\n")
        if record.exc_info:
            lines.extend(_formatter.formatException(record.exc_info).split("\n"))
        elif record.exc_text:
            lines.extend(record.exc_text.split("\n"))
        if record.stack_info:
            lines.extend(_formatter.formatStack(record.stack_info).split("\n"))
        lines[0] = f"{record.levelname} {lines[0]}"
        with self._lock:
            for text in lines:
                self._tail.add(text)
            self._dirty = True

    def report(self, fraction: object, message: object = "") -> None:
        """Set the progress; a :class:`~flowforge.domain.output.ProgressError` for a bad
        value (raised in the caller: the handler)."""
        progress = check_progress(fraction, message)
        with self._lock:
            self._progress = progress
            self._dirty = True

    def take_live(self) -> Captured | None:
        """What changed since the last take (the whole current tail and progress), or None."""
        with self._lock:
            if not self._dirty:
                return None
            self._dirty = False
            return self._captured()

    def final(self) -> Captured | None:
        """Everything to store with the attempt's finish; None if it wrote and reported
        nothing."""
        with self._lock:
            if self._tail.written == 0 and self._progress is None:
                return None
            return self._captured()

    def _captured(self) -> Captured:
        output = self._tail.output() if self._tail.written else None
        return Captured(output, self._progress)


class HandlerLog:
    """``ctx.log``: a logger-like object whose records are the attempt's output.

    Each record at INFO or above (DEBUG too when the tree logs it) is added to the attempt
    (``LEVEL message``, then its traceback's lines); each one the tree's log level lets through
    is also logged to ``flowforge.handler`` with the task's fields, as the handler's own
    ``logging`` records reach the tree's log. Formatting that fails never fails the handler.
    """

    def __init__(self, output: AttemptOutput, fields: dict[str, str]) -> None:
        self._output = output
        self._fields = fields
        self._logger = logging.getLogger(HANDLER_LOGGER)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, **kwargs)

    def critical(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.log(logging.CRITICAL, msg, *args, **kwargs)

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **_: Any) -> None:
        logged = self._logger.isEnabledFor(level)
        if level < logging.INFO and not logged:
            return
        if exc_info is True:
            exc_info = sys.exc_info()
        elif isinstance(exc_info, BaseException):
            exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
        if isinstance(exc_info, tuple) and exc_info[0] is None:
            exc_info = None
        extra = {**self._fields, "stream": "log", "action": "handler_log"}
        record = self._logger.makeRecord(
            self._logger.name, level, "(ctx.log)", 0, msg, args, exc_info, extra=extra
        )
        # formatted once, so the tree's log shows what the attempt keeps (a bad format too)
        record.msg, record.args = message(record), ()
        self._output.record(record)
        if logged:
            self._logger.handle(record)


def message(record: logging.LogRecord) -> str:
    """The record's message; a format that fails (a handler's bad format string is its bug,
    not the worker's) is kept as written: ``'msg' % args``."""
    try:
        return record.getMessage()
    except Exception:
        return f"{record.msg!r} % {record.args!r}"
