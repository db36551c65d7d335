"""The async handler workload of ``scripts/bench`` (docs/performance.md "Async handlers").

One-task runs of a handler that waits 50 ms — ``bench.nap`` (``time.sleep``: a sync handler on
the handler thread) and ``bench.nap_async`` (``await asyncio.sleep``: the worker's event loop,
``worker.async_concurrency`` at once) — triggered at once: ``per_worker`` sync runs per worker,
and ``ASYNC_FACTOR`` times as many async ones (both last about as long if the target is met).
Each figure is tasks/s from the first run created to the last task finished (database clock),
divided by the tree's workers; the ratio of the two is the figure SPEC 7.5 sets a target for
(≥ 16 with the default ``async_concurrency`` of 16).

Run alone (a tree of its own, nothing else measured)::

    python -m tests.harness.bench_async --database-url URL --broker-url URL --workers 1
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.triggers import Triggers

POLL_S = 0.02
TRIGGER_BATCH = 500
#: Async runs per sync run: the target ratio, so both workloads take about as long.
ASYNC_FACTOR = 16
SYNC = WorkflowDef("bench-nap", (TaskDef("t", "bench.nap"),))
ASYNC = WorkflowDef("bench-nap-async", (TaskDef("t", "bench.nap_async"),))


def per_worker_rate(
    triggers: Triggers,
    conn: psycopg.Connection[Any],
    workflow: WorkflowDef,
    runs: int,
    workers: int,
    timeout_s: float,
) -> float:
    """Trigger ``runs`` runs of ``workflow`` at once; tasks/s per worker until the last ends."""
    for offset in range(0, runs, TRIGGER_BATCH):
        upto = min(runs, offset + TRIGGER_BATCH)
        triggers.trigger_many(workflow, [{"i": i} for i in range(offset, upto)])
    deadline = time.monotonic() + timeout_s
    params = {"wf": workflow.name}
    query = (
        "SELECT count(*) FILTER (WHERE t.state = 'SUCCEEDED'),"
        " extract(epoch FROM max(t.finished_at) - min(r.created_at))"
        " FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id WHERE r.workflow = %(wf)s"
    )
    while time.monotonic() < deadline:
        row = conn.execute(query, params).fetchone()
        if row is not None and row[0] == runs:
            return runs / float(row[1]) / workers
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {runs} runs of {workflow.name}")


def measure(
    triggers: Triggers,
    conn: psycopg.Connection[Any],
    workers: int,
    per_worker: int,
    timeout_s: float,
    record: Callable[..., None],
) -> None:
    """Record the sync and async nap rates per worker and their ratio (module docstring)."""
    sync_runs = per_worker * workers
    sync = per_worker_rate(triggers, conn, SYNC, sync_runs, workers, timeout_s)
    async_runs = ASYNC_FACTOR * sync_runs
    awaited = per_worker_rate(triggers, conn, ASYNC, async_runs, workers, timeout_s)
    record("sync 50 ms handler per worker", "tasks/s", sync, runs=sync_runs, workers=workers)
    record("async 50 ms handler per worker", "tasks/s", awaited, runs=async_runs)
    record("async/sync per worker", "x", awaited / sync)


def main(argv: list[str] | None = None) -> int:
    from tests.harness import bench

    parser = bench.alone_parser("bench_async", __doc__, workers=1)
    parser.add_argument("--per-worker", type=int, default=80, help="sync runs per worker")
    args = parser.parse_args(argv)

    def workload(triggers: Triggers, conn: psycopg.Connection[Any], record: Any) -> None:
        measure(triggers, conn, args.workers, args.per_worker, 600.0, record)

    return bench.run_alone(args, workload)


if __name__ == "__main__":
    sys.exit(main())
