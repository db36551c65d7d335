"""Queues that route, with real trees (``flowforge up``) on one database and one broker (issue
20, SPEC 7.4), counted in PostgreSQL: every execution is a ``test_executions`` row naming the
worker's pid, and the process registry names the queue each worker consumes.

- Two trees with different ``broker.queue`` and different handler modules, runs triggered from
  each (and a task of one tree's workflow sent to the other's queue): every task is executed
  once, by a worker of its own queue; none is buried ``unknown_handler`` (what happened before
  queues routed: each publisher sent every row to its own queue).
- One tree with two pools (``processes.pools``, the second importing one module only): tasks
  route by ``queue:``; READY tasks on a queue no worker consumes are reported unserved until
  the tree starts (failure mode 70); a pool's worker SIGKILLed mid-run is restarted on its own
  queue and every run still succeeds, each task on its own queue (failure mode 71).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.client import Client
from flowforge.config import load_config
from flowforge.definitions import workflow_from_mapping
from flowforge.domain.dag import WorkflowDef
from flowforge.domain.names import BANDS, band_queue
from flowforge.store.db import Database
from flowforge.store.reads import Reads
from tests.e2e import HANDLERS_MODULE, Stack
from tests.helpers import wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real trees

Sql = psycopg.Connection[tuple[Any, ...]]

PARTNER_MODULE = "tests.e2e_queue_handlers"
RUNS = 12
READY_S = 60.0
DONE_S = 120.0


def config_file(stack: Stack, name: str, **overrides: Any) -> Path:
    """The stack's config with ``overrides``, in a file of its own (``config_path`` writes
    one file per started process, and these trees are not the stack's processes)."""
    return stack.config_path(**overrides).rename(stack.directory / f"tree-{name}.yaml")


def workflow(name: str, tasks: list[dict[str, Any]]) -> WorkflowDef:
    return workflow_from_mapping({"name": name, "tasks": tasks})


def run_all(config: Path, wf: WorkflowDef, n: int) -> list[UUID]:
    with Client(load_config(config, env={}), [wf]) as client:
        return [r.run_id for r in client.trigger_many(wf.name, [{}] * n)]


def settled(sql: Sql, runs: list[UUID]) -> bool:
    row = sql.execute(
        "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s)"
        " AND state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')",
        (runs,),
    ).fetchone()
    return row is not None and row[0] == len(runs)


def wait_settled(sql: Sql, runs: list[UUID], trees: list[Tree]) -> None:
    def probe() -> bool:
        for tree in trees:
            assert tree.proc.poll() is None, f"a tree exited:\n{tree.log()[-3000:]}"
        return settled(sql, runs)

    wait_for(probe, DONE_S, 0.2, f"{len(runs)} runs to finish")


def executed_on(sql: Sql) -> list[tuple[str, str, str | None, str, int]]:
    """Each execution: (task name, handler, the task's queue, the queue of the worker that ran
    it, executions of that task run so far). The worker's queue comes from the registry, while
    the trees run (a worker deregisters when it stops)."""
    return sql.execute(
        "SELECT t.name, e.handler, t.queue, p.queue,"
        "       count(*) OVER (PARTITION BY e.task_run_id)::int"
        "  FROM test_executions e"
        "  JOIN task_runs t ON t.id = e.task_run_id"
        "  JOIN processes p ON p.pid = e.pid AND p.role = 'worker'"
    ).fetchall()


def states(sql: Sql, runs: list[UUID]) -> dict[str, int]:
    found = sql.execute(
        "SELECT state, count(*) FROM task_runs WHERE run_id = ANY(%s) GROUP BY state", (runs,)
    ).fetchall()
    return {str(state): int(n) for state, n in found}


def executions(sql: Sql) -> int:
    row = sql.execute("SELECT count(*) FROM test_executions").fetchone()
    assert row is not None
    return int(row[0])


