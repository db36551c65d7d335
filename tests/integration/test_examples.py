"""The shipped example workflows (``config/workflows``) run on real role processes with the
example handlers (``config/examples``), driven through the CLI as ``scripts/demo`` drives
them: what the demo shows on a fresh machine, proven in the suite."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import cli_runner
from tests.e2e import REPO, Stack
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

SETTINGS: dict[str, Any] = {"handlers": ["examples.handlers"], "workflows": ["workflows"]}


def _cli(config: Path, *args: str) -> str:
    result: subprocess.CompletedProcess[str] = cli_runner.run_config(config, *args)
    assert result.returncode == 0, (args, result.returncode, result.stdout, result.stderr)
    return result.stdout


def _run(config: Path, run_id: str) -> dict[str, Any]:
    run: dict[str, Any] = json.loads(_cli(config, "status", run_id, "--json"))
    return run


def test_the_example_workflows_run_to_success_on_a_tree(stack: Stack) -> None:
    # the config Stack writes lives in stack.directory: relative paths resolve from there
    shutil.copytree(REPO / "config" / "examples", stack.directory / "examples")
    shutil.copytree(REPO / "config" / "workflows", stack.directory / "workflows")
    stack.start_all(workers=2, **SETTINGS)
    config = stack.config_path(**SETTINGS)

    order = _cli(
        config,
        "trigger",
        "order-fulfilment",
        "--input",
        '{"order_id": 42, "customer_id": 7, "amount": 1999, "items": ["book"]}',
    ).strip()
    catalogue = _cli(
        config, "trigger", "catalogue-import", "--input", '{"batch": "b1", "files": 5}'
    ).strip()
    # sent before the wait starts: the event is kept and delivered when it does
    _cli(config, "event", "send", "catalogue.approved", "--key", "b1", "--data", '{"by": "ci"}')

    wait_for(
        lambda: (
            {_run(config, order)["state"], _run(config, catalogue)["state"]}
            <= {"SUCCEEDED", "FAILED", "CANCELLED"}
        ),
        timeout=120,
        what="both example runs to finish",
    )
    assert _run(config, order)["state"] == "SUCCEEDED"
    run = _run(config, catalogue)
    assert run["state"] == "SUCCEEDED", run
    tasks = {t["name"]: t for t in run["tasks"]}
    assert tasks["import_file"]["result"] == [
        {"file": f"b1/part-{n}.csv", "index": n, "rows": 100 + n} for n in range(5)
    ]
    assert tasks["approve"]["result"] == {"by": "ci"}
    assert tasks["announce"]["result"] == {"greet": {"greeting": "hello, catalogue batch b1"}}
    assert tasks["undo"]["state"] == "CANCELLED"
    assert tasks["undo"]["cancel_cause"] == "condition_not_met"
    assert run["compensated"] == []
    [child] = run["children"]
    assert child["workflow"] == "hello" and child["state"] == "SUCCEEDED"
    assert _run(config, child["run_id"])["parent_run_id"] == catalogue
