"""Events through `flowforge event send`, `POST /api/v1/events` and `Client.send_event`
(SPEC 7.3), and what `flowforge status` shows of a waiting task.

The real command (tests/cli_runner.py) and the api role on a thread of this process
(tests/api_here.py), over a real database. Bad input is one line and exit 2 / a JSON 400, and
nothing is stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.client import Client
from flowforge.config import load_config
from flowforge.definitions import load_paths
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError
from tests.api_client import Api, assert_json_error, serve_config, write_config
from tests.cli_runner import assert_refused as refused
from tests.cli_runner import run_config as flowforge
from tests.helpers import drain
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

ORDER = """\
name: order
tasks:
  - name: approve
    wait_for_event: {name: order.approved, key: "order-{order_id}", timeout: 1d}
  - name: ship
    handler: x
    depends_on: approve
"""


@pytest.fixture
def setup(tmp_path: Path, clean_database_url: str) -> Path:
    return write_config(
        tmp_path, clean_database_url, {"order.yaml": ORDER}, events={"retention": "2d"}
    )


@pytest.fixture
def api(setup: Path) -> Iterator[Api]:
    with serve_config(setup) as running:
        yield running


def waiting_run(setup: Path, repo: Store, order_id: str) -> str:
    workflow = load_paths([setup.parent / "workflows"])["order"]
    run_id = repo.trigger(workflow, {"order_id": order_id}).run_id
    drain(repo)
    assert repo.get_run(run_id).task("approve").state is TaskState.RUNNING
    return str(run_id)


def count(sql: Sql, table: str) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def test_the_config_reads_events_retention_as_a_duration(setup: Path) -> None:
    assert load_config(setup, env={}).events.retention == 2 * 86_400.0


def test_status_shows_what_a_task_waits_for_and_event_send_wakes_it(
    setup: Path, repo: Store, sql: Sql
) -> None:
    run_id = waiting_run(setup, repo, "17")
    shown = flowforge(setup, "status", run_id)
    assert shown.returncode == 0, shown.stderr
    assert "waits for event order.approved key 'order-17' until" in shown.stdout
    as_json = json.loads(flowforge(setup, "status", run_id, "--json").stdout)
    [approve] = [t for t in as_json["tasks"] if t["name"] == "approve"]
    assert (approve["event_name"], approve["event_key"]) == ("order.approved", "order-17")
    assert approve["state"] == "RUNNING" and approve["wake_at"] is not None

    sent = flowforge(setup, "event", "send", "order.approved", "--key", "order-17", "--data", "[1]")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.splitlines()[0].endswith("woke 1 task(s)")
    assert f"run {run_id}  task approve" in sent.stdout
    assert repo.get_run(run_id).task("approve").result == [1]
    again = flowforge(
        setup, "event", "send", "order.approved", "--key", "order-17", "--json"
    )  # stored, wakes nothing more
    assert again.returncode == 0 and json.loads(again.stdout)["woke"] == []
    assert count(sql, "event_deliveries") == 1


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["", "--key", "k"], "event name"),
        (["bad name", "--key", "k"], "event name"),
        (["order.approved", "--key", "k", "--data", "{bad"], "--data is not valid JSON"),
        (["order.approved", "--key", "k", "--data", "NaN"], "event data"),
        (["order.approved", "--key", "k", "--data", '{"a": "\\u0000"}'], "event data"),
        (["order.approved", "--key", "k" * 2000], "event key"),
        (["order.approved"], "--key"),
    ],
)
def test_event_send_refuses_bad_input_with_one_line_and_exit_2(
    setup: Path, sql: Sql, args: list[str], fragment: str
) -> None:
    refused(flowforge(setup, "event", "send", *args), exitcodes.USAGE, fragment)
    assert count(sql, "events") == 0


def test_the_api_sends_an_event_and_answers_what_it_woke(
    api: Api, setup: Path, repo: Store, sql: Sql
) -> None:
    run_id = waiting_run(setup, repo, "5")
    graph = api.get(f"/api/v1/runs/{run_id}/graph").json()  # what the dashboard draws
    nodes = {n["name"]: n for n in graph["nodes"]}
    assert (nodes["approve"]["event_name"], nodes["approve"]["event_key"]) == (
        "order.approved",
        "order-5",
    )
    assert nodes["approve"]["wake_at"] is not None and nodes["ship"]["event_name"] is None
    reply = api.post("/api/v1/events", {"name": "order.approved", "key": "order-5", "data": 7})
    assert reply.status == 201, reply.body
    body = reply.json()
    assert body["name"] == "order.approved" and body["key"] == "order-5"
    assert [(w["run_id"], w["task"]) for w in body["woke"]] == [(run_id, "approve")]
    assert repo.get_run(run_id).task("approve").result == 7
    run = api.get(f"/api/v1/runs/{run_id}").json()
    [approve] = [t for t in run["tasks"] if t["name"] == "approve"]
    assert approve["state"] == "SUCCEEDED" and approve["event_key"] == "order-5"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([], "JSON object"),
        ({}, "event name"),
        ({"key": "k"}, "event name"),
        ({"name": 5, "key": "k"}, "event name"),
        ({"name": "order.approved"}, "event key"),
        ({"name": "order.approved", "key": ["k"]}, "event key"),
        ({"name": "order.approved", "key": "a\u0000b"}, "event key"),
        ({"name": "order.approved", "key": "k", "extra": 1}, "unknown field"),
        ({"name": "order.approved", "key": "k", "data": {"a": "\u0000"}}, "event data"),
    ],
)
def test_the_api_refuses_a_bad_event_with_400_and_stores_nothing(
    api: Api, sql: Sql, body: Any, fragment: str
) -> None:
    assert fragment in assert_json_error(api.post("/api/v1/events", body), 400)
    assert count(sql, "events") == 0


def test_the_api_needs_the_token_to_send(api: Api, sql: Sql) -> None:
    body = {"name": "order.approved", "key": "k"}
    assert_json_error(api.post("/api/v1/events", body, auth=False), 401)
    assert count(sql, "events") == 0


def test_client_send_event_wakes_the_wait_and_refuses_bad_input(
    setup: Path, repo: Store, sql: Sql
) -> None:
    run_id = waiting_run(setup, repo, "9")
    with Client(load_config(setup, env={})) as client:
        with pytest.raises(InputError, match="event data"):
            client.send_event("order.approved", "order-9", {"x": float("inf")})
        assert count(sql, "events") == 0
        sent = client.send_event("order.approved", "order-9", {"x": 1})
        assert [w.task for w in sent.woke] == ["approve"]
        assert client.status(run_id).task("approve").result == {"x": 1}
    drain(repo)
    assert repo.get_run(run_id).state is RunState.RUNNING  # ship is READY: no worker here
