"""An attempt's output and a task's progress through the api and the CLI (SPEC 7.5):
``GET /api/v1/task-runs/{id}/logs``, ``flowforge logs [--attempt N] [--follow] [--json]``,
progress in ``status`` (text and JSON) and the api's task JSON. Handler text is untrusted:
escaped on the terminal, JSON in the api. Bad ids and attempt numbers are 4xx / exit 2, an
unknown task run or attempt a 404 / exit 5, never a traceback or a 5xx.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.model import Finish
from flowforge.domain.output import Captured, Output, Progress
from flowforge.domain.states import TaskState
from tests import cli_runner
from tests.api_client import UNKNOWN_ID, Api, assert_json_error, ok, serve_stack
from tests.helpers import claim_task, single, wait_for
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "flowforge.example.yaml"
HOSTILE = "\x1b[2J\x1b[31mred\x1b[0m\rover\u202e"


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    with serve_stack(tmp_path_factory.mktemp("logs-api"), database_url, broker_url) as found:
        yield found


def flowforge(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env["FLOWFORGE_DATABASE_URL"] = url
    return cli_runner.run(["-c", str(EXAMPLE), *args], env)


def running(repo: Store, sql: Sql, text: str, progress: Progress | None) -> tuple[UUID, UUID]:
    """A run whose one task is RUNNING with ``text`` written and ``progress`` reported."""
    run = repo.trigger(single("logs-api"), {})
    task = repo.get_run(run.run_id).tasks[0]
    claim = claim_task(repo, sql, task.id)
    found = Captured(Output(text, 10), progress)
    assert repo.write_output([(claim.task_run_id, claim.fencing_token, found)]) == 1
    return run.run_id, task.id


def test_the_api_serves_the_latest_attempt_s_output_as_json(
    api: Api, repo: Store, sql: Sql
) -> None:
    run_id, task_id = running(repo, sql, f"INFO {HOSTILE}\nplain\n", Progress(0.5, HOSTILE))
    body = ok(api.get(f"/api/v1/task-runs/{task_id}/logs"))
    assert body["output"] == f"INFO {HOSTILE}\nplain\n"  # JSON carries it; a page escapes it
    assert (body["attempt"], body["attempts"], body["running"]) == (1, 1, True)
    assert body["dropped_bytes"] == 10
    assert body["total_bytes"] == 10 + len(body["output"].encode())
    assert body["task_state"] == "RUNNING" and body["outcome"] == "running"
    assert ok(api.get(f"/api/v1/task-runs/{task_id}/logs?attempt=1")) == body
    task = ok(api.get(f"/api/v1/task-runs/{task_id}"))["task"]
    assert task["progress"] == {"fraction": 0.5, "message": HOSTILE}
    [listed] = ok(api.get(f"/api/v1/runs/{run_id}"))["tasks"]
    assert listed["progress"] == {"fraction": 0.5, "message": HOSTILE}


@pytest.mark.parametrize(
    ("path", "status", "fragment"),
    [
        ("/api/v1/task-runs/not-a-uuid/logs", 400, "task run id"),
        ("/api/v1/task-runs/%00/logs", 400, "task run id"),
        (f"/api/v1/task-runs/{UNKNOWN_ID}/logs", 404, "no task run"),
        ("/api/v1/task-runs/TASK/logs?attempt=0", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=-1", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=x", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=1.0", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=%00", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=2147483648", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=99999999999999999999999", 400, "attempt"),
        ("/api/v1/task-runs/TASK/logs?attempt=2", 404, "has no attempt 2"),
    ],
)
def test_bad_ids_and_attempts_are_json_4xx(
    api: Api, repo: Store, sql: Sql, path: str, status: int, fragment: str
) -> None:
    _, task_id = running(repo, sql, "x\n", None)
    message = assert_json_error(api.get(path.replace("TASK", str(task_id))), status)
    assert fragment in message


def test_flowforge_logs_prints_the_output_escaped_after_a_dropped_marker(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    _, task_id = running(repo, sql, f"INFO {HOSTILE}\nplain\n", None)
    printed = cli_runner.assert_ok(flowforge(clean_database_url, "logs", str(task_id)))
    assert printed.splitlines() == [
        "[… 10 bytes dropped …]",
        "INFO \\x1b[2J\\x1b[31mred\\x1b[0m\\rover\\u202e",
        "plain",
    ]
    assert "\x1b" not in printed and "\r" not in printed
    as_json = json.loads(
        cli_runner.assert_ok(flowforge(clean_database_url, "logs", str(task_id), "--json"))
    )
    assert as_json["output"] == f"INFO {HOSTILE}\nplain\n" and as_json["attempt"] == 1


def test_flowforge_status_shows_the_progress(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id, _ = running(repo, sql, "x\n", Progress(0.25, HOSTILE))
    text = cli_runner.assert_ok(flowforge(clean_database_url, "status", str(run_id)))
    header, row = text.splitlines()[-2:]
    assert header.split()[-1] == "PROGRESS"
    assert row.endswith("25% \\x1b[2J\\x1b[31mred\\x1b[0m\\rover\\u202e")
    as_json = json.loads(
        cli_runner.assert_ok(flowforge(clean_database_url, "status", str(run_id), "--json"))
    )
    assert as_json["tasks"][0]["progress"] == {"fraction": 0.25, "message": HOSTILE}


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["logs", "nope"], exitcodes.USAGE, "task run id"),
        (["logs", "TASK", "--attempt", "0"], exitcodes.USAGE, "--attempt must be"),
        (["logs", "TASK", "--attempt", "x"], exitcodes.USAGE, "--attempt must be"),
        (["logs", "TASK", "--attempt", "-1"], exitcodes.USAGE, "--attempt must be"),
        (["logs", "TASK", "--attempt", "2147483648"], exitcodes.USAGE, "--attempt must be"),
        (["logs", "TASK", "--json", "--follow"], exitcodes.USAGE, "cannot be combined"),
        (["logs", UNKNOWN_ID], exitcodes.NOT_FOUND, "no task run"),
        (["logs", "TASK", "--attempt", "3"], exitcodes.NOT_FOUND, "has no attempt 3"),
    ],
)
def test_flowforge_logs_refuses_bad_input_in_one_line(
    repo: Store, sql: Sql, clean_database_url: str, args: list[str], code: int, fragment: str
) -> None:
    _, task_id = running(repo, sql, "x\n", None)
    args = [a.replace("TASK", str(task_id)) for a in args]
    cli_runner.assert_refused(flowforge(clean_database_url, *args), code, fragment)


def test_flowforge_logs_follow_streams_until_the_attempt_ends(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run = repo.trigger(single("logs-follow"), {})
    task = repo.get_run(run.run_id).tasks[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env["FLOWFORGE_DATABASE_URL"] = clean_database_url
    # a real process, started before the task has an attempt: it waits for the first
    follower = subprocess.Popen(
        [sys.executable, "-m", "flowforge.cli", "-c", str(EXAMPLE), "logs", str(task.id), "-f"],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(follower.stdout.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        claim = claim_task(repo, sql, task.id)
        pair = (claim.task_run_id, claim.fencing_token)
        repo.write_output([(*pair, Captured(Output("first\n", 0), None))])
        wait_for(lambda: lines == ["first\n"], timeout=30, what="the follower to print a line")
        repo.write_output([(*pair, Captured(Output("first\nsecond\n", 0), None))])
        wait_for(lambda: len(lines) == 2, timeout=30, what="the second line")
        final = Captured(Output("first\nsecond\nlast\n", 0), None)
        repo.finish_many([(*pair, Finish(TaskState.SUCCEEDED, captured=final))])
        assert follower.wait(30) == 0, follower.stderr.read()  # type: ignore[union-attr]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(10)
    reader.join(10)
    assert lines == ["first\n", "second\n", "last\n"]
