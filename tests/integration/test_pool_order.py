"""The pool hands out the connection returned last (store/db.py ``LifoPool``).

psycopg_pool hands its connections out in turn; a process using one at a time then spreads its
statements over every connection the pool opened, each a session with its own caches and its
own custom plans after a drain. Read from the server: the backend that serves each statement.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flowforge.store.db import Database
from tests.helpers import pool_of

pytestmark = pytest.mark.integration


@pytest.fixture
def two_connections(clean_database_url: str) -> Iterator[Database]:
    with pool_of(clean_database_url, 2, "pool-order") as db:
        yield db


def backend(db: Database) -> int:
    (row,) = db.execute(b"SELECT pg_backend_pid() AS pid")
    return int(row["pid"])


def test_one_caller_at_a_time_is_served_by_one_connection(two_connections: Database) -> None:
    db = two_connections
    with db.transaction() as first, db.transaction() as second:  # both connections open
        first.execute("SELECT 1")
        second.execute("SELECT 1")
    served = {backend(db) for _ in range(20)}
    assert len(served) == 1


def test_the_connection_returned_last_is_handed_out_first(two_connections: Database) -> None:
    db = two_connections
    with db.transaction() as outer:
        outer.execute("SELECT pg_backend_pid() AS pid")
        held = outer.fetchone()
        assert held is not None
        with db.transaction() as inner:  # the other connection, returned first
            inner.execute("SELECT pg_backend_pid() AS pid")
            other = inner.fetchone()
            assert other is not None
    assert other["pid"] != held["pid"]
    assert backend(db) == held["pid"]  # returned last: the outer one
