"""``flowforge purge --dead --older-than AGE`` through the real command, on a real database.

Rows are made by driving the repository and aged with SQL (the database clock is the only
clock). A dry run counts without deleting; a purge deletes exactly the old dead tasks with their
runs, batch by batch, writes an audit row and says how many blocked streams it released; a bad
duration is one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import TaskState
from tests.helpers import FAST_RETRY, drain, single, task_ids
from tests.integration.test_cli_operations import (
    assert_operator_error,
    flowforge,
    ok,
    ok_json,
)
from tests.integration.test_retention import BLOCKING, backdate, dead_single, die
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text("workflows: []\n")
    return path


def count(sql: Sql, table: str) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def aged_dead(repo: Store, sql: Sql, hours: float, **run_input: Any) -> Any:
    """A one-task run of a blocking stream whose task died ``hours`` ago; its task id."""
    task_id = dead_single(repo, sql, BLOCKING, **run_input)
    backdate(sql, repo.get_task(task_id).run_id, hours=hours)
    return task_id


def test_a_dry_run_counts_and_lists_what_would_go_and_deletes_nothing(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    old = aged_dead(repo, sql, hours=100 * 24, account=1)
    aged_dead(repo, sql, hours=1, account=2)  # younger than 90d
    before = {t: count(sql, t) for t in ("workflow_runs", "task_runs", "task_attempts")}

    args = ("purge", "--dead", "--older-than", "90d", "--dry-run")
    data = ok_json(flowforge(*args, "--json", url=clean_database_url, config=config))
    assert {k: data[k] for k in ("dry_run", "runs", "tasks", "dead_tasks", "kept")} == {
        "dry_run": True,
        "runs": 1,
        "tasks": 1,
        "dead_tasks": 1,
        "kept": 0,
    }
    assert (data["older_than_s"], data["streams_released"]) == (90 * 86_400, 1)
    assert data["released_streams"] == ["account-1"]
    assert [t["id"] for t in data["shown"]] == [str(old)]

    text = ok(flowforge(*args, url=clean_database_url, config=config))
    assert "dry run: would purge 1 dead task(s) older than 90d in 1 run(s)" in text
    assert "would release 1 ordering stream(s) held by on_dead: block" in text
    assert str(old) in text
    assert {t: count(sql, t) for t in before} == before
    assert count(sql, "purge_audit") == 0


def test_a_purge_deletes_exactly_the_old_dead_tasks_and_says_which_streams_it_released(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    old = aged_dead(repo, sql, hours=13, account=1)
    waiting = task_ids(repo, repo.trigger(BLOCKING, {"account": 1}).run_id)["only"]
    recent = aged_dead(repo, sql, hours=11, account=2)
    drain(repo)
    assert repo.get_task(waiting).state is TaskState.PENDING  # held by the dead task

    args = ("purge", "--dead", "--older-than", "12h", "--by", "carol", "--json")
    data = ok_json(flowforge(*args, url=clean_database_url, config=config))
    assert {k: data[k] for k in ("dry_run", "runs", "dead_tasks", "streams_released")} == {
        "dry_run": False,
        "runs": 1,
        "dead_tasks": 1,
        "streams_released": 1,
    }
    assert data["released_streams"] == ["account-1"] and data["batches"] == 1
    remaining = {r[0] for r in sql.execute("SELECT id FROM task_runs")}
    assert remaining == {waiting, recent} and old not in remaining
    drain(repo)
    assert repo.get_task(waiting).state is TaskState.READY
    audit = sql.execute("SELECT requested_by, dead_task_ids, released_streams FROM purge_audit")
    assert audit.fetchall() == [("carol", [old], ["account-1"])]

    text = ok(flowforge("purge", "--dead", "--older-than", "12h", url=clean_database_url))
    assert text.splitlines()[0] == (
        "purged 0 dead task(s) older than 12h in 0 run(s) (0 task run(s) in all), 0 batch(es)"
    )


def test_a_purge_goes_in_bounded_batches_and_reports_what_it_kept(
    repo: Store, sql: Sql, clean_database_url: str, config: Path
) -> None:
    for n in range(3):
        dead_single(repo, sql, single("batched"), n=n)
    siblings = WorkflowDef(
        "siblings",
        (TaskDef("x", "tests.noop", retry=FAST_RETRY), TaskDef("y", "tests.noop")),
        fail_fast=False,
    )
    active = repo.trigger(siblings).run_id
    drain(repo)
    die(repo, sql, task_ids(repo, active)["x"])  # y can still run: x must wait
    sql.execute("UPDATE workflow_runs SET finished_at = now() - interval '1 hour'")
    sql.execute("UPDATE task_runs SET finished_at = now() - interval '1 hour' WHERE state = 'DEAD'")

    args = ("purge", "--dead", "--older-than", "30m", "--batch-size", "1", "--workflow")
    data = ok_json(flowforge(*args, "batched", "--json", url=clean_database_url, config=config))
    assert (data["runs"], data["batches"], data["kept"]) == (3, 3, 0)
    assert count(sql, "purge_audit") == 3
    text = ok(flowforge("purge", "--dead", "--older-than", "45s", url=clean_database_url))
    assert "purged 0 dead task(s) older than 45s" in text
    assert "kept 1 dead task(s) as old whose run still has work that can change" in text
    assert [r[0] for r in sql.execute("SELECT id FROM workflow_runs")] == [active]


@pytest.mark.parametrize("age", ["90", "1.5h", "0d", "-5m", "1h30m", "", "90 d", "7w", "12H"])
def test_a_bad_duration_is_one_line_and_exit_2_and_deletes_nothing(
    repo: Store, sql: Sql, clean_database_url: str, age: str
) -> None:
    aged_dead(repo, sql, hours=24 * 365, account=1)
    result = flowforge("purge", "--dead", "--older-than", age, url=clean_database_url)
    assert_operator_error(result, exitcodes.USAGE, "--older-than")
    assert count(sql, "task_runs") == 1


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("purge", "--older-than", "90d"), "--dead"),
        (("purge", "--dead"), "--older-than"),
        (("purge", "--dead", "--older-than", "90d", "--batch-size", "0"), "--batch-size"),
    ],
)
def test_an_incomplete_purge_command_is_one_line_and_exit_2(
    clean_database_url: str, args: tuple[str, ...], fragment: str
) -> None:
    assert_operator_error(flowforge(*args, url=clean_database_url), exitcodes.USAGE, fragment)
