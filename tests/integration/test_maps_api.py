"""A map task (``for_each``) through the api and the CLI: one graph node with its items counted
by state, the items paged in item order, ``flowforge status`` counting them; bad paging
parameters and ids that are not maps are JSON 4xx, never a 500.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.states import TaskState
from flowforge.errors import InputError, NotFoundError
from tests import cli_runner
from tests.api_client import UNKNOWN_ID, Api, assert_json_error, ok, serve_stack
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
    with serve_stack(tmp_path_factory.mktemp("maps-api"), database_url, broker_url) as found:
        yield found


def expanded(repo: Store, sql: Sql, n: int) -> tuple[UUID, dict[str, UUID]]:
    """A run whose map has ``n`` items, items 0 and 1 SUCCEEDED."""
    run_id = repo.trigger(MAPPED, {}).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=list(range(n)))
    dispatch(sql)
    drain(repo)
    tokens = dict(dispatch(sql))  # the outbox rows of one statement carry no item order
    first_two = sql.execute(
        "SELECT id FROM task_runs WHERE map_id = %s AND item_index < 2 ORDER BY item_index",
        (ids["process"],),
    ).fetchall()
    for (tid,) in first_two:
        item = repo.claim(tid, tokens[tid], "w", 30.0).claim
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


def items_url(task_run_id: UUID | str, query: str = "") -> str:
    return f"/api/v1/task-runs/{task_run_id}/items" + (f"?{query}" if query else "")


def walk(api: Api, task_run_id: UUID, query: str) -> list[dict[str, Any]]:
    """Every item the pages of ``query`` give, following ``next_cursor`` to the end."""
    seen: list[dict[str, Any]] = []
    page = ok(api.get(items_url(task_run_id, query)))
    for _ in range(1000):  # a bound: a cursor that never ends would fail, not hang
        seen += page["items"]
        if page["next_cursor"] is None:
            return seen
        page = ok(api.get(items_url(task_run_id, f"{query}&cursor={page['next_cursor']}")))
    raise AssertionError("the pages never ended")


def test_the_items_come_a_page_at_a_time_in_item_order(api: Api, repo: Store, sql: Sql) -> None:
    _, ids = expanded(repo, sql, 250)
    first = ok(api.get(items_url(ids["process"], "limit=100")))
    assert first["counts"] == {"SUCCEEDED": 2, "READY": 248}
    assert first["task"]["name"] == "process" and first["task"]["for_each"] == "list"
    assert [i["index"] for i in first["items"]] == list(range(100))
    assert isinstance(first["next_cursor"], str)
    assert [i["item"] for i in first["items"][:3]] == [0, 1, 2]
    assert first["items"][0]["state"] == "SUCCEEDED" and first["items"][0]["result"] == 0
    # 100 + 100 + 50: every item exactly once, in item order, and the last page says so
    walked = walk(api, ids["process"], "limit=100")
    assert [i["index"] for i in walked] == list(range(250))
    assert len({i["id"] for i in walked}) == 250
    exact = ok(api.get(items_url(ids["process"], "limit=250")))
    assert len(exact["items"]) == 250 and exact["next_cursor"] is None
    default = ok(api.get(items_url(ids["process"])))
    assert len(default["items"]) == 100  # the default page
    item_id = first["items"][5]["id"]
    item = ok(api.get(f"/api/v1/task-runs/{item_id}"))
    assert item["task"]["map_id"] == str(ids["process"]) and item["task"]["item_index"] == 5
    assert item["upstream"] == {}  # the list it maps over is its item, not an upstream
    # nor is it the map's: those are its items, paged here, not sent whole with its detail
    assert ok(api.get(f"/api/v1/task-runs/{ids['process']}"))["upstream"] == {}
    assert ok(api.get(f"/api/v1/task-runs/{ids['merge']}"))["upstream"] == {"process": None}


def test_a_state_filter_pages_only_those_items_and_counts_them_all(
    api: Api, repo: Store, sql: Sql
) -> None:
    _, ids = expanded(repo, sql, 250)
    done = walk(api, ids["process"], "state=succeeded&limit=1")
    assert [(i["index"], i["state"]) for i in done] == [(0, "SUCCEEDED"), (1, "SUCCEEDED")]
    ready = walk(api, ids["process"], "state=READY&limit=100")
    assert [i["index"] for i in ready] == list(range(2, 250))
    none = ok(api.get(items_url(ids["process"], "state=DEAD")))
    assert none["items"] == [] and none["next_cursor"] is None
    assert none["counts"] == {"SUCCEEDED": 2, "READY": 248}  # counts ignore the filter


def other_cursor() -> str:
    """A well-formed cursor of another list (the runs')."""
    return base64.urlsafe_b64encode(
        f"{datetime.now(UTC).isoformat()}|{UNKNOWN_ID}".encode()
    ).decode()


@pytest.mark.parametrize(
    ("query", "names"),
    [
        ("cursor=", "cursor"),
        ("cursor=x", "cursor"),
        ("cursor=%00", "cursor"),
        ("cursor=aXRlbTo1", None),  # item:5, well-formed: the only valid row, checked below
        ("cursor=aXRlbTo1==", "cursor"),  # padded: not what the api writes
        ("cursor=aXRlbTotMQ", "cursor"),  # item:-1
        ("cursor=aXRlbTo5OTk5OTk5OTk5OQ", "cursor"),  # item:99999999999: past an integer
        ("cursor=MTI", "cursor"),  # a bare number
        ("cursor=RUNS", "cursor"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("limit=x", "limit"),
        ("limit=-1", "limit"),
        ("state=nope", "state"),
        ("state=SCHEDULED", "state"),  # a run state, not a task state
        ("state=%00", "state"),
    ],
)
def test_bad_paging_parameters_are_a_400_naming_the_parameter(
    api: Api, repo: Store, sql: Sql, query: str, names: str | None
) -> None:
    _, ids = expanded(repo, sql, 10)
    query = query.replace("RUNS", other_cursor())
    if names is None:
        assert [i["index"] for i in ok(api.get(items_url(ids["process"], query)))["items"]] == [
            6,
            7,
            8,
            9,
        ]
        return
    message = assert_json_error(api.get(items_url(ids["process"], query)), 400)
    assert names in message


def test_items_of_a_task_that_is_not_a_map_or_of_no_task_are_a_404(
    api: Api, repo: Store, sql: Sql
) -> None:
    _, ids = expanded(repo, sql, 3)
    assert "not a map" in assert_json_error(api.get(items_url(ids["merge"])), 404)
    assert_json_error(api.get(items_url(UNKNOWN_ID)), 404)
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


def flowforge(url: str, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env["FLOWFORGE_DATABASE_URL"] = url
    return cli_runner.run(["-c", str(EXAMPLE), *args], env)


def test_flowforge_items_prints_the_counts_then_a_page_and_the_cursor_of_the_next(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    run_id, ids = expanded(repo, sql, 250)
    first = flowforge(clean_database_url, "items", str(run_id), "process", "--limit", "100")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith(f"map process (task run {ids['process']})")
    assert lines[1] == "250 items: 248 READY, 2 SUCCEEDED"
    assert lines[2].split() == ["INDEX", "STATE", "ATTEMPT", "REASON", "ITEM", "ID"]
    rows = [line.split() for line in lines[3:-1]]
    assert [int(r[0]) for r in rows] == list(range(100))
    assert rows[0][:3] == ["0", "SUCCEEDED", "1"] and rows[2][:2] == ["2", "READY"]
    cursor = lines[-1].removeprefix("next page: --cursor ")
    seen = [int(r[0]) for r in rows]
    for _ in range(10):  # bounded: 250 items, 100 a page
        page = flowforge(
            clean_database_url, "items", str(ids["process"]), "--limit", "100", "--cursor", cursor
        )
        assert page.returncode == 0, page.stderr
        lines = page.stdout.splitlines()
        seen += [int(line.split()[0]) for line in lines[3:-1]]
        if lines[-1] == "last page":
            break
        cursor = lines[-1].removeprefix("next page: --cursor ")
    assert seen == list(range(250))

    as_json = flowforge(
        clean_database_url, "items", str(run_id), "process", "--json", "--state", "succeeded"
    )
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["counts"] == {"READY": 248, "SUCCEEDED": 2} and data["next_cursor"] is None
    assert [(i["index"], i["state"], i["result"]) for i in data["items"]] == [
        (0, "SUCCEEDED", 0),
        (1, "SUCCEEDED", 1),
    ]


def test_client_map_items_pages_as_the_api_does(
    repo: Store, sql: Sql, clean_database_url: str
) -> None:
    from flowforge.client import Client
    from flowforge.config import load_config

    _, ids = expanded(repo, sql, 250)
    config = load_config(EXAMPLE, env={"FLOWFORGE_DATABASE_URL": clean_database_url})
    with Client(config) as client:
        seen, cursor = [], None
        for _ in range(10):  # bounded: 250 items, 100 a page
            page = client.map_items(ids["process"], limit=100, cursor=cursor)
            seen += [i.index for i in page.items]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert seen == list(range(250))
        assert page.counts == {"SUCCEEDED": 2, "READY": 248}
        done = client.map_items(str(ids["process"]), state=TaskState.SUCCEEDED)
        assert [i.index for i in done.items] == [0, 1] and done.next_cursor is None
        for bad in ({"cursor": "x"}, {"limit": 0}, {"state": "later"}):
            with pytest.raises(InputError):
                client.map_items(ids["process"], **bad)
        with pytest.raises(NotFoundError, match="not a map"):
            client.map_items(ids["merge"])


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["RUN", "nope"], exitcodes.NOT_FOUND, "has no task 'nope'"),
        (["RUN", "merge"], exitcodes.NOT_FOUND, "not a map"),
        (["MERGE"], exitcodes.NOT_FOUND, "not a map"),
        ([UNKNOWN_ID, "process"], exitcodes.NOT_FOUND, "no run"),
        ([UNKNOWN_ID], exitcodes.NOT_FOUND, "no task run"),
        (["not-a-uuid", "process"], exitcodes.USAGE, "run id"),
        (["MAP", "--limit", "0"], exitcodes.USAGE, "--limit must be an integer from 1 to 500"),
        (["MAP", "--limit", "x"], exitcodes.USAGE, "--limit"),
        (["MAP", "--state", "bogus"], exitcodes.USAGE, "--state must be one of"),
        (["MAP", "--cursor", "x\x1b[2J"], exitcodes.USAGE, "--cursor is malformed"),
        (["MAP", "extra", "words"], exitcodes.USAGE, "unrecognized arguments"),
    ],
)
def test_flowforge_items_refuses_with_one_line_and_its_exit_code(
    repo: Store, sql: Sql, clean_database_url: str, args: list[str], code: int, message: str
) -> None:
    run_id, ids = expanded(repo, sql, 3)
    names = {"RUN": str(run_id), "MERGE": str(ids["merge"]), "MAP": str(ids["process"])}
    found = flowforge(clean_database_url, "items", *[names.get(a, a) for a in args])
    assert found.returncode == code, found
    assert message in found.stderr and found.stdout == ""
    assert len(found.stderr.splitlines()) == 1 and "Traceback" not in found.stderr
    assert "\x1b" not in found.stderr  # what the operator typed is shown escaped, never obeyed


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
