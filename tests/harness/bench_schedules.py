"""The schedule workloads of ``scripts/bench`` (SPEC 7.2; docs/performance.md, "Schedules").

Played by the bench process as one scheduler would, through the product's own store part
(:class:`~flowforge.store.schedules.Schedules`), on the bench's fresh database:

- **due**: N schedules (``every: 1h``) all due at the same instant; the time from the first
  pass to the last until every one has its run (passes of ``batch`` schedules, as the
  scheduler's ``batch_size``), and the rate;
- **idle pass**: the same N schedules, none due: the database time of the pass's statement
  (``EXPLAIN ANALYZE`` of ``lock_due_schedules``: planning + execution) and the wall time of a
  whole ``fire_due`` call from this process (one round trip), medians of many.

The workflow is not in the tree's files, so the tree's own scheduler leaves these schedules
alone; their runs are ordinary runs (its workers execute them).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.schedule import Overlap, ScheduleDef
from flowforge.store import queries
from flowforge.store.db import Database
from flowforge.store.schedules import Schedules

WORKFLOW = "bench-schedules"
HANDLER = "bench.noop"
IDLE_SAMPLES = 50
SCHEDULE_TABLES = "schedule_fires, schedules"


def workflow(n: int) -> WorkflowDef:
    """One workflow with ``n`` hourly schedules (due together once moved into this hour)."""
    schedules = tuple(ScheduleDef(every="1h", overlap=Overlap.ALLOW) for _ in range(n))
    return WorkflowDef(WORKFLOW, (TaskDef("t", HANDLER),), schedules=schedules)


def measure(url: str, n: int, batch: int, record: Callable[..., None]) -> None:
    """One repetition of both workloads over ``n`` schedules, recorded as figures."""
    flows = {WORKFLOW: workflow(n)}
    db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench-schedules")
    db.open()
    try:
        part = Schedules(db)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {SCHEDULE_TABLES}")
            part.sync(flows)
            conn.execute("UPDATE schedules SET next_fire_at = date_trunc('hour', now())")
            conn.execute("ANALYZE schedules")
            started = time.perf_counter()
            passes = 0
            while part.fire_due(flows, batch):
                passes += 1
            wall = time.perf_counter() - started
            made = conn.execute(
                "SELECT count(*) FROM workflow_runs WHERE schedule IS NOT NULL"
            ).fetchone()
            assert made is not None and made[0] >= n, f"{made} runs for {n} due schedules"
            record("schedules due", "s", wall, schedules=n, batch=batch, passes=passes)
            record("schedule runs", "runs/s", n / wall)
            conn.execute("ANALYZE schedules")
            record("schedule idle pass db", "ms", _idle_db_ms(conn), schedules=n)
            record("schedule idle pass", "ms", _idle_wall_ms(part, flows, batch))
    finally:
        db.close()


def _idle_db_ms(conn: psycopg.Connection[Any]) -> float:
    """The database's own time for the pass's statement with nothing due: planning plus
    execution, from ``EXPLAIN (ANALYZE, FORMAT JSON)``; the median of many."""
    statement = queries.load()["lock_due_schedules"].decode()
    params = {"workflows": [WORKFLOW], "limit": 500}
    samples = []
    for _ in range(IDLE_SAMPLES):
        with conn.transaction():  # FOR UPDATE inside EXPLAIN ANALYZE needs a transaction
            row = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + sql.SQL(statement), params
            ).fetchone()
        assert row is not None
        plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
        samples.append(float(plan[0]["Planning Time"]) + float(plan[0]["Execution Time"]))
    return statistics.median(samples)


def _idle_wall_ms(part: Schedules, flows: dict[str, WorkflowDef], batch: int) -> float:
    samples = []
    for _ in range(IDLE_SAMPLES):
        started = time.perf_counter()
        assert part.fire_due(flows, batch) == []
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)
