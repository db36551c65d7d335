"""Versioned schema migrations: ``NNNN_name.sql`` files applied in order, each once.

Safe to run twice (applied versions are recorded) and by several processes at once (a
session-level advisory lock serialises them). A recorded migration whose file changed, or a
database that is ahead of this code, is refused rather than guessed at.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from flowforge.errors import DatabaseConfigError, DatabaseUnavailableError, MigrationError
from flowforge.store.db import connect_once
from flowforge.store.pgerrors import translate

logger = logging.getLogger(__name__)

#: Arbitrary but fixed: the advisory lock key every migrating process agrees on.
MIGRATION_LOCK_KEY = 0x466C6F77  # "Flow"
_FILE_PATTERN = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS flowforge_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def available_migrations() -> tuple[Migration, ...]:
    """The migrations shipped with this package, in version order."""
    folder = resources.files("flowforge.store") / "migrations"
    found = []
    for entry in folder.iterdir():
        match = _FILE_PATTERN.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return tuple(sorted(found, key=lambda m: m.version))


def migrate(url: str) -> list[int]:
    """Bring the database at ``url`` to the newest schema; return the versions applied now."""
    migrations = available_migrations()
    with connect_once(url) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        try:
            return _apply_pending(conn, migrations)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))


def _apply_pending(
    conn: psycopg.Connection[tuple[object, ...]], migrations: tuple[Migration, ...]
) -> list[int]:
    conn.execute(_CREATE_TABLE)
    rows = conn.execute("SELECT version, checksum FROM flowforge_migrations").fetchall()
    applied = {int(str(v)): str(c) for v, c in rows}
    known = {m.version: m for m in migrations}
    ahead = sorted(set(applied) - set(known))
    if ahead:
        raise MigrationError(
            f"the database has schema version {ahead[-1]}, newer than this FlowForge knows"
        )
    for version, checksum in applied.items():
        if known[version].checksum != checksum:
            raise MigrationError(f"migration {version:04d} changed after it was applied")
    done = []
    for migration in migrations:
        if migration.version in applied:
            continue
        try:
            with conn.transaction():
                conn.execute(migration.sql.encode())
                conn.execute(
                    "INSERT INTO flowforge_migrations (version, name, checksum) "
                    "VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )
        except psycopg.Error as exc:  # say which migration failed (an outage stays an outage)
            error = translate(exc)
            if isinstance(error, DatabaseUnavailableError | DatabaseConfigError):
                raise error from exc
            raise MigrationError(
                f"migration {migration.version:04d}_{migration.name} failed: {error}"
            ) from exc
        logger.info(
            "applied migration %04d_%s",
            migration.version,
            migration.name,
            extra={"action": "migration_applied"},
        )
        done.append(migration.version)
    return done
