"""Values PostgreSQL can store: every JSON value and text that a statement carries.

PostgreSQL's ``jsonb`` refuses NaN and ±Infinity, the escape ``\\u0000`` and lone surrogates;
its ``text`` refuses NUL and anything that is not UTF-8; a btree index refuses an entry over
about 2.7 kB. A value in such a shape fails its whole statement, and one statement may carry
other tasks' outcomes (a worker finishes a batch at once), so every value is made storable here
first, or refused with an :class:`UnstorableValueError` that says what is wrong and where.

* :func:`to_json`: a JSON-bound value (input, result) → its canonical JSON text, or refused.
* :func:`check_text`: a key (idempotency key, ordering key): refused, never altered, since a
  changed key would be another key.
* :func:`clean_text`: free text (error text, tracebacks): cleaned and cut, never refused.

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from itertools import accumulate
from typing import Any

from flowforge.errors import UnstorableValueError, ValueTooLargeError

#: Containers (objects, arrays) nested deeper than this are refused.
MAX_DEPTH = 100
#: Default bound on a JSON value's encoded size (bytes of UTF-8); results have their own
#: (``worker.max_result_bytes``).
MAX_JSON_BYTES = 16 * 1024 * 1024
#: Bound on a key's size (bytes of UTF-8): well under what one btree index entry can hold.
MAX_KEY_BYTES = 1024
#: Bound on operator text kept for the audit (a requeue's reason and requester; bytes).
MAX_NOTE_BYTES = 16 * 1024
#: Longest error text and traceback stored for an attempt (characters).
MAX_ERROR_CHARS = 4000
MAX_TRACEBACK_CHARS = 20_000
#: What :func:`clean_text` puts in place of a character PostgreSQL cannot store.
REPLACEMENT = "\ufffd"
#: Longest JSON path quoted in a refusal (characters).
MAX_PATH_CHARS = 200

_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1, +1, -1, -1 as signed bytes
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[{]}")))
# One encoder for every call: json.dumps builds a new one per call when given options.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class JsonText(str):
    """Canonical JSON text that :func:`to_json` made: storable as ``jsonb`` as it is."""

    __slots__ = ()


def to_json(
    value: Any, what: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH
) -> JsonText:
    """``value`` as canonical JSON text (compact; tuples become arrays, and int, float, bool
    and None keys strings, as :mod:`json` does), or :class:`UnstorableValueError`.

    Refused: NaN and ±Infinity, a NUL character or a lone surrogate in a string or a key,
    containers nested deeper than ``max_depth``, a type JSON does not have; and, as
    :class:`ValueTooLargeError`, text over ``max_bytes`` bytes of UTF-8. The message starts with
    ``what`` and names the first place found wrong as a JSON path (``$.items[3].name``).
    """
    try:
        text = _ENCODER.encode(value)
        data = text.encode()  # a lone surrogate cannot be encoded: UnicodeEncodeError
    except (TypeError, ValueError, RecursionError) as exc:
        found = _find(value, [], 0, max_depth) or f"$: not JSON ({_first_line(exc)})"
        raise UnstorableValueError(f"{what}: {found}") from None
    # Screens on the text at C speed; a walk in Python only to say where: a NUL is always
    # written as this escape (or it is a literal backslash-u0000: the walk tells), and the
    # number of brackets bounds the nesting from above.
    deep = text.count("[") + text.count("{") > max_depth and _nesting(data) > max_depth
    if deep or "\\u0000" in text:
        problem = _find(value, [], 0, max_depth)
        if problem is not None:
            raise UnstorableValueError(f"{what}: {problem}")
    if len(data) > max_bytes:
        raise ValueTooLargeError(
            f"{what}: {len(data)} bytes as JSON, over the limit of {max_bytes} bytes"
        )
    return JsonText(text)


def check_text(text: Any, what: str, max_bytes: int = MAX_KEY_BYTES) -> str:
    """``text`` if PostgreSQL ``text`` (and an index on it) can hold it as given, else
    :class:`UnstorableValueError` (:class:`ValueTooLargeError` over ``max_bytes`` bytes)."""
    if not isinstance(text, str):
        raise UnstorableValueError(f"{what}: must be text, not {type(text).__name__}")
    problem = _text_problem(text)
    if problem is not None:
        raise UnstorableValueError(f"{what}: {problem}")
    size = len(text) if text.isascii() else len(text.encode())
    if size > max_bytes:
        raise ValueTooLargeError(f"{what}: {size} bytes, over the limit of {max_bytes} bytes")
    return text


def check_note(requested_by: Any, reason: Any, label: str) -> None:
    """What an operator wrote for an audit row (who, and why: ``label`` names the reason in
    the error), refused — never altered — before any change if PostgreSQL text could not hold
    it: not text, NUL, a lone surrogate, over :data:`MAX_NOTE_BYTES`. ``reason`` may be None."""
    check_text(requested_by, "requested_by", MAX_NOTE_BYTES)
    if reason is not None:
        check_text(reason, label, MAX_NOTE_BYTES)


def clean_text(text: str, max_chars: int, *, keep_end: bool = False) -> str:
    """``text`` cut to ``max_chars`` characters (its start, or its end with ``keep_end``, as
    for a traceback) with each NUL and lone surrogate replaced by U+FFFD. Never refuses."""
    if len(text) > max_chars:
        text = text[len(text) - max_chars :] if keep_end else text[:max_chars]
    if "\x00" in text:
        text = text.replace("\x00", REPLACEMENT)
    if not text.isascii():
        text = _SURROGATE.sub(REPLACEMENT, text)
    return str(text)


# ------------------------------------------------------------------ finding what is wrong


def _find(value: Any, trail: list[str], depth: int, max_depth: int) -> str | None:
    """``"<path>: <problem>"`` for the first unstorable place in ``value``, or None."""
    if isinstance(value, str):
        problem = _text_problem(value)
        return None if problem is None else f"{_path(trail)}: {problem}"
    if value is None or isinstance(value, bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{_path(trail)}: {value!r} is not a JSON number"
    if isinstance(value, dict | list | tuple):
        if depth >= max_depth:
            return f"{_path(trail)}: nested deeper than {max_depth} levels"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict):
                name, problem = _key(key)
                if problem is not None:
                    return f"{_path(trail)}: key {_shown(name)}: {problem}"
                trail.append(f".{name}" if _IDENTIFIER.fullmatch(name) else f"[{_shown(name)}]")
            else:
                trail.append(f"[{key}]")
            found = _find(item, trail, depth + 1, max_depth)
            trail.pop()
            if found is not None:
                return found
        return None
    return f"{_path(trail)}: {type(value).__name__} is not a JSON type"


def _nesting(data: bytes) -> int:
    """How deep containers nest in JSON text ``data``, at C speed: escaped backslashes and
    quotes dropped, every other quote delimits a string; outside the strings, each bracket is
    +1 or -1, and the deepest point is the nesting."""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    steps = array("b", outside.translate(_BRACKET_STEPS, _NOT_BRACKETS))
    return max(accumulate(steps), default=0)


def _key(key: Any) -> tuple[str, str | None]:
    """A dict key as JSON writes it, and what makes it unstorable (None: nothing)."""
    if isinstance(key, str):
        return key, _text_problem(key)
    if isinstance(key, bool):
        return ("true" if key else "false"), None
    if isinstance(key, int):
        return int.__repr__(key), None
    if isinstance(key, float):
        problem = None if math.isfinite(key) else f"{key!r} is not a JSON number"
        return float.__repr__(key), problem
    if key is None:
        return "null", None
    return repr(key)[:40], f"a key of type {type(key).__name__} is not JSON"


def _text_problem(text: str) -> str | None:
    at = text.find("\x00")
    if at >= 0:
        return f"NUL character at offset {at}"
    if not text.isascii():
        found = _SURROGATE.search(text)
        if found is not None:
            return f"lone surrogate U+{ord(found.group()):04X} at offset {found.start()}"
    return None


def _shown(name: str) -> str:
    """A key quoted for a message: ASCII only, control characters and surrogates escaped."""
    return json.dumps(name if len(name) <= 40 else name[:40] + "…")


def _path(trail: list[str]) -> str:
    path = "$" + "".join(trail)
    if len(path) <= MAX_PATH_CHARS:
        return path
    half = MAX_PATH_CHARS // 2
    return f"{path[:half]}…{path[-half:]}"


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
