"""Sub-workflows through `flowforge status`, `flowforge workflows validate`, the api's run JSON
and `Client.trigger` (SPEC 7.3).

The real command (tests/cli_runner.py) and the api role on a thread of this process
(tests/api_here.py), over a real database. Bad definitions are one line each on stderr and
exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.cli import exitcodes
from flowforge.client import Client
from flowforge.config import load_config
from flowforge.domain.model import TaskRun
from flowforge.domain.states import TaskState
from tests import cli_runner
from tests.api_client import TOKEN, TOKEN_ENV, Api
from tests.api_here import ApiHere
from tests.e2e import REPO
from tests.harness.resources import free_ports
from tests.helpers import drain
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

ORDER = """\
name: order
tasks:
  - {name: approve, handler: e2e.record}
  - name: invoice
    workflow: invoicing
    depends_on: [approve]
    input: {order: "{order_id}", total: "{upstream[approve][total]}", fixed: [1, {a: b}]}
"""
INVOICING = """\
name: invoicing
tasks:
  - {name: bill, handler: e2e.record}
"""


@pytest.fixture
def setup(tmp_path: Path, clean_database_url: str) -> Path:
    folder = tmp_path / "workflows"
    folder.mkdir()
    (folder / "order.yaml").write_text(ORDER)
    (folder / "invoicing.yaml").write_text(INVOICING)
    port = free_ports(1)[0]
    config = tmp_path / "flowforge.yaml"
    config.write_text(
        json.dumps(
            {
                "database": {"url": clean_database_url},
                "workflows": [str(folder)],
                "handlers": ["tests.e2e_handlers"],
                "api": {"listen": f"127.0.0.1:{port}", "token_env": TOKEN_ENV},
            }
        )
    )
    return config


@pytest.fixture
def api(setup: Path) -> Iterator[Api]:
    config = load_config(setup, env={TOKEN_ENV: TOKEN})
    server = ApiHere(config)
    server.start()
    try:
        yield Api(server.port, TOKEN, setup)
    finally:
        server.stop()


def flowforge(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    return cli_runner.run(["-c", str(config), *args], env, cwd=REPO)


def started_child(setup: Path, repo: Store, sql: Sql) -> tuple[str, str]:
    """A run of order (triggered through the Client, which registers invoicing) whose invoice
    task runs its child; (parent run id, child run id)."""
    with Client(load_config(setup, env={})) as client:
        run_id = client.trigger("order", {"order_id": 42}).run_id
    invoice = approved(repo, run_id, 9)
    return str(run_id), str(invoice.child_run_id)


def approved(repo: Store, run_id: UUID | str, total: int) -> TaskRun:
    """Run ``approve`` (result ``{"total": total}``) and the passes: the invoice task, whose
    child run started."""
    approve = repo.get_run(run_id).task("approve")
    claim = repo.claim(approve.id, approve.fencing_token, "w", 30.0)
    assert claim.claim is not None
    repo.finish(approve.id, claim.claim.fencing_token, TaskState.SUCCEEDED, result={"total": total})
    drain(repo)
    invoice = repo.get_run(run_id).task("invoice")
    assert invoice.state is TaskState.RUNNING and invoice.child_run_id is not None
    return invoice


def test_status_links_the_parent_to_its_child_and_back(setup: Path, repo: Store, sql: Sql) -> None:
    parent, child = started_child(setup, repo, sql)
    shown = flowforge(setup, "status", parent)
    assert shown.returncode == 0, shown.stderr
    [invoice] = [line for line in shown.stdout.splitlines() if line.startswith("invoice")]
    assert f"child run {child} (invoicing)" in invoice
    as_json = json.loads(flowforge(setup, "status", parent, "--json").stdout)
    [task] = [t for t in as_json["tasks"] if t["name"] == "invoice"]
    assert (task["child_workflow"], task["child_run_id"]) == ("invoicing", child)
    assert [(c["task"], c["run_id"], c["attempt"]) for c in as_json["children"]] == [
        ("invoice", child, 1)
    ]
    assert as_json["parent_run_id"] is None
    of_child = flowforge(setup, "status", child)
    assert f"child of run {parent}  task run {task['id']}" in of_child.stdout
    child_json = json.loads(flowforge(setup, "status", child, "--json").stdout)
    assert (child_json["parent_run_id"], child_json["parent_task_id"]) == (parent, task["id"])
    assert child_json["input"] == {"order": 42, "total": 9, "fixed": [1, {"a": "b"}]}
    listed = {r["id"]: r for r in json.loads(flowforge(setup, "runs", "--json").stdout)}
    assert listed[child]["parent_run_id"] == parent and listed[parent]["parent_run_id"] is None


def test_the_api_run_json_carries_the_links(api: Api, setup: Path, repo: Store, sql: Sql) -> None:
    parent, child = started_child(setup, repo, sql)
    reply = api.get(f"/api/v1/runs/{parent}")
    assert reply.status == 200
    body = reply.json()
    assert body["children"][0]["run_id"] == child
    [task] = [t for t in body["tasks"] if t["name"] == "invoice"]
    assert task["child_run_id"] == child
    reply = api.get(f"/api/v1/runs/{child}")
    assert reply.status == 200 and reply.json()["parent_run_id"] == parent
    reply = api.get(f"/api/v1/runs/{parent}/graph")
    assert reply.status == 200
    graph = reply.json()
    [node] = [n for n in graph["nodes"] if n["name"] == "invoice"]
    assert node["child_run_id"] == child and graph["run"]["children"][0]["run_id"] == child


def test_a_run_triggered_through_the_api_starts_its_child(api: Api, repo: Store) -> None:
    run_id = api.create("order", {"order_id": 1})["id"]
    invoice = approved(repo, run_id, 1)
    assert invoice.child_run_id is not None
    child = repo.get_run(invoice.child_run_id)
    assert child.workflow == "invoicing"  # its definition registered by the api's trigger
    assert child.input == {"order": 1, "total": 1, "fixed": [1, {"a": "b"}]}


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        (
            {"a.yaml": "name: a\ntasks:\n  - {name: t, workflow: nowhere}\n"},
            "'nowhere' is not defined",
        ),
        (
            {
                "a.yaml": "name: a\ntasks:\n  - {name: t, workflow: b}\n",
                "b.yaml": "name: b\ntasks:\n  - {name: t, workflow: a}\n",
            },
            "recurse into themselves: a -> b -> a",
        ),
        ({"a.yaml": "name: a\ntasks:\n  - {name: t, workflow: a}\n"}, "cannot recurse into itself"),
        (
            {
                "a.yaml": "name: a\ntasks:\n  - {name: t, workflow: b, handler: x}\n",
                "b.yaml": INVOICING,
            },
            "both workflow and handler",
        ),
        (
            {"a.yaml": "name: a\ntasks:\n  - {name: t, workflow: b, sleep: 1m}\n"},
            "both workflow and sleep",
        ),
        (
            {"a.yaml": 'name: a\ntasks:\n  - {name: t, workflow: b, input: {x: "{a.b}"}}\n'},
            "template field {a.b}",
        ),
        (
            {
                "a.yaml": "name: a\ntasks:\n"
                '  - {name: t, workflow: b, input: {x: "{upstream[z]}"}}\n'
            },
            "not one of its dependencies",
        ),
        (
            {"a.yaml": "name: a\ntasks:\n  - {name: t, workflow: b, input: [1]}\n"},
            "expected a mapping",
        ),
        (
            {"a.yaml": "name: a\ntasks:\n  - {name: t, handler: x, input: {a: 1}}\n"},
            "input is only for",
        ),
        (
            {"a.yaml": "name: a\ntasks:\n  - {name: t, workflow: b, timeout: 5}\n"},
            "takes no timeout",
        ),
    ],
)
def test_validate_refuses_bad_child_workflows_with_one_line_each_and_exit_2(
    tmp_path: Path, files: dict[str, str], fragment: str
) -> None:
    folder = tmp_path / "wf"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    config = tmp_path / "flowforge.yaml"
    config.write_text(json.dumps({"workflows": [str(folder)]}))
    done = flowforge(config, "workflows", "validate")
    assert done.returncode == exitcodes.USAGE
    assert fragment in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert all(line.startswith("flowforge: ") for line in done.stderr.splitlines())


def test_validate_accepts_a_parent_and_its_child(setup: Path) -> None:
    done = flowforge(setup, "workflows", "validate")
    assert done.returncode == 0, done.stderr
    assert "2 workflow(s) valid: invoicing, order" in done.stdout
