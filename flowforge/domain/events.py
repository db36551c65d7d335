"""Events sent to waiting tasks (``wait_for_event``): checking what a sender gives.

Pure: no I/O. An event is a name (the same shape as a task or workflow name), a key (text
PostgreSQL can store and index, as an idempotency key) and optional data (any JSON value, which
becomes the woken task's result).
"""

from __future__ import annotations

from typing import Any

from flowforge.domain.names import NAME_PATTERN
from flowforge.domain.values import JsonText, check_text, to_json
from flowforge.errors import InputError

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
