"""``scripts/bench --payloads``: throughput with 100 B, 10 KB and 100 KB inputs and results,
and where their bytes go (issue 22, "Payloads"; docs/performance.md "Soak and payloads").

On a fresh database and a tree of ``--workers`` workers, for each size: one-task runs whose
input is ``{"blob": <size bytes of base64 of random bytes>}`` and whose handler (``bench.echo``)
returns the same blob as its result. Random base64 is not what payloads are, but it is what
PostgreSQL's TOAST compression cannot shrink much: the bytes measured are near the most a
payload of that size costs. Per size, on tables emptied first:

* tasks/s (database timestamps: first run created → last task finished) and the trigger's
  runs/s (the caller's clock, batches of :data:`BATCH`);
* bytes per task each hot table grew by, in all and by heap, TOAST and indexes,
  and the stored (compressed) size of an input and of a result (``pg_column_size``);
* WAL bytes per task (``pg_current_wal_lsn``: the server's, every database's — run it on a
  server nothing else writes to).

Nothing here asserts a figure. Run alone::

    python -m tests.harness.bench_payloads --database-url URL --broker-url URL [--tasks 500]
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.triggers import Triggers
from tests.harness import bench, bench_maps

SIZES = (100, 10_000, 100_000)
#: Runs per trigger call: fewer than the bench's 500, a batch of 100 KB inputs is 50 MB.
BATCH = 100
#: Where a run's bytes land.
TABLES = ("workflow_runs", "task_runs", "task_attempts", "outbox", "task_edges")
ECHO = WorkflowDef("payload", (TaskDef("t", "bench.echo"),))
#: The JSON around the blob: ``{"blob": "..."}``.
_ENVELOPE = len('{"blob":""}')

#: Per table: heap, TOAST (with its index) and indexes, bytes.
SIZES_SQL = """
SELECT relname::text, pg_relation_size(oid),
       coalesce(pg_total_relation_size(nullif(reltoastrelid, 0)), 0), pg_indexes_size(oid)
  FROM pg_class WHERE relname = ANY(%(t)s)
"""
PARTS = ("heap", "toast", "indexes")
STORED_SQL = (
    "SELECT (SELECT avg(pg_column_size(input)) FROM workflow_runs),"
    " (SELECT avg(pg_column_size(result)) FROM task_runs)"
)


def blob(size: int) -> str:
    """Base64 text of random bytes, sized so that ``{"blob": ...}`` is ``size`` bytes of JSON."""
    length = max(1, size - _ENVELOPE)
    return base64.b64encode(os.urandom(length))[:length].decode()


def _wal(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


def _sizes(conn: psycopg.Connection[Any]) -> dict[tuple[str, str], int]:
    """Bytes by (table, part of :data:`PARTS`)."""
    return {
        (row[0], part): int(n)
        for row in conn.execute(SIZES_SQL, {"t": list(TABLES)}).fetchall()
        for part, n in zip(PARTS, row[1:], strict=True)
    }


def measure_size(
    repo: Triggers,
    conn: psycopg.Connection[Any],
    size: int,
    tasks: int,
    record: Callable[..., None],
    timeout_s: float = 600.0,
) -> None:
    """Run ``tasks`` echo runs of ``size`` bytes on emptied tables; record the figures listed in
    the module's docstring, each named ``SIZE B: ...``."""
    bench_maps.truncate(conn, bench.TABLES.replace("processes, ", ""))
    payload = {"blob": blob(size)}
    before_sizes, before_wal = _sizes(conn), _wal(conn)
    started = time.perf_counter()
    for offset in range(0, tasks, BATCH):
        repo.trigger_many(ECHO, [payload] * min(BATCH, tasks - offset))
    triggered = time.perf_counter() - started
    bench._wait_until(conn, bench.ALL_SUCCEEDED, {"n": tasks}, timeout_s)
    row = conn.execute(
        "SELECT extract(epoch FROM max(t.finished_at) - min(r.created_at))"
        " FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
    ).fetchone()
    wall = float(row[0]) if row and row[0] else time.perf_counter() - started
    wal = _wal(conn) - before_wal
    after_sizes = _sizes(conn)
    stored = conn.execute(STORED_SQL).fetchone()
    label = f"{size} B"
    record(f"{label}: tasks/s", "tasks/s", tasks / wall)
    record(f"{label}: trigger", "runs/s", tasks / triggered)
    record(f"{label}: WAL per task", "bytes/task", wal / tasks)
    for name in TABLES:
        grown = {p: after_sizes.get((name, p), 0) - before_sizes.get((name, p), 0) for p in PARTS}
        record(f"{label}: {name} per task", "bytes/task", sum(grown.values()) / tasks)
        for part, n in grown.items():
            if n:
                record(f"{label}: {name} {part} per task", "bytes/task", n / tasks)
    if stored and stored[0] is not None:
        record(f"{label}: stored input", "bytes", float(stored[0]))
    if stored and stored[1] is not None:
        record(f"{label}: stored result", "bytes", float(stored[1]))


def measure(
    repo: Triggers,
    conn: psycopg.Connection[Any],
    tasks: int,
    record: Callable[..., None],
    sizes: Sequence[int] = SIZES,
) -> None:
    """:func:`measure_size` for each of ``sizes``."""
    for size in sizes:
        measure_size(repo, conn, size, tasks, record)


def print_table(results: dict[str, Any]) -> None:
    print(f"{'figure':<36} {'median':>12} {'min':>12} {'max':>12}  unit")
    for name, r in results.items():
        print(f"{name:<36} {r['median']:>12.1f} {r['min']:>12.1f} {r['max']:>12.1f}  {r['unit']}")


def run(args: argparse.Namespace) -> int:
    """``scripts/bench --payloads``: the report merged into ``--json`` under ``"payloads"``."""
    tasks = 50 if args.quick else 1000
    repeat = 1 if args.quick else args.repeat
    with bench.service_urls(args) as (server_url, broker_url):
        report: dict[str, Any] = {
            "machine": bench.machine(server_url, broker_url),
            "settings": {"sizes": list(SIZES), "tasks": tasks, "workers": args.workers},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_average": round(os.getloadavg()[0], 2),
            "results": bench.alone(
                server_url,
                broker_url,
                args.workers,
                repeat,
                lambda repo, conn, record: measure(repo, conn, tasks, record),
            ),
        }
    bench.merge_json(args.json, "payloads", report)
    print_table(report["results"])
    print(f'JSON written to {args.json} (under "payloads")')
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = bench.alone_parser("bench_payloads", __doc__, workers=4)
    parser.add_argument("--tasks", type=int, default=1000, help="runs per size")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    return bench.run_alone(
        args, lambda repo, conn, record: measure(repo, conn, args.tasks, record, sizes)
    )


if __name__ == "__main__":
    sys.exit(main())
