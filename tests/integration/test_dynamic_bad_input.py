"""Bad input to issue 19's constructs through every path that needs a process or a database,
class by class (the tables are in tests/bad_dynamic.py):

- a workflow file: ``flowforge workflows validate`` — one line on stderr, exit 2;
- an event: ``POST /api/v1/events`` (a JSON 400), ``flowforge event send`` (one line, exit 2),
  ``Client.send_event`` (``InputError``) — and nothing stored;
- a run input that cannot fill a wait's key: ``POST /api/v1/runs``, ``flowforge trigger``,
  ``Client.trigger`` — and no run;
- a map's upstream result that cannot be expanded: at run time, the map DEAD with a reason and
  a one-line ``last_error``, no item, its dependents cancelled, the run FAILED.

Never a traceback, a 5xx or another exception.
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
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.reasons import FailureReason
from flowforge.domain.states import RunState, TaskState
from flowforge.errors import InputError
from tests.api_client import Api, assert_json_error, serve_config, write_config
from tests.bad_dynamic import (
    BAD_EVENTS,
    BAD_FILES,
    BAD_RESULTS,
    BAD_WAIT_INPUTS,
    CLI_EVENTS,
    FILE,
    KEYED_WAIT,
)
from tests.cli_runner import assert_refused, run_config
from tests.helpers import claim_task, dispatch, drain, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Path:
    """A config with the ``keyed`` workflow (a wait keyed ``order-{order[id]}``) and an api."""
    directory = tmp_path_factory.mktemp("bad-input")
    return write_config(
        directory, database_url, {"k.yaml": KEYED_WAIT}, handlers=["tests.e2e_handlers"]
    )


@pytest.fixture(scope="module")
def api(config: Path) -> Iterator[Api]:
    with serve_config(config) as running:
        yield running


def count(sql: Sql, table: str) -> int:
    row = sql.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ workflow files


@pytest.mark.parametrize(("process", "top", "fragment"), BAD_FILES)
def test_workflows_validate_refuses_each_bad_definition_with_one_line_and_exit_2(
    config: Path, tmp_path: Path, process: str, top: str, fragment: str
) -> None:
    path = tmp_path / "etl.yaml"
    path.write_text(FILE.format(process=process, top=top))
    found = run_config(config, "workflows", "validate", str(path))
    line = assert_refused(found, exitcodes.USAGE, fragment)
    assert str(path) in line


# ------------------------------------------------------------------ events


@pytest.mark.parametrize(("name", "key", "fragment"), BAD_EVENTS)
def test_the_api_refuses_each_bad_event_with_a_json_400(
    api: Api, sql: Sql, name: Any, key: Any, fragment: str
) -> None:
    sent = {"name": name, "key": key, "data": {"x": 1}}
    request = {field: value for field, value in sent.items() if value is not None}
    assert fragment in assert_json_error(api.post("/api/v1/events", request), 400)
    assert count(sql, "events") == 0


@pytest.mark.parametrize(("name", "key", "fragment"), BAD_EVENTS)
def test_client_send_event_refuses_each_bad_event(
    config: Path, sql: Sql, name: Any, key: Any, fragment: str
) -> None:
    with Client(load_config(config, env={})) as client, pytest.raises(InputError) as caught:
        client.send_event(name, key, {"x": 1})
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    assert count(sql, "events") == 0


@pytest.mark.parametrize(("args", "fragment"), CLI_EVENTS)
def test_event_send_refuses_each_bad_event_with_one_line_and_exit_2(
    config: Path, sql: Sql, args: list[str], fragment: str
) -> None:
    assert_refused(run_config(config, "event", "send", *args), exitcodes.USAGE, fragment)
    assert count(sql, "events") == 0


# ------------------------------------------------------------------ triggers


@pytest.mark.parametrize(("run_input", "fragment"), BAD_WAIT_INPUTS)
def test_a_run_input_that_cannot_fill_a_wait_key_is_refused_everywhere(
    api: Api, config: Path, sql: Sql, run_input: dict[str, Any], fragment: str
) -> None:
    reply = api.post("/api/v1/runs", {"workflow": "keyed", "input": run_input})
    assert fragment in assert_json_error(reply, 400)
    if "\x00" not in repr(run_input):  # a NUL cannot be a command-line argument
        found = run_config(config, "trigger", "keyed", "--input", json.dumps(run_input))
        assert_refused(found, exitcodes.USAGE, fragment)
    with Client(load_config(config, env={})) as client, pytest.raises(InputError, match=fragment):
        client.trigger("keyed", run_input)
    assert count(sql, "workflow_runs") == 0


# ------------------------------------------------------------------ run time


@pytest.mark.parametrize(("result", "max_items", "key", "reason", "fragment"), BAD_RESULTS)
def test_a_result_the_map_cannot_expand_buries_it_with_a_clear_reason(
    repo: Store,
    sql: Sql,
    result: Any,
    max_items: int | None,
    key: str | None,
    reason: FailureReason,
    fragment: str,
) -> None:
    wf = WorkflowDef(
        "bad-map",
        (
            TaskDef("list", "tests.noop"),
            TaskDef("process", "tests.noop", for_each="list", idempotency_key=key),
            TaskDef("merge", "tests.noop", depends_on=("process",)),
        ),
        max_items=max_items,
    )
    run_id = repo.trigger(wf).run_id
    ids = task_ids(repo, run_id)
    claim = claim_task(repo, sql, ids["list"])
    assert repo.finish(ids["list"], claim.fencing_token, TaskState.SUCCEEDED, result=result)
    dispatch(sql)
    drain(repo)
    process = repo.get_task(ids["process"])
    assert process.state is TaskState.DEAD and process.failure_reason is reason
    assert process.last_error is not None and fragment in process.last_error
    assert "\n" not in process.last_error and len(process.last_error) < 400
    assert count(sql, "task_runs WHERE map_id IS NOT NULL") == 0  # nothing half-expanded
    assert repo.get_task(ids["merge"]).state is TaskState.CANCELLED
    assert repo.get_run(run_id).state is RunState.FAILED
