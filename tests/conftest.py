"""Fixtures for real PostgreSQL (and, in later layers, RabbitMQ).

``FLOWFORGE_TEST_DATABASE_URL`` names a server this suite may create databases on; without it
a private instance is started under ``.services/``. Each session gets its own database,
migrated once; each test starts from empty tables. With ``CI=true`` a missing service fails
the test instead of skipping it.
"""

# ruff: noqa: E402  (bytecode is switched on before anything else is imported)
from __future__ import annotations

import sys

# This machine sets PYTHONDONTWRITEBYTECODE: without a cache pytest parses, rewrites and compiles
# the asserts of every test module anew in every run and in each xdist worker (two thirds of the
# fast loop's collection: docs/development.md, "The fast loop"), and every role process and CLI
# the tests start compiles FlowForge from source. Written here, the caches (__pycache__,
# git-ignored; pytest's own are tagged `-pytest-X.Y`) are checked against their sources' mtime
# and size on every import, as always.
sys.dont_write_bytecode = False

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import psycopg.sql
import pytest
from psycopg.rows import tuple_row

from flowforge.config import DatabaseConfig
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from tests import shared_cluster
from tests.e2e import Stack
from tests.harness.cluster import PrivateRabbitCluster
from tests.harness.resources import create_database, drop_database
from tests.store import Store

IN_CI = os.environ.get("CI", "").lower() == "true"

TABLES = (
    "test_executions, counters, processes, purge_audit, requeue_audit, idempotency_keys, outbox, "
    "schedule_fires, schedules, event_deliveries, events, rerun_audit, task_audit, "
    "gate_audit, pauses, breaker_transitions, breaker_transitions_purged, "
    "breaker_transitions_folded, breakers, "
    "task_attempts, task_edges, task_runs, workflow_runs, workflow_definitions"
)


#: Handler executions recorded by tests/e2e_handlers.py: tests count executions here.
TEST_EXECUTIONS_DDL = """
CREATE TABLE test_executions (
    id          bigserial   PRIMARY KEY,
    task_run_id uuid        NOT NULL,
    run_id      uuid        NOT NULL,
    task        text        NOT NULL,
    handler     text        NOT NULL,
    attempt     integer     NOT NULL,
    pid         integer     NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
)"""


@pytest.fixture(autouse=True)
def _logging_enabled() -> Iterator[None]:
    """Every test starts with logging enabled: the CLI's ``main()`` run in this process silences
    it without ``-v`` (``logging.disable``), which would leave a later test's ``caplog`` empty
    — in whatever order pytest-xdist hands tests to a worker."""
    yield
    logging.disable(logging.NOTSET)


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
    from tests.harness import services

    pg = services.PrivatePostgres(services.DEFAULT_BASE_DIR, port=services.DEFAULT_PG_PORT)
    try:
        pg.start()
    except services.ServiceUnavailable as exc:
        _unavailable(str(exc))
    yield pg.url


@pytest.fixture(scope="session")
def database_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, migrated database for this test session (dropped at the end)."""
    try:
        url = create_database(pg_server_url, "flowforge_test")
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL at {pg_server_url} is unreachable: {exc}")
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TEST_EXECUTIONS_DDL)
        # A commit returns before its WAL reaches the disk (every session of this database,
        # role processes too): what a commit makes visible, and when, is unchanged; only a
        # crash of the server could lose the last commits, and no test here crashes the
        # shared server (tests/chaos do that to private instances, which keep the default).
        conn.execute(
            psycopg.sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(
                psycopg.sql.Identifier(str(conn.info.dbname))
            )
        )
    yield url
    drop_database(pg_server_url, url)


@pytest.fixture(scope="session")
def broker_url() -> Iterator[str]:
    """A RabbitMQ this session may declare queues on (each test uses its own queue)."""
    url = os.environ.get("FLOWFORGE_TEST_BROKER_URL")
    if url:
        yield url
        return
    from tests.harness import services

    rabbit = services.PrivateRabbitMQ(
        services.DEFAULT_BASE_DIR,
        services.DEFAULT_AMQP_PORT,
        services.DEFAULT_DIST_PORT,
        services.DEFAULT_NODE_NAME,
    )
    try:
        rabbit.start()
    except services.ServiceUnavailable as exc:
        _unavailable(str(exc))
    yield rabbit.url


@pytest.fixture
def stack(tmp_path: Path, clean_database_url: str, broker_url: str) -> Iterator[Stack]:
    """Role processes for one test against the session database and broker, on a fresh queue."""
    running = Stack(tmp_path, clean_database_url, broker_url)
    yield running
    running.stop_all()
    running.delete_queue()


class _Emptier:
    """Empties every FlowForge table and restarts their sequences in one round trip, on a
    connection kept for the session (reopened if it broke)."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._conn = psycopg.connect(database_url, autocommit=True)
        names = [table.strip() for table in TABLES.split(",")]
        # the sequences owned by columns of those tables: what RESTART IDENTITY would reset
        sequences = [
            str(row[0])
            for row in self._conn.execute(
                "SELECT s.oid::regclass::text FROM pg_class s"
                " JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid"
                " JOIN pg_class t ON t.oid = d.refobjid"
                " WHERE s.relkind = 'S' AND d.deptype IN ('a', 'i') AND t.relname = ANY(%s)",
                (names,),
            ).fetchall()
        ]
        # one simple query: its statements run as one transaction (children first)
        self._statement = psycopg.sql.SQL("; ").join(
            [psycopg.sql.SQL("DELETE FROM {}").format(psycopg.sql.Identifier(n)) for n in names]
            + [
                psycopg.sql.SQL("SELECT setval({}::regclass, 1, false)").format(
                    psycopg.sql.Literal(seq)
                )
                for seq in sorted(sequences)
            ]
        )

    def empty(self) -> None:
        if self._conn.closed:
            self._conn = psycopg.connect(self._url, autocommit=True)
        self._conn.execute(self._statement, prepare=False)

    def close(self) -> None:
        self._conn.close()


