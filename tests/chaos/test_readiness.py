"""Readiness of the api child through RabbitMQ and PostgreSQL outages (SPEC 5).

The api (``flowforge role api``) runs with a scheduler, a publisher and a worker against the
chaos session's private services (see conftest.py). Stopping the broker makes ``/health/ready``
a 503 naming ``"rabbitmq": "error"``; stopping PostgreSQL makes it name ``"postgres": "error"``.
Throughout each outage the api itself keeps answering — ``/health/live`` promptly, the other
endpoints with JSON — and once the service is back readiness returns to 200 without any process
being restarted.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.chaos.support import ChaosDb, ChaosServices
from tests.e2e import RoleProcess, Stack
from tests.harness.resources import free_ports
from tests.helpers import wait_for

pytestmark = pytest.mark.chaos

#: The api and the roles must be up, and ready again after an outage, within this (seconds).
READY_TIMEOUT_S = 90.0
#: Readiness must notice an outage within this (seconds).
NOTICE_TIMEOUT_S = 30.0
#: A readiness check may wait this long for a dead service before it answers (seconds).
READY_REQUEST_TIMEOUT_S = 20.0
#: ``/health/live`` must answer within this (seconds) even while a service is down.
LIVE_BUDGET_S = 2.0
#: How long an outage is watched to show the api keeps serving (seconds).
WATCH_S = 2.0
#: The api's ``database.connect_timeout_s`` (also how long it waits for a pooled connection).
API_DB_TIMEOUT_S = 1.0
POLL_S = 0.2
TOKEN_ENV = "FLOWFORGE_API_TOKEN"
TOKEN = "chaos-readiness-token"


@dataclass
class Reply:
    status: int
    body: bytes
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class ApiProcess:
    process: RoleProcess
    port: int

    def get(self, path: str, timeout: float = READY_REQUEST_TIMEOUT_S) -> Reply:
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
            response = conn.getresponse()
            return Reply(response.status, response.read(), time.monotonic() - started)
        finally:
            conn.close()

    def answers(self, path: str) -> bool:
        try:
            return self.get(path, timeout=2).status == 200
        except OSError:
            return False


def start_ready_tree(stack: Stack) -> tuple[ApiProcess, list[RoleProcess]]:
    """An api plus a scheduler, a publisher and a worker; returns once ready says 200."""
    (port,) = free_ports(1)
    stack.extra_env = {**stack.extra_env, TOKEN_ENV: TOKEN}  # reads need it (api.read_access)
    api = ApiProcess(
        stack.start(
            "api",
            api={"listen": f"127.0.0.1:{port}"},
            # a database request waits at most this long for a connection: outage tests are short
            database={"connect_timeout_s": API_DB_TIMEOUT_S},
        ),
        port,
    )
    roles = stack.start_all(workers=1)
    wait_for(
        lambda: api.answers("/health/ready"),
        timeout=READY_TIMEOUT_S,
        interval=POLL_S,
        what="the api to be ready",
    )
    return api, [api.process, *roles]


def wait_ready_status(api: ApiProcess, status: int, component: str, state: str) -> dict[str, Any]:
    """Poll ``/health/ready`` until it answers ``status`` with ``component`` in ``state``."""

    def probe() -> dict[str, Any] | None:
        reply = api.get("/health/ready")
        body: dict[str, Any] = reply.json()
        return body if reply.status == status and body.get(component) == state else None

    timeout = NOTICE_TIMEOUT_S if status == 503 else READY_TIMEOUT_S
    return wait_for(
        probe,
        timeout=timeout,
        interval=POLL_S,
        what=f"/health/ready to answer {status} with {component!r}: {state!r}",
    )


def assert_keeps_serving(
    api: ApiProcess, roles: list[RoleProcess], path: str, status: int, component: str
) -> None:
    """For :data:`WATCH_S`: live answers promptly, ``path`` answers ``status`` with JSON,
    readiness still names ``component``, and no process exits."""
    deadline = time.monotonic() + WATCH_S
    while True:
        live = api.get("/health/live")
        assert live.status == 200 and live.json() == {"status": "ok"}
        assert live.seconds < LIVE_BUDGET_S, f"/health/live took {live.seconds:.1f}s"
        reply = api.get(path)
        assert reply.status == status, (reply.status, reply.body[:300])
        assert b"Traceback" not in reply.body
        body = reply.json()
        if status != 200:
            assert set(body) == {"error"}, body
        ready = api.get("/health/ready")
        assert ready.status == 503 and ready.json()[component] == "error", ready.body
        assert all(p.alive() for p in roles), "a process exited during the outage"
        if time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


@pytest.mark.slow
def test_broker_outage_turns_ready_503_naming_rabbitmq_and_back_to_200(
    chaos_services: ChaosServices, chaos_stack: Stack, chaos_db: ChaosDb
) -> None:
    api, roles = start_ready_tree(chaos_stack)
    pids = [p.pid for p in roles]

    chaos_services.rabbit.stop()
    body = wait_ready_status(api, 503, "rabbitmq", "error")
    assert body["status"] == "error" and body["postgres"] == "ok"
    assert_keeps_serving(api, roles, "/api/v1/runs", 200, "rabbitmq")

    chaos_services.start_broker()
    body = wait_ready_status(api, 200, "rabbitmq", "ok")
    assert set(body.values()) == {"ok"}, body
    assert [p.pid for p in roles] == pids and all(p.alive() for p in roles)


@pytest.mark.slow
def test_postgres_outage_turns_ready_503_naming_postgres_and_back_to_200(
    chaos_services: ChaosServices, chaos_stack: Stack, chaos_db: ChaosDb
) -> None:
    api, roles = start_ready_tree(chaos_stack)
    pids = [p.pid for p in roles]

    chaos_services.pg.stop()
    body = wait_ready_status(api, 503, "postgres", "error")
    assert body["status"] == "error" and body["rabbitmq"] == "ok"
    assert_keeps_serving(api, roles, "/api/v1/runs", 503, "postgres")

    chaos_services.pg.start()
    body = wait_ready_status(api, 200, "postgres", "ok")
    assert set(body.values()) == {"ok"}, body
    assert api.get("/api/v1/runs").status == 200
    assert [p.pid for p in roles] == pids and all(p.alive() for p in roles)
