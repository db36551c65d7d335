"""Workflows defined in Python (SPEC 7.5) through the command line and a real tree: the CLI
lists, validates and exports them (``flowforge workflows export NAME``: YAML that loads back
to the same digest; a bad name is one line and exit 5), and a tree whose config lists a
workflow module runs its workflow on worker processes and fires its schedule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from flowforge import workflow_from_mapping
from flowforge.cli import exitcodes
from tests import pyflows
from tests.cli_runner import assert_ok, run_config
from tests.e2e import Stack
from tests.helpers import query_count, wait_for

#: A config naming tests/pyflows.py as a workflow module and a handler module.
SETTINGS: dict[str, Any] = {
    "handlers": ["tests.e2e_handlers", "tests.pyflows"],
    "workflow_modules": ["tests.pyflows"],
}


def write_config(folder: Path, **settings: Any) -> Path:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump({**SETTINGS, **settings}))
    return path


def test_export_prints_yaml_that_loads_back_to_the_python_definition(tmp_path: Path) -> None:
    out = assert_ok(run_config(write_config(tmp_path), "workflows", "export", "py-pipeline"))
    built = pyflows.pipeline.build()
    loaded = workflow_from_mapping(yaml.safe_load(out), "export")
    assert loaded == built and loaded.digest == built.digest
    assert out.startswith(f"# workflow py-pipeline, digest {built.digest}\n")
    # the schedule of a workflow is exported with it
    ticking = workflow_from_mapping(
        yaml.safe_load(
            assert_ok(run_config(write_config(tmp_path), "workflows", "export", "py-ticking"))
        )
    )
    assert ticking.schedules == pyflows.ticking.build().schedules


def test_export_of_a_file_workflow_loads_back_to_the_same_digest(tmp_path: Path) -> None:
    (tmp_path / "wf").mkdir()
    (tmp_path / "wf" / "f.yaml").write_text(
        "name: f\ntasks:\n  - {name: a, handler: e2e.record, timeout: 5}\n"
        "  - {name: b, sleep: 1m, depends_on: a}\n"
    )
    config = write_config(tmp_path, workflows=["wf"])
    out = assert_ok(run_config(config, "workflows", "export", "f"))
    listed = json.loads(assert_ok(run_config(config, "workflows", "list", "--json")))
    digests = {w["name"]: w for w in listed}
    assert set(digests) == {"f", "py-pipeline", "py-ticking"}  # files and modules alike
    assert workflow_from_mapping(yaml.safe_load(out)).to_dict() == digests["f"]


@pytest.mark.parametrize("name", ["nope", "", "\x1b[31mred", "py-pipeline\n"])
def test_export_of_an_unknown_name_is_one_line_and_exit_5(tmp_path: Path, name: str) -> None:
    result = run_config(write_config(tmp_path), "workflows", "export", name)
    assert result.returncode == exitcodes.NOT_FOUND and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("flowforge: no workflow is called ")
    assert "\x1b" not in line and "configured: py-pipeline, py-ticking" in line


def test_export_with_a_broken_definition_is_exit_2_naming_it(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("name: broken\ntasks: [{name: a, handler: h, x: 1}]\n")
    result = run_config(
        write_config(tmp_path, workflows=["broken.yaml"]), "workflows", "export", "py-pipeline"
    )
    assert result.returncode == exitcodes.USAGE and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"flowforge: {tmp_path / 'broken.yaml'}:2: tasks[0].x: unknown key"
    ]


def test_validate_checks_the_modules_workflows_against_the_handlers(tmp_path: Path) -> None:
    out = assert_ok(run_config(write_config(tmp_path), "workflows", "validate"))
    assert out == "2 workflow(s) valid: py-pipeline, py-ticking\n"
    # without the module among the handlers, nothing registers its step's handler
    config = write_config(tmp_path, handlers=["tests.e2e_handlers"])
    result = run_config(config, "workflows", "validate")
    assert result.returncode == exitcodes.USAGE and result.stdout == ""
    assert result.stderr.splitlines() == [
        "flowforge: module tests.pyflows: workflow 'py-pipeline': tasks[1].handler: no "
        "configured handler module registers 'py-pipeline.double'"
    ]


@pytest.mark.slow
def test_a_python_workflow_runs_on_a_tree_and_its_schedule_fires(
    stack: Stack, sql: psycopg.Connection[tuple[Any, ...]]
) -> None:
    stack.start_all(workers=2, **SETTINGS)
    config = stack.config_path(**SETTINGS)
    run_id = assert_ok(run_config(config, "trigger", "py-pipeline", "--input", '{"n": 21}')).strip()

    def status() -> dict[str, Any]:
        found: dict[str, Any] = json.loads(
            assert_ok(run_config(config, "status", run_id, "--json"))
        )
        return found

    finished = {"SUCCEEDED", "FAILED", "CANCELLED"}
    wait_for(lambda: status()["state"] in finished, timeout=60, what="the run to finish")
    run = status()
    assert run["state"] == "SUCCEEDED", run
    tasks = {t["name"]: t for t in run["tasks"]}
    assert tasks["double"]["result"] == {"doubled": 42}
    assert list(tasks["last"]["result"]["upstream"]) == ["pause"]  # after the durable timer
    # each handler task executed exactly once, counted in the database
    executions = sql.execute(
        "SELECT task, count(*) FROM test_executions WHERE run_id = %s GROUP BY task",
        (run_id,),
    ).fetchall()
    assert dict(executions) == {"first": 1, "double": 1, "last": 1}
    # the scheduler fired the Python-defined schedule, and its runs ran
    wait_for(
        lambda: (
            query_count(
                sql,
                "SELECT count(*) FROM workflow_runs WHERE workflow = 'py-ticking'"
                " AND schedule = 'py-tick' AND state = 'SUCCEEDED'",
            )
            >= 2
        ),
        timeout=60,
        what="two scheduled runs of py-ticking to succeed",
    )
