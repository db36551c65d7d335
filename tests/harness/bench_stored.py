"""``scripts/bench --stored ROWS``: the engine with a big store against an empty one (issue 22,
"Scale of what is stored"; docs/performance.md "Stored scale").

On one fresh database a tree (``--workers`` workers) is measured twice: first with the database
empty, then after :mod:`tests.harness.stored_fill` added ``ROWS`` READY tasks on a queue no
worker consumes, ``ROWS`` finished runs and a twentieth as many failed runs, each with a DEAD
task (:data:`DEAD_SHARE`: what retention keeps until an operator purges it). Each time:

* ``trigger rate`` (runs/s, batches of 500 one-task runs) and ``tasks/s`` (first run created →
  last of its tasks finished, database timestamps);
* ``dispatch p50/p99`` (ms, a run triggered → its task started, one run at a time) and ``claim
  p50/p99`` (ms, its dispatch published → its attempt started: the broker's hand-over and the
  worker's claim statement);
* the reads the dashboard's pages make (``GET /api/v1/overview``, ``/api/v1/runs``,
  ``/api/v1/dead``, ``/api/v1/processes``), ``/metrics``, ``/health/ready`` and ``stats``
  (:meth:`~flowforge.store.reads.Reads.stats`, in this process): the median of
  :data:`READS` calls each, ms.

Then a tree whose retention (one day) finds every finished run due works: the purge's rate,
the tree's tasks/s against the loaded phase's (the cost, target 10% at most) and the lock waits
seen meanwhile (``pg_locks`` sampled every 10 ms: the longest wait and how often one was seen).

Loaded over empty is printed for each figure (the target: 1.5 times at most for the engine's
figures, :data:`ENGINE`, and 200 ms loaded for the reads), and the database's bytes per task
run after the fill. Nothing here asserts a figure. Run alone::

    python -m tests.harness.bench_stored --database-url URL --broker-url URL --rows 100000
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.db import Database
from flowforge.store.reads import Reads
from flowforge.store.triggers import Triggers
from tests.harness import bench, bench_api, stored_fill

#: Calls per read figure (the median is reported).
READS = 5
#: The reads timed over HTTP: figure name → path.
PAGES = {
    "overview": "/api/v1/overview",
    "runs page": "/api/v1/runs?limit=50",
    "dead page": "/api/v1/dead?limit=50",
    "processes": "/api/v1/processes",
    "/metrics": "/metrics",
    "/health/ready": "/health/ready",
}
#: How often :class:`LockWaits` looks at pg_locks (seconds).
LOCK_SAMPLE_S = 0.01
#: Failed runs (a DEAD task each) stored per finished run: one in this many.
DEAD_SHARE = 20
#: Figures whose loaded/empty ratio has the 1.5x target (the rest: 200 ms loaded).
ENGINE = ("trigger rate", "tasks/s", "dispatch p50", "dispatch p99", "claim p50", "claim p99")


def _get_ms(port: int, path: str) -> float:
    """One GET of ``path`` (a 200 expected), in milliseconds, on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=bench_api.TIMEOUT_S)
    try:
        started = time.perf_counter()
        conn.request("GET", path, headers=bench_api._headers())
        bench_api.check(conn.getresponse(), 200)
        return (time.perf_counter() - started) * 1000
    finally:
        conn.close()


