"""Running a handler off the worker's main thread, and turning what it did into a finish.

The main thread must keep serving the broker connection (heartbeats) and renewing the lease
while a handler runs, so handlers run on one long-lived daemon thread. Python cannot stop a
running thread: a handler that overruns its timeout is abandoned and the worker replaces itself.
"""

from __future__ import annotations

import json
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import PermanentError
from flowforge.roles.context import TaskContext

#: Longest error text stored for an attempt (characters).
MAX_ERROR_CHARS = 4000
MAX_TRACEBACK_CHARS = 20_000


@dataclass
class Job:
    """One handler call; ``done`` is set when it returned or raised."""

    fn: Callable[[TaskContext], Any]
    ctx: TaskContext
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    traceback: str | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(self.ctx)
        except BaseException as exc:  # a handler's failure is data, whatever it raised
            self.error = exc
            self.traceback = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]
        finally:
            self.done.set()


class HandlerThread:
    """A daemon thread that runs submitted jobs one at a time."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[TaskContext], Any], ctx: TaskContext) -> Job:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="handler", daemon=True)
            self._thread.start()
        job = Job(fn, ctx)
        self._jobs.put(job)
        return job

    def _serve(self) -> None:
        while True:
            self._jobs.get().run()


@dataclass(frozen=True)
class Finish:
    """How to finish a task run after its handler ended."""

    state: TaskState
    result: Any = None
    reason: FailureReason | None = None
    error: str | None = None
    traceback: str | None = None


def classify(job: Job) -> Finish:
    """The finish for a completed job: failure, cancellation, or success with a JSON result."""
    if job.error is not None:
        reason = (
            FailureReason.PERMANENT_ERROR
            if isinstance(job.error, PermanentError)
            else FailureReason.HANDLER_ERROR
        )
        return Finish(
            TaskState.FAILED, reason=reason, error=describe(job.error), traceback=job.traceback
        )
    if job.ctx.cancelled.is_set():
        return Finish(TaskState.CANCELLED, result=_jsonable_or_none(job.result))
    try:
        json.dumps(job.result)
    except (TypeError, ValueError) as exc:
        return Finish(
            TaskState.FAILED,
            reason=FailureReason.UNSERIALIZABLE_RESULT,
            error=f"the handler's result is not JSON-serialisable: {exc}"[:MAX_ERROR_CHARS],
        )
    return Finish(TaskState.SUCCEEDED, result=job.result)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def _jsonable_or_none(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value
