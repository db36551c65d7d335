"""The priority workload of ``scripts/bench`` (docs/performance.md "Priorities").

A priority-9 task's dispatch latency (its run created → its task started, database clock) on
an empty queue, then behind a backlog of ``backlog`` priority-0 one-task runs triggered at once:
while the tree works through the backlog, priority-9 runs are triggered one at a time, each
waited for. The figure is the ratio of the two medians (the target: at most 2). How much of the
backlog was still waiting when the last sample started is recorded with it, so a sample taken
after the backlog drained cannot pass for one behind it.

Where the time goes is recorded too: the trigger call's own duration (its transaction starts
the clock), created → published (the outbox), the outbox rows pending when each sample was
triggered (a sweep in flight), the time from the trigger call's return to the task's start
(what dispatching took, the trigger's own transaction left out; wall clock against the
database's, one host) and the publisher's pace on the backlog's rows.

Run alone (a tree of its own, nothing else measured)::

    python -m tests.harness.bench_priorities --database-url URL --broker-url URL --repeat 3
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.triggers import Triggers

POLL_S = 0.005
TRIGGER_BATCH = 500
#: The backlog's tasks the tree must have started before the first sample: it is busy with it.
BUSY_AFTER = 200


def _one(name: str, handler: str = "bench.noop") -> WorkflowDef:
    return WorkflowDef(name, (TaskDef("t", handler),))


def _started_ms(
    conn: psycopg.Connection[Any], run_id: Any, timeout_s: float, returned: float | None = None
) -> float:
    """Wait until the run's task started; its dispatch latency in ms (database clock), or with
    ``returned`` (the wall clock when the trigger call returned: the same host's clock) the
    time from then on, which leaves the trigger's own transaction out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT extract(epoch FROM t.started_at - r.created_at) * 1000,"
            " extract(epoch FROM t.started_at)"
            " FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
            " WHERE r.id = %(id)s AND t.started_at IS NOT NULL",
            {"id": run_id},
        ).fetchone()
        if row is not None:
            return float(row[0]) if returned is None else (float(row[1]) - returned) * 1000
        time.sleep(POLL_S)
    raise RuntimeError(f"run {run_id} not started within {timeout_s}s")


def _published_ms(conn: psycopg.Connection[Any], run_ids: list[Any]) -> list[float]:
    """Each run's first outbox row: created → published (ms), where a dispatch's time goes;
    in the order of ``run_ids``."""
    rows = conn.execute(
        "SELECT r.id, extract(epoch FROM min(o.published_at) - r.created_at) * 1000"
        " FROM workflow_runs r JOIN task_runs t ON t.run_id = r.id"
        " JOIN outbox o ON o.task_run_id = t.id WHERE r.id = ANY(%(ids)s) GROUP BY r.id",
        {"ids": run_ids},
    ).fetchall()
    found = {r[0]: float(r[1]) for r in rows if r[1] is not None}
    return [found[i] for i in run_ids if i in found]


def _outbox_pending(conn: psycopg.Connection[Any]) -> int:
    """Outbox rows not yet published: a sample triggered while many wait meets a publisher
    busy with its sweep."""
    row = conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()
    return int(row[0]) if row else 0


def _drain_rate(conn: psycopg.Connection[Any]) -> float:
    """The backlog's outbox rows published per second, first to last (the publisher's pace
    while it had a backlog: every row was pending when the first went out)."""
    row = conn.execute(
        "SELECT count(*), extract(epoch FROM max(o.published_at) - min(o.published_at))"
        " FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
        " JOIN workflow_runs r ON r.id = t.run_id WHERE r.workflow = 'backlog'"
    ).fetchone()
    if row is None or not row[1]:
        return 0.0
    return float(row[0]) / float(row[1])


def _waiting(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
        " WHERE r.workflow = 'backlog' AND t.started_at IS NULL"
    ).fetchone()
    return int(row[0]) if row else 0


