"""Fixtures for real PostgreSQL (and, in later layers, RabbitMQ).

``FLOWFORGE_TEST_DATABASE_URL`` names a server this suite may create databases on; without it
a private instance is started under ``.services/``. Each session gets its own database,
migrated once; each test starts from empty tables. With ``CI=true`` a missing service fails
the test instead of skipping it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from flowforge.config import DatabaseConfig
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from flowforge.store.repository import Repository

REPO_ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"

TABLES = (
    "counters, processes, requeue_audit, idempotency_keys, outbox, task_attempts, task_edges, task_runs, "
    "workflow_runs, workflow_definitions"
)


def _unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(f"required service missing in CI: {message}")
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A PostgreSQL server on which this session may create a database."""
    url = os.environ.get("FLOWFORGE_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from flowforge.testing.services import PrivatePostgres, ServiceUnavailable

    pg = PrivatePostgres(REPO_ROOT / ".services", port=55432)
    try:
        pg.start()
    except ServiceUnavailable as exc:
        _unavailable(str(exc))
    yield pg.url


@pytest.fixture(scope="session")
def database_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, migrated database for this test session (dropped at the end)."""
    name = f"flowforge_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = psycopg.connect(pg_server_url, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL at {pg_server_url} is unreachable: {exc}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # name is generated above, not input
    params = conninfo_to_dict(pg_server_url)
    params["dbname"] = name
    url = make_conninfo(**params)
    migrate(url)
    yield url
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def clean_database_url(database_url: str) -> str:
    """The session database with every FlowForge table emptied."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    return database_url


@pytest.fixture
def db(clean_database_url: str) -> Iterator[Database]:
    database = Database(DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=16))
    database.open()
    yield database
    database.close()


@pytest.fixture
def repo(db: Database) -> Repository:
    return Repository(db, rand=lambda: 0.5)


@pytest.fixture
def sql(clean_database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain autocommit connection for test assertions and setup."""
    with psycopg.connect(clean_database_url, autocommit=True) as conn:
        yield conn
