"""Priorities with a real tree (``flowforge up``: scheduler, publisher, workers), counted in
PostgreSQL (issue 20, SPEC 7.4; docs/flow-control.md "Priorities").

A backlog of priority-0 runs is triggered at once; once the tree is busy with it, priority-9
runs are triggered. The order is read from ``task_attempts.started_at`` (each attempt's claim
time): every priority-9 task started before most of what was still waiting of the backlog when
it was triggered, and every task was executed once (``test_executions``).
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
from tests.helpers import wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real tree

Sql = psycopg.Connection[tuple[Any, ...]]

BACKLOG = 1500
URGENT = 10
DONE_S = 300.0


def started(sql: Sql, runs: list[UUID]) -> int:
    row = sql.execute(
        "SELECT count(*) FROM task_runs WHERE run_id = ANY(%s) AND started_at IS NOT NULL",
        (runs,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def succeeded(sql: Sql, runs: list[UUID]) -> int:
    row = sql.execute(
        "SELECT count(*) FROM task_runs WHERE run_id = ANY(%s) AND state = 'SUCCEEDED'", (runs,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_priority_9_tasks_overtake_a_backlog_on_a_real_tree(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    config = stack.config_path(processes={"workers": 2})
    wf = workflow_from_mapping({"name": "work", "tasks": [{"name": "t", "handler": "e2e.record"}]})
    trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
    trees[0].ready()
    with Client(load_config(config, env={}), [wf]) as client:
        backlog = [r.run_id for r in client.trigger_many("work", [{}] * BACKLOG)]
        wait_for(lambda: started(sql, backlog) >= 100, 60, 0.05, "the tree busy with the backlog")
        ahead_at_trigger = started(sql, backlog)
        urgent = [r.run_id for r in client.trigger_many("work", [{}] * URGENT, priority=9)]
    waiting = BACKLOG - ahead_at_trigger
    # every task finished (not only started: its execution row is written by the handler)
    wait_for(lambda: succeeded(sql, backlog + urgent) == BACKLOG + URGENT, DONE_S, 0.2, "every run")
    ahead = sql.execute(
        "SELECT (SELECT count(*) FROM task_attempts b JOIN task_runs bt ON bt.id = b.task_run_id"
        "         WHERE bt.run_id = ANY(%(backlog)s) AND b.started_at < a.started_at)"
        "  FROM task_attempts a JOIN task_runs t ON t.id = a.task_run_id"
        " WHERE t.run_id = ANY(%(urgent)s)",
        {"backlog": backlog, "urgent": urgent},
    ).fetchall()
    overtaken = [ahead_at_trigger + waiting - int(r[0]) for r in ahead]
    assert len(overtaken) == URGENT
    assert waiting > BACKLOG // 2, waiting  # the backlog was still there when they came
    # each overtook at least three quarters of what was still waiting of the backlog
    assert min(overtaken) >= 3 * waiting // 4, (waiting, sorted(overtaken))
    # started is claimed: the last batch's handlers may still run; count once all finished
    wait_for(lambda: succeeded(sql, backlog + urgent) == BACKLOG + URGENT, DONE_S, 0.2, "done")
    row = sql.execute(
        "SELECT count(*), count(DISTINCT task_run_id) FROM test_executions"
    ).fetchone()
    assert row == (BACKLOG + URGENT, BACKLOG + URGENT)  # each task executed once
    for tree in trees:
        assert tree.proc.poll() is None, tree.log()[-3000:]
