"""Events sent to waiting tasks (``wait_for_event``): what a task waits for (:class:`EventWait`)
and checking what a sender gives.

Pure: no I/O. An event is a name (the same shape as a task or workflow name), a key (text
PostgreSQL can store and index, as an idempotency key) and optional data (any JSON value, which
becomes the woken task's result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowforge.domain.keys import check_template
from flowforge.domain.names import NAME_PATTERN, check_name
from flowforge.domain.timing import MAX_SPAN_S
from flowforge.domain.values import JsonText, check_text, to_json
from flowforge.errors import DefinitionError, InputError

#: Largest event data accepted, as JSON (bytes): the data becomes a task's result, and a
#: result is bounded by default to this (``worker.max_result_bytes``).
MAX_EVENT_DATA_BYTES = 1024 * 1024


def check_event(name: Any, key: Any, data: Any = None) -> tuple[str, str, JsonText | None]:
    """``(name, key, data as JSON text or None)`` ready to store, or :class:`InputError` (or
    one of :class:`~flowforge.errors.UnstorableValueError`) naming the field."""
    if not isinstance(name, str) or not name:
        raise InputError("event name: required, a non-empty string")
    if not NAME_PATTERN.fullmatch(name):
        raise InputError(
            f"event name {name[:80]!r} is invalid: use 1-128 letters, digits, '_', '.', '-'"
        )
    if key is None:
        raise InputError("event key: required (the key a waiting task's template renders)")
    key = check_text(key, "event key")
    stored = None if data is None else to_json(data, "event data", max_bytes=MAX_EVENT_DATA_BYTES)
    return name, key, stored


@dataclass(frozen=True)
class EventWait:
    """What a ``wait_for_event`` task waits for: an event called ``name`` whose key is
    ``key`` (a template over the run input, like an idempotency key), for at most
    ``timeout`` seconds after its dependencies are met (then it is DEAD ``event_timeout``)."""

    name: str
    key: str
    timeout: float

    def __post_init__(self) -> None:
        check_name(self.name, "wait_for_event.name")
        check_template(self.key, "wait_for_event.key")
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or not 0 < self.timeout <= MAX_SPAN_S  # NaN fails this too
        ):
            raise DefinitionError(
                f"wait_for_event.timeout must be more than 0 and at most {MAX_SPAN_S:.0f} seconds"
            )
