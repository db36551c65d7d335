"""`flowforge migrate` on real PostgreSQL: fresh install, re-run, concurrent runs, refusals."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import psycopg
import pytest

from flowforge.errors import MigrationError
from flowforge.store.migrate import available_migrations, migrate
from tests.harness.resources import create_database, drop_database

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_database_url(pg_server_url: str) -> Iterator[str]:
    """A brand-new empty database, dropped after the test."""
    url = create_database(pg_server_url, "flowforge_migrate")
    yield url
    drop_database(pg_server_url, url)


def current_version(url: str) -> int | None:
    """The newest applied version, or None on a database FlowForge never migrated."""
    with psycopg.connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('flowforge_migrations') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return None
        row = conn.execute("SELECT max(version) FROM flowforge_migrations").fetchone()
        return int(str(row[0])) if row and row[0] is not None else None


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {r[0] for r in rows}


def test_migrate_on_an_empty_database_creates_the_schema_then_is_a_no_op(
    empty_database_url: str,
) -> None:
    newest = available_migrations()[-1].version
    assert current_version(empty_database_url) is None
    assert migrate(empty_database_url) == [m.version for m in available_migrations()]
    assert {"workflow_runs", "task_runs", "outbox", "flowforge_migrations"} <= _tables(
        empty_database_url
    )
    assert current_version(empty_database_url) == newest
    assert migrate(empty_database_url) == []
    with psycopg.connect(empty_database_url) as conn:
        count = conn.execute("SELECT count(*) FROM flowforge_migrations").fetchone()
    assert count == (len(available_migrations()),)


def _migrate_in_child(
    url: str, start: multiprocessing.synchronize.Event, out: multiprocessing.Queue
) -> None:  # type: ignore[type-arg]
    start.wait(10)
    try:
        out.put(("ok", migrate(url)))
    except Exception as exc:
        out.put(("error", repr(exc)))


def test_two_processes_migrating_at_once_apply_each_migration_once(
    empty_database_url: str,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_migrate_in_child, args=(empty_database_url, start, out))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(status == "ok" for status, _ in results), results
    applied = [v for _, versions in results for v in versions]
    assert sorted(applied) == [m.version for m in available_migrations()]
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT version FROM flowforge_migrations ORDER BY 1").fetchall()
    assert [r[0] for r in rows] == [m.version for m in available_migrations()]


def test_a_database_ahead_of_the_code_is_refused(empty_database_url: str) -> None:
    migrate(empty_database_url)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO flowforge_migrations (version, name, checksum)"
            " VALUES (9999, 'future', 'x')"
        )
    with pytest.raises(MigrationError, match="newer"):
        migrate(empty_database_url)


def test_an_applied_migration_that_changed_is_refused(empty_database_url: str) -> None:
    migrate(empty_database_url)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("UPDATE flowforge_migrations SET checksum = 'tampered' WHERE version = 1")
    with pytest.raises(MigrationError, match="changed"):
        migrate(empty_database_url)
