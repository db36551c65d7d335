"""A map's items under a per-tenant concurrency key with real trees (issue 20, SPEC 7.3 and
7.4): 8 workers on 2 trees (``flowforge up``) on one database and one queue, one tree SIGKILLed
while items run. The peak number of items running at once per key is computed from the
attempts' start and finish timestamps in the database (a killed worker's attempt ends when its
lease is reaped), and must never exceed the key's limit; ``max_parallel`` bounds the items in
play, counted the same way.
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
from tests.helpers import query_count, wait_for
from tests.integration.test_map_limits import peaks
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real trees

Sql = psycopg.Connection[tuple[Any, ...]]

ITEMS = 48
TENANT_LIMIT = 3
MAX_PARALLEL = 8
DONE_S = 180.0
WORKFLOW = workflow_from_mapping(
    {
        "name": "tenant_map",
        "tasks": [
            {"name": "list", "handler": "e2e.tenant_items"},
            {
                "name": "process",
                "handler": "e2e.item_paced",
                "for_each": "list",
                "max_parallel": MAX_PARALLEL,
                "concurrency": {"key": "tenant-{item[tenant]}", "limit": TENANT_LIMIT},
            },
            {"name": "merge", "handler": "e2e.record", "depends_on": ["process"]},
        ],
    }
)


def test_peak_items_per_key_never_exceed_the_limit_with_8_workers_on_2_trees(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    config = stack.config_path(processes={"workers": 4})
    for i in range(2):
        trees.append(Tree(config, tmp_path / f"tree-{i}.log", env=stack.env()))
    for tree in trees:
        tree.ready()
    run_input = {"n": ITEMS, "tenants": ["a", "b", "c"], "item_s": 0.3}
    with Client(load_config(config, env={}), [WORKFLOW]) as client:
        run: UUID = client.trigger("tenant_map", run_input).run_id
    # one tree SIGKILLed while items run: its slots free when their leases are reaped
    wait_for(
        lambda: (
            query_count(
                sql, "SELECT count(*) FROM test_executions WHERE handler = 'e2e.item_paced'"
            )
            >= 8
        ),
        60.0,
        0.05,
        "items executing",
    )
    trees[0].kill()

    def settled() -> bool:
        assert trees[1].proc.poll() is None, f"the tree exited:\n{trees[1].log()[-3000:]}"
        done = "SELECT count(*) FROM workflow_runs WHERE id = %s AND state = 'SUCCEEDED'"
        return query_count(sql, done, run) == 1

    wait_for(settled, DONE_S, 0.2, "the run to succeed")
    found = peaks(sql)
    everything = peaks(sql, "NULL")["all"]
    print(f"peak items per key: {found}; all items: {everything}")  # docs/flow-control.md
    assert set(found) == {"tenant-a", "tenant-b", "tenant-c"}
    assert all(n <= TENANT_LIMIT for n in found.values())
    assert everything <= MAX_PARALLEL
    assert min(found.values()) >= 2  # the limits were reached for, not a serial run by chance
    # no held-back item used an attempt: only a reaped one (the killed tree's) has a second
    extra = query_count(sql, "SELECT count(*) FROM task_attempts WHERE attempt > 1")
    reaped = query_count(sql, "SELECT count(*) FROM task_attempts WHERE outcome = 'lease_expired'")
    assert extra == reaped
    print(f"attempts reaped after the tree was killed: {reaped}")
