"""The private primary + synchronous replica harness: streaming, failover, no lost commits.

One pair per module on free ports in a fresh temporary directory, stopped at the end even on
failure. Each test starts from a healthy pair (node 0 primary, node 1 sync standby); a test
that failed over leaves a pair that the next ``start()`` rebuilds (about 2 s). The machine's
shared PostgreSQL and the dev services are never contacted.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg_pool import ConnectionPool, PoolTimeout

from tests.chaos.support import unavailable
from tests.harness.replication import STANDBY_NAME, PrivateReplicatedPostgres
from tests.harness.resources import free_ports
from tests.harness.services import ServiceError, ServiceUnavailable
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROBE_DDL = "CREATE TABLE IF NOT EXISTS failover_probe (marker text PRIMARY KEY)"
#: Commits the writer must have acknowledged before the primary is killed under it.
ACKED_BEFORE_KILL = 50
WRITER_MAX_COMMITS = 100_000  # bound on the writer loop if the kill never reaches it
RECOVERY_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def replicated() -> Iterator[PrivateReplicatedPostgres]:
    """The module's pair (not started yet); both nodes stopped and files removed at the end."""
    base_dir = Path(tempfile.mkdtemp(prefix="ff-repl-"))
    base_dir.chmod(0o755)  # the postgres account must be able to traverse it
    primary_port, replica_port = free_ports(2)
    pair = PrivateReplicatedPostgres(base_dir, primary_port, replica_port)
    try:
        yield pair
    finally:
        try:
            pair.stop()
        finally:
            shutil.rmtree(base_dir, ignore_errors=True)


@pytest.fixture
def pair(replicated: PrivateReplicatedPostgres) -> PrivateReplicatedPostgres:
    """A healthy pair: node 0 read-write, node 1 streaming with sync_state 'sync'."""
    try:
        started = time.monotonic()
        replicated.start()
        print(f"pair ready in {time.monotonic() - started:.2f} s")
    except ServiceUnavailable as exc:
        unavailable(str(exc))
    with psycopg.connect(replicated.url, autocommit=True) as conn:
        conn.execute(PROBE_DDL)
    return replicated


def _server_port(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT inet_server_port()").fetchone()
    assert row is not None
    return int(row[0])


def _markers(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {str(r[0]) for r in conn.execute("SELECT marker FROM failover_probe").fetchall()}


def _insert(url: str, marker: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO failover_probe (marker) VALUES (%s)", (marker,))


class _Writer(threading.Thread):
    """Commits one row at a time through ``url`` until its connection breaks; records each
    marker only after its commit was acknowledged."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.acked: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        prefix = uuid.uuid4().hex[:8]
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                for n in range(WRITER_MAX_COMMITS):
                    marker = f"{prefix}-{n}"
                    conn.execute("INSERT INTO failover_probe (marker) VALUES (%s)", (marker,))
                    self.acked.append(marker)
        except BaseException as exc:
            self.error = exc


def test_replica_streams_synchronously(pair: PrivateReplicatedPostgres) -> None:
    with psycopg.connect(pair.admin_url(0), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, state, sync_state FROM pg_stat_replication"
        ).fetchall()
        sync_names = conn.execute("SHOW synchronous_standby_names").fetchone()
        sync_commit = conn.execute("SHOW synchronous_commit").fetchone()
        slots = conn.execute(
            "SELECT slot_name, active FROM pg_replication_slots WHERE slot_type = 'physical'"
        ).fetchall()
    assert rows == [(STANDBY_NAME, "streaming", "sync")]
    assert sync_names == (STANDBY_NAME,)
    assert sync_commit == ("on",)
    assert slots == [("ff_replica_slot", True)]
    with psycopg.connect(pair.server_url(1), autocommit=True) as conn:
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
    assert pair.primary_index() == 0
    assert _server_port(pair.url) == pair.nodes[0].port


def test_commit_on_primary_is_visible_on_replica(pair: PrivateReplicatedPostgres) -> None:
    marker = f"visible-{uuid.uuid4().hex}"
    with psycopg.connect(pair.url, autocommit=True) as conn:
        # remote_apply: the commit returns only once the standby has replayed it, so the
        # row must be visible there at once (the default 'on' waits for the flush only)
        conn.execute("SET synchronous_commit = remote_apply")
        conn.execute("INSERT INTO failover_probe (marker) VALUES (%s)", (marker,))
    assert marker in _markers(pair.server_url(1))
    with (
        psycopg.connect(pair.server_url(1), autocommit=True) as standby,
        pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
    ):
        standby.execute("INSERT INTO failover_probe (marker) VALUES ('never')")


def test_failover_loses_no_acknowledged_commit(pair: PrivateReplicatedPostgres) -> None:
    writer = _Writer(pair.url)
    writer.start()
    wait_for(lambda: len(writer.acked) >= ACKED_BEFORE_KILL, what="commits before the kill")

    started = time.monotonic()
    assert pair.kill_primary() == 0  # under the writer, commits in flight
    print(f"kill_primary took {time.monotonic() - started:.2f} s")
    writer.join(timeout=RECOVERY_DEADLINE_S)
    assert not writer.is_alive(), "the writer did not notice the dead primary"
    assert isinstance(writer.error, psycopg.OperationalError), writer.error
    acked = set(writer.acked)

    # no read-write host: node 0 refuses connections, node 1 is still a standby
    with pytest.raises(psycopg.OperationalError, match="read-only"):
        _insert(pair.url, "during-outage")
    with pytest.raises(ServiceError):
        pair.primary_index()

    started = time.monotonic()
    assert pair.promote_replica() == 1
    print(f"promote_replica took {time.monotonic() - started:.2f} s")
    assert pair.primary_index() == 1
    assert _server_port(pair.url) == pair.nodes[1].port
    missing = acked - _markers(pair.url)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged commits lost"
    _insert(pair.url, "after-promotion")
    assert "after-promotion" in _markers(pair.server_url(1))


def test_pool_recovers_after_promotion(pair: PrivateReplicatedPostgres) -> None:
    with ConnectionPool(
        pair.url, min_size=2, max_size=2, timeout=5.0, kwargs={"autocommit": True}
    ) as pool:
        pool.wait(timeout=RECOVERY_DEADLINE_S)
        with pool.connection() as conn:
            assert conn.execute("SELECT inet_server_port()").fetchone() == (pair.nodes[0].port,)

        pair.kill_primary()
        pair.promote_replica()

        failures: list[str] = []

        def query_succeeds() -> int | None:
            try:
                with pool.connection(timeout=5.0) as conn:
                    conn.execute("INSERT INTO failover_probe (marker) VALUES (%s)", ("pooled",))
                    row = conn.execute("SELECT inet_server_port()").fetchone()
            except (psycopg.OperationalError, PoolTimeout) as exc:
                failures.append(type(exc).__name__)  # a connection to the dead primary
                return None
            return int(row[0]) if row is not None else None

        port = wait_for(
            query_succeeds, timeout=RECOVERY_DEADLINE_S, interval=0.1, what="the pool to recover"
        )
        print(f"pool recovered after {len(failures)} failed attempts: {failures}")
        assert port == pair.nodes[1].port
        assert len(failures) <= pool.max_size  # one per stale connection, then fresh ones
