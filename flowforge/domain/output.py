"""What a handler's attempt wrote, kept bounded, and the progress it reported (SPEC 7.5).

Pure: no I/O, no clock, no locks (the worker's :mod:`flowforge.roles.attemptlog` guards a
:class:`Tail` for its threads). Everything here is already storable as PostgreSQL text.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from flowforge.domain.states import TaskState
from flowforge.domain.values import clean_text
from flowforge.errors import InputError

#: A progress message longer than this (characters) is cut.
MAX_PROGRESS_MESSAGE_CHARS = 200
#: The highest attempt number (PostgreSQL's integer).
MAX_ATTEMPT = 2**31 - 1


class ProgressError(ValueError):
    """A ``ctx.progress`` call with a value that is not a fraction from 0 to 1 (raised inside
    the handler: uncaught, it fails the attempt as any exception does)."""


@dataclass(frozen=True)
class Output:
    """An attempt's captured text (its last bytes) and how many bytes were dropped before it."""

    text: str
    dropped: int


@dataclass(frozen=True)
class AttemptLog:
    """What one attempt of a task run wrote, as stored: ``attempt`` None when the task run has
    no attempt yet; ``attempts`` how many it has had; ``finished_at`` None while it runs."""

    task_run_id: UUID
    task_state: TaskState
    attempts: int
    attempt: int | None
    started_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    output: Output


@dataclass(frozen=True)
class Progress:
    """A fraction from 0 to 1 and a cleaned message (possibly empty)."""

    fraction: float
    message: str


@dataclass(frozen=True)
class Captured:
    """What an attempt reported, to store: its output (None: it wrote nothing) and its latest
    progress (None: it reported none)."""

    output: Output | None
    progress: Progress | None


def parse_attempt(raw: str | int | None, name: str = "attempt") -> int | None:
    """An attempt number (1 to :data:`MAX_ATTEMPT`) given as an int or as decimal digits;
    None when absent; an :class:`InputError` naming ``name`` for anything else (a bool, a
    sign, a blank, zero, a number too large)."""
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        number = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit():
        number = int(raw)
    else:
        number = 0
    if not 0 < number <= MAX_ATTEMPT:
        raise InputError(f"{name} must be an integer from 1 to {MAX_ATTEMPT}")
    return number


def check_progress(fraction: object, message: object = "") -> Progress:
    """``fraction`` as a float in [0, 1] and ``message`` cleaned and cut; a
    :class:`ProgressError` naming the problem otherwise (a bool, a string, NaN, an infinity,
    a value outside [0, 1], a message that is not a string)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ProgressError(
            f"progress fraction must be a number from 0 to 1, not {type(fraction).__name__}"
        )
    value = float(fraction)
    if math.isnan(value):
        raise ProgressError("progress fraction must be a number from 0 to 1, not NaN")
    if not 0.0 <= value <= 1.0:
        raise ProgressError(f"progress fraction must be from 0 to 1, not {value!r}")
    if message is None:
        message = ""
    if not isinstance(message, str):
        raise ProgressError(f"progress message must be a string, not {type(message).__name__}")
    return Progress(value, clean_text(message, MAX_PROGRESS_MESSAGE_CHARS))


class Tail:
    """The last ``limit`` bytes (UTF-8) of the lines added, and how many bytes were dropped.

    Each line is stored with its newline; a line alone longer than ``limit`` keeps its end.
    Memory is bounded by ``limit`` whatever is added. Not thread-safe.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("a tail's limit must be positive")
        self.limit = limit
        self._lines: deque[bytes] = deque()
        self._size = 0
        self.dropped = 0
        self.written = 0  # every byte ever added (dropped + kept)

    def add(self, line: str) -> None:
        data = (clean_text(line, len(line)) + "\n").encode("utf-8", "replace")
        self.written += len(data)
        if len(data) > self.limit:
            self.dropped += len(data) - self.limit
            data = data[len(data) - self.limit :]
            # a cut inside a multi-byte character: drop its leftover continuation bytes too
            while data and data[0] & 0xC0 == 0x80:
                data = data[1:]
                self.dropped += 1
        self._lines.append(data)
        self._size += len(data)
        while self._size > self.limit:
            gone = self._lines.popleft()
            self._size -= len(gone)
            self.dropped += len(gone)

    def output(self) -> Output:
        return Output(b"".join(self._lines).decode("utf-8", "replace"), self.dropped)
