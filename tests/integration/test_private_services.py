"""The private PostgreSQL / RabbitMQ harness: connect, SIGKILL, start again, stop.

Runs one private instance of each on free ports in a fresh temporary directory and
never contacts the machine's shared services; it only checks (via /proc/net/tcp, without
connecting) that whatever listened on 5432/5672 before still listens afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pika
import psycopg
import pytest

from tests.harness.resources import free_ports
from tests.harness.services import PrivatePostgres, PrivateRabbitMQ, ServiceUnavailable

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SHARED_PORTS = frozenset({5432, 5672})
TCP_LISTEN_STATE = "0A"
QUEUE = "flowforge-private-services-probe"
MARKER_ROW = "survives-sigkill"
STARTUP_BUDGET_S = {"postgres": 30.0, "rabbitmq": 60.0}


@dataclass
class Services:
    """The running private instances plus what the shared ports looked like before."""

    base_dir: Path
    pg: PrivatePostgres
    rabbit: PrivateRabbitMQ
    shared_listening_before: frozenset[int]


def _listening_ports() -> frozenset[int]:
    """Local TCP ports in LISTEN state (IPv4 and IPv6), read from /proc without connecting."""
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == TCP_LISTEN_STATE:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return frozenset(ports)


def _timed_start(service: PrivatePostgres | PrivateRabbitMQ, label: str) -> None:
    """Start ``service`` and fail if it took longer than its budget (seconds)."""
    started = time.monotonic()
    service.start()
    elapsed = time.monotonic() - started
    print(f"{label} started in {elapsed:.1f} s")
    assert elapsed < STARTUP_BUDGET_S[label], f"{label} took {elapsed:.1f} s to start"


def _stop_all(pg: PrivatePostgres, rabbit: PrivateRabbitMQ) -> None:
    """Stop both instances; the first error is re-raised after both were attempted."""
    errors: list[Exception] = []
    for service in (rabbit, pg):
        try:
            service.stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    """Both private services, started once for the module and always stopped at the end."""
    shared_before = _listening_ports() & SHARED_PORTS
    base_dir = Path(tempfile.mkdtemp(prefix="ff-services-"))
    base_dir.chmod(0o755)  # the postgres / rabbitmq accounts must be able to traverse it
    pg_port, amqp_port, dist_port, epmd_port = free_ports(4)
    pg = PrivatePostgres(base_dir, pg_port)
    rabbit = PrivateRabbitMQ(
        base_dir, amqp_port, dist_port, f"fftest-{os.getpid()}", epmd_port=epmd_port
    )
    try:
        try:
            _timed_start(pg, "postgres")
            _timed_start(rabbit, "rabbitmq")
        except ServiceUnavailable as exc:
            pytest.skip(str(exc))
        yield Services(base_dir, pg, rabbit, shared_before)
    finally:
        _stop_all(pg, rabbit)
        shutil.rmtree(base_dir, ignore_errors=True)


def _declare_queue(url: str, *, passive: bool = False) -> None:
    """Open a pika connection to ``url`` and declare (or passively check) the probe queue."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue=QUEUE, durable=True, passive=passive)
    finally:
        connection.close()


def test_postgres_accepts_connections(services: Services) -> None:
    with psycopg.connect(services.pg.url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.execute("SELECT current_database()").fetchone() == ("flowforge",)
        conn.execute("CREATE TABLE IF NOT EXISTS probe (note text NOT NULL)")
        conn.execute("INSERT INTO probe (note) VALUES (%s)", (MARKER_ROW,))


def test_rabbitmq_accepts_connections(services: Services) -> None:
    _declare_queue(services.rabbit.url)
    assert QUEUE in services.rabbit.rabbitmqctl("list_queues", "-q", "name")


def test_postgres_starts_again_after_sigkill(services: Services) -> None:
    pg = services.pg
    old_pid = pg.pid
    assert old_pid is not None
    orphaned = psycopg.connect(pg.url, autocommit=True)  # a backend alive during the crash
    try:
        orphaned.execute("SELECT 1")
        pg.kill()
        assert not pg.is_running()
    finally:
        orphaned.close()
    pg.start()
    assert pg.pid not in (None, old_pid)
    with psycopg.connect(pg.url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        rows = conn.execute("SELECT note FROM probe").fetchall()
    assert rows == [(MARKER_ROW,)]


def test_rabbitmq_starts_again_after_sigkill(services: Services) -> None:
    rabbit = services.rabbit
    old_pid = rabbit.pid
    assert old_pid is not None
    # The node writes queue metadata through mnesia's log in its own time; once, on a loaded
    # machine, a SIGKILL seconds after the declaration lost it. What is under test is that the
    # node comes back on the same data, so the metadata is put on disk first.
    rabbit.rabbitmqctl("eval", "mnesia:dump_log().")
    rabbit.kill()
    assert not rabbit.is_running()
    rabbit.start()
    assert rabbit.pid not in (None, old_pid)
    _declare_queue(rabbit.url, passive=True)  # the durable queue survived the crash


def test_stop_frees_ports_and_leaves_shared_services_alone(services: Services) -> None:
    private_ports = {services.pg.port, services.rabbit.amqp_port, services.rabbit.dist_port}
    private_ports.add(services.rabbit.epmd_port)
    assert private_ports <= _listening_ports()

    _stop_all(services.pg, services.rabbit)

    assert not services.pg.is_running()
    assert not services.rabbit.is_running()
    listening = _listening_ports()
    assert not (private_ports & listening), "a private service still listens"
    assert services.shared_listening_before <= listening, "a shared service stopped listening"
