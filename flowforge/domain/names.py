"""What a name of FlowForge's own may be: a workflow, task, handler, event or queue name, and
what a priority may be, with the priority bands a queue is made of."""

from __future__ import annotations

import re

from flowforge.errors import DefinitionError

#: 1-128 letters, digits, ``_``, ``.`` and ``-``, not starting with ``.`` or ``-``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")

#: The longest task queue name, in UTF-8 bytes: what RabbitMQ accepts (an AMQP short string,
#: 255) less the suffix of its highest priority band (``.p5``), which must fit too.
MAX_QUEUE_BYTES = 252
#: Queue names RabbitMQ keeps for itself (declaring one is refused with ACCESS_REFUSED).
RESERVED_QUEUE_PREFIX = "amq."


def queue_problem(name: object) -> str | None:
    """Why ``name`` cannot be a task queue's name (None: it can).

    A queue name is what RabbitMQ accepts as given: text of 1 to :data:`MAX_QUEUE_BYTES`
    UTF-8 bytes not starting with ``amq.``; FlowForge also refuses surrounding whitespace and
    control characters (a name shown on a terminal or in a log must be the name declared).
    """
    if not isinstance(name, str):
        return f"must be text, not {type(name).__name__}"
    if not name:
        return "must not be empty"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_QUEUE_BYTES:
        return f"must be at most {MAX_QUEUE_BYTES} bytes (UTF-8)"
    if name != name.strip():
        return "must not start or end with whitespace"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 or 0xD800 <= ord(c) < 0xE000 for c in name):
        return "must not hold control characters"
    if name.startswith(RESERVED_QUEUE_PREFIX):
        return f"must not start with {RESERVED_QUEUE_PREFIX!r} (RabbitMQ keeps those names)"
    return None


#: Task priorities: 0 (the default) to 9, higher first within a queue (SPEC 7.4).
MAX_PRIORITY = 9
#: The lowest priority of each band of a queue (docs/flow-control.md "Priorities"): a quorum
#: queue has no priorities, so a queue ``Q`` is three quorum queues, ``Q`` (priority 0),
#: ``Q.p1`` (1-4) and ``Q.p5`` (5-9), and the worker takes from the highest band first.
BANDS = (0, 1, 5)


def priority_problem(value: object) -> str | None:
    """Why ``value`` cannot be a priority (None: it can): a whole number 0 to 9, not a bool."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be a whole number from 0 to {MAX_PRIORITY}, not {type(value).__name__}"
    if not 0 <= value <= MAX_PRIORITY:
        return f"must be a whole number from 0 to {MAX_PRIORITY}, got {value}"
    return None


def min_priority_problem(value: object) -> str | None:
    """Why ``value`` cannot be a worker's ``min_priority`` (None: it can): the lowest priority
    of a band, as a worker takes whole bands (docs/flow-control.md "Reserved workers")."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in BANDS:
        lows = ", ".join(str(low) for low in BANDS[:-1]) + f" or {BANDS[-1]}"
        return (
            f"must be {lows} (the lowest priority of a band: 0, 1-4, 5-{MAX_PRIORITY}),"
            f" not {value!r}"
        )
    return None


def band(priority: int) -> int:
    """The index in :data:`BANDS` of the band ``priority`` belongs to."""
    return sum(1 for low in BANDS[1:] if priority >= low)


def band_queue(queue: str, index: int) -> str:
    """The broker queue of band ``index`` of ``queue``: band 0 is the queue itself (so every
    message published before priorities is in it), the others carry their lowest priority."""
    return queue if index == 0 else f"{queue}.p{BANDS[index]}"


def check_name(value: str, label: str) -> None:
    """:class:`DefinitionError` unless ``value`` is a name (:data:`NAME_PATTERN`); ``label``
    says what it names."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise DefinitionError(
            f"{label} {value!r} is invalid: use 1-128 letters, digits, '_', '.', '-'"
        )
