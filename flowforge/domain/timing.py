"""Delays, durable timers and deadlines (SPEC 7.2): the values, checked before any SQL runs.

Pure: no clock. Every "now" is the database's: a start time given as an instant is judged
against the ``now()`` of the trigger's own transaction (:func:`judge_start_at`), and a delay, a
sleep or a deadline is a number of seconds the store adds to the database clock in SQL.

Bounds (documented in docs/time.md):

* a delay, a sleep and a deadline are finite, positive numbers of seconds, at most
  :data:`MAX_SPAN_S` (366 days) — far inside PostgreSQL's range, and past any sane plan;
* a start time needs a UTC offset (a naive time is refused, never guessed), may lie at most
  :data:`PAST_TOLERANCE_S` (60 s) before the database's now (a caller whose clock runs a little
  behind, or who computed "now + 1 s" slowly, is not refused: the run starts at once), and at
  most :data:`MAX_AHEAD_S` (3,660 days) after it.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from flowforge.errors import InputError

#: Longest delay, sleep or deadline accepted, in seconds (366 days).
MAX_SPAN_S = 366 * 86_400.0
#: How far before the database's now an explicit start time may lie, in seconds.
PAST_TOLERANCE_S = 60.0
#: How far after the database's now an explicit start time may lie, in seconds (3,660 days).
MAX_AHEAD_S = 3_660 * 86_400.0
#: Longest text read as a start time (an ISO 8601 time with fractions and an offset is ~32).
MAX_INSTANT_CHARS = 64


def seconds(value: Any, label: str) -> float:
    """``value`` (seconds as a number, or a :class:`~datetime.timedelta`) as a float of
    seconds in (0, :data:`MAX_SPAN_S`]; :class:`InputError` naming ``label`` otherwise."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{label} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not 0 < value <= MAX_SPAN_S:
        raise InputError(
            f"{label} must be more than 0 and at most {MAX_SPAN_S:.0f} seconds (366 days), "
            f"got {value!r}"
        )
    return float(value)


def parse_instant(text: Any, label: str) -> datetime:
    """An ISO 8601 date and time *with* a UTC offset (``2026-12-24T09:00:00+01:00``, or ``Z``).

    A time without an offset is refused rather than read as UTC or as some machine's local
    time: the caller says which instant it means. :class:`InputError` names ``label``.
    """
    if not isinstance(text, str):
        raise InputError(f"{label} must be an ISO 8601 date and time, got {type(text).__name__}")
    shown = text[:60]
    try:
        # fromisoformat lets a trailing NUL through: only short printable ASCII is a time
        if len(text) > MAX_INSTANT_CHARS or not (text.isascii() and text.isprintable()):
            raise ValueError(text)
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise InputError(
            f"{label} {shown!r} is not an ISO 8601 date and time (e.g. 2026-12-24T09:00:00+01:00)"
        ) from exc
    return aware(value, label)


def aware(value: Any, label: str) -> datetime:
    """``value`` if it is a datetime with a UTC offset; :class:`InputError` otherwise."""
    if not isinstance(value, datetime):
        raise InputError(f"{label} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InputError(
            f"{label} {value.isoformat()!r} has no UTC offset: give one "
            "(e.g. +01:00 or Z), so the instant is unambiguous"
        )
    return value


def judge_start_at(start_at: datetime, now: datetime, label: str = "start_at") -> None:
    """Refuse a start time in the past (beyond :data:`PAST_TOLERANCE_S`) or too far ahead
    (beyond :data:`MAX_AHEAD_S`), both measured from ``now``, the database's clock."""
    ahead = (start_at - now).total_seconds()
    if ahead < -PAST_TOLERANCE_S:
        raise InputError(
            f"{label} {start_at.isoformat()} is in the past (the database's clock says "
            f"{now.isoformat(timespec='seconds')})"
        )
    if ahead > MAX_AHEAD_S:
        raise InputError(
            f"{label} {start_at.isoformat()} is more than {MAX_AHEAD_S / 86_400:.0f} days ahead"
        )


def start(start_at: Any, delay: Any) -> tuple[datetime | None, float | None]:
    """(start time, delay in seconds) of a trigger; at most one of them may be given."""
    if start_at is not None and delay is not None:
        raise InputError("give either start_at or delay, not both")
    return (
        None if start_at is None else aware(start_at, "start_at"),
        None if delay is None else seconds(delay, "delay"),
    )
