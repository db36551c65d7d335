"""A handler's stdout and stderr become its own log records, never raw lines in the tree's log.

A handler shares its process's descriptors 1 and 2 with the tree's log (every child inherits
the supervisor's stderr). Written there raw, its output could forge records (a printed
``2026-… INFO scheduler[1] …``), carry terminal escapes, and break ``logging.format: json``.
:func:`capture` (run once in the worker child, before any handler is imported) therefore:

1. moves the process's log handlers to a duplicate of the real stderr (``dup(2)``), so the
   process's own records still reach the tree's log, one ``write(2)`` each;
2. points descriptors 1 and 2 at two pipes, so every write — ``print``, ``sys.stderr``, a C
   extension, a subprocess — lands there, and makes ``sys.stdout`` line-buffered;
3. starts one daemon thread (``handler-output``) that reads both pipes and logs each line as a
   record of the logger ``flowforge.handler`` (stdout at INFO, stderr at WARNING) with
   ``stream`` and, while a handler runs, ``task``, ``task_run_id`` and ``run_id``. The
   formatter (``supervisor/logs.py``) escapes control characters; a line longer than
   :data:`MAX_LINE_BYTES` is cut into several records, so the reader's memory is bounded.

Attribution: :func:`attributed` brackets each handler call (the worker's handler thread). When
the call ends it flushes Python's streams and waits (at most :data:`SETTLE_S`) until the reader
has taken everything already in the pipes, so what a handler wrote before it returned is its
own even when the next handler starts at once. Output written after that (a subprocess the
handler left running) belongs to whichever handler runs when it is read, or to none.

Records a handler logs itself (``logging.info(…)``) already go to the log handlers; a filter
adds the same attribution to the ones logged inside the call: the attribution is a context
variable, set by :func:`attributed` in the handler thread and by :func:`attributed_async` in an
async handler's own :class:`asyncio.Task` (each task runs in a copy of the context, so
concurrent async calls each see their own).

Async handlers run concurrently on one event loop thread, so the pipes cannot tell their output
apart, and :func:`attributed`'s settle (a wait) would stall the loop. Their *Python-level*
writes are therefore routed before they reach a pipe: :func:`capture` replaces ``sys.stdout``
and ``sys.stderr`` with :class:`_Routed` wrappers, which hand a line written inside
:func:`attributed_async` straight to :func:`_emit` with that call's attribution (a last line
without its newline when the call ends), and pass every other write through. What bypasses
Python's ``sys.stdout``/``sys.stderr`` objects in an async handler — ``sys.stdout.buffer``,
``os.write(1, …)``, a C extension, a subprocess — reaches the pipes and is attributed like
any fd-level output: to the sync handler call running at that moment, or to none.

Per attempt (SPEC 7.5): an attribution carries the attempt's sink (an
:class:`~flowforge.roles.attemptlog.AttemptOutput`), and each line :func:`_emit` logs is also
added to it, as is each record the call logs through :mod:`logging` (:class:`AttemptRecords`,
a handler on the root logger). The attribution is held twice: as the process's current one
(what the reader thread attributes descriptor output to: a descriptor has no context, so this
is exact while one handler runs at a time, as on the handler thread) and in a context variable
(:data:`_owner`), which the log filter and :class:`AttemptRecords` read. A context variable
follows the call, not the thread: an asyncio Task started inside the call inherits it, so
concurrent async handlers' records are each their own.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, TextIO
from uuid import UUID

from flowforge.roles.attemptlog import HANDLER_LOGGER, AttemptOutput
from supervisor.logs import AtomicLineHandler

logger = logging.getLogger(HANDLER_LOGGER)

#: A line longer than this (bytes) is logged as several records.
MAX_LINE_BYTES = 2048
#: The longest a finished handler waits for the reader to take its output (seconds).
SETTLE_S = 0.2
_READ_BYTES = 1 << 16
_LEVELS = {"stdout": logging.INFO, "stderr": logging.WARNING}


class Attribution(NamedTuple):
    """Whose output it is: the handler call running now (a tuple: made for every call)."""

    task: str
    task_run_id: UUID
    run_id: UUID
    sink: AttemptOutput | None = None  # the attempt's captured output, if it keeps one

    def fields(self) -> dict[str, str]:
        return {"task": self.task, "task_run_id": str(self.task_run_id), "run_id": str(self.run_id)}

    @property
    def label(self) -> str:
        """What a text line shows after the logger name."""
        return f"{self.task} {self.task_run_id}"


class _Capture:
    """The pipes, the reader thread and the current attribution of one process."""

    def __init__(self, pipes: dict[int, str]) -> None:
        self._pipes = pipes  # read end → stream name
        self._pending = {fd: b"" for fd in pipes}
        self._lock = threading.Lock()  # held from a read until its lines are logged
        self._unread = select.poll()  # settle's own: is anything left in a pipe?
        for fd in pipes:
            self._unread.register(fd, select.POLLIN)
        self.current: Attribution | None = None
        self._thread = threading.Thread(target=self._serve, name="handler-output", daemon=True)
        self._thread.start()

    def settle(self) -> None:
        """Return once the reader took every byte already written (or after SETTLE_S)."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # a handler may have replaced or closed them: no matter
            pass
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            with self._lock:
                if not self._unread.poll(0):
                    # a last line without its newline is the finished call's too
                    for fd, pending in self._pending.items():
                        if pending:
                            self._pending[fd] = b""
                            _emit(self._pipes[fd], pending, self.current)
                    return
            time.sleep(0.001)

    def _serve(self) -> None:
        poller = select.poll()
        for fd in self._pipes:
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _event in poller.poll():
                with self._lock:
                    data = os.read(fd, _READ_BYTES)
                    if data:
                        self._take(fd, data, self.current)
                if not data:  # every writer closed it (someone closed descriptor 1 or 2)
                    poller.unregister(fd)

    def _take(self, fd: int, data: bytes, owner: Attribution | None) -> None:
        pending = self._pending[fd] + data
        *lines, pending = pending.split(b"\n")
        while len(pending) > MAX_LINE_BYTES:
            lines.append(pending[:MAX_LINE_BYTES])
            pending = pending[MAX_LINE_BYTES:]
        self._pending[fd] = pending
        for line in lines:
            for start in range(0, max(len(line), 1), MAX_LINE_BYTES):
                _emit(self._pipes[fd], line[start : start + MAX_LINE_BYTES], owner)


