"""Named SQL queries, read once from ``queries.sql``.

A query starts at a ``-- name: <name>`` line and runs to the next such line (or fragment). A
fragment starts at a ``-- fragment: <name>(<param>)`` line: SQL several queries share (the
release of a finished task's dependents, say). A query uses one with a line
``-- use: <name>(<cte>)``, which is replaced by the fragment's SQL (its comment lines before
and after dropped) with ``{<param>}`` replaced by ``<cte>``. Queries are returned as bytes so
psycopg receives them verbatim; parameters are always passed separately.

Comments and layout are for this file only: a query is sent compacted (:func:`compact`: no
comments, one space where there was any run of whitespace, none after a comma or an opening or
before a closing parenthesis). psycopg caches its parse of a query's text (the ``%(name)s`` to
``$n`` conversion) only up to 4,096 bytes, and re-parses a longer one at every execution on
the client's CPU; the server parses fewer bytes too (docs/performance.md, "Submitting work"
and "Chain hop and CPU per task").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType

#: psycopg caches its parse of a statement's ``%(name)s`` placeholders only up to this many bytes
#: (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``) and parses a longer one again at every
#: execution, on the caller's CPU: a longer statement goes through :func:`numbered` instead.
PARSE_CACHED_BYTES = 4096
_PLACEHOLDER = re.compile(rb"%\(([a-z_][a-z0-9_]*)\)s|%%")

_HEAD_LINE = re.compile(
    r"^--\s*(name|fragment):\s*([a-z_][a-z0-9_]*)(?:\(([a-z_]+)\))?\s*$", re.MULTILINE
)
#: ``-- use: fragment(cte)``; inside a fragment the argument may be its own ``{param}``.
_USE_LINE = re.compile(
    r"^--\s*use:\s*([a-z_][a-z0-9_]*)\(([a-z_][a-z0-9_]*|\{[a-z_]+\})\)\s*$", re.MULTILINE
)


def parse(text: str, *, compacted: bool = True) -> Mapping[str, bytes]:
    """Split a SQL file into its named queries, fragments expanded; each :func:`compact` (as
    sent) unless ``compacted`` is false (as written, comments inside the SQL kept).

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
        {
            name: (compact(sql) if compacted else sql).encode()
            for name, sql in ((name, _USE_LINE.sub(expand, body)) for name, body in bodies.items())
        }
    )


def compact(sql: str) -> str:
    """``sql`` as sent: ``--`` comments dropped, each run of whitespace one space, none at
    either end, none beside a comma or a parenthesis, none around a comparison (``=``,
    ``<>``, ``<=``, ...), a ``+`` or a ``-`` between operands (a name, a number, a
    parenthesis, a quote or a placeholder: the operator cannot run into another, nor a ``-``
    into a comment, then). Text inside single quotes is kept
    as it is (the file quotes nothing else: no dollar quotes, no quoted identifiers)."""
    bare = _COMMENT.sub(lambda m: m.group(1) or " ", sql)
    pieces = _QUOTED.split(bare)  # odd pieces are quoted texts, left alone
    for k in range(0, len(pieces), 2):
        piece = _NEEDLESS_SPACE.sub("", _SPACES.sub(" ", pieces[k]))
        pieces[k] = _SPACED_COMPARISON.sub(r"\1", piece)
    return "".join(pieces).strip()


#: A quoted text (kept, with its '' escapes) or a comment (dropped).
_COMMENT = re.compile(r"('(?:[^']|'')*')|--[^\n]*")
_QUOTED = re.compile(r"('(?:[^']|'')*')")
_SPACES = re.compile(r"\s+")
#: (a parenthesis or a comma is a token of its own: a space beside one separates nothing)
_NEEDLESS_SPACE = re.compile(r" (?=[(),])|(?<=[(),]) ")
#: (a piece's start or end borders a quoted text: an operand too)
_SPACED_COMPARISON = re.compile(r"(?:(?<=[\w)])|^) ?([<>=]+|[-+]) ?(?=[\w(%]|$)")


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
    """The package's named queries as sent (parsed on first use, then cached)."""
    return parse(_text())


@functools.cache
def readable() -> Mapping[str, bytes]:
    """The package's named queries as written (not compacted), for reading: a test that
    checks what a query says, a person."""
    return parse(_text(), compacted=False)


def _text() -> str:
    return (resources.files("flowforge.store") / "queries.sql").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=32)
def numbered(query: bytes) -> tuple[bytes, tuple[str, ...]]:
    """``query`` with PostgreSQL's own placeholders: each ``%(name)s`` as ``$n`` (one number per
    name, in the order each first appears) and ``%%`` as ``%``; the names in that order. For a
    statement over :data:`PARSE_CACHED_BYTES`, sent through psycopg's ``RawCursor`` with its
    parameters in that order (``store/db.py`` ``run_statement``): converted once per process,
    not at every execution."""
    order: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        if match.group(0) == b"%%":
            return b"%"
        name = match.group(1).decode()
        if name not in order:
            order.append(name)
        return b"$%d" % (order.index(name) + 1)

    return _PLACEHOLDER.sub(number, query), tuple(order)
