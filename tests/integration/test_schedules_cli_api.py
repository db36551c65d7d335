"""Schedules through `flowforge schedules ...` and `/api/v1/schedules` (SPEC 7.2).

The real command (forked off a preloaded interpreter, tests/cli_runner.py) and the api role
on a thread of this process (tests/api_here.py), over a real database whose schedules were
synced from the config's workflow files as the scheduler does. Bad input is one line and exit
2 / a JSON 400, an unknown name exit 5 / 404, a retired schedule exit 6 / 409; nothing is
stored by a refused request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.definitions import load_paths
from flowforge.domain.dag import WorkflowDef
from tests.api_client import Api, assert_json_error, serve_config, write_config
from tests.cli_runner import assert_ok
from tests.cli_runner import assert_refused as refused
from tests.cli_runner import run_config as flowforge
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

NIGHTLY = """\
name: nightly
tasks:
  - name: report
    handler: x
schedules:
  - cron: "0 3 * * *"
    timezone: Europe/Berlin
    input: {region: eu}
  - every: 1h
    name: hourly
    overlap: allow
"""


@pytest.fixture
def setup(tmp_path: Path, clean_database_url: str, repo: Store) -> Path:
    """A config naming a workflow file with two schedules, synced into the database."""
    config = write_config(tmp_path, clean_database_url, {"nightly.yaml": NIGHTLY})
    repo.sync(load_paths([tmp_path / "workflows"]))
    return config


def retire_all(repo: Store, folder: Path) -> None:
    """A reload after the file lost its schedules: both are retired."""
    flow = load_paths([folder])["nightly"]
    repo.sync({"nightly": WorkflowDef("nightly", flow.tasks)})


def count(sql: Sql, table: str) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ the command


def test_list_shows_each_schedule_with_state_timetable_and_fire_times(setup: Path) -> None:
    text = assert_ok(flowforge(setup, "schedules", "list"))
    header, *lines = text.splitlines()
    assert header.split() == [
        "NAME", "WORKFLOW", "TIMETABLE", "TIMEZONE", "STATE", "NEXT", "LAST", "FIRE", "LAST", "RUN"
    ]  # fmt: skip
    assert [line.split()[0] for line in lines] == ["hourly", "nightly/0"]
    assert "cron 0 3 * * *" in lines[1] and "Europe/Berlin" in lines[1] and "active" in lines[1]
    data = json.loads(assert_ok(flowforge(setup, "schedules", "list", "--json")))
    [hourly, nightly] = data["schedules"]
    assert hourly["timetable"] == "every 1h" and hourly["spec"]["overlap"] == "allow"
    assert nightly["spec"]["input"] == {"region": "eu"} and nightly["state"] == "active"
    assert nightly["next_fire_at"] is not None and nightly["last_run"] is None


def test_pause_resume_and_trigger_by_name_with_a_slash(setup: Path, repo: Store) -> None:
    paused = json.loads(assert_ok(flowforge(setup, "schedules", "pause", "nightly/0", "--json")))
    assert paused["state"] == "paused" and paused["paused_at"] is not None
    assert assert_ok(flowforge(setup, "schedules", "resume", "nightly/0")).startswith(
        "resumed nightly/0 (state active, next fire "
    )
    run_id = assert_ok(flowforge(setup, "schedules", "trigger", "nightly/0")).strip()
    run = repo.get_run(run_id)
    assert run.schedule == "nightly/0" and run.fire_time is not None
    assert dict(run.input) == {"region": "eu"}
    status = assert_ok(flowforge(setup, "status", run_id))
    assert f"schedule nightly/0  fire time {run.fire_time:%Y-%m-%d %H:%M:%S}" in status
    shown = json.loads(assert_ok(flowforge(setup, "status", run_id, "--json")))
    assert shown["schedule"] == "nightly/0" and shown["fire_time"] == run.fire_time.isoformat()
    listed = json.loads(assert_ok(flowforge(setup, "schedules", "list", "--json")))["schedules"]
    assert listed[1]["last_run"] == {"id": run_id, "state": "PENDING"}
    assert listed[1]["last_decision"]["manual"] is True
    history = json.loads(assert_ok(flowforge(setup, "schedules", "show", "nightly/0", "--json")))
    assert [h["outcome"] for h in history["history"]] == ["created"]
    assert "created (manual)" in assert_ok(flowforge(setup, "schedules", "show", "nightly/0"))


def test_operator_mistakes_are_one_line_and_change_nothing(
    setup: Path, repo: Store, sql: Sql
) -> None:
    before = (count(sql, "workflow_runs"), count(sql, "schedule_fires"))
    refused(flowforge(setup, "schedules", "pause", "nightly/9"), exitcodes.NOT_FOUND, "no schedule")
    refused(flowforge(setup, "schedules", "trigger", "nope"), exitcodes.NOT_FOUND, "no schedule")
    refused(flowforge(setup, "schedules", "pause", "a\x01b\x00"), exitcodes.USAGE, "NUL")
    refused(
        flowforge(setup, "schedules", "show", "hourly", "--limit", "0"), exitcodes.USAGE, "--limit"
    )
    refused(flowforge(setup, "schedules", "frobnicate"), exitcodes.USAGE, "invalid choice")
    repo.sync(
        {
            "nightly": load_paths([setup.parent / "workflows"])["nightly"].__class__(
                "nightly", load_paths([setup.parent / "workflows"])["nightly"].tasks
            )
        }
    )  # the file's schedules are gone: both retired
    refused(flowforge(setup, "schedules", "trigger", "hourly"), exitcodes.REFUSED, "retired")
    assert (count(sql, "workflow_runs"), count(sql, "schedule_fires")) == before
    assert "retired" in assert_ok(flowforge(setup, "schedules", "list"))


# ------------------------------------------------------------------ the api


@pytest.fixture
def api(setup: Path) -> Iterator[Api]:
    with serve_config(setup) as running:
        yield running


def test_the_api_lists_reads_pauses_resumes_and_triggers(api: Api, repo: Store) -> None:
    listed = api.get("/api/v1/schedules")
    assert listed.status == 200
    assert [s["name"] for s in listed.json()["schedules"]] == ["hourly", "nightly/0"]
    for path in ("/api/v1/schedules/nightly%2F0", "/api/v1/schedules/nightly/0"):
        one = api.get(path)
        assert one.status == 200, (path, one.body)
        assert one.json()["name"] == "nightly/0" and one.json()["history"] == []
    paused = api.post("/api/v1/schedules/nightly%2F0/pause")
    assert paused.status == 200 and paused.json()["state"] == "paused"
    resumed = api.post("/api/v1/schedules/nightly/0/resume")
    assert resumed.status == 200 and resumed.json()["state"] == "active"
    fired = api.post("/api/v1/schedules/hourly/trigger")
    assert fired.status == 201, fired.body
    run_id = fired.json()["run_id"]
    assert fired.headers["Location"] == f"/api/v1/runs/{run_id}"
    run = api.get(f"/api/v1/runs/{run_id}").json()
    assert run["schedule"] == "hourly" and run["fire_time"] == fired.json()["fire_time"]
    history = api.get("/api/v1/schedules/hourly?limit=5").json()["history"]
    assert [(h["outcome"], h["manual"], h["run_id"]) for h in history] == [
        ("created", True, run_id)
    ]


def test_the_api_refuses_what_the_caller_got_wrong_and_stores_nothing(
    api: Api, repo: Store, sql: Sql
) -> None:
    before = (count(sql, "workflow_runs"), count(sql, "schedule_fires"))
    assert_json_error(api.post("/api/v1/schedules/hourly/trigger", auth=False), 401)
    assert_json_error(api.post("/api/v1/schedules/hourly/pause", auth=False), 401)
    assert "no schedule" in assert_json_error(api.post("/api/v1/schedules/nope/pause"), 404)
    assert_json_error(api.post("/api/v1/schedules/nightly%2F7/trigger"), 404)
    assert_json_error(api.get("/api/v1/schedules/a%2Fb%2Fc"), 404)
    assert "NUL" in assert_json_error(api.post("/api/v1/schedules/a%00b/resume"), 400)
    assert_json_error(api.get("/api/v1/schedules/hourly?limit=0"), 400)
    assert_json_error(api.request("DELETE", "/api/v1/schedules/hourly"), 405)
    retire_all(repo, api.config.parent / "workflows")
    assert "retired" in assert_json_error(api.post("/api/v1/schedules/hourly/trigger"), 409)
    assert (count(sql, "workflow_runs"), count(sql, "schedule_fires")) == before
    assert repo.get_schedule("hourly").state == "retired"


def test_the_api_lists_schedules_a_page_at_a_time_by_name(api: Api) -> None:
    first = api.get("/api/v1/schedules?limit=1").json()
    assert [s["name"] for s in first["schedules"]] == ["hourly"]
    assert first["next_cursor"] == "hourly"
    second = api.get("/api/v1/schedules?limit=1&cursor=hourly").json()
    assert [s["name"] for s in second["schedules"]] == ["nightly/0"]
    assert second["next_cursor"] is None
    whole = api.get("/api/v1/schedules").json()  # the default page holds both
    assert [s["name"] for s in whole["schedules"]] == ["hourly", "nightly/0"]
    assert whole["next_cursor"] is None
    assert api.get("/api/v1/schedules?cursor=zzz").json() == {"schedules": [], "next_cursor": None}
    assert_json_error(api.get("/api/v1/schedules?cursor=a%00b"), 400)
    assert_json_error(api.get("/api/v1/schedules?limit=1001"), 400)
