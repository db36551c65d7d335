"""Running ``async def`` handlers: an event loop on a thread of its own, a bounded number at once.

A worker's async handlers share one event loop, run by a daemon thread (``async-handlers``)
started at the first async job. Each call is one :class:`asyncio.Task` (so each has its own
copy of the context: context variables, the output attribution, are per call), and at most
``worker.async_concurrency`` of them run at once; the rest wait here, in order, and can be
withdrawn until they start, as :class:`~flowforge.roles.execution.HandlerThread`'s can.

The loop has its thread to itself: sync handlers run on the handler thread and the broker is
served by the main thread, so a sync handler that blocks (``time.sleep``, a socket read, a lock
released by the GIL) never stalls an async one, nor the other way round. What the loop cannot
survive is an async handler that blocks *it* (``time.sleep`` in an ``async def``): every async
call of the worker waits meanwhile.

Two things end a call early, both by :meth:`asyncio.Task.cancel`, so the handler sees
:class:`asyncio.CancelledError` at its current ``await``:

* its ``ctx.cancelled`` is set (the run was cancelled, fail-fast stopped it, its lease was
  lost): the task is cancelled from the thread that sets it (:class:`CancelEvent`);
* its task's ``timeout`` passes (:func:`asyncio.timeout`): the job is marked ``timed_out`` and
  classified as the sync path's timeout, with no worker replaced — the loop stops the call.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import threading
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowforge.domain.values import MAX_TRACEBACK_CHARS
from flowforge.roles.context import CancelEvent
from flowforge.roles.output import attributed_async

if TYPE_CHECKING:
    from flowforge.roles.execution import Job


class AsyncRunner:
    """An event loop thread that runs async jobs, at most ``limit`` at once (module doc)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()  # the waiting jobs, and the moment one starts
        self._running = 0  # written on the loop thread, under the lock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[int, asyncio.Task[None]] = {}  # id(job) -> its task (loop thread)
        #: Set whenever a call ends (a slot is free); whoever waits on it clears it.
        self.freed = threading.Event()

    @property
    def running(self) -> int:
        """How many calls run now (a snapshot, for tests and logs)."""
        return self._running

    def free(self) -> int:
        """Slots neither running nor promised to a waiting job (a snapshot)."""
        with self._lock:
            return self._limit - self._running - len(self._waiting)

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs``; they start, in order, as soon as a slot is free."""
        loop = self._started()
        with self._lock:
            self._waiting.extend(jobs)
        loop.call_soon_threadsafe(self._start_waiting)

    def withdraw(self) -> list[Job]:
        """Take back every job that has not started and waits for a slot; they will never
        run here. Those a free slot awaits are left: the loop starts them in a moment (a
        batch that just filled its free slots hands back nothing it took for them)."""
        with self._lock:
            promised = max(0, self._limit - self._running)
            jobs = list(self._waiting)[promised:]
            for _ in jobs:
                self._waiting.pop()
        return jobs

    def cancel(self, job: Job) -> None:
        """Cancel ``job``'s call if it runs (a hook gave it up); safe from any thread."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._cancel, id(job))

    def _cancel(self, key: int) -> None:
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()

    def _started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="async-handlers", daemon=True)
            thread.start()
            self._loop = loop
        return self._loop

    def _start_waiting(self) -> None:
        loop = self._loop
        assert loop is not None
        while self._running < self._limit:
            with self._lock:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                job.started = time.monotonic()  # under the lock: withdraw never takes it
                self._running += 1  # under the lock too: withdraw counts the free slots
            # a fresh context: started from the finally of the call before (_call), the task
            # would otherwise inherit the context variables that call set
            task = loop.create_task(self._call(job), context=contextvars.Context())
            self._tasks[id(job)] = task
            cancelled = job.ctx.cancelled
            if isinstance(cancelled, CancelEvent):
                # set from another thread; the task is cancelled on the loop's
                cancelled.on_set(functools.partial(loop.call_soon_threadsafe, task.cancel))

    async def _call(self, job: Job) -> None:
        ctx = job.ctx
        scope: asyncio.Timeout | None = None
        try:
            with attributed_async(ctx.name, ctx.task_run_id, ctx.run_id, ctx.output):
                try:
                    if job.timeout_s is None:
                        job.result = await _awaited(job)
                    else:
                        async with asyncio.timeout(job.timeout_s) as scope:
                            job.result = await _awaited(job)
                except BaseException as exc:  # a handler's failure is data, whatever it raised
                    job.error = exc
                    job.traceback = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]
        finally:
            job.timed_out = scope is not None and scope.expired()
            del self._tasks[id(job)]
            with self._lock:
                self._running -= 1
            job.ended = time.monotonic()
            job.done.set()
            self._start_waiting()
            self.freed.set()


async def _awaited(job: Job) -> Any:
    return await job.fn(job.ctx)
