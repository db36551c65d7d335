"""The context a handler receives (SPEC 5.1, 7.5)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from flowforge.roles.attemptlog import AttemptOutput, HandlerLog
from flowforge.roles.upstream import UpstreamList, UpstreamMap


class CancelEvent(threading.Event):
    """``ctx.cancelled``: a :class:`threading.Event` that also calls what :meth:`on_set`
    registered when it is set, from the thread that sets it (the lease keeper, the cancel
    listener). An async handler's task is cancelled through it at once, without polling."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], object]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once when the event is set (at once if it is set already)."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()


@dataclass(frozen=True)
class TaskContext:
    """Everything a handler may know about its task, and where it reports.

    ``cancelled`` is set when the run is cancelled (or fail-fast stops it, or the lease was
    lost): a handler that checks it and returns ends CANCELLED, not SUCCEEDED. In an
    ``async def`` handler the same moment raises :class:`asyncio.CancelledError` at its
    current ``await``; letting it propagate ends the task CANCELLED too.

    ``item`` and ``index``: for an item of a map task (``for_each``), its element of the
    upstream list and its position from 0; None for every other task.

    ``upstream``: each upstream task's result by name. Within ``worker.upstream_inline_items``
    a plain dict of JSON values; beyond it (a wide fan-in, a long upstream list) read-only
    views that fetch pages on demand (:mod:`flowforge.roles.upstream`; docs/handlers.md
    "Large upstream results"). :meth:`upstream_items` reads a list without blocking an event
    loop.

    ``log``: a logger (``debug``/``info``/``warning``/``error``/``exception``) whose records
    are kept with this attempt, with its stdout and stderr (``flowforge logs``);
    :meth:`progress` reports how far it is. ``output`` holds both (the worker's).
    """

    input: Mapping[str, Any]
    upstream: Mapping[str, Any]
    attempt: int
    task_run_id: UUID
    run_id: UUID
    name: str
    cancelled: threading.Event = field(default_factory=CancelEvent)
    item: Any = None
    index: int | None = None
    output: AttemptOutput = field(default_factory=AttemptOutput, compare=False, repr=False)

    @property
    def log(self) -> HandlerLog:
        fields = {
            "task": self.name,
            "task_run_id": str(self.task_run_id),
            "run_id": str(self.run_id),
            "label": f"{self.name} {self.task_run_id} log",
        }
        return HandlerLog(self.output, fields)

    async def upstream_items(self, name: str) -> AsyncIterator[Any]:
        """The elements of upstream ``name``'s list result, in order, for an ``async def``
        handler: each page of a paged one (:class:`~flowforge.roles.upstream.UpstreamList`)
        is fetched in a thread, as is the lookup in a paged ``ctx.upstream``, so the event
        loop never waits on the database. ``KeyError`` for a name that is not upstream,
        ``TypeError`` for a result that is not a list."""
        upstream = self.upstream
        if isinstance(upstream, UpstreamMap):
            value = await asyncio.to_thread(upstream.__getitem__, name)
        else:
            value = upstream[name]
        if isinstance(value, UpstreamList):
            async for page in value.apages():
                for element in page:
                    yield element
            return
        if not isinstance(value, list):
            raise TypeError(f"upstream {name!r} is not a list but {type(value).__name__}")
        for element in value:
            yield element

    def progress(self, fraction: float, message: str = "") -> None:
        """Report ``fraction`` (0 to 1) done, with a short ``message`` (cut to 200 characters),
        shown live by ``flowforge status``, the api and the dashboard. A ``ValueError``
        (``ProgressError``) for NaN, an infinity, a bool, a non-number, or a value outside
        [0, 1]. Stored at most every ``worker.output_flush_ms`` and with the finish."""
        self.output.report(fraction, message)
