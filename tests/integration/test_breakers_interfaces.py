"""Circuit breakers and pauses through `flowforge breakers|pause|resume`, the api and /metrics.

The real command (tests/cli_runner.py) and the api role on a thread of this process, over a real
database. Refusals: a bad name or note exit 2 / 400, a handler no workflow names exit 5 / 404, a
state that refuses exit 6 / 409 — one line on stderr or a JSON error, nothing changed or audited.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.model import ClaimOutcome
from tests.api_client import assert_json_error, serve_config, write_config
from tests.cli_runner import assert_ok
from tests.cli_runner import assert_refused as refused
from tests.cli_runner import run_config as flowforge
from tests.helpers import drain
from tests.integration.test_breakers import HANDLER, open_by_failures, ready, try_claim
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def config(tmp_path: Path, clean_database_url: str) -> Path:
    return write_config(tmp_path, clean_database_url, {})


def audited(sql: Sql) -> list[tuple[str, str, str | None]]:
    rows = sql.execute("SELECT action, name, reason FROM gate_audit ORDER BY id").fetchall()
    return [(str(a), str(n), r) for a, n, r in rows]


def test_cli_breakers_list_open_and_close(config: Path, repo: Store, sql: Sql) -> None:
    assert "no breaker has tripped" in assert_ok(flowforge(config, "breakers", "list"))
    waiting = open_by_failures(repo, sql, extra=1)
    try_claim(repo, sql, waiting[0])
    out = assert_ok(flowforge(config, "breakers", "list"))
    assert HANDLER in out and "open" in out and "3 in 60s, 30s" in out
    (shown,) = json.loads(assert_ok(flowforge(config, "breakers", "list", "--json")))["breakers"]
    assert (shown["state"], shown["recent_failures"], shown["parked"]) == ("open", 3, 1)
    out = assert_ok(
        flowforge(config, "breakers", "open", HANDLER, "--by", "ann", "--reason", "hold")
    )
    assert out == f"breaker of handler '{HANDLER}': open -> open\n"  # now held
    data = json.loads(assert_ok(flowforge(config, "breakers", "close", HANDLER, "--json")))
    assert (data["action"], data["previous_state"], data["new_state"]) == (
        "breaker_close",
        "open",
        "closed",
    )
    drain(repo)
    assert try_claim(repo, sql, waiting[0]) is ClaimOutcome.EXECUTE
    assert audited(sql)[0] == ("breaker_open", HANDLER, "hold")


def test_cli_refusals_are_one_line_with_their_exit_code(
    config: Path, repo: Store, sql: Sql
) -> None:
    ready(repo, sql, 1)
    refused(flowforge(config, "breakers", "close", HANDLER), exitcodes.REFUSED, "closed already")
    refused(flowforge(config, "breakers", "open", "no.such"), exitcodes.NOT_FOUND, "no workflow")
    refused(flowforge(config, "breakers", "open", "bad name"), exitcodes.USAGE, "handler name")
    refused(flowforge(config, "breakers", "list", "bad name"), exitcodes.USAGE, "handler name")
    refused(flowforge(config, "pause", "queue", "amq.x"), exitcodes.USAGE, "queue name")
    refused(flowforge(config, "pause", "handler", "no.such"), exitcodes.NOT_FOUND, "no workflow")
    refused(flowforge(config, "resume", "queue", "partner"), exitcodes.REFUSED, "not paused")
    refused(
        flowforge(config, "pause", "queue", "partner", "--reason", "x" * 20_000),
        exitcodes.USAGE,
        "--reason",
    )
    assert audited(sql) == []


def test_cli_pause_list_and_resume(config: Path, repo: Store, sql: Sql) -> None:
    (tid,) = ready(repo, sql, 1, breaker=None, queue="partner")
    out = assert_ok(flowforge(config, "pause", "queue", "partner", "--reason", "deploy"))
    assert out == "queue 'partner': running -> paused\n"
    refused(flowforge(config, "pause", "queue", "partner"), exitcodes.REFUSED, "paused already")
    assert try_claim(repo, sql, tid) is ClaimOutcome.LOST
    (listed,) = json.loads(assert_ok(flowforge(config, "pause", "list", "--json")))["pauses"]
    assert (listed["scope"], listed["name"], listed["parked"]) == ("queue", "partner", 1)
    assert "partner" in assert_ok(flowforge(config, "pause", "list"))
    assert_ok(flowforge(config, "resume", "queue", "partner"))
    assert "nothing is paused" in assert_ok(flowforge(config, "pause", "list"))
    drain(repo)
    assert try_claim(repo, sql, tid) is ClaimOutcome.EXECUTE
    assert [a for a, _, _ in audited(sql)] == ["pause", "resume"]


def test_api_breakers_pauses_and_refusals(config: Path, repo: Store, sql: Sql) -> None:
    tasks = ready(repo, sql, 4)
    with serve_config(config) as api:
        assert api.get("/api/v1/breakers").json() == {"breakers": []}
        reply = api.post(f"/api/v1/breakers/{HANDLER}/open", {"reason": "maintenance"})
        assert reply.status == 200, reply.body
        assert reply.json() == {
            "action": "breaker_open",
            "scope": "handler",
            "name": HANDLER,
            "previous_state": "closed",
            "new_state": "open",
            "key": None,  # the handler's own breaker (migration 0020)
        }
        (shown,) = api.get("/api/v1/breakers").json()["breakers"]
        assert (shown["state"], shown["held"]) == ("open", True)
        assert try_claim(repo, sql, tasks[0]) is ClaimOutcome.LOST
        detail = api.get(f"/api/v1/task-runs/{tasks[0]}").json()
        assert detail["task"]["waiting_on"] == "circuit_open"
        assert "held open already" in assert_json_error(
            api.post(f"/api/v1/breakers/{HANDLER}/open"), 409
        )
        assert api.post(f"/api/v1/breakers/{HANDLER}/close").status == 200
        assert_json_error(api.post(f"/api/v1/breakers/{HANDLER}/close"), 409)
        assert_json_error(api.post("/api/v1/breakers/no.such/open"), 404)
        assert_json_error(api.post("/api/v1/breakers/bad%20name/open"), 400)
        assert_json_error(api.post(f"/api/v1/breakers/{HANDLER}/open", {"why": 1}), 400)
        assert_json_error(api.post(f"/api/v1/breakers/{HANDLER}/open", {"reason": 5}), 400)
        # pauses
        reply = api.post("/api/v1/queues/partner/pause", {"requested_by": "ops"})
        assert (reply.status, reply.json()["new_state"]) == (200, "paused")
        assert api.get("/api/v1/pauses").json()["pauses"][0]["name"] == "partner"
        assert_json_error(api.post("/api/v1/queues/partner/pause"), 409)
        assert api.post("/api/v1/queues/partner/resume").status == 200
        assert_json_error(api.post("/api/v1/queues/partner/resume"), 409)
        assert_json_error(api.post("/api/v1/queues/amq.x/pause"), 400)
        assert_json_error(api.post("/api/v1/handlers/no.such/pause"), 404)
        assert api.post(f"/api/v1/handlers/{HANDLER}/pause").status == 200
        assert api.post(f"/api/v1/handlers/{HANDLER}/resume").status == 200
    assert [a for a, _, _ in audited(sql)] == [
        "breaker_open",
        "breaker_close",
        "pause",
        "resume",
        "pause",
        "resume",
    ]


def test_metrics_show_breaker_state_transitions_and_parked(
    config: Path, repo: Store, sql: Sql
) -> None:
    waiting = open_by_failures(repo, sql, extra=2)
    for tid in waiting:
        try_claim(repo, sql, tid)
    with serve_config(config) as api:
        text = api.get("/metrics").body.decode()
    assert f'flowforge_breaker_state{{handler="{HANDLER}",key=""}} 2.0' in text
    assert f'flowforge_breaker_transitions_total{{handler="{HANDLER}",to_state="open"}} 1.0' in text
    assert 'flowforge_parked_tasks{waiting_on="circuit_open"} 2.0' in text
    assert 'flowforge_parked_tasks{waiting_on="paused"} 0.0' in text
