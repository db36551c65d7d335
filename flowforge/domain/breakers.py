"""Circuit breakers and pauses (SPEC 7.4; docs/flow-control.md "Circuit breakers and pauses").

Pure: the breaker's configuration as a workflow declares it, its states, which failures count,
and the names an operator may pause. The state itself lives in PostgreSQL (``breakers``,
``pauses``: migration 0018) and moves only by the conditional statements of queries.sql.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from flowforge.domain.keys import check_template
from flowforge.domain.names import NAME_PATTERN, queue_problem
from flowforge.domain.reasons import FailureReason
from flowforge.domain.values import check_text
from flowforge.errors import DefinitionError, InputError

#: Most failures a breaker may be set to count (its window keeps at most this many times).
MAX_BREAKER_FAILURES = 10_000
#: Longest window or cooldown accepted, in seconds (a day: a breaker is about an outage of a
#: dependency, not a schedule; an operator holds one open by hand for longer).
MAX_BREAKER_SPAN_S = 86_400.0

#: The failures of an attempt that count against its handler's breaker: the handler raised, or
#: ran past its timeout — what a dependency that is down or hanging looks like. Not counted: a
#: PermanentError (the input is bad, not the dependency), an unknown handler (a config
#: mistake), a result that cannot be stored (the dependency answered), a cancellation, and a
#: lease reaped (the worker died: that says nothing of the dependency; a hung call is ended by
#: the task's timeout, which counts).
COUNTED_FAILURES = frozenset({FailureReason.HANDLER_ERROR, FailureReason.TIMEOUT})


class BreakerState(StrEnum):
    """Where a handler's breaker stands."""

    CLOSED = "closed"  # tasks run; failures are counted in the window
    OPEN = "open"  # tasks wait (parked, no attempt used) until the cooldown is over
    HALF_OPEN = "half_open"  # one probe runs; its success closes, its failure reopens


class PauseScope(StrEnum):
    """What an operator pauses: every task of a queue, or every task of a handler."""

    QUEUE = "queue"
    HANDLER = "handler"


class Waiting(StrEnum):
    """``waiting_on`` of a task held back at its claim (it is RETRYING with no retry time)."""

    CIRCUIT_OPEN = "circuit_open"
    PAUSED = "paused"


@dataclass(frozen=True)
class CircuitBreaker:
    """``circuit_breaker: {failures, window, cooldown, key}`` (SPEC 7.4): after ``failures``
    counted failures of the task's handler within ``window`` seconds, the handler's breaker
    opens and its tasks wait, using no attempt; ``cooldown`` seconds later one probe runs
    (half-open): its success closes the breaker, its failure opens it again for another
    cooldown.

    Without ``key`` the breaker is the handler's, shared by every task (of any workflow or
    tree) that runs it and declares no key. ``key``: a template over the run input (a map's
    item: over the input, ``item`` and ``index``), rendered like a rate key; each rendered key
    of the handler has its own breaker, which holds only the tasks with that key. Each failure
    is judged by the failing task's own numbers."""

    failures: int
    window: float
    cooldown: float
    key: str | None = None

    def __post_init__(self) -> None:
        if self.key is not None:
            check_template(self.key, "circuit_breaker.key")
        count = self.failures
        if (
            isinstance(count, bool)
            or not isinstance(count, int)
            or not 1 <= count <= MAX_BREAKER_FAILURES
        ):
            raise DefinitionError(
                f"circuit_breaker.failures must be a whole number from 1 to "
                f"{MAX_BREAKER_FAILURES}, not {count!r}"
            )
        for label in ("window", "cooldown"):
            value = getattr(self, label)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not 0 < value <= MAX_BREAKER_SPAN_S
            ):
                raise DefinitionError(
                    f"circuit_breaker.{label} must be a number of seconds more than 0 and at "
                    f"most {MAX_BREAKER_SPAN_S:.0f} (or a duration such as 30s, 5m in YAML), "
                    f"not {value!r}"
                )
            object.__setattr__(self, label, float(value))

    def to_dict(self) -> dict[str, float | int | str]:
        """The canonical form (the workflow digest's; ``key`` only when set, so the digests of
        workflows without one stay as they were)."""
        data: dict[str, float | int | str] = {
            "failures": self.failures,
            "window": self.window,
            "cooldown": self.cooldown,
        }
        if self.key is not None:
            data["key"] = self.key
        return data


