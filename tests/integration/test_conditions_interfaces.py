"""rerun and compensation through every interface: the CLI (exit codes, one-line errors), the
HTTP api (400 / 404 / 409 JSON, never a 5xx) and the Python client (issue 19)."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.states import RunState, TaskState
from tests.api_client import StartApi, assert_json_error
from tests.helpers import drain, task_ids
from tests.integration.test_cli import assert_operator_error, flowforge
from tests.integration.test_conditions import SAGA, compensated_run, succeed
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
UNKNOWN_ID = "00000000-0000-0000-0000-000000000000"


def audit_rows(sql: Sql) -> int:
    row = sql.execute("SELECT count(*) FROM rerun_audit").fetchone()
    assert row is not None
    return int(row[0])


def test_cli_status_says_what_was_compensated_and_rerun_resets_the_failure(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id = compensated_run(repo, sql)
    human = flowforge("status", str(run_id), url=clean_database_url)
    assert human.returncode == 0, human.stderr
    assert "compensated: refund" in human.stdout
    data = json.loads(flowforge("status", str(run_id), "--json", url=clean_database_url).stdout)
    assert data["compensated"] == ["refund"]
    assert {t["name"]: t["run_if"] for t in data["tasks"]}["refund"] == "any_failed"

    done = flowforge(
        "rerun", str(run_id), "--reason", "carrier back", "--by", "ops", url=clean_database_url
    )
    assert done.returncode == 0, done.stderr
    assert "2 task(s) reset" in done.stdout and "FAILED" in done.stdout
    assert repo.get_task(task_ids(repo, run_id)["ship"]).state is TaskState.PENDING
    (entry,) = repo.rerun_history(run_id)
    assert (entry.requested_by, entry.reason) == ("ops", "carrier back")

    # not finished now: refused, nothing more audited
    again = flowforge("rerun", str(run_id), url=clean_database_url)
    assert_operator_error(again, exitcodes.REFUSED, "not finished")
    assert audit_rows(sql) == 1


def test_cli_rerun_from_a_task_as_json(repo: Store, sql: Sql, clean_database_url: str) -> None:
    run_id = compensated_run(repo, sql)
    done = flowforge("rerun", str(run_id), "--from", "charge", "--json", url=clean_database_url)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert sorted(data["task_names"]) == ["charge", "refund", "ship"]
    assert data["previous_state"] == "FAILED" and data["run"]["finished_at"] is None


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (("rerun", UNKNOWN_ID), exitcodes.NOT_FOUND, "no run with id"),
        (("rerun", "xyz"), exitcodes.USAGE, "malformed run id"),
        (("rerun", UNKNOWN_ID, "--reason", "x" * 20_000), exitcodes.USAGE, "rerun reason"),
        (("rerun", UNKNOWN_ID, "--from", "t" * 20_000), exitcodes.USAGE, "task to rerun from"),
    ],
)
def test_cli_rerun_refusals(
    clean_database_url: str, sql: Sql, args: tuple[str, ...], code: int, fragment: str
) -> None:
    assert_operator_error(flowforge(*args, url=clean_database_url), code, fragment)
    assert audit_rows(sql) == 0


def test_cli_rerun_of_an_unknown_task_is_refused(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id = compensated_run(repo, sql)
    result = flowforge("rerun", str(run_id), "--from", "nope", url=clean_database_url)
    assert_operator_error(result, exitcodes.NOT_FOUND, "no task named 'nope'")
    assert audit_rows(sql) == 0
    assert repo.get_run(run_id).state is RunState.FAILED


def test_api_rerun_resets_audits_and_refuses_bad_requests(
    api_here: StartApi, repo: Store, sql: Sql
) -> None:
    api = api_here()
    run_id = compensated_run(repo, sql)
    path = f"/api/v1/runs/{run_id}/rerun"
    shown = api.get(f"/api/v1/runs/{run_id}").json()
    assert shown["compensated"] == ["refund"]

    for body, status, fragment in (
        ([1], 400, "may only hold"),
        ({"why": "x"}, 400, "may only hold"),
        ({"reason": 5}, 400, "'reason' must be a string"),
        ({"from": ["ship"]}, 400, "'from' must be a string"),
        ({"requested_by": None}, 400, "'requested_by' must be a string"),
        ({"reason": "a\u0000b"}, 400, "NUL"),
        ({"reason": "x" * 100_000}, 400, "reason"),
        ({"from": "nope"}, 404, "no task named"),
    ):
        reply = api.post(path, body)
        assert fragment in assert_json_error(reply, status), (body, reply.body)
    assert "malformed" in assert_json_error(api.post("/api/v1/runs/12/rerun"), 400)
    assert "no run" in assert_json_error(api.post(f"/api/v1/runs/{UNKNOWN_ID}/rerun"), 404)
    assert audit_rows(sql) == 0

    reply = api.post(path, {"reason": "fixed", "requested_by": "alice", "from": "ship"})
    assert reply.status == 200, reply.body
    data = reply.json()
    assert sorted(data["task_names"]) == ["refund", "ship"]
    assert data["previous_state"] == "FAILED" and data["run"]["state"] == "RUNNING"
    assert "not finished" in assert_json_error(api.post(path), 409)
    history = api.get(path).json()["reruns"]
    assert [(h["requested_by"], h["reason"], h["from_task"]) for h in history] == [
        ("alice", "fixed", "ship")
    ]
    assert audit_rows(sql) == 1


def test_client_rerun(repo: Store, sql: Sql, clean_database_url: str) -> None:
    from flowforge.client import Client
    from flowforge.config import load_config
    from tests.integration.test_cli import EXAMPLE

    run_id = compensated_run(repo, sql)
    config = load_config(EXAMPLE, env={"FLOWFORGE_DATABASE_URL": clean_database_url})
    with Client(config) as client:
        done = client.rerun(run_id, "script", "nightly retry")
    assert sorted(done.task_names) == ["refund", "ship"]
    assert repo.rerun_history(run_id)[0].requested_by == "script"


def test_cli_status_shows_a_skip_and_a_waiting_condition(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id = repo.trigger(SAGA).run_id
    ids = task_ids(repo, run_id)
    waiting = flowforge("status", str(run_id), url=clean_database_url)
    assert "run_if any_failed" in waiting.stdout
    succeed(repo, sql, ids["charge"])
    succeed(repo, sql, ids["ship"])
    drain(repo)
    human = flowforge("status", str(run_id), url=clean_database_url)
    assert human.returncode == 0, human.stderr
    assert "skipped: run_if any_failed not met" in human.stdout and "SUCCEEDED" in human.stdout
    assert "compensated" not in human.stdout
    data = json.loads(flowforge("status", str(run_id), "--json", url=clean_database_url).stdout)
    refund = {t["name"]: t for t in data["tasks"]}["refund"]
    assert (refund["state"], refund["cancel_cause"]) == ("CANCELLED", "condition_not_met")
    assert data["compensated"] == [] and data["state"] == "SUCCEEDED"
