"""The process registry and the readiness it feeds, in this process against real PostgreSQL
and RabbitMQ.

A role's :class:`~flowforge.roles.presence.Presence` registers it (host, pid, role, the
database's clock), refreshes its row every ``TOUCH_INTERVAL_S`` and removes it on a clean stop;
``/health/ready`` (the falcon app, served by a test client) is 200 only while a scheduler, a
publisher and a worker are registered and fresh, and names the one missing. The same through
real role processes and the api child: test_roles_delivery.py and test_api.py (``slow``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import falcon.testing
import psycopg
import pytest

from flowforge.api import health
from flowforge.api.app import create_app
from flowforge.broker.publish import ConfirmingPublisher
from flowforge.client import Client
from flowforge.config import ApiConfig, BrokerConfig, Config, DatabaseConfig
from flowforge.roles import presence
from flowforge.roles.presence import Presence
from tests.e2e import Stack
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

OK = {
    "status": "ok",
    "postgres": "ok",
    "rabbitmq": "ok",
    "scheduler": "ok",
    "publisher": "ok",
    "worker": "ok",
}


def registered(sql: Sql) -> dict[str, tuple[str, int, Any, Any]]:
    """role → (host, pid, started_at, last_seen_at) of every registered process."""
    found = sql.execute("SELECT role, host, pid, started_at, last_seen_at FROM processes")
    return {r[0]: (r[1], int(r[2]), r[3], r[4]) for r in found.fetchall()}


def test_a_role_registers_refreshes_on_its_interval_and_deregisters(
    repo: Store, sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Presence(repo, "worker")
    worker.announce()
    [(host, pid, started_at, first_seen)] = registered(sql).values()
    assert (host, pid) == (socket.gethostname(), os.getpid())
    assert started_at <= first_seen

    worker.tick()  # within TOUCH_INTERVAL_S: no statement, nothing changes
    assert registered(sql)["worker"][3] == first_seen

    monkeypatch.setattr(presence, "TOUCH_INTERVAL_S", 0.0)
    worker.tick()
    refreshed = registered(sql)["worker"]
    assert refreshed[3] > first_seen and refreshed[2] == started_at  # the same registration

    worker.leave()
    assert registered(sql) == {}


@pytest.fixture
def ready_probe(stack: Stack, clean_database_url: str) -> Iterator[falcon.testing.TestClient]:
    """The api's app on the stack's queue (declared as a role would), readiness not cached."""
    broker = BrokerConfig(url=(stack.broker_url,), queue=stack.queue)
    declaring = ConfirmingPublisher(broker)
    declaring.connect()
    declaring.close()
    config = Config(database=DatabaseConfig(url=clean_database_url), broker=broker)
    with Client(config) as client:
        api = ApiConfig(allowed_hosts=("*",), ready_cache_s=0)
        yield falcon.testing.TestClient(create_app(client, None, api))


def test_ready_needs_a_fresh_scheduler_publisher_and_worker_and_names_the_one_missing(
    ready_probe: falcon.testing.TestClient, repo: Store, sql: Sql
) -> None:
    def ready() -> tuple[int, Any]:
        reply = ready_probe.simulate_get("/health/ready")
        return reply.status_code, reply.json

    nobody = {**OK, "status": "error", "scheduler": "error", "publisher": "error"}
    assert ready() == (503, {**nobody, "worker": "error"})
    roles = {role: Presence(repo, role) for role in ("scheduler", "publisher", "worker")}
    for role in roles.values():
        role.announce()
    assert ready() == (200, OK)

    roles["publisher"].leave()  # a clean stop deregisters at once
    assert ready() == (503, {**OK, "status": "error", "publisher": "error"})

    sql.execute(  # a worker silent for longer than FRESH_S counts as gone
        "UPDATE processes SET last_seen_at = now() - make_interval(secs => %s) WHERE role = %s",
        (health.FRESH_S + 1, "worker"),
    )
    assert ready() == (503, {**OK, "status": "error", "publisher": "error", "worker": "error"})
    assert ready_probe.simulate_get("/health/live").json == {"status": "ok"}
