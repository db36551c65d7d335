"""``scripts/bench``'s map workload (issue 19): a ``width``-item map (``for_each``) against the
static fan-out of the same width, in tasks per second from database timestamps.

Both run ``width`` no-op tasks between a first and a last task: the static fan-out has them as
``width`` tasks planned at trigger time; the map has one map task that a scheduler pass expands
into ``width`` items when the first task's list result is in, and settles when they are done.
``python -m tests.harness.bench_maps`` runs this workload alone (``--help``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.triggers import Triggers


def map_workflow(width: int) -> WorkflowDef:
    """list (returns ``width`` items) → process (for_each: list) → end."""
    return WorkflowDef(
        f"map-{width}",
        (
            TaskDef("list", "bench.items"),
            TaskDef("process", "bench.noop", for_each="list"),
            TaskDef("end", "bench.noop", depends_on=("process",)),
        ),
        max_items=max(width, 1),
    )


def map_run(
    repo: Triggers, conn: psycopg.Connection[Any], width: int, timeout_s: float
) -> dict[str, float]:
    """One run of :func:`map_workflow` to success: its wall time (created → finished, on the
    database clock) and the executed tasks (items, list and end) per second."""
    from tests.harness.bench import _wait_until  # bench imports this module

    run_id = repo.trigger(map_workflow(width), {"n": width}).run_id
    _wait_until(
        conn,
        "SELECT state = 'SUCCEEDED' FROM workflow_runs WHERE id = %(id)s",
        {"id": run_id},
        timeout_s,
    )
    row = conn.execute(
        "SELECT extract(epoch FROM finished_at - created_at) FROM workflow_runs WHERE id = %(id)s",
        {"id": run_id},
    ).fetchone()
    wall = float(row[0]) if row else 0.0
    tasks = width + 2
    return {"wall_s": wall, "tasks_per_s": tasks / wall, "ms_per_task": 1000 * wall / tasks}


def truncate(conn: psycopg.Connection[Any], tables: str, attempts: int = 10) -> None:
    """Empty ``tables`` while the tree runs: its scheduler may hold a lock the TRUNCATE needs
    in the other order (a deadlock PostgreSQL breaks by failing one side): try again."""
    for attempt in range(attempts):
        try:
            conn.execute(f"TRUNCATE {tables} CASCADE")
            return
        except psycopg.errors.DeadlockDetected:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    from tests.harness import bench

    parser = argparse.ArgumentParser(prog="python -m tests.harness.bench_maps", description=__doc__)
    parser.add_argument("--width", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--database-url", help="a PostgreSQL server URL (a database is created)")
    parser.add_argument("--broker-url", help="a RabbitMQ URL")
    args = parser.parse_args(argv)
    samples: dict[str, list[float]] = {"map": [], "static fan-out": []}
    with (
        bench.service_urls(args) as (server_url, broker_url),
        bench.fresh_database(server_url) as url,
        tempfile.TemporaryDirectory() as tmp,
    ):
        tree = bench.Tree(Path(tmp), url, broker_url, args.workers)
        from flowforge.config import DatabaseConfig
        from flowforge.store.db import Database

        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        repo = Triggers(db)
        try:
            tree.start()
            with psycopg.connect(url, autocommit=True) as conn:
                for rep in range(args.repeat):
                    print(f"repetition {rep + 1}/{args.repeat}", file=sys.stderr)
                    truncate(conn, bench.TABLES.replace("processes, ", ""))
                    mapped = map_run(repo, conn, args.width, args.timeout)
                    static = bench.fanout(repo, conn, args.width, args.timeout)
                    samples["map"].append(round(mapped["tasks_per_s"], 1))
                    samples["static fan-out"].append(round(static["tasks_per_s"], 1))
                    print(f"map {mapped} static {static}", file=sys.stderr)
        finally:
            tree.stop()
            db.close()
    report = {
        name: {"unit": "tasks/s", "median": statistics.median(v), "samples": v}
        for name, v in samples.items()
    }
    report["settings"] = {"width": args.width, "workers": args.workers, "repeat": args.repeat}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
