"""Named SQL queries and shipped migrations (no database needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import flowforge.store.repository as repository_module
from flowforge.store import queries
from flowforge.store.migrate import available_migrations

REPOSITORY_SOURCE = Path(repository_module.__file__).read_text(encoding="utf-8")
DIRECT_KEY = re.compile(r"""\b_?q\[\s*["']([a-z_][a-z0-9_]*)["']\s*\]""")
#: Queries the repository selects by name through a variable (self._q[lock_query], ...).
INDIRECT_NAMES = (
    "lock_failed",
    "apply_routing",
    "lock_expired_leases",
    "apply_reap",
    "purge_runs",
    "purge_outbox",
    "purge_keys",
)
PLACEHOLDER = re.compile(r"%\((?P<name>[a-z_][a-z0-9_]*)\)s")


def test_parse_splits_named_queries_and_drops_the_header() -> None:
    text = (
        "-- a header comment that belongs to no query\n"
        "-- name: first\nSELECT 1;\n\n"
        "--name:second  \n-- comment inside\nSELECT %(x)s;\n"
    )
    parsed = queries.parse(text)
    assert list(parsed) == ["first", "second"]
    assert parsed["first"] == b"SELECT 1;"
    assert parsed["second"] == b"-- comment inside\nSELECT %(x)s;"


def test_parse_returns_bytes_in_read_only_mapping() -> None:
    parsed = queries.parse("-- name: q\nSELECT 1;\n")
    assert isinstance(parsed["q"], bytes)
    with pytest.raises(TypeError):
        parsed["other"] = b""  # type: ignore[index]


def test_parse_refuses_duplicate_names() -> None:
    with pytest.raises(ValueError, match="duplicate query name 'q'"):
        queries.parse("-- name: q\nSELECT 1;\n-- name: q\nSELECT 2;\n")


def test_parse_of_text_without_names_is_empty() -> None:
    assert dict(queries.parse("SELECT 1;\n")) == {}


def test_load_is_cached() -> None:
    assert queries.load() is queries.load()


def test_load_has_no_empty_query() -> None:
    empty = [name for name, body in queries.load().items() if not body.strip()]
    assert empty == []


def referenced_names() -> set[str]:
    return set(DIRECT_KEY.findall(REPOSITORY_SOURCE))


def test_repository_references_queries_by_name() -> None:
    names = referenced_names()
    assert len(names) >= 20  # the regex really finds the repository's lookups
    assert {"claim", "finish", "notify_scheduler"} <= names


def test_every_query_the_repository_names_exists() -> None:
    missing = sorted(referenced_names() - set(queries.load()))
    assert missing == []


def test_every_indirectly_named_query_is_in_the_source_and_exists() -> None:
    for name in INDIRECT_NAMES:
        assert f'"{name}"' in REPOSITORY_SOURCE, name
    assert sorted(set(INDIRECT_NAMES) - set(queries.load())) == []


def test_no_query_is_unused_by_the_repository() -> None:
    used = referenced_names() | set(INDIRECT_NAMES)
    assert sorted(set(queries.load()) - used) == []


@pytest.mark.parametrize("name", sorted(queries.load()))
def test_query_uses_only_named_placeholders(name: str) -> None:
    text = queries.load()[name].decode()
    stray = PLACEHOLDER.sub("", text).replace("%%", "")
    assert "%" not in stray, f"{name}: Python %-formatting other than %(name)s: {text!r}"


def test_placeholder_guard_catches_string_building() -> None:
    bad = "SELECT * FROM t WHERE id = %s AND name = '%d'"
    assert "%" in PLACEHOLDER.sub("", bad)


def test_available_migrations_are_numbered_from_one_without_gaps() -> None:
    migrations = available_migrations()
    assert migrations, "no migration shipped"
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))


def test_available_migrations_have_names_sql_and_distinct_checksums() -> None:
    migrations = available_migrations()
    assert migrations[0].name == "initial"
    for migration in migrations:
        assert re.fullmatch(r"[a-z0-9_]+", migration.name)
        assert "CREATE" in migration.sql.upper()
        assert len(migration.checksum) == 64
    assert len({m.checksum for m in migrations}) == len(migrations)