def breaker_name(handler: str, key: str | None) -> str:
    """How messages and logs name a breaker: ``breaker of handler 'h'``, or with a key
    ``breaker of handler 'h' key 'k'`` (key None or '': the handler-wide one)."""
    return f"breaker of handler {handler!r}" + (f" key {key!r}" if key else "")


def check_breaker_key(key: object, label: str = "breaker key") -> str:
    """``key`` if it can name a keyed breaker: text PostgreSQL can store and index, not empty
    (``''`` is the handler-wide breaker's, which a task or an operator names by giving no key).
    :class:`InputError` naming ``label`` otherwise — the same rule for a rendered key and for
    the key an operator types."""
    if not isinstance(key, str):
        raise InputError(f"{label} must be text, not {type(key).__name__}")
    if key == "":
        raise InputError(
            f"{label} is empty: '' is the handler's own breaker (give no key to name it)"
        )
    return check_text(key, label)


def check_handler_name(name: object) -> str:
    """``name`` if it can be a handler's (what ``breakers`` and ``pause handler`` take);
    :class:`InputError` naming the rule otherwise."""
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise InputError(
            f"handler name {name!r} is not valid: 1-128 letters, digits, '_', '.', '-', "
            "not starting with '.' or '-'"
        )
    return name


def check_pause_target(scope: object, name: object) -> tuple[PauseScope, str]:
    """The scope and name of a pause or resume; :class:`InputError` for a scope other than
    ``queue`` or ``handler``, or a name that cannot be one (a queue's as RabbitMQ takes it)."""
    if scope not in {s.value for s in PauseScope}:
        raise InputError(f"pause scope must be 'queue' or 'handler', not {scope!r}")
    kind = PauseScope(str(scope))
    if kind is PauseScope.HANDLER:
        return kind, check_handler_name(name)
    problem = queue_problem(name)
    if problem is not None:
        raise InputError(f"queue name {problem}")
    assert isinstance(name, str)
    return kind, name


@dataclass(frozen=True)
class Breaker:
    """One breaker as the database holds it (``flowforge breakers list``): a handler's, or one
    key's of a handler (``key`` ``''``: the handler-wide one)."""

    handler: str
    key: str
    state: BreakerState
    held: bool  # opened by an operator: no probe until one closes it
    recent_failures: int  # counted failures within its window
    failures: int | None  # the thresholds the last counted failure wrote (None: none yet)
    window_s: float | None
    cooldown_s: float | None
    opened_at: datetime | None  # the last opening
    probe_due_in_s: float | None  # an automatic open breaker: seconds left of its cooldown
    probe_task_id: str | None  # half-open: the task run probing
    parked: int  # tasks held back by it (of the handler, with its key)
    transitions: int
    updated_at: datetime


@dataclass(frozen=True)
class Pause:
    """One paused queue or handler (``flowforge pause list``)."""

    scope: PauseScope
    name: str
    paused_by: str
    reason: str | None
    paused_at: datetime
    parked: int  # tasks held back by it now


@dataclass(frozen=True)
class Transition:
    """One transition of a breaker, as its statement recorded it (logged once, by one
    scheduler)."""

    handler: str
    key: str  # '': the handler-wide breaker
    from_state: BreakerState
    to_state: BreakerState
    cause: str  # failures, cooldown, probe_succeeded, probe_failed, probe_lost, operator
    at: datetime


@dataclass(frozen=True)
class GateChange:
    """What an operator's breaker or pause action did (the API's and ``--json``'s answer)."""

    action: str  # pause, resume, breaker_open, breaker_close
    scope: str  # queue or handler
    name: str
    previous_state: str  # closed, open, half_open; or running, paused
    new_state: str
    key: str | None = None  # a keyed breaker's key (None: the handler's breaker, or a pause)


@dataclass(frozen=True)
class BreakerGauge:
    """One breaker as ``/metrics`` shows it: its state and its transitions into each state."""

    handler: str
    key: str  # '': the handler-wide breaker
    state: BreakerState
    transitions: dict[BreakerState, int]


@dataclass(frozen=True)
class GateGauges:
    """``/metrics``' breakers and parked tasks (by ``waiting_on``); ``folded``: per (handler,
    state entered), the transitions of keyed breakers retention deleted (their handler's
    counter keeps them)."""

    breakers: tuple[BreakerGauge, ...]
    parked: dict[str, int]
    folded: dict[tuple[str, BreakerState], int] = field(default_factory=dict)


@dataclass(frozen=True)
class GatePass:
    """What the scheduler's gate pass did: parked tasks given a retry time of now (probes
    included), and the breaker transitions it took to log."""

    unparked: int
    transitions: tuple[Transition, ...]
