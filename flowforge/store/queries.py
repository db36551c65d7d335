"""Named SQL queries, read once from ``queries.sql``.

A query starts at a ``-- name: <name>`` line and runs to the next such line (or fragment). A
fragment starts at a ``-- fragment: <name>(<param>)`` line: SQL several queries share (the
release of a finished task's dependents, say). A query uses one with a line
``-- use: <name>(<cte>)``, which is replaced by the fragment's SQL (its comment lines before
and after dropped) with ``{<param>}`` replaced by ``<cte>``. Queries are returned as bytes so
psycopg receives them verbatim; parameters are always passed separately.

The comment lines a query starts with document it here and are not sent: psycopg caches its
parse of a query's text only up to 4,096 bytes, and the trigger's ``insert_tasks`` was over
that by its documentation alone (docs/performance.md, "Submitting work"). Comments inside the
SQL are kept.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType

_HEAD_LINE = re.compile(
    r"^--\s*(name|fragment):\s*([a-z_][a-z0-9_]*)(?:\(([a-z_]+)\))?\s*$", re.MULTILINE
)
#: ``-- use: fragment(cte)``; inside a fragment the argument may be its own ``{param}``.
_USE_LINE = re.compile(
    r"^--\s*use:\s*([a-z_][a-z0-9_]*)\(([a-z_][a-z0-9_]*|\{[a-z_]+\})\)\s*$", re.MULTILINE
)


def parse(text: str) -> Mapping[str, bytes]:
    """Split a SQL file into its named queries, fragments expanded.

    A duplicate name, a fragment without its parameter, or a use of an unknown fragment is a
    programming error (ValueError).
    """
    parts = _HEAD_LINE.split(text)
    bodies: dict[str, str] = {}
    fragments: dict[str, tuple[str, str]] = {}
    for kind, name, param, body in zip(
        parts[1::4], parts[2::4], parts[3::4], parts[4::4], strict=True
    ):
        if name in bodies or name in fragments:
            raise ValueError(f"duplicate query or fragment name {name!r}")
        if kind == "fragment":
            if not param:
                raise ValueError(f"fragment {name!r} names no parameter")
            fragments[name] = (param, _without_outer_comments(body))
        else:
            bodies[name] = _without_leading_comments(body)

    def expand(use: re.Match[str], outer: tuple[str, ...] = ()) -> str:
        fragment, cte = use.group(1), use.group(2)
        if fragment not in fragments:
            raise ValueError(f"use of unknown fragment {fragment!r}")
        if fragment in outer:
            raise ValueError(f"fragment {fragment!r} uses itself")
        param, sql = fragments[fragment]
        # a fragment may use another: its uses are expanded once its parameter is in place
        inner = (*outer, fragment)
        return _USE_LINE.sub(lambda m: expand(m, inner), sql.replace("{" + param + "}", cte))

    return MappingProxyType(
        {name: _USE_LINE.sub(expand, body).encode() for name, body in bodies.items()}
    )


def _without_leading_comments(body: str) -> str:
    """A query's SQL without the comment lines that document it (before its first SQL line)."""
    lines = body.strip().splitlines()
    while lines and _prose(lines[0]):
        lines.pop(0)
    return "\n".join(lines)


def _without_outer_comments(body: str) -> str:
    """The SQL of a fragment: what documents it (before) and the next section's title (after)
    stay out of every query that uses it."""
    lines = body.strip().splitlines()
    while lines and _prose(lines[0]):
        lines.pop(0)
    while lines and _prose(lines[-1]):
        lines.pop()
    return "\n".join(lines)


def _prose(line: str) -> bool:
    """A blank or comment line that is not a ``-- use:`` (a fragment may end with one)."""
    return not line.strip() or (line.lstrip().startswith("--") and not _USE_LINE.match(line))


@functools.cache
def load() -> Mapping[str, bytes]:
    """The package's named queries (parsed on first use, then cached)."""
    return parse((resources.files("flowforge.store") / "queries.sql").read_text(encoding="utf-8"))