def test_two_trees_on_one_database_keep_their_work_apart(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    qa, qb = f"{stack.queue}.a", f"{stack.queue}.b"
    common: dict[str, Any] = {"processes": {"workers": 2}}
    config_a = config_file(stack, "a", broker={"queue": qa}, handlers=[HANDLERS_MODULE], **common)
    config_b = config_file(stack, "b", broker={"queue": qb}, handlers=[PARTNER_MODULE], **common)
    wf_a = workflow(
        "wf_a",
        [
            {"name": "first", "handler": "e2e.record"},
            {"name": "then", "handler": "e2e.record", "depends_on": ["first"]},
            # sent to the other tree's queue: only its workers import e2e.partner
            {"name": "abroad", "handler": "e2e.partner", "depends_on": ["first"], "queue": qb},
        ],
    )
    wf_b = workflow(
        "wf_b",
        [
            {"name": "first", "handler": "e2e.partner"},
            {"name": "then", "handler": "e2e.partner", "depends_on": ["first"]},
        ],
    )
    for i, config in enumerate((config_a, config_b)):
        trees.append(Tree(config, tmp_path / f"tree-{i}.log", env=stack.env()))
    for tree in trees:
        tree.ready()
    runs = run_all(config_a, wf_a, RUNS) + run_all(config_b, wf_b, RUNS)
    try:
        wait_settled(sql, runs, trees)
        assert states(sql, runs) == {"SUCCEEDED": RUNS * 3 + RUNS * 2}
        found = executed_on(sql)
        assert len(found) == executions(sql) == RUNS * 5  # every execution by a live worker
        assert {(name, handler, task_queue) for name, handler, task_queue, _, _ in found} == {
            ("first", "e2e.record", qa),
            ("then", "e2e.record", qa),
            ("abroad", "e2e.partner", qb),
            ("first", "e2e.partner", qb),
            ("then", "e2e.partner", qb),
        }
        assert all(task_queue == worker_queue for _, _, task_queue, worker_queue, _ in found)
        assert all(n == 1 for *_, n in found)  # each task run executed once
    finally:
        _delete_queues(stack, qa, qb)


def test_one_tree_with_two_pools_routes_by_queue_and_survives_a_pool_worker_killed(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    main, partner = stack.queue, f"{stack.queue}.partner"
    config = stack.config_path(
        handlers=[HANDLERS_MODULE, PARTNER_MODULE],
        processes={
            "pools": [
                {"queue": main, "workers": 2},
                {"queue": partner, "workers": 2, "handlers": [PARTNER_MODULE]},
            ]
        },
    )
    wf = workflow(
        "pooled",
        [
            {"name": "first", "handler": "e2e.record"},
            {"name": "call", "handler": "e2e.partner", "depends_on": ["first"], "queue": partner},
            {"name": "last", "handler": "e2e.record", "depends_on": ["call"]},
        ],
    )
    # triggered before any worker runs: READY on a queue nobody consumes (failure mode 70)
    runs = run_all(config, wf, RUNS)
    db = Database(load_config(config, env={}).database)
    db.open()
    try:
        unserved = [q.queue for q in Reads(db).queue_loads() if q.unserved]
        assert unserved == [main]
        trees.append(Tree(config, tmp_path / "tree.log", env=stack.env()))
        trees[0].ready()
        # a partner worker SIGKILLed while runs are in flight (failure mode 71)
        pid = wait_for(lambda: _worker_pid(sql, partner), READY_S, 0.05, "a partner worker")
        signal_when_busy(sql, pid)
        more = run_all(config, wf, RUNS)
        wait_settled(sql, runs + more, trees)
        assert states(sql, runs + more) == {"SUCCEEDED": 2 * RUNS * 3}
        found = executed_on(sql)
        assert len(found) == executions(sql)  # every execution by a registered worker
        assert all(task_queue == worker_queue for _, _, task_queue, worker_queue, _ in found)
        assert {(name, task_queue) for name, _, task_queue, _, _ in found} == {
            ("first", main),
            ("call", partner),
            ("last", main),
        }
        assert not [q.queue for q in Reads(db).queue_loads() if q.unserved]
        assert "unknown_handler" not in _reasons(sql)
    finally:
        db.close()
        _delete_queues(stack, partner)


def signal_when_busy(sql: Sql, pid: int) -> None:
    """SIGKILL ``pid`` (a worker) once executions have begun; whatever it held is reaped
    when its leases lapse, and the supervisor starts another worker on its queue."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline and executions(sql) == 0:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


def _worker_pid(sql: Sql, queue: str) -> int | None:
    row = sql.execute(
        "SELECT pid FROM processes WHERE role = 'worker' AND queue = %s LIMIT 1", (queue,)
    ).fetchone()
    return None if row is None else int(row[0])


def _reasons(sql: Sql) -> set[str]:
    found = sql.execute(
        "SELECT DISTINCT failure_reason FROM task_attempts WHERE failure_reason IS NOT NULL"
    )
    return {str(r[0]) for r in found.fetchall()}


def _delete_queues(stack: Stack, *names: str) -> None:
    from tests.delivery import broker_channel

    with broker_channel(stack) as channel:
        for name in names:
            for index in range(len(BANDS)):  # the queue and its priority bands
                channel.queue_delete(band_queue(name, index))
