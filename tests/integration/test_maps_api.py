"""A map task (``for_each``) through the api and the CLI: one graph node with its items counted
by state, the items paged in item order, ``flowforge status`` counting them; bad paging
parameters and ids that are not maps are JSON 4xx, never a 500.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import TaskState
from tests import cli_runner
from tests.api_client import UNKNOWN_ID, Api, Reply, assert_json_error, serve_here
from tests.e2e import Stack
from tests.helpers import claim_task, dispatch, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "flowforge.example.yaml"
MAPPED = WorkflowDef(
    "api-map",
    (
        TaskDef("list", "tests.noop"),
        TaskDef("process", "tests.noop", for_each="list"),
        TaskDef("merge", "tests.noop", depends_on=("process",)),
    ),
)


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str
) -> Iterator[Api]:
    stack = Stack(tmp_path_factory.mktemp("maps-api"), database_url, broker_url)
    found, server = serve_here(stack)
    try:
        yield found
    finally:
        server.stop()


def ok(reply: Reply) -> Any:
    assert reply.status == 200, (reply.status, reply.body[:500])
    return reply.json()


def expanded(repo: Store, sql: Sql, n: int) -> tuple[UUID, dict[str, UUID]]:
    """A run whose map has ``n`` items, two of them SUCCEEDED."""
    run_id = repo.trigger(MAPPED, {}).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=list(range(n)))
    dispatch(sql)
    drain(repo)
    for tid, tok in dispatch(sql)[:2]:
        item = repo.claim(tid, tok, "w", 30.0).claim
        assert item is not None
        repo.finish(tid, item.fencing_token, TaskState.SUCCEEDED, result=item.index)
    drain(repo)
    return run_id, ids


def test_the_graph_draws_a_map_as_one_node_with_its_items_counted(
    api: Api, repo: Store, sql: Sql
) -> None:
    run_id, _ = expanded(repo, sql, 250)
    graph = ok(api.get(f"/api/v1/runs/{run_id}/graph"))
    assert [n["name"] for n in graph["nodes"]] == ["list", "process", "merge"]
    node = next(n for n in graph["nodes"] if n["name"] == "process")
    assert node["for_each"] == "list" and node["state"] == "RUNNING"
    assert node["item_counts"] == {"SUCCEEDED": 2, "READY": 248}
    assert next(n for n in graph["nodes"] if n["name"] == "merge")["item_counts"] is None
    run = ok(api.get(f"/api/v1/runs/{run_id}"))
    assert len(run["tasks"]) == 3  # items are not listed with the run's tasks


def test_the_items_come_a_page_at_a_time_in_item_order(api: Api, repo: Store, sql: Sql) -> None:
    _, ids = expanded(repo, sql, 250)
    first = ok(api.get(f"/api/v1/task-runs/{ids['process']}/items?limit=100"))
    assert first["counts"] == {"SUCCEEDED": 2, "READY": 248}
    assert first["task"]["name"] == "process" and first["task"]["for_each"] == "list"
    indexes = [i["index"] for i in first["items"]]
    assert indexes == list(range(100)) and first["next_after"] == 99
    assert [i["item"] for i in first["items"][:3]] == [0, 1, 2]
    assert first["items"][0]["state"] == "SUCCEEDED" and first["items"][0]["result"] == 0
    seen = indexes
    after = first["next_after"]
    while after is not None:
        page = ok(api.get(f"/api/v1/task-runs/{ids['process']}/items?after={after}&limit=100"))
        seen += [i["index"] for i in page["items"]]
        after = page["next_after"]
    assert seen == list(range(250))
    item_id = first["items"][5]["id"]
    item = ok(api.get(f"/api/v1/task-runs/{item_id}"))
    assert item["task"]["map_id"] == str(ids["process"]) and item["task"]["item_index"] == 5
    assert item["upstream"] == {}  # the list it maps over is its item, not an upstream


@pytest.mark.parametrize(
    "query",
    ["after=-2", "after=x", "after=1.5", "after=99999999999", "after=%00", "limit=0", "limit=501"],
)
def test_bad_paging_parameters_are_a_400_naming_the_parameter(
    api: Api, repo: Store, sql: Sql, query: str
) -> None:
    _, ids = expanded(repo, sql, 3)
    message = assert_json_error(api.get(f"/api/v1/task-runs/{ids['process']}/items?{query}"), 400)
    assert query.split("=")[0] in message


def test_items_of_a_task_that_is_not_a_map_or_of_no_task_are_a_404(
    api: Api, repo: Store, sql: Sql
) -> None:
    _, ids = expanded(repo, sql, 3)
    assert "not a map" in assert_json_error(api.get(f"/api/v1/task-runs/{ids['merge']}/items"), 404)
    assert_json_error(api.get(f"/api/v1/task-runs/{UNKNOWN_ID}/items"), 404)
    assert_json_error(api.get("/api/v1/task-runs/not-a-uuid/items"), 400)


def test_status_counts_a_maps_items_in_one_line(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id, _ = expanded(repo, sql, 5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env["FLOWFORGE_DATABASE_URL"] = clean_database_url
    human = cli_runner.run(["-c", str(EXAMPLE), "status", str(run_id)], env)
    assert human.returncode == 0, human.stderr
    line = next(x for x in human.stdout.splitlines() if x.startswith("process "))
    assert "5 items: 3 READY, 2 SUCCEEDED" in line
    as_json = cli_runner.run(["-c", str(EXAMPLE), "status", str(run_id), "--json"], env)
    process = next(t for t in json.loads(as_json.stdout)["tasks"] if t["name"] == "process")
    assert process["item_counts"] == {"READY": 3, "SUCCEEDED": 2}
    assert len(json.loads(as_json.stdout)["tasks"]) == 3


@pytest.mark.parametrize(
    ("process", "message"),
    [
        ("for_each: merge", "for_each names 'merge', which is not upstream of it"),
        ("for_each: nowhere", "for_each names unknown task 'nowhere'"),
        ("for_each: list, max_parallel: 0", "max_parallel must be a whole number"),
        ("max_parallel: 3", "max_parallel is only for a for_each task"),
    ],
)
def test_workflows_validate_refuses_a_bad_map_with_exit_2_naming_it(
    tmp_path: Path, process: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: etl\ntasks:\n"
        "  - {name: list, handler: h.list}\n"
        f"  - {{name: process, handler: h.process, {process}}}\n"
        "  - {name: merge, handler: h.merge, depends_on: [process]}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    found = cli_runner.run(["-c", str(EXAMPLE), "workflows", "validate", str(path)], env)
    assert found.returncode == exitcodes.USAGE, found
    assert message in found.stderr and "Traceback" not in found.stderr