@pytest.fixture(scope="session")
def _emptier(database_url: str) -> Iterator[_Emptier]:
    emptier = _Emptier(database_url)
    yield emptier
    emptier.close()


@pytest.fixture
def clean_database_url(database_url: str, _emptier: _Emptier) -> str:
    """The session database with every FlowForge table emptied and its sequences restarted.

    ``DELETE`` (children first), not ``TRUNCATE``: on these small tables it takes a few
    milliseconds where TRUNCATE of twelve tables takes 0.1-0.3 s (new files for every table
    and index), and this runs before most integration tests. The result is the same to a test
    (no rows, ids from 1) except for dead tuples, which only a test reading query plans could
    notice: those take :func:`truncated_database_url`.
    """
    _emptier.empty()
    return database_url


@pytest.fixture
def truncated_database_url(database_url: str) -> str:
    """The session database truncated: emptied without dead tuples (for query plans)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    return database_url


@pytest.fixture(scope="session")
def _session_database(database_url: str) -> Iterator[Database]:
    database = Database(DatabaseConfig(url=database_url, pool_min=1, pool_max=16))
    database.open()
    yield database
    database.close()


@pytest.fixture
def db(clean_database_url: str, _session_database: Database) -> Iterator[Database]:
    """The session database's pool, kept open across tests, on emptied tables.

    Opening a pool per test cost three new server sessions (``open``'s direct check, the
    pool's first connection and the one it adds for the first request made before that one
    is ready): each a backend fork and cold catalog caches on the server (figures:
    docs/development.md, "The fast loop's cost"). Nothing the store does outlives a
    transaction on a pooled connection (its locks are ``pg_advisory_xact_lock``; ``LISTEN``
    and the migration lock take connections of their own), and the pool discards a
    connection that broke, so a test sees what a fresh pool would show it. A test that
    closed it (a role's ``shutdown`` closes the database it was given) leaves it reopened for
    the next.
    """
    yield _session_database
    _session_database.open()  # a no-op unless this test closed it


@pytest.fixture
def repo(db: Database) -> Store:
    return Store(db, rand=lambda: 0.5)


class _SqlConnection:
    """One autocommit connection kept for the session: :func:`sql`'s (reopened if it broke)."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def get(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self._url, autocommit=True)
        return self._conn

    def settle(self) -> None:
        """After a test: no transaction left open (its locks would block the next test's
        emptying) and nothing the test SET kept for the next; a connection left in any other
        state than idle, or changed, is closed and the next test gets a new one."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        if not (idle and conn.autocommit and not conn.read_only and conn.row_factory is tuple_row):
            conn.close()
            return
        conn.execute("RESET ALL; UNLISTEN *; SELECT pg_advisory_unlock_all()", prepare=False)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


@pytest.fixture(scope="session")
def _sql_connection(database_url: str) -> Iterator[_SqlConnection]:
    kept = _SqlConnection(database_url)
    yield kept
    kept.close()


@pytest.fixture
def sql(
    clean_database_url: str, _sql_connection: _SqlConnection
) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain autocommit connection for test assertions and setup: one per session, settled
    after every test (:meth:`_SqlConnection.settle`) — a new server session per test cost
    a backend fork and cold catalog caches, for a connection tests use as a fresh one."""
    yield _sql_connection.get()
    _sql_connection.settle()


# ------------------------------------------------------------------ the shared RabbitMQ cluster

_CLUSTER = shared_cluster.SharedCluster()


@pytest.fixture
def rabbit_cluster() -> PrivateRabbitCluster:
    """The private 3-node RabbitMQ cluster the tests asking for it share
    (tests/shared_cluster.py): booted by the first, stopped after the last of them."""
    return _CLUSTER.get()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared cluster's users run one after another (it boots once)."""
    items[:] = shared_cluster.group_users(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last of a run of the cluster's users (and its fixtures' teardown), stop it."""
    try:
        return (yield)
    finally:
        if shared_cluster.last_user(item, nextitem):
            _CLUSTER.stop()


def pytest_sessionfinish() -> None:
    """A run cut short still stops the cluster."""
    _CLUSTER.stop()
