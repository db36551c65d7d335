"""The api's safety net for database errors, in process against real PostgreSQL.

A value that reaches PostgreSQL and is refused there is the caller's mistake: a 400 naming
it, never a 503 "unavailable" (only an outage is). Input checks in front of the database may
refuse such values earlier; these requests go straight through a falcon test client to the
real trigger statement to prove the net under them. A misconfigured database is a 500 whose
id is logged, and the server can still be reached.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator

import falcon.testing
import psycopg
import pytest

from flowforge.api.app import create_app
from flowforge.client import Client
from flowforge.config import ApiConfig, Config, DatabaseConfig
from tests.coalescing import at_once, count_commits, unreachable
from tests.harness.resources import create_database, drop_database
from tests.helpers import single

pytestmark = pytest.mark.integration

TOKEN = "t0ken"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
#: Requests sent at once, as many as the api's request threads (api.threads).
THREADS = 16


def app_for(url: str) -> Iterator[falcon.testing.TestClient]:
    config = Config(database=DatabaseConfig(url=url, connect_timeout_s=1))
    with Client(config, workflows=[single("api-db-errors")]) as client:
        yield falcon.testing.TestClient(create_app(client, TOKEN, ApiConfig(allowed_hosts=("*",))))


@pytest.fixture
def api(clean_database_url: str) -> Iterator[falcon.testing.TestClient]:
    yield from app_for(clean_database_url)


# JSON text Python parses but jsonb refuses: a lone surrogate escape, a NUL character
@pytest.mark.parametrize("value", ['"\\ud800"', '"a\\udc00b"', '{"k\\ud83d": 1}'])
def test_a_value_postgresql_refuses_is_a_400_not_a_503(
    api: falcon.testing.TestClient, sql: psycopg.Connection[tuple[object, ...]], value: str
) -> None:
    body = '{"workflow": "api-db-errors", "input": {"x": ' + value + "}}"
    reply = api.simulate_post("/api/v1/runs", body=body, headers=HEADERS)
    assert reply.status_code == 400, reply.text
    assert set(reply.json) == {"error"} and "unavailable" not in reply.json["error"]
    assert sql.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)


@pytest.fixture
def unmigrated_api(pg_server_url: str) -> Iterator[falcon.testing.TestClient]:
    url = create_database(pg_server_url, "ff_api_unmigrated")
    try:
        yield from app_for(url)
    finally:
        drop_database(pg_server_url, url)


def test_an_unmigrated_database_is_a_500_with_a_logged_id(
    unmigrated_api: falcon.testing.TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="flowforge.api.errors"):
        reply = unmigrated_api.simulate_get("/api/v1/runs", headers=HEADERS)
    assert reply.status_code == 500, reply.text
    found = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\)", reply.json["error"])
    assert found, reply.json
    logged = [r.getMessage() for r in caplog.records if found[1] in r.getMessage()]
    assert len(logged) == 1 and "is not migrated" in logged[0] and "flowforge migrate" in logged[0]
    assert json.loads(unmigrated_api.simulate_get("/health/live").text) == {"status": "ok"}


def test_an_outage_is_every_concurrent_post_s_503_each_request_tried_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Concurrent POSTs share a commit (flowforge/coalesce.py); against a database nobody
    listens on, every one of them is answered 503 "unavailable" as JSON, none a 500 or a
    traceback, and none was tried again alone after its shared commit failed: an outage is
    everyone's, not retried one by one (the client-level proof is test_client_coalesce's; this
    is the api's answer to it)."""
    with Client(unreachable(), workflows=[single("api-db-errors")]) as client:
        api = falcon.testing.TestClient(create_app(client, TOKEN, ApiConfig(allowed_hosts=("*",))))
        commits = count_commits(client, monkeypatch)

        def post(n: int) -> falcon.testing.Result:
            body = {"workflow": "api-db-errors", "input": {"n": n}}
            return api.simulate_post("/api/v1/runs", json=body, headers=HEADERS)

        replies = at_once([functools.partial(post, n) for n in range(THREADS)])
    alone, shared = commits.alone, commits.shared
    for reply in replies:
        assert reply.status_code == 503, reply.text
        assert set(reply.json) == {"error"} and "unavailable" in reply.json["error"], reply.json
    assert shared and max(shared) > 1, (alone, shared)
    assert len(alone) + sum(shared) == THREADS, (alone, shared)  # each request tried once
