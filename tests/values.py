"""Generated JSON-ish values for property tests, and an oracle of what PostgreSQL can store.

The strategies mix what PostgreSQL refuses (NaN, ±Infinity, NUL, lone surrogates in strings and
keys, nesting over the bound, big strings, non-JSON types) with ordinary values, so a property
meets both sides. The oracle is written independently of :mod:`flowforge.domain.values`: it
states the rules, the code under test implements them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st

from flowforge.domain.values import MAX_DEPTH

#: Characters PostgreSQL text and jsonb refuse, and look-alikes they accept.
AWKWARD = ["\x00", "\ud800", "\udbff", "\udc00", "\udfff", "\\u0000", "\\", "é", "😀", "\n", "a"]

texts = st.one_of(
    st.text(max_size=12),
    st.lists(st.sampled_from(AWKWARD), max_size=6).map("".join),
    st.builds(lambda n: "x" * n, st.integers(0, 3000)),  # big strings, against size bounds
)
keys = st.one_of(texts, st.integers(-5, 5), st.booleans(), st.none())
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)


def nested(depth: int, leaf: Any = 1) -> Any:
    """``depth`` containers, lists and objects alternating, around ``leaf``."""
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"d": value}
    return value


json_values = st.one_of(
    st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(keys, inner, max_size=4),
        ),
        max_leaves=16,
    ),
    st.builds(nested, st.integers(MAX_DEPTH - 2, MAX_DEPTH + 2), scalars),
)
#: Values a handler may return that are not JSON at all.
non_json = st.one_of(st.sets(st.integers(), max_size=2), st.binary(max_size=4), st.just(object()))


def text_ok(text: str) -> bool:
    """PostgreSQL text can hold it: no NUL, no surrogate code point."""
    return not any(c == "\x00" or 0xD800 <= ord(c) <= 0xDFFF for c in text)


def storable(value: Any, depth: int = 0) -> bool:
    """The oracle: JSON that jsonb can hold as given, nested at most MAX_DEPTH deep."""
    if isinstance(value, str):
        return text_ok(value)
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return depth < MAX_DEPTH and all(storable(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return depth < MAX_DEPTH and all(
            (text_ok(k) if isinstance(k, str) else k is None or isinstance(k, bool | int))
            and storable(v, depth + 1)
            for k, v in value.items()
        )
    return False


def canonical(value: Any) -> Any:
    """What a storable value reads back as (tuples as lists, non-text keys as text)."""
    return json.loads(json.dumps(value))


def size(value: Any) -> int:
    """Bytes of a storable value's compact JSON, as bounds count them."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def cleaned(text: str) -> str:
    """Free text as it must be stored: NUL and surrogates replaced by U+FFFD."""
    return "".join(c if text_ok(c) else "\ufffd" for c in text)


def same(stored: Any, expected: Any) -> bool:
    """``stored`` (read back from jsonb) is ``canonical(expected)``. jsonb keeps numbers as
    decimals and writes them without exponent, so a float may come back as an int of the same
    decimal value: floats compare by value, as ``float(stored)``."""
    if isinstance(expected, float):
        return isinstance(stored, int | float) and float(stored) == expected
    if isinstance(expected, list):
        return (
            isinstance(stored, list)
            and len(stored) == len(expected)
            and all(same(s, e) for s, e in zip(stored, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(stored, dict)
            and stored.keys() == expected.keys()
            and all(same(stored[k], v) for k, v in expected.items())
        )
    return type(stored) is type(expected) and stored == expected
