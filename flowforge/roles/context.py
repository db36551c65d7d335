"""The context a handler receives (SPEC 5.1)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID


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
    """Everything a handler may know about its task.

    ``cancelled`` is set when the run is cancelled (or fail-fast stops it, or the lease was
    lost): a handler that checks it and returns ends CANCELLED, not SUCCEEDED. In an
    ``async def`` handler the same moment raises :class:`asyncio.CancelledError` at its
    current ``await``; letting it propagate ends the task CANCELLED too.

    ``item`` and ``index``: for an item of a map task (``for_each``), its element of the
    upstream list and its position from 0; None for every other task.
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
