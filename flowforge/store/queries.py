"""Named SQL queries, read once from ``queries.sql``.

A query starts at a ``-- name: <name>`` line and runs to the next one. Queries are returned as
bytes so psycopg receives them verbatim; parameters are always passed separately.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType

_NAME_LINE = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse(text: str) -> Mapping[str, bytes]:
    """Split a SQL file into its named queries; duplicate names are a programming error."""
    parts = _NAME_LINE.split(text)
    queries: dict[str, bytes] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"duplicate query name {name!r}")
        queries[name] = body.strip().encode()
    return MappingProxyType(queries)


@functools.cache
def load() -> Mapping[str, bytes]:
    """The package's named queries (parsed on first use, then cached)."""
    return parse((resources.files("flowforge.store") / "queries.sql").read_text(encoding="utf-8"))
