"""Running handlers off the worker's main thread, and turning what they did into a finish.

The main thread must keep serving the broker connection (heartbeats) and renewing leases
while a handler runs, so handlers run on one long-lived daemon thread, one job after another.
Jobs not started yet can be withdrawn (a worker held up by a slow handler hands them back).
Python cannot stop a running thread: a handler that overruns its timeout is abandoned and the
worker replaces itself.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowforge.domain.model import Finish
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from flowforge.domain.values import MAX_ERROR_CHARS, MAX_TRACEBACK_CHARS, clean_text, to_json
from flowforge.errors import PermanentError, UnstorableValueError, ValueTooLargeError
from flowforge.roles.context import TaskContext
from flowforge.roles.output import attributed


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
        ctx = self.ctx
        try:
            # done is set only once the call's output was taken (attributed's settle), so the
            # finish stores all of it
            with attributed(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
                self.result = self.fn(ctx)
        except BaseException as exc:  # a handler's failure is data, whatever it raised
            self.error = exc
            self.traceback = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]  # cleaned by classify
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
            job.run()


def classify(job: Job, max_result_bytes: int) -> Finish:
    """The finish for a completed job: failure, cancellation, or success with a JSON result,
    with what the attempt wrote and reported (:func:`captured`).

    Whatever the handler returned or raised, the finish holds only what PostgreSQL can store:
    the result as checked JSON text (:func:`~flowforge.domain.values.to_json`), error text and
    traceback cleaned. A result it cannot store fails the task with ``unserializable_result``,
    one over ``max_result_bytes`` with ``result_too_large`` (neither is retried); a cancelled
    task's unstorable result is dropped.
    """
    return captured(job, _outcome(job, max_result_bytes))


def captured(job: Job, finish: Finish) -> Finish:
    """``finish`` with the job's captured output and progress (unchanged if it had none)."""
    found = job.ctx.output.final()
    return finish if found is None else dataclasses.replace(finish, captured=found)


def _outcome(job: Job, max_result_bytes: int) -> Finish:
    if job.error is not None:
        reason = (
            FailureReason.PERMANENT_ERROR
            if isinstance(job.error, PermanentError)
            else FailureReason.HANDLER_ERROR
        )
        tb = job.traceback
        return Finish(
            TaskState.FAILED,
            reason=reason,
            error=describe(job.error),
            traceback=None if tb is None else clean_text(tb, MAX_TRACEBACK_CHARS, keep_end=True),
        )
    if job.result is None:
        result = None
    else:
        try:
            result = to_json(job.result, "the handler's result", max_bytes=max_result_bytes)
        except UnstorableValueError as exc:
            if job.ctx.cancelled.is_set():
                return Finish(TaskState.CANCELLED)
            too_large = isinstance(exc, ValueTooLargeError)
            return Finish(
                TaskState.FAILED,
                reason=(
                    FailureReason.RESULT_TOO_LARGE
                    if too_large
                    else FailureReason.UNSERIALIZABLE_RESULT
                ),
                error=clean_text(str(exc), MAX_ERROR_CHARS),
            )
    if job.ctx.cancelled.is_set():
        return Finish(TaskState.CANCELLED, result=result)
    return Finish(TaskState.SUCCEEDED, result=result)


def describe(exc: BaseException) -> str:
    """``Type: message``, cleaned for PostgreSQL and cut to MAX_ERROR_CHARS; a ``__str__``
    that fails does not fail the worker."""
    try:
        message = str(exc)
    except Exception:  # a handler's exception type may be broken in any way
        message = "<str() of the exception failed>"
    return clean_text(f"{type(exc).__name__}: {message}", MAX_ERROR_CHARS)