def _emit(stream: str, line: bytes, owner: Attribution | None) -> None:
    text = line.removesuffix(b"\r").decode("utf-8", "replace")
    extra: dict[str, str] = {"stream": stream, "action": "handler_output"}
    label = stream
    if owner is not None:
        extra.update(owner.fields())
        label = f"{owner.label} {stream}"
    extra["label"] = label
    logger.log(_LEVELS[stream], "%s", text, extra=extra)
    if owner is not None and owner.sink is not None:
        owner.sink.line(text)


_capture: _Capture | None = None
#: The handler call whose code runs in this context (its log records get the tags).
_owner: contextvars.ContextVar[Attribution | None] = contextvars.ContextVar(
    "flowforge_handler_call", default=None
)
#: An async handler call's lines not ended yet, by stream (set only inside attributed_async).
_async_lines: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "flowforge_async_output", default=None
)


class _Routed:
    """``sys.stdout`` / ``sys.stderr`` of a capturing process (module docstring): a write
    inside :func:`attributed_async` becomes that call's records at once; any other write, and
    every other attribute, is the wrapped stream's."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        pending = _async_lines.get()
        if pending is None:
            return self._stream.write(text)
        *lines, pending[self._name] = (pending.get(self._name, "") + text).split("\n")
        owner = _owner.get()
        for line in lines:
            _emit_text(self._name, line, owner)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _emit_text(stream: str, text: str, owner: Attribution | None) -> None:
    data = text.encode("utf-8", "replace")
    for start in range(0, max(len(data), 1), MAX_LINE_BYTES):
        _emit(stream, data[start : start + MAX_LINE_BYTES], owner)


def capture() -> None:
    """Turn this process's descriptors 1 and 2 into handler output (module docstring).

    Call once, after logging is configured and before handlers run; later calls do nothing.
    Log handlers writing to descriptor 1 or 2 (an :class:`AtomicLineHandler`, or a stream
    handler on ``sys.stderr`` as ``flowforge role`` sets up) are moved to a duplicate of the
    real stderr first: left there, a record would be read back as output, forever.
    """
    global _capture
    if _capture is not None:
        return
    log_fd = os.dup(2)
    os.set_inheritable(log_fd, False)  # a handler's subprocess gets the pipes, not the log
    log_stream = open(log_fd, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    for handler in logging.getLogger().handlers:
        if isinstance(handler, AtomicLineHandler) and handler.fd in (1, 2):
            handler.retarget(log_fd)
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.stdout,
            sys.stderr,
            sys.__stdout__,
            sys.__stderr__,
        ):
            handler.setStream(log_stream)
        handler.addFilter(_attribute)
    logging.getLogger().addHandler(AttemptRecords())
    with contextlib.suppress(Exception):  # a crash dump goes to the log, not into the pipe
        import faulthandler

        if faulthandler.is_enabled():
            faulthandler.enable(log_fd)
    pipes: dict[int, str] = {}
    for target, stream in ((1, "stdout"), (2, "stderr")):
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, False)
        os.dup2(write_fd, target)  # the duplicate is inheritable: subprocesses write here too
        os.close(write_fd)
        pipes[read_fd] = stream
    for stream_object in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream_object.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stdout = _Routed(sys.stdout, "stdout")
    sys.stderr = _Routed(sys.stderr, "stderr")
    _capture = _Capture(pipes)


def drain() -> None:
    """Log what is in the pipes now (at most :data:`SETTLE_S`): before the process exits."""
    if _capture is not None:
        _capture.settle()


@contextlib.contextmanager
def attributed(
    task: str, task_run_id: UUID, run_id: UUID, sink: AttemptOutput | None = None
) -> Iterator[None]:
    """Output written inside this block is the given handler call's, and is added to ``sink``
    when one is given (module docstring)."""
    owner = Attribution(task, task_run_id, run_id, sink)
    token = _owner.set(owner)
    found = _capture
    try:
        if found is None:
            yield
            return
        found.current = owner
        try:
            yield
        finally:
            found.settle()
            found.current = None
    finally:
        _owner.reset(token)


@contextlib.contextmanager
def attributed_async(
    task: str, task_run_id: UUID, run_id: UUID, sink: AttemptOutput | None = None
) -> Iterator[None]:
    """As :func:`attributed`, for an async handler call inside its own :class:`asyncio.Task`:
    its Python-level writes and log records are its own, and added to ``sink`` when one is
    given (module docstring); never waits."""
    owner = Attribution(task, task_run_id, run_id, sink)
    if _capture is None:
        token = _owner.set(owner)
        try:
            yield
        finally:
            _owner.reset(token)
        return
    pending: dict[str, str] = {}
    tokens = (_owner.set(owner), _async_lines.set(pending))
    try:
        yield
    finally:
        _async_lines.reset(tokens[1])
        _owner.reset(tokens[0])
        for stream, text in pending.items():
            if text:  # a last line without its newline is the finished call's too
                _emit_text(stream, text, owner)


#: The logger whose records, and its children's, are FlowForge's own: never a handler's
#: attempt output (AttemptRecords).
OWN_LOGGER = "flowforge"


class AttemptRecords(logging.Handler):
    """Adds each record logged inside a handler call to that call's attempt sink, in the
    format of ``ctx.log``'s lines (:meth:`~flowforge.roles.attemptlog.AttemptOutput.record`);
    :func:`capture` puts one on the root logger.

    Which records: those logged in the call's context (:data:`_owner`: the sync call on the
    handler thread, each concurrent async call in its own Task, and a thread or Task started
    in a copy of that context) that reach the root logger's handlers — the ones the tree's log
    gets — and that their logger's level lets through (checked again here: a record handed to
    ``Logger.handle`` directly skipped that check). Never those of the ``flowforge`` logger
    and its children, decided by name: the context says *when* a record was logged, not
    *whose code* logged it, and FlowForge's code running inside a call is not the handler's —
    ``ctx.log`` (``flowforge.handler``: ``HandlerLog`` added it already), the stdout and
    stderr records of the same logger (:func:`_emit` added their lines), a
    :class:`~flowforge.client.Client` the handler uses. It never logs and never raises: a
    record it cannot add is left out (the other log handlers still get it)."""

    def emit(self, record: logging.LogRecord) -> None:
        owner = _owner.get()
        if owner is None or owner.sink is None:
            return
        # e.g. a traceback that cannot be formatted, a hand-made record without a level
        with contextlib.suppress(Exception):
            if _kept(record):
                owner.sink.record(record)


def _kept(record: logging.LogRecord) -> bool:
    """Whether a record of a handler call goes to its attempt (:class:`AttemptRecords`)."""
    name = record.name
    if name == OWN_LOGGER or name.startswith(OWN_LOGGER + "."):
        return False
    found = logging.root if name == "root" else logging.Logger.manager.loggerDict.get(name)
    # a record named after no logger was handled by some logger all the same
    return not isinstance(found, logging.Logger) or found.isEnabledFor(record.levelno)


def _attribute(record: logging.LogRecord) -> bool:
    """Tag a record logged inside a handler call (a filter): the call of its context."""
    owner = _owner.get()
    if owner is not None and not hasattr(record, "task_run_id"):
        for key, value in owner.fields().items():
            setattr(record, key, value)
        record.label = owner.label
    return True