def measure(
    repo: Triggers,
    conn: psycopg.Connection[Any],
    backlog: int,
    samples: int,
    timeout_s: float,
    record: Callable[..., None],
    backlog_ms: float = 0.0,
) -> None:
    """One repetition: ``samples`` priority-9 latencies on an empty queue, then as many behind
    the backlog; records both medians and their ratio. With ``backlog_ms`` each backlog task
    sleeps that long (the workers are saturated rather than the engine: the case a priority
    is for), and every figure's name says so."""
    if backlog_ms:
        record = _named(record, f" [{backlog_ms:g}-ms backlog]")
    urgent = _one("urgent")
    empty_runs: list[Any] = []
    empty: list[float] = []
    empty_after: list[float] = []
    for i in range(samples):
        empty_runs.append(repo.trigger(urgent, {"i": i}, priority=9).run_id)
        returned = time.time()
        empty.append(_started_ms(conn, empty_runs[-1], timeout_s))
        empty_after.append(_started_ms(conn, empty_runs[-1], timeout_s, returned))
    for offset in range(0, backlog, TRIGGER_BATCH):
        count = min(backlog, offset + TRIGGER_BATCH) - offset
        if backlog_ms:
            work = _one("backlog", "bench.sleep")
            inputs = [{"i": offset + i, "ms": backlog_ms} for i in range(count)]
        else:
            work, inputs = _one("backlog"), [{"i": offset + i} for i in range(count)]
        repo.trigger_many(work, inputs)
    deadline = time.monotonic() + timeout_s
    while _waiting(conn) > backlog - min(BUSY_AFTER, backlog // 2):
        if time.monotonic() > deadline:
            raise RuntimeError("the tree did not start on the backlog")
        time.sleep(POLL_S)
    runs: list[Any] = []
    behind: list[float] = []
    pending: list[int] = []
    calls: list[float] = []  # the trigger's own call, client clock: its commit is in it
    after: list[float] = []  # from the trigger's return: what dispatching it took
    for i in range(samples):
        pending.append(_outbox_pending(conn))
        called = time.perf_counter()
        runs.append(repo.trigger(urgent, {"b": i}, priority=9).run_id)
        returned = time.time()
        calls.append((time.perf_counter() - called) * 1000)
        behind.append(_started_ms(conn, runs[-1], timeout_s))
        after.append(_started_ms(conn, runs[-1], timeout_s, returned))
    left = _waiting(conn)
    record("priority 9 dispatch, empty queue", "ms", statistics.median(empty), n=samples)
    record("  empty-queue samples", "ms", max(empty), all=[round(x, 1) for x in empty])
    record(f"  samples behind {backlog}", "ms", max(behind), all=[round(x, 1) for x in behind])
    record(
        f"priority 9 dispatch behind {backlog}",
        "ms",
        statistics.median(behind),
        backlog=backlog,
    )
    published = _published_ms(conn, runs)
    record(
        f"  of which created → published behind {backlog}",
        "ms",
        statistics.median(published),
        all=[round(x, 1) for x in published],
    )
    record(
        "  of which created → published, empty queue",
        "ms",
        statistics.median(_published_ms(conn, empty_runs)),
    )
    record("  outbox rows pending at each sample", "rows", max(pending), all=pending)
    record(
        f"  trigger call behind {backlog}",
        "ms",
        statistics.median(calls),
        all=[round(x, 1) for x in calls],
    )
    record(
        f"  trigger returned → started behind {backlog}",
        "ms",
        statistics.median(after),
        all=[round(x, 1) for x in after],
    )
    record("  trigger returned → started, empty queue", "ms", statistics.median(empty_after))
    record(
        "priority 9 returned → started behind/empty",
        "x",
        statistics.median(after) / statistics.median(empty_after),
    )
    record("priority 9 behind/empty", "x", statistics.median(behind) / statistics.median(empty))
    record(f"backlog left after the samples (of {backlog})", "tasks", float(left))
    # the backlog drains before the next workload
    _wait_drained(conn, timeout_s)
    record("  publisher pace on the backlog's outbox rows", "rows/s", _drain_rate(conn))


def _named(record: Callable[..., None], suffix: str) -> Callable[..., None]:
    def named(name: str, unit: str, value: float, **extra: Any) -> None:
        record(name + suffix, unit, value, **extra)

    return named


def _wait_drained(conn: psycopg.Connection[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
            " WHERE r.workflow IN ('backlog', 'urgent') AND t.state <> 'SUCCEEDED'"
        ).fetchone()
        if row is not None and row[0] == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("the backlog did not drain")


def main(argv: list[str] | None = None) -> int:
    from tests.harness import bench

    parser = bench.alone_parser("bench_priorities", __doc__, workers=4)
    parser.add_argument(
        "--reserved",
        type=int,
        default=0,
        help="more workers, reserved for priorities 5 and above (a pool of their own)",
    )
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument(
        "--backlog-ms",
        type=float,
        default=0.0,
        help="each backlog task sleeps this long (0: does nothing, the engine is all that runs)",
    )
    args = parser.parse_args(argv)

    def workload(triggers: Triggers, conn: psycopg.Connection[Any], record: Any) -> None:
        measure(triggers, conn, args.backlog, args.samples, 600.0, record, args.backlog_ms)

    return bench.run_alone(args, workload, reserved=args.reserved)


if __name__ == "__main__":
    sys.exit(main())
