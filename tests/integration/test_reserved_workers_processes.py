"""Reserved workers with a real tree (``flowforge up``), counted in PostgreSQL (issue 20,
SPEC 7.4; docs/flow-control.md "Reserved workers").

A tree of two workers on a queue and one reserved for priorities 5 and above. A backlog of
priority-0 runs whose handler takes half a second keeps both plain workers busy; priority-9
runs triggered behind it are run — every one of them — by the reserved worker (its process
title, read from ``/proc`` for the pid each execution recorded) while most of the backlog still
waits, the reserved worker runs no priority-0 task, and every task is executed once.
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

BACKLOG = 40
URGENT = 5
DONE_S = 120.0


def count(sql: Sql, runs: list[UUID], where: str) -> int:
    row = sql.execute(
        f"SELECT count(*) FROM task_runs WHERE run_id = ANY(%s) AND {where}", (runs,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def pids(sql: Sql, runs: list[UUID]) -> set[int]:
    found = sql.execute("SELECT DISTINCT pid FROM test_executions WHERE run_id = ANY(%s)", (runs,))
    return {int(r[0]) for r in found.fetchall()}


def title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_urgent_runs_go_to_the_reserved_worker_while_the_backlog_waits(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    pools = [
        {"queue": stack.queue, "workers": 2},
        {"queue": stack.queue, "workers": 1, "min_priority": 5},
    ]
    config = stack.config_path(processes={"pools": pools})
    slow = workflow_from_mapping({"name": "slow", "tasks": [{"name": "t", "handler": "e2e.sleep"}]})
    quick = workflow_from_mapping(
        {"name": "quick", "tasks": [{"name": "t", "handler": "e2e.record"}]}
    )
    trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
    trees[0].ready()
    with Client(load_config(config, env={}), [slow, quick]) as client:
        backlog = [r.run_id for r in client.trigger_many("slow", [{"seconds": 0.5}] * BACKLOG)]
        wait_for(lambda: count(sql, backlog, "started_at IS NOT NULL") >= 2, 60, 0.05, "busy")
        urgent = [r.run_id for r in client.trigger_many("quick", [{}] * URGENT, priority=9)]
    wait_for(lambda: count(sql, urgent, "state = 'SUCCEEDED'") == URGENT, 60, 0.05, "urgent")
    # they did not wait for the backlog: most of it had not even started
    assert count(sql, backlog, "started_at IS NULL") >= BACKLOG // 2
    (reserved,) = pids(sql, urgent)  # all of them in one process: the reserved worker
    assert f"worker:{stack.queue}:p5" in title(reserved), title(reserved)
    wait_for(lambda: count(sql, backlog, "state = 'SUCCEEDED'") == BACKLOG, DONE_S, 0.2, "done")
    assert reserved not in pids(sql, backlog)  # it never ran a priority-0 task
    row = sql.execute(
        "SELECT count(*), count(DISTINCT task_run_id) FROM test_executions"
    ).fetchone()
    assert row == (BACKLOG + URGENT, BACKLOG + URGENT)  # each task executed once
    for tree in trees:
        assert tree.proc.poll() is None, tree.log()[-3000:]
