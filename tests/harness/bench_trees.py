"""``scripts/bench --trees``: several ``flowforge up`` trees on one database and one queue
(issue 22, "Scale out"; docs/performance.md "Several trees").

For each count of trees asked (``1,2,3``), on a fresh database: that many trees, each with
``--workers`` workers, all consuming the same task queue, execute ``--tasks`` one-task runs
(triggered in batches before the clock starts: the figure is the trees', not the caller's).
Reported per count:

* ``trees N: tasks/s`` in all (database timestamps: first run created → last task finished)
  and ``tasks/s per tree`` (each tree's share of the attempts, over the same wall);
* CPU per task, in milliseconds, of the trees' processes, of PostgreSQL's (every process of the
  server: run it on a server nothing else uses) and of RabbitMQ's (``beam.smp``), read from
  ``/proc`` before and after, and the database's share of that CPU;
* the server's writing transactions per task (transaction ids assigned) and WAL bytes per
  task (``pg_current_wal_lsn``) — the server's, every database's: run it on a server nothing
  else writes to, as for its CPU.

On one machine the trees share its cores: the totals say how far one more tree helps on this
machine, and the per-task costs are what the arithmetic for a larger deployment starts from.
Nothing here asserts a figure. Run alone::

    python -m tests.harness.bench_trees --database-url URL --broker-url URL [--trees 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg

from flowforge.config import DatabaseConfig
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers
from tests.harness import bench
from tests.harness.cpuprobe import (
    cpu_seconds,
    server_counters,
    service_pids,
    spent,
)


def measure_trees(
    server_url: str,
    broker_url: str,
    count: int,
    workers: int,
    tasks: int,
    record: Callable[..., None],
    timeout_s: float = 600.0,
) -> None:
    """Run ``tasks`` one-task runs on ``count`` trees sharing one database and queue; record
    the figures listed in the module's docstring, each named ``trees N: ...``."""
    queue = f"flowforge.bench.{uuid.uuid4().hex[:8]}"
    with (
        bench.fresh_database(server_url) as url,
        tempfile.TemporaryDirectory() as tmp,
        ExitStack() as stack,
    ):
        trees = []
        for index in range(count):
            directory = Path(tmp) / f"tree{index}"
            directory.mkdir()
            tree = bench.Tree(directory, url, broker_url, workers, queue=queue)
            stack.callback(tree.stop)
            trees.append(tree)
        for tree in trees:
            tree.start()
        bench.wait_for_workers(url, workers * count, *trees)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        stack.callback(db.close)
        with psycopg.connect(url, autocommit=True) as conn:
            _run(trees, Triggers(db), conn, count, tasks, record, timeout_s)


def _run(
    trees: Sequence[bench.Tree],
    repo: Triggers,
    conn: psycopg.Connection[Any],
    count: int,
    tasks: int,
    record: Callable[..., None],
    timeout_s: float,
) -> None:
    label = f"trees {count}"
    pids = [t.pids() for t in trees]

    def reading() -> tuple[list[dict[int, float]], dict[str, dict[int, float]], tuple[int, int]]:
        services = {name: cpu_seconds(p) for name, p in service_pids().items()}
        return [cpu_seconds(p) for p in pids], services, server_counters(conn)

    before = reading()
    figures = bench.throughput(repo, conn, bench.Settings(tasks=tasks, timeout_s=timeout_s))
    after = reading()
    wall = tasks / figures["tasks_per_s"]
    record(f"{label}: tasks/s", "tasks/s", figures["tasks_per_s"])
    for index, done in enumerate(_attempts_by_tree(conn, pids)):
        record(f"{label}: tree {index + 1} tasks/s", "tasks/s", done / wall)
    trees_s = sum(spent(b, a) for b, a in zip(before[0], after[0], strict=True))
    service_s = {name: spent(before[1].get(name, {}), cpu) for name, cpu in after[1].items()}
    total = trees_s + sum(service_s.values())
    record(f"{label}: CPU per task, trees", "ms/task", 1000 * trees_s / tasks)
    for name, seconds in service_s.items():
        record(f"{label}: CPU per task, {name}", "ms/task", 1000 * seconds / tasks)
    if total > 0:
        record(f"{label}: database share of CPU", "%", 100 * service_s["postgresql"] / total)
    xids, wal = (a - b for a, b in zip(after[2], before[2], strict=True))
    record(f"{label}: writing transactions per task", "xacts/task", xids / tasks)
    record(f"{label}: WAL per task", "bytes/task", wal / tasks)


def _attempts_by_tree(conn: psycopg.Connection[Any], pids: Sequence[Sequence[int]]) -> list[int]:
    """How many attempts each tree's workers made (``task_attempts.worker`` is host/pid)."""
    by_pid = {
        int(worker.rsplit("/", 1)[1]): int(n)
        for worker, n in conn.execute(
            "SELECT worker, count(*) FROM task_attempts WHERE worker IS NOT NULL GROUP BY 1"
        ).fetchall()
    }
    return [sum(by_pid.get(pid, 0) for pid in tree) for tree in pids]


def measure(
    server_url: str,
    broker_url: str,
    counts: Sequence[int],
    workers: int,
    tasks: int,
    repeat: int,
    record: Callable[..., None],
    progress: Callable[[str], None],
) -> None:
    """:func:`measure_trees` for each count in ``counts``, ``repeat`` times each."""
    for rep in range(repeat):
        for count in counts:
            progress(f"trees: {count} tree(s), repetition {rep + 1}/{repeat}")
            measure_trees(server_url, broker_url, count, workers, tasks, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_trees", description=__doc__)
    parser.add_argument("--trees", default="1,2,3", help="tree counts, comma-separated")
    parser.add_argument("--workers", type=int, default=2, help="workers per tree")
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    args = parser.parse_args(argv)
    results: dict[str, bench.Result] = {}

    def record(name: str, unit: str, value: float, **extra: Any) -> None:
        results.setdefault(name, bench.Result(name, unit)).samples.append(round(value, 3))

    counts = [int(c) for c in args.trees.split(",")]
    measure(
        args.database_url,
        args.broker_url,
        counts,
        args.workers,
        args.tasks,
        args.repeat,
        record,
        lambda m: print(m, file=sys.stderr),
    )
    print(json.dumps({name: r.summary() for name, r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
