"""Running handlers off the worker's main thread, and turning what they did into a finish.

The main thread must keep serving the broker connection (heartbeats) and renewing leases
while a handler runs, so sync handlers run on one long-lived daemon thread, one job after
another, and ``async def`` handlers on an event loop thread of their own, several at once
(:mod:`flowforge.roles.asyncrun`); :class:`Executor` sends each job to its kind's. Jobs not
started yet can be withdrawn (a worker held up by a slow handler hands them back). Python
cannot stop a running thread: a sync handler that overruns its timeout is abandoned and the
worker replaces itself; an async one is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
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
from flowforge.roles.asyncrun import AsyncRunner
from flowforge.roles.context import TaskContext
from flowforge.roles.output import attributed


def is_async(fn: Callable[..., Any]) -> bool:
    """True for a handler whose call returns a coroutine: an ``async def`` function (also
    behind :func:`functools.partial`), or an object with an ``async def __call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method itself is what is asked about
    )


def timeout_finish(timeout_s: float) -> Finish:
    """The outcome of a handler that ran past its task's ``timeout`` (either kind)."""
    return Finish(
        TaskState.FAILED,
        reason=FailureReason.TIMEOUT,
        error=f"the handler ran longer than its timeout of {timeout_s}s",
    )


@dataclass
class Job:
    """One handler call; ``started`` and ``ended`` are its monotonic start and end, ``done``
    set when it ended.

    ``timeout_s``: the task's timeout, which an async call's loop applies itself
    (``timed_out`` then); a sync call's is the :class:`~flowforge.roles.concerns.TimeLimit`
    hook's."""

    fn: Callable[[TaskContext], Any]
    ctx: TaskContext
    timeout_s: float | None = None
    started: float | None = None
    ended: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    traceback: str | None = None
    timed_out: bool = False
    asynchronous: bool = field(init=False)

    def __post_init__(self) -> None:
        self.asynchronous = is_async(self.fn)

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
            self.ended = time.monotonic()
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


class Executor:
    """Where jobs run: sync ones on the :class:`HandlerThread`, async ones on the
    :class:`~flowforge.roles.asyncrun.AsyncRunner` (``async_concurrency`` at once)."""

    def __init__(self, async_concurrency: int) -> None:
        self.thread = HandlerThread()
        self.loop = AsyncRunner(async_concurrency)

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs``: the sync ones run one after another in order, the async ones
        start at once while a slot is free."""
        later = [job for job in jobs if not job.asynchronous]
        now = [job for job in jobs if job.asynchronous]
        if now:
            self.loop.submit(now)
        if later:
            self.thread.submit(later)

    def withdraw(self) -> list[Job]:
        """Take back every job that has not started, of either kind."""
        return [*self.thread.withdraw(), *self.loop.withdraw()]

    def cancel(self, job: Job) -> None:
        """Stop an async job early (a hook gave it up); a sync one cannot be stopped."""
        if job.asynchronous:
            self.loop.cancel(job)


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
    if job.timed_out and job.timeout_s is not None:
        return timeout_finish(job.timeout_s)
    if isinstance(job.error, asyncio.CancelledError) and job.ctx.cancelled.is_set():
        return Finish(TaskState.CANCELLED)  # the async handler let the cancellation through
    if inspect.isawaitable(job.result):
        _close(job.result)
        error = "the handler returned an awaitable: declare it `async def` to have it awaited"
        return Finish(TaskState.FAILED, reason=FailureReason.HANDLER_ERROR, error=error)
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


def _close(awaitable: Any) -> None:
    """Close a coroutine nobody will await (no "never awaited" warning at collection)."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()


def describe(exc: BaseException) -> str:
    """``Type: message``, cleaned for PostgreSQL and cut to MAX_ERROR_CHARS; a ``__str__``
    that fails does not fail the worker."""
    try:
        message = str(exc)
    except Exception:  # a handler's exception type may be broken in any way
        message = "<str() of the exception failed>"
    return clean_text(f"{type(exc).__name__}: {message}", MAX_ERROR_CHARS)
