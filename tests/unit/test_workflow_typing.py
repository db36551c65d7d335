"""flowforge.Workflow is typed for its users (SPEC 7.5): mypy --strict accepts a workflow
written with it and refuses, at the line, a value of the wrong kind, an unknown key or a
word no field takes — before anything runs."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # one cold mypy run (about 10 s on the shared machine)

USER_MODULE = """\
from datetime import timedelta

from flowforge import Concurrency, RetryPolicy, RunIf, Workflow, task


@task("payments.refund")
def refund(ctx: object) -> None:
    return None


flow = Workflow("orders", deadline="2h", fail_fast=False)
charge = flow.task(
    "charge",
    "payments.charge",
    retry=RetryPolicy(max_attempts=5),
    timeout=timedelta(seconds=30),
    concurrency=Concurrency("tenant-{tenant}", 3),
    rate_limit={"limit": 10, "per": "1s"},
)
flow.task("wait", sleep="10m", depends_on=charge)
flow.task("refund", refund, depends_on=[charge], run_if=RunIf.ANY_FAILED)


@flow.step(depends_on=["wait"], retry={"max_attempts": 3, "jitter": "full"})
def ship(ctx: object) -> dict[str, int]:
    return {"shipped": 1}


flow.task("child", workflow=Workflow("invoicing"), input={"order": "{order_id}"})
flow.schedule(cron="@daily", overlap="allow", input={"order_id": 1, "tenant": "t"})
definition = flow.build()
flow.task("bad-timeout", "x", timeout="30s")  # error: text where only seconds go
flow.task("bad-retry", "x", retry={"attempts": 3})  # error: no such retry key
flow.task("bad-run-if", "x", run_if="sometimes")  # error: no such condition
flow.task("bad-key", "x", retries=3)  # error: no such task key
flow.schedule(cron="@daily", overlap="never")  # error: no such overlap policy
"""


def test_mypy_strict_accepts_a_workflow_and_refuses_each_bad_value_at_its_line(
    tmp_path: Path,
) -> None:
    module = tmp_path / "user_flows.py"
    module.write_text(textwrap.dedent(USER_MODULE))
    out, err, status = api.run(
        ["--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"), str(module)]
    )
    assert status == 1, (out, err)
    flagged = sorted({int(n) for n in re.findall(r"user_flows\.py:(\d+): error", out)})
    expected = [n for n, line in enumerate(USER_MODULE.splitlines(), 1) if "# error:" in line]
    assert len(expected) == 5
    assert flagged == expected, out
