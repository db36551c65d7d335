"""The context a handler receives (SPEC 5.1)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID


@dataclass(frozen=True)
class TaskContext:
    """Everything a handler may know about its task.

    ``cancelled`` is set when the run is cancelled (or fail-fast stops it, or the lease was
    lost): a handler that checks it and returns ends CANCELLED, not SUCCEEDED.

    ``item`` and ``index``: for an item of a map task (``for_each``), its element of the
    upstream list and its position from 0; None for every other task.
    """

    input: Mapping[str, Any]
    upstream: Mapping[str, Any]
    attempt: int
    task_run_id: UUID
    run_id: UUID
    name: str
    cancelled: threading.Event = field(default_factory=threading.Event)
    item: Any = None
    index: int | None = None
