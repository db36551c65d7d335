"""Fixtures for chaos tests, which stop, kill and restart PostgreSQL and RabbitMQ.

They never touch the shared dev services (26432/26672) nor the machine's 5432/5672: one
private instance of each is started for the whole chaos session on free ports, in a base
directory of its own (mode 0755, so the postgres/rabbitmq accounts can enter it), and stopped
at the end. Before and after every test both services are brought back up, so a test that
fails in the middle of an outage cannot break the next one. With ``CI=true`` a missing service
fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.chaos.support import (
    CONSUMER_TIMEOUT_MS,
    NODE_NAME,
    ChaosDb,
    ChaosServices,
    create_database,
    unavailable,
)
from tests.conftest import TABLES
from tests.e2e import Stack
from tests.harness.resources import free_ports
from tests.harness.services import PrivatePostgres, PrivateRabbitMQ, ServiceUnavailable


@pytest.fixture(scope="session")
def chaos_services() -> Iterator[ChaosServices]:
    """One private PostgreSQL and RabbitMQ for the chaos session, always stopped after."""
    base_dir = Path(tempfile.mkdtemp(prefix="ff-chaos-"))
    base_dir.chmod(0o755)  # pytest's tmp dirs are 0700: the service accounts could not enter
    pg_port, amqp_port, dist_port, epmd_port = free_ports(4)
    services = ChaosServices(
        base_dir,
        PrivatePostgres(base_dir, pg_port),
        PrivateRabbitMQ(
            base_dir,
            amqp_port,
            dist_port,
            f"{NODE_NAME}-{os.getpid()}",
            epmd_port=epmd_port,
            consumer_timeout_ms=CONSUMER_TIMEOUT_MS,
        ),
    )
    try:
        try:
            services.ensure_running()
        except ServiceUnavailable as exc:
            unavailable(str(exc))
        services.database_url = create_database(services.pg.url)
        yield services
    finally:
        try:
            services.rabbit.stop()
        finally:
            services.pg.stop()
            shutil.rmtree(base_dir, ignore_errors=True)


@pytest.fixture
def chaos_db(chaos_services: ChaosServices) -> Iterator[ChaosDb]:
    """Both services running, every table emptied, and the test's view of the database."""
    chaos_services.ensure_running()
    with psycopg.connect(chaos_services.database_url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    view = ChaosDb(chaos_services.database_url)
    yield view
    view.close()


@pytest.fixture
def chaos_stack(
    tmp_path: Path, chaos_services: ChaosServices, chaos_db: ChaosDb
) -> Iterator[Stack]:
    """Role processes for one test against the private services, on a fresh queue.

    At the end every role is stopped, both services run again and the queue is deleted.
    """
    stack = Stack(tmp_path, chaos_services.database_url, chaos_services.rabbit.url)
    try:
        yield stack
    finally:
        try:
            stack.stop_all()
        finally:
            chaos_services.ensure_running()
            stack.delete_queue()
