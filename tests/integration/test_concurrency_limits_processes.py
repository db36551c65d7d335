"""Concurrency limits with real trees (issue 20, SPEC 7.4): 8 workers on 2 trees (``flowforge
up``) on one database and one queue, one tree SIGKILLed mid-run. The peak concurrency of each key
is computed from the attempts' start and finish timestamps in the database (a killed worker's
attempt ends when its lease is reaped), and must never exceed the key's limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.client import Client
from flowforge.config import load_config
from flowforge.definitions import workflow_from_mapping
from tests.e2e import Stack
from tests.helpers import query_count, running_peaks, wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real trees

Sql = psycopg.Connection[tuple[Any, ...]]

RUNS_PER_TENANT = 16
TENANT_LIMIT = 3
PARTNER_LIMIT = 2
DONE_S = 180.0
WORKFLOW = workflow_from_mapping(
    {
        "name": "limited",
        "tasks": [
            {
                "name": "call",
                "handler": "e2e.sleep",
                "concurrency": {"key": "tenant-{tenant}", "limit": TENANT_LIMIT},
            },
            {  # a key without fields: one global limit for every task naming it
                "name": "notify",
                "handler": "e2e.sleep",
                "depends_on": ["call"],
                "concurrency": {"key": "partner", "limit": PARTNER_LIMIT},
            },
        ],
    }
)


def peaks(sql: Sql) -> dict[str, int]:
    """Per concurrency key, the most attempts running at one instant."""
    return running_peaks(
        sql.execute(
            "SELECT t.concurrency_key, a.started_at, a.finished_at"
            "  FROM task_attempts a JOIN task_runs t ON t.id = a.task_run_id"
            " WHERE t.concurrency_key IS NOT NULL"
        )
    )


def test_peak_concurrency_per_key_never_exceeds_its_limit_with_8_workers_on_2_trees(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    config = stack.config_path(processes={"workers": 4})
    for i in range(2):
        trees.append(Tree(config, tmp_path / f"tree-{i}.log", env=stack.env()))
    for tree in trees:
        tree.ready()
    inputs = [{"tenant": t, "seconds": 0.3} for t in ("a", "b") for _ in range(RUNS_PER_TENANT)]
    with Client(load_config(config, env={}), [WORKFLOW]) as client:
        runs: list[UUID] = [r.run_id for r in client.trigger_many("limited", inputs)]
    # one tree SIGKILLed while tasks run: its slots free when their leases are reaped
    wait_for(
        lambda: query_count(sql, "SELECT count(*) FROM test_executions") >= 8,
        60.0,
        0.05,
        "executions",
    )
    trees[0].kill()

    def settled() -> bool:
        assert trees[1].proc.poll() is None, f"the tree exited:\n{trees[1].log()[-3000:]}"
        done = "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s) AND state = 'SUCCEEDED'"
        return query_count(sql, done, runs) == len(runs)

    wait_for(settled, DONE_S, 0.2, "every run to succeed")
    found = peaks(sql)
    print(f"peak concurrency per key: {found}")  # the figure docs/flow-control.md quotes
    assert found["tenant-a"] <= TENANT_LIMIT and found["tenant-b"] <= TENANT_LIMIT
    assert found["partner"] <= PARTNER_LIMIT
    assert min(found.values()) >= 2  # the limits were reached for, not a serial run by chance
    # no held-back task used an attempt: only a reaped one (the killed tree's) has a second
    extra = query_count(sql, "SELECT count(*) FROM task_attempts WHERE attempt > 1")
    reaped = query_count(sql, "SELECT count(*) FROM task_attempts WHERE outcome = 'lease_expired'")
    assert extra == reaped
    print(f"attempts reaped after the tree was killed: {reaped}")
