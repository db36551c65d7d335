"""Delayed runs and deadlines through the CLI and the HTTP API (issue 18), against PostgreSQL.

Good input makes a SCHEDULED run shown by ``status``, listed by ``runs --state SCHEDULED`` and
``GET /api/v1/runs?state=SCHEDULED``, and cancellable; every class of bad input is one line
naming the field, exit 2 / HTTP 400, and nothing stored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.states import RunState
from tests.api_client import Api, assert_json_error, count_runs, serve_here
from tests.e2e import Stack
from tests.integration.test_cli import assert_operator_error, flowforge

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def db_now(sql: Sql) -> datetime:
    row = sql.execute("SELECT now()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


# ------------------------------------------------------------------ CLI


def test_cli_trigger_delay_shows_lists_and_cancels_a_scheduled_run(
    clean_database_url: str, sql: Sql
) -> None:
    made = flowforge(
        "trigger", "hello", "--delay", "10m", "--deadline", "2h", url=clean_database_url
    )
    assert made.returncode == 0, made.stderr
    run_id = made.stdout.strip()
    uuid.UUID(run_id)
    status = flowforge("status", run_id, url=clean_database_url)
    assert status.returncode == 0, status.stderr
    assert "state SCHEDULED" in status.stdout and "start at " in status.stdout
    assert "deadline " in status.stdout
    shown = json.loads(flowforge("status", run_id, "--json", url=clean_database_url).stdout)
    start_at = datetime.fromisoformat(shown["start_at"])
    deadline_at = datetime.fromisoformat(shown["deadline_at"])
    assert deadline_at - start_at == timedelta(hours=2)
    assert shown["failure_reason"] is None
    listed = flowforge("runs", "--state", "scheduled", "--json", url=clean_database_url)
    assert [r["id"] for r in json.loads(listed.stdout)] == [run_id]
    cancelled = flowforge("cancel", run_id, url=clean_database_url)
    assert cancelled.returncode == 0 and "CANCELLED" in cancelled.stdout


def test_cli_trigger_at_a_time_with_an_offset(clean_database_url: str, sql: Sql) -> None:
    at = (db_now(sql) + timedelta(days=1)).astimezone().isoformat()
    made = flowforge("trigger", "hello", "--at", at, url=clean_database_url)
    assert made.returncode == 0, made.stderr
    shown = json.loads(
        flowforge("status", made.stdout.strip(), "--json", url=clean_database_url).stdout
    )
    assert shown["state"] == RunState.SCHEDULED
    assert datetime.fromisoformat(shown["start_at"]) == datetime.fromisoformat(at)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--at", "PAST"), "is in the past"),
        (("--at", "2026-12-24T09:00:00"), "no UTC offset"),
        (("--at", "next tuesday"), "--at 'next tuesday' is not an ISO 8601"),
        (("--at", "9999-12-31T00:00:00Z"), "days ahead"),
        (("--at", "FUTURE", "--delay", "5m"), "not both"),
        (("--delay", "0s"), "--delay: '0s' is not a duration"),
        (("--delay", "soon"), "--delay: 'soon' is not a duration"),
        (("--delay", "999999999d"), "delay must be more than 0 and at most"),
        (("--deadline", "1h30m"), "--deadline: '1h30m' is not a duration"),
        (("--deadline", "0m"), "--deadline"),
    ],
)
def test_cli_bad_timing_is_one_line_exit_2_and_nothing_stored(
    clean_database_url: str, sql: Sql, args: tuple[str, ...], fragment: str
) -> None:
    now = db_now(sql)
    values = {
        "PAST": (now - timedelta(hours=1)).isoformat(),
        "FUTURE": (now + timedelta(hours=1)).isoformat(),
    }
    given = [values.get(a, a) for a in args]
    result = flowforge("trigger", "hello", *given, url=clean_database_url)
    assert_operator_error(result, exitcodes.USAGE, fragment)
    assert count_runs(sql) == 0


# ------------------------------------------------------------------ HTTP API


@pytest.fixture
def api(tmp_path: Path, clean_database_url: str, broker_url: str) -> Iterator[Api]:
    """The api role on a thread of this process, over this test's clean database."""
    stack = Stack(tmp_path, clean_database_url, broker_url)
    found, server = serve_here(stack)
    try:
        yield found
    finally:
        server.stop()


def test_api_creates_a_scheduled_run_with_start_at_and_a_deadline(api: Api, sql: Sql) -> None:
    start_at = (db_now(sql) + timedelta(hours=3)).isoformat()
    reply = api.post(
        "/api/v1/runs", {"workflow": "api-other", "start_at": start_at, "deadline": "30m"}
    )
    assert reply.status == 201, reply.body
    run = reply.json()
    assert run["state"] == "SCHEDULED"
    assert datetime.fromisoformat(run["start_at"]) == datetime.fromisoformat(start_at)
    assert datetime.fromisoformat(run["deadline_at"]) - datetime.fromisoformat(
        start_at
    ) == timedelta(minutes=30)
    delayed = api.post("/api/v1/runs", {"workflow": "api-record", "delay": 90, "deadline": 60})
    assert delayed.status == 201 and delayed.json()["state"] == "SCHEDULED"
    listed = api.get("/api/v1/runs?state=SCHEDULED").json()["runs"]
    assert {r["id"] for r in listed} == {run["id"], delayed.json()["id"]}
    cancelled = api.post(f"/api/v1/runs/{run['id']}/cancel")
    assert cancelled.status == 200 and cancelled.json()["state"] == "CANCELLED"


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"start_at": "PAST"}, "in the past"),
        ({"start_at": "2030-01-01T00:00:00"}, "no UTC offset"),
        ({"start_at": "soon"}, "'start_at' 'soon' is not an ISO 8601"),
        ({"start_at": 1767225600}, "'start_at' must be an ISO 8601"),
        ({"start_at": {"at": 1}}, "'start_at' must be an ISO 8601"),
        ({"start_at": "2030-01-01T00:00:00Z\u0000"}, "not an ISO 8601"),
        ({"start_at": "9999-01-01T00:00:00+00:00"}, "days ahead"),
        ({"start_at": "FUTURE", "delay": "1m"}, "not both"),
        ({"delay": "0s"}, "'delay'"),
        ({"delay": -1}, "'delay' must be more than 0"),
        ({"delay": 1e300}, "'delay' must be more than 0"),
        ({"delay": True}, "'delay' must be a number"),
        ({"deadline": "2 hours"}, "'deadline'"),
        ({"deadline": [1]}, "'deadline' must be a number"),
        ({"deadline": 0}, "'deadline' must be more than 0"),
    ],
)
def test_api_bad_timing_is_400_naming_the_field_and_nothing_stored(
    api: Api, sql: Sql, fields: dict[str, Any], fragment: str
) -> None:
    now = db_now(sql)
    values = {
        "PAST": (now - timedelta(hours=1)).isoformat(),
        "FUTURE": (now + timedelta(hours=1)).isoformat(),
    }
    body = {
        "workflow": "api-record",
        **{k: values.get(v, v) if isinstance(v, str) else v for k, v in fields.items()},
    }
    message = assert_json_error(api.post("/api/v1/runs", body), 400)
    assert fragment in message and "\n" not in message
    assert count_runs(sql) == 0
