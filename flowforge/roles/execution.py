"""Running handlers off the worker's main thread, and turning what they did into a finish.

The main thread must keep serving the broker connection (heartbeats) and renewing leases
while a handler runs, so handlers run on one long-lived daemon thread, one job after another.
Jobs not started yet can be withdrawn (a worker held up by a slow handler hands them back).
Python cannot stop a running thread: a handler that overruns its timeout is abandoned and the
worker replaces itself.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowforge.domain.model import Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.errors import PermanentError
from flowforge.roles.context import TaskContext
from flowforge.roles.output import attributed

#: Longest error text stored for an attempt (characters).
MAX_ERROR_CHARS = 4000
MAX_TRACEBACK_CHARS = 20_000


@dataclass
class Job:
    """One handler call; ``started`` is its monotonic start, ``done`` set when it ended."""

    fn: Callable[[TaskContext], Any]
    ctx: TaskContext
    started: float | None = None
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
    """A daemon thread that runs submitted jobs one at a time, in order."""

    def __init__(self) -> None:
        self._jobs: collections.deque[Job] = collections.deque()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, jobs: Sequence[Job]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="handler", daemon=True)
            self._thread.start()
        with self._changed:
            self._jobs.extend(jobs)
            self._changed.notify()

    def withdraw(self) -> list[Job]:
        """Take back every job that has not started; they will never run here."""
        with self._changed:
            jobs = list(self._jobs)
            self._jobs.clear()
        return jobs

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._jobs:
                    self._changed.wait()
                job = self._jobs.popleft()
                job.started = time.monotonic()  # under the lock: withdraw never takes it
            with attributed(job.ctx.name, job.ctx.task_run_id, job.ctx.run_id):
                job.run()


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
