"""The `flowforge` command as an operator uses it: a process of its own, a real database.

Operator mistakes must give one line on stderr, a distinct non-zero exit code and no traceback.
The first test starts ``python -m flowforge.cli`` in a fresh interpreter each time, as a shell
does; the others fork it off a preloaded interpreter (tests/cli_runner.py), which runs the
same ``__main__`` in its own process for a fraction of the cost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowforge.cli import exitcodes
from tests import cli_runner

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "flowforge.example.yaml"
UNKNOWN_ID = "00000000-0000-0000-0000-000000000000"


def flowforge(
    *args: str, url: str | None = None, config: Path = EXAMPLE, fresh_interpreter: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    if url is not None:
        env["FLOWFORGE_DATABASE_URL"] = url
    if not fresh_interpreter:
        return cli_runner.run(["-c", str(config), *args], env)
    return subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def assert_operator_error(
    result: subprocess.CompletedProcess[str], code: int, fragment: str
) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_migrate_twice_then_trigger_and_status(clean_database_url: str) -> None:
    first = flowforge("migrate", url=clean_database_url, fresh_interpreter=True)
    assert first.returncode == 0, first.stderr
    assert "up to date" in first.stdout  # the session database is already migrated
    triggered = flowforge(
        "trigger",
        "order-fulfilment",
        "--input",
        '{"order_id": 1, "customer_id": 2, "amount": 3}',
        url=clean_database_url,
        fresh_interpreter=True,
    )
    assert triggered.returncode == 0, triggered.stderr
    run_id = triggered.stdout.strip()
    assert len(run_id) == 36 and "\n" not in run_id
    status = flowforge("status", run_id, "--json", url=clean_database_url, fresh_interpreter=True)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["id"] == run_id and data["workflow"] == "order-fulfilment"
    assert data["state"] == "PENDING"
    assert {t["name"] for t in data["tasks"]} == {"charge", "reserve", "ship", "notify"}
    assert all(
        {"id", "name", "state", "attempt", "failure_reason"} <= t.keys() for t in data["tasks"]
    )
    human = flowforge("status", run_id, url=clean_database_url, fresh_interpreter=True)
    assert human.returncode == 0 and "charge" in human.stdout and "PENDING" in human.stdout


def test_trigger_with_an_idempotency_key_replays_and_refuses_another_input(
    clean_database_url: str,
) -> None:
    args = ("trigger", "hello", "--idempotency-key", "k-1")
    first = flowforge(*args, "--input", '{"name": "a"}', url=clean_database_url)
    again = flowforge(*args, "--input", '{"name": "a"}', url=clean_database_url)
    assert first.returncode == again.returncode == 0
    assert first.stdout == again.stdout
    other = flowforge(*args, "--input", '{"name": "b"}', url=clean_database_url)
    assert_operator_error(other, exitcodes.REFUSED, "different request")


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (("status", "not-a-uuid"), exitcodes.USAGE, "malformed run id"),
        (("status", UNKNOWN_ID), exitcodes.NOT_FOUND, "no run with id"),
        (("cancel", UNKNOWN_ID), exitcodes.NOT_FOUND, "no run with id"),
        (("cancel", "xyz"), exitcodes.USAGE, "malformed run id"),
        (("dead", "requeue", UNKNOWN_ID), exitcodes.NOT_FOUND, "no task run with id"),
        (("dead", "requeue", "12"), exitcodes.USAGE, "malformed task run id"),
        (("trigger", "no-such-workflow"), exitcodes.USAGE, "unknown workflow"),
        (("trigger", "hello", "--input", "{not json"), exitcodes.USAGE, "not valid JSON"),
        (("trigger", "hello", "--input", "[1, 2]"), exitcodes.USAGE, "JSON object"),
        (("trigger", "order-fulfilment", "--input", "{}"), exitcodes.USAGE, "cannot format"),
        (("runs", "--state", "SLEEPING"), exitcodes.USAGE, "--state must be one of"),
        (("no-such-command",), exitcodes.USAGE, "invalid choice"),
    ],
)
def test_operator_mistakes_get_one_line_and_a_distinct_exit_code(
    clean_database_url: str, args: tuple[str, ...], code: int, fragment: str
) -> None:
    assert_operator_error(flowforge(*args, url=clean_database_url), code, fragment)


def test_requeue_of_a_task_that_is_not_dead_is_refused(clean_database_url: str) -> None:
    run_id = flowforge("trigger", "hello", url=clean_database_url).stdout.strip()
    task_id = json.loads(flowforge("status", run_id, "--json", url=clean_database_url).stdout)[
        "tasks"
    ][0]["id"]
    assert_operator_error(
        flowforge("dead", "requeue", task_id, url=clean_database_url), exitcodes.REFUSED, "not DEAD"
    )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("database:\n  urll: x\n", "database.urll: unknown key"),
        ("processes:\n  workers: four\n", "processes.workers: expected an integer"),
        ("broker: [1\n", "not valid YAML"),
        ("- a\n- b\n", "expected a mapping"),
        ("worker:\n  lease_s: 5\n  heartbeat_s: 10\n", "heartbeat_s must be shorter"),
    ],
)
def test_a_bad_config_file_gives_one_clear_line(tmp_path: Path, text: str, fragment: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = flowforge("migrate", config=config)
    assert_operator_error(result, exitcodes.USAGE, fragment)
    assert str(config) in result.stderr


def test_a_missing_config_file_gives_one_clear_line(tmp_path: Path) -> None:
    assert_operator_error(
        flowforge("migrate", config=tmp_path / "missing.yaml"),
        exitcodes.USAGE,
        "cannot read config file",
    )


def test_an_unreachable_database_gives_one_line_and_its_own_exit_code() -> None:
    result = flowforge(
        "migrate", url="postgresql://postgres@127.0.0.1:1/flowforge?connect_timeout=1"
    )
    assert_operator_error(result, exitcodes.UNAVAILABLE, "database unavailable")


def test_config_flag_is_accepted_after_the_subcommand(clean_database_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env["FLOWFORGE_DATABASE_URL"] = clean_database_url
    result = cli_runner.run(["workflows", "list", "--json", "-c", str(EXAMPLE)], env)
    assert result.returncode == 0, result.stderr
    names = {w["name"] for w in json.loads(result.stdout)}
    assert names == {"catalogue-import", "hello", "order-fulfilment"}
