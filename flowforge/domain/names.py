"""What a name of FlowForge's own may be: a workflow, task, handler or event name."""

from __future__ import annotations

import re

#: 1-128 letters, digits, ``_``, ``.`` and ``-``, not starting with ``.`` or ``-``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")

#: The longest queue name RabbitMQ accepts (an AMQP short string), in UTF-8 bytes.
MAX_QUEUE_BYTES = 255
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
