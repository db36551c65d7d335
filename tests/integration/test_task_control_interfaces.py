"""Control of single tasks through `flowforge task ...`, `flowforge keys show`, the filters of
`flowforge dead list`, `/api/v1/task-runs/{id}/cancel|retry-now|bury` and `/api/v1/keys` (SPEC 7.4).

The real command (tests/cli_runner.py) and the api role on a thread of this process, over a
real database. Refusals: bad id or note exit 2 / 400, unknown task exit 5 / 404, wrong state
exit 6 / 409 naming the state — each with nothing changed and nothing audited.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import TaskState
from tests.api_client import assert_json_error, serve_config, write_config
from tests.cli_runner import assert_ok
from tests.cli_runner import assert_refused as refused
from tests.cli_runner import run_config as flowforge
from tests.helpers import bury, chain, claim_task, drain
from tests.integration.test_task_control import STREAM, retrying
from tests.integration.test_task_control import ready_run as ready
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def config(tmp_path: Path, clean_database_url: str) -> Path:
    return write_config(tmp_path, clean_database_url, {})


def audit_count(sql: Sql) -> int:
    row = sql.execute("SELECT count(*) FROM task_audit").fetchone()
    assert row is not None
    return int(row[0])


def test_cli_cancel_retry_now_and_bury(config: Path, repo: Store, sql: Sql) -> None:
    ids = ready(repo, chain("c2", 2))
    out = assert_ok(
        flowforge(config, "task", "cancel", str(ids["t0"]), "--by", "ann", "--reason", "dup")
    )
    assert f"task run {ids['t0']} (t0): READY -> CANCELLED" in out
    tid = retrying(repo, sql)
    data = json.loads(assert_ok(flowforge(config, "task", "retry-now", str(tid), "--json")))
    assert (data["action"], data["previous_state"], data["effect"]) == (
        "retry_now",
        "RETRYING",
        "now",
    )
    assert data["task"]["state"] == "READY"
    claim = claim_task(repo, sql, tid)
    out = assert_ok(flowforge(config, "task", "bury", str(tid), "--reason", "poison"))
    assert "asked to stop; it ends DEAD (operator) when its worker stops" in out
    assert repo.finish(tid, claim.fencing_token, TaskState.CANCELLED)
    drain(repo)
    task = repo.get_task(tid)
    assert (task.state, task.failure_reason) == (TaskState.DEAD, FailureReason.OPERATOR)
    rows = sql.execute(
        "SELECT action, requested_by, reason, previous_state, new_state FROM task_audit ORDER BY id"
    ).fetchall()
    user = rows[1][1]  # --by absent: the OS user
    assert rows == [
        ("cancel", "ann", "dup", "READY", "CANCELLED"),
        ("retry_now", user, None, "RETRYING", "READY"),
        ("bury", user, "poison", "RUNNING", "RUNNING"),
    ]


@pytest.mark.parametrize("action", ["cancel", "retry-now", "bury"])
def test_cli_refusals(config: Path, repo: Store, sql: Sql, action: str) -> None:
    ids = ready(repo, chain("c2", 2))
    claim = claim_task(repo, sql, ids["t0"])
    assert repo.finish(ids["t0"], claim.fencing_token, TaskState.SUCCEEDED)
    drain(repo)
    refused(flowforge(config, "task", action, str(ids["t0"])), exitcodes.REFUSED, "is SUCCEEDED")
    refused(
        flowforge(config, "task", action, str(uuid.uuid4())), exitcodes.NOT_FOUND, "no task run"
    )
    refused(flowforge(config, "task", action, "nope"), exitcodes.USAGE, "task run id")
    refused(
        flowforge(config, "task", action, str(ids["t1"]), "--reason", "x" * 20_000),
        exitcodes.USAGE,
        "--reason",
    )
    assert audit_count(sql) == 0
    assert repo.get_task(ids["t1"]).state is TaskState.READY


def test_api_cancel_retry_now_and_bury(config: Path, repo: Store, sql: Sql) -> None:
    ids = ready(repo, chain("c2", 2))
    tid = retrying(repo, sql)
    with serve_config(config) as api:
        reply = api.post(
            f"/api/v1/task-runs/{ids['t0']}/bury", {"reason": "bad", "requested_by": "ops"}
        )
        assert reply.status == 200, reply.body
        data = reply.json()
        assert (data["action"], data["effect"], data["task"]["state"]) == ("bury", "now", "DEAD")
        assert data["task"]["failure_reason"] == "operator"
        reply = api.post(f"/api/v1/task-runs/{tid}/retry-now")
        assert (reply.status, reply.json()["task"]["state"]) == (200, "READY")
        reply = api.post(f"/api/v1/task-runs/{tid}/cancel", {"reason": "not needed"})
        assert (reply.status, reply.json()["task"]["state"]) == (200, "CANCELLED")
        # the task's detail lists what was done to it
        audit = api.get(f"/api/v1/task-runs/{tid}").json()["audit"]
        assert [(a["action"], a["requested_by"], a["new_state"]) for a in audit] == [
            ("retry_now", "api", "READY"),
            ("cancel", "api", "CANCELLED"),
        ]
        n = audit_count(sql)
        # refusals: wrong state 409 naming it, unknown 404, bad id / body 400
        message = assert_json_error(api.post(f"/api/v1/task-runs/{tid}/bury"), 409)
        assert "is CANCELLED" in message
        assert_json_error(api.post(f"/api/v1/task-runs/{uuid.uuid4()}/cancel"), 404)
        assert_json_error(api.post("/api/v1/task-runs/nope/retry-now"), 400)
        assert_json_error(api.post(f"/api/v1/task-runs/{ids['t1']}/cancel", {"why": "x"}), 400)
        assert_json_error(api.post(f"/api/v1/task-runs/{ids['t1']}/cancel", {"reason": 5}), 400)
        assert_json_error(
            api.post(f"/api/v1/task-runs/{ids['t1']}/cancel", {"reason": "nul \x00"}), 400
        )
        assert_json_error(api.post(f"/api/v1/task-runs/{ids['t1']}/cancel", b"{not json"), 400)
        assert audit_count(sql) == n


def test_keys_show_and_the_keys_api(config: Path, repo: Store, sql: Sql) -> None:
    first = ready(repo, STREAM, {"account": 1})["step"]
    second = ready(repo, STREAM, {"account": 1})["step"]
    bury(repo, sql, first)  # DEAD handler error; on_dead: block keeps the stream
    out = assert_ok(flowforge(config, "keys", "show", "acct-1"))
    assert "ordering key 'acct-1' (limit 1): held by 1, 1 waiting" in out
    assert "on_dead: block" in out and str(first) in out and str(second) in out
    data = json.loads(assert_ok(flowforge(config, "keys", "show", "acct-1", "--json")))
    (hold,) = data["holds"]
    assert (hold["kind"], hold["limit"], hold["waiting"]) == ("ordering", 1, 1)
    assert [h["id"] for h in hold["holders"]] == [str(first)]
    assert hold["holders"][0]["state"] == "DEAD"
    assert "nothing holds key 'free'" in assert_ok(flowforge(config, "keys", "show", "free"))
    refused(flowforge(config, "keys", "show", "x" * 20_000), exitcodes.USAGE, "key")
    with serve_config(config) as api:
        reply = api.get("/api/v1/keys?key=acct-1")
        assert reply.status == 200
        assert reply.json()["holds"][0]["holders"][0]["id"] == str(first)
        assert api.get("/api/v1/keys?key=free").json() == {"key": "free", "holds": []}
        assert_json_error(api.get("/api/v1/keys"), 400)
        assert_json_error(api.get("/api/v1/keys?key=a%00b"), 400)


def test_dead_list_filters_mirror_the_api(config: Path, repo: Store, sql: Sql) -> None:
    one = ready(repo, WorkflowDef("alpha", (TaskDef("only", "tests.noop"),)))["only"]
    two = ready(repo, WorkflowDef("beta", (TaskDef("only", "tests.other"),)))["only"]
    bury(repo, sql, one)  # permanent_error
    repo.bury_task(two, "op")  # operator

    def listed(*flags: str) -> list[str]:
        return [
            t["id"]
            for t in json.loads(assert_ok(flowforge(config, "dead", "list", "--json", *flags)))
        ]

    assert sorted(listed()) == sorted([str(one), str(two)])
    assert listed("--reason", "operator") == [str(two)]
    assert listed("--reason", "PERMANENT_ERROR") == [str(one)]  # any case, as the API's
    assert listed("--workflow", "alpha") == [str(one)]
    assert listed("--handler", "tests.other") == [str(two)]
    assert listed("--workflow", "alpha", "--reason", "operator") == []
    refused(flowforge(config, "dead", "list", "--reason", "nope"), exitcodes.USAGE, "--reason")
    refused(flowforge(config, "dead", "list", "--limit", "0"), exitcodes.USAGE, "--limit")
    refused(
        flowforge(config, "dead", "list", "--workflow", "w" * 20_000), exitcodes.USAGE, "workflow"
    )
    with serve_config(config) as api:
        found = api.get("/api/v1/dead?reason=operator&handler=tests.other").json()["tasks"]
        assert [t["id"] for t in found] == [str(two)]


def test_keys_show_a_concurrency_key_and_status_says_why_a_task_waits(
    config: Path, repo: Store, sql: Sql
) -> None:
    from flowforge.domain.limits import Concurrency  # concurrency limits (issue 20)

    limited = WorkflowDef(
        "limited", (TaskDef("call", "tests.noop", concurrency=Concurrency("partner", 1)),)
    )
    runs = [repo.trigger(limited).run_id for _ in range(3)]
    drain(repo)
    holder = repo.get_run(runs[0]).tasks[0].id
    out = assert_ok(flowforge(config, "keys", "show", "partner"))
    assert "concurrency key 'partner' (limit 1): held by 1, 2 waiting" in out
    assert "waits for a free slot of the key" in out and str(holder) in out
    data = json.loads(assert_ok(flowforge(config, "keys", "show", "partner", "--json")))
    (hold,) = data["holds"]
    assert (hold["kind"], hold["limit"], hold["waiting"]) == ("concurrency", 1, 2)
    assert [h["id"] for h in hold["holders"]] == [str(holder)]
    status = json.loads(assert_ok(flowforge(config, "status", str(runs[2]), "--json")))
    (task,) = status["tasks"]
    assert (task["waiting_on"], task["concurrency_key"], task["concurrency_limit"]) == (
        "concurrency",
        "partner",
        1,
    )
    assert "concurrency" in assert_ok(
        flowforge(config, "status", str(runs[2]))
    )  # the WAITING_ON column
    with serve_config(config) as api:
        assert api.get("/api/v1/keys?key=partner").json()["holds"][0]["kind"] == "concurrency"
        reply = api.get(f"/api/v1/task-runs/{task['id']}").json()
        assert reply["task"]["waiting_on"] == "concurrency"