def _wait_done(conn: psycopg.Connection[Any], workflow: str, tasks: int, timeout_s: float) -> None:
    """Wait until ``tasks`` tasks of ``workflow``'s runs SUCCEEDED."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
            " WHERE r.workflow = %s AND t.state = 'SUCCEEDED'",
            (workflow,),
        ).fetchone()
        if row and row[0] >= tasks:
            return
        time.sleep(bench.POLL_S)
    raise RuntimeError(f"{workflow}: not done in {timeout_s} s")


def throughput(
    repo: Triggers, conn: psycopg.Connection[Any], tasks: int, timeout_s: float
) -> dict[str, float]:
    """Trigger rate and tasks/s of ``tasks`` one-task runs of a workflow of their own (so the
    store's other rows are not counted). A batch of another workflow goes first, untimed and
    waited for: the pool's connections, their prepared statements and first plans are then not
    in the rate (four timed batches by default, so those once-per-connection costs moved the
    figure by 2x between runs of the same code)."""
    tag = uuid.uuid4().hex[:8]
    warm = WorkflowDef(f"stored-warm-{tag}", (TaskDef("t", "bench.noop"),))
    warming = min(tasks, bench.TRIGGER_BATCH)
    repo.trigger_many(warm, [{"i": i} for i in range(warming)])
    _wait_done(conn, warm.name, warming, timeout_s)  # the tree idle again
    many = WorkflowDef(f"stored-many-{tag}", (TaskDef("t", "bench.noop"),))
    started = time.perf_counter()
    for offset in range(0, tasks, bench.TRIGGER_BATCH):
        inputs = [{"i": i} for i in range(offset, min(tasks, offset + bench.TRIGGER_BATCH))]
        repo.trigger_many(many, inputs)
    triggered = time.perf_counter() - started
    _wait_done(conn, many.name, tasks, timeout_s)
    row = conn.execute(
        "SELECT extract(epoch FROM max(t.finished_at) - min(r.created_at))"
        " FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id WHERE r.workflow = %s",
        (many.name,),
    ).fetchone()
    return {
        "trigger rate": tasks / triggered,
        "tasks/s": tasks / float(row[0]) if row and row[0] else float("nan"),
    }


def engine(
    repo: Triggers, conn: psycopg.Connection[Any], tasks: int, runs: int, timeout_s: float
) -> dict[str, float]:
    """:func:`throughput`, then dispatch and claim latency (see the module docstring) of
    ``runs`` runs triggered one at a time."""
    figures = throughput(repo, conn, tasks, timeout_s)
    one = WorkflowDef(f"stored-one-{uuid.uuid4().hex[:8]}", (TaskDef("t", "bench.noop"),))
    for i in range(runs):
        repo.trigger(one, {"i": i})
        _wait_done(conn, one.name, i + 1, timeout_s)
    found = conn.execute(
        "SELECT extract(epoch FROM t.started_at - r.created_at) * 1000,"
        "       extract(epoch FROM a.started_at - o.published_at) * 1000"
        "  FROM workflow_runs r JOIN task_runs t ON t.run_id = r.id"
        "  JOIN task_attempts a ON a.task_run_id = t.id AND a.attempt = 1"
        "  JOIN outbox o ON o.task_run_id = t.id AND o.fencing_token = a.fencing_token - 1"
        " WHERE r.workflow = %s",
        (one.name,),
    ).fetchall()
    dispatch = sorted(float(r[0]) for r in found)
    claim = sorted(float(r[1]) for r in found)
    return figures | {
        "dispatch p50": bench._pct(dispatch, 50),
        "dispatch p99": bench._pct(dispatch, 99),
        "claim p50": bench._pct(claim, 50),
        "claim p99": bench._pct(claim, 99),
    }


class LockWaits:
    """Samples ``pg_locks`` every :data:`LOCK_SAMPLE_S` on a connection of its own, in a thread:
    the longest wait for a lock seen (``waitstart``, PostgreSQL 14+) and how many samples saw
    a session waiting."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.longest_ms = 0.0
        self.samples = 0
        self.waiting = 0

    def __enter__(self) -> LockWaits:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _sample(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop.wait(LOCK_SAMPLE_S):
                row = conn.execute(
                    "SELECT extract(epoch FROM max(clock_timestamp() - waitstart)) * 1000"
                    " FROM pg_locks WHERE NOT granted AND database = ("
                    "   SELECT oid FROM pg_database WHERE datname = current_database())"
                ).fetchone()
                self.samples += 1
                if row and row[0] is not None:
                    self.waiting += 1
                    self.longest_ms = max(self.longest_ms, float(row[0]))


def _finished_left(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM workflow_runs WHERE workflow = %s",
        (stored_fill.FINISHED_WORKFLOW.name,),
    ).fetchone()
    return int(row[0]) if row else 0


def retention(
    url: str, broker_url: str, workers: int, tasks: int, window_s: float, timeout_s: float
) -> dict[str, float]:
    """A tree whose retention (1 day) finds every filled finished run due works: its
    throughput (as :func:`throughput`) while the purge runs, the purge's rate over
    ``window_s`` seconds (at least the throughput's time) and the lock waits seen meanwhile."""
    scheduler = {"retention_days": 1, "idempotency_retention_days": 2}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o755)
        tree = bench.Tree(Path(tmp), url, broker_url, workers, scheduler=scheduler)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                before = _finished_left(conn)
                started = time.monotonic()
                tree.start()
                with LockWaits(url) as locks:
                    figures = throughput(Triggers(db), conn, tasks, timeout_s)
                    rest = window_s - (time.monotonic() - started)
                    if rest > 0:
                        time.sleep(rest)  # the purge's rate over the whole window
                    after = _finished_left(conn)
                    wall = time.monotonic() - started
            return {
                "tasks/s while purging": figures["tasks/s"],
                "purge rate": (before - after) / wall,
                "longest lock wait": locks.longest_ms,
                "samples with a lock wait": 100 * locks.waiting / max(1, locks.samples),
            }
        finally:
            tree.stop()
            db.close()


def reads(port: int, store: Reads) -> dict[str, float]:
    """The median of :data:`READS` calls of each read (ms)."""
    found: dict[str, float] = {}
    for name, path in PAGES.items():
        found[name] = statistics.median(_get_ms(port, path) for _ in range(READS))
    timed = []
    for _ in range(READS):
        started = time.perf_counter()
        store.stats(3)
        timed.append((time.perf_counter() - started) * 1000)
    found["stats"] = statistics.median(timed)
    return found


def phase(
    url: str, broker_url: str, workers: int, tasks: int, runs: int, timeout_s: float
) -> dict[str, float]:
    """The engine's figures and the reads' with a tree of ``workers`` on ``url`` as it is."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o755)
        tree = bench.Tree(Path(tmp), url, broker_url, workers)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        try:
            tree.start()
            bench_api.wait_live(tree.api_port, bench.READY_TIMEOUT_S)
            with psycopg.connect(url, autocommit=True) as conn:
                figures = engine(Triggers(db), conn, tasks, runs, timeout_s)
            return figures | reads(tree.api_port, Reads(db))
        finally:
            tree.stop()
            db.close()


def measure(
    server_url: str,
    broker_url: str,
    rows: int,
    workers: int,
    tasks: int,
    runs: int,
    progress: Callable[[str], None],
    window_s: float = 30.0,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Both phases on one fresh database (see the module docstring): per figure its unit,
    ``empty``, ``loaded`` and ``ratio``; the fill's timings and the bytes per task run; then
    :func:`retention` over ``window_s`` seconds, its throughput against the loaded phase's."""
    load_at_start = os.getloadavg()
    with bench.fresh_database(server_url) as url:
        progress("stored: empty database")
        empty = phase(url, broker_url, workers, tasks, runs, timeout_s)
        dead = rows // DEAD_SHARE
        progress(
            f"stored: filling {rows:,} READY tasks, {rows:,} finished runs"
            f" and {dead:,} failed runs with a DEAD task"
        )
        fill = stored_fill.fill(url, rows, rows, progress, dead=dead)
        size = stored_fill.bytes_per_task_run(url)
        progress("stored: loaded database")
        loaded = phase(url, broker_url, workers, tasks, runs, timeout_s)
        progress(f"stored: retention purging the finished runs for {window_s:g} s")
        purging = retention(url, broker_url, workers, tasks, window_s, timeout_s)
    purging["tasks/s loaded, no purge"] = loaded["tasks/s"]
    purging["throughput cost"] = 100 * (1 - purging["tasks/s while purging"] / loaded["tasks/s"])
    figures = {
        name: {
            "unit": "runs/s"
            if name == "trigger rate"
            else "tasks/s"
            if name == "tasks/s"
            else "ms",
            "empty": round(empty[name], 3),
            "loaded": round(loaded[name], 3),
            "ratio": round(_cost(name, empty[name], loaded[name]), 3),
        }
        for name in empty
    }
    return {
        "rows": rows,
        "dead": dead,
        # the machine's load average (1, 5, 15 min) at the start and the end: the figures are
        # only comparable between runs at a like load
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
        "figures": figures,
        "fill_s": fill,
        "size": size,
        "retention": {name: round(value, 3) for name, value in purging.items()},
    }


def _cost(name: str, empty: float, loaded: float) -> float:
    """How many times worse loaded is than empty (a rate's inverse: above 1 is worse)."""
    if name in ("trigger rate", "tasks/s"):
        return empty / loaded if loaded else float("inf")
    return loaded / empty if empty else float("inf")


def print_report(report: dict[str, Any]) -> None:
    load = report.get("load_average", {})
    print(
        f"stored: {report['rows']:,} READY tasks + {report['rows']:,} finished runs"
        f" + {report.get('dead', 0):,} failed runs with a DEAD task"
        f" (load average {load.get('start', ['?'])[0]} at the start,"
        f" {load.get('end', ['?'])[0]} at the end)"
    )
    print(f"{'figure':<16} {'empty':>10} {'loaded':>10} {'cost':>7}  unit  target")
    for name, f in report["figures"].items():
        target = "<= 1.5x" if name in ENGINE else "< 200 ms loaded"
        print(
            f"{name:<16} {f['empty']:>10.1f} {f['loaded']:>10.1f} {f['ratio']:>6.2f}x"
            f"  {f['unit']}  {target}"
        )
    size = report["size"]
    print(
        f"database: {size['database_bytes'] / 2**20:,.0f} MiB, "
        f"{size['bytes_per_task_run']:,.0f} bytes per task run "
        f"({', '.join(f'{k} {v:,.0f}' for k, v in size['tables'].items())})"
    )
    r = report["retention"]
    print(
        f"retention: {r['purge rate']:,.1f} runs/s purged;"
        f" tasks/s {r['tasks/s while purging']:,.0f} purging against"
        f" {r['tasks/s loaded, no purge']:,.0f} not (cost"
        f" {r['throughput cost']:.1f}%, target <= 10%); longest lock wait"
        f" {r['longest lock wait']:.1f} ms, {r['samples with a lock wait']:.1f}% of samples"
        " with a session waiting for a lock"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_stored", description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--latency-runs", type=int, default=100)
    parser.add_argument("--window", type=float, default=30.0, help="retention window (s)")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--json", type=Path, help="where to merge the report (under 'stored')")
    args = parser.parse_args(argv)
    report = measure(
        args.database_url,
        args.broker_url,
        args.rows,
        args.workers,
        args.tasks,
        args.latency_runs,
        lambda m: print(m, file=sys.stderr),
        args.window,
    )
    if args.json:
        bench.merge_json(args.json, "stored", report)
    print_report(report)
    print(json.dumps(report["figures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
