"""The event round trip scripts/bench measures (issue 19): send → the waiting task done → the
task after it done on a worker, one event at a time on a running tree.

Each run waits (``wait_for_event``, its own key) and then runs one no-op task. Once every wait
has started, the bench sends the events one by one and waits for each run to succeed before
the next, so each figure is one event's latency, not a queue's. Times are the database's:
the event's ``created_at`` (the send's transaction), the woken task's ``finished_at`` (the same
transaction: the send wakes it) and the next task's ``finished_at``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.store.events import Events
from flowforge.store.triggers import Triggers

POLL_S = 0.002
WORKFLOW = WorkflowDef(
    "bench-event",
    (
        TaskDef("wait", wait_for_event=EventWait("bench.go", "{i}", 3600.0)),
        TaskDef("after", "bench.noop", depends_on=("wait",)),
    ),
)


def _until(conn: psycopg.Connection[Any], query: str, params: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute(query, params).fetchone()
        if row and row[0]:
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for: {query}")


def _pct(values: list[float], pct: float) -> float:
    index = min(len(values) - 1, max(0, round(pct / 100 * (len(values) - 1))))
    return sorted(values)[index]


def round_trip(
    triggers: Triggers, events: Events, conn: psycopg.Connection[Any], runs: int, timeout_s: float
) -> dict[str, float]:
    """p50/p99 (ms) of send → next task done, and of the send call itself (client side)."""
    run_ids = [r.run_id for r in triggers.trigger_many(WORKFLOW, [{"i": i} for i in range(runs)])]
    _until(
        conn,
        "SELECT count(*) = %s FROM task_runs WHERE name = 'wait' AND state = 'RUNNING'"
        " AND run_id = ANY(%s)",
        (runs, run_ids),
        timeout_s,
    )
    calls: list[float] = []
    for i, run_id in enumerate(run_ids):
        started = time.perf_counter()
        events.send_event("bench.go", str(i), {"i": i})
        calls.append((time.perf_counter() - started) * 1000)
        _until(
            conn,
            "SELECT state = 'SUCCEEDED' FROM workflow_runs WHERE id = %s",
            (run_id,),
            timeout_s,
        )
    rows = conn.execute(
        "SELECT extract(epoch FROM a.finished_at - e.created_at) * 1000"
        " FROM events e"
        " JOIN event_deliveries d ON d.event_id = e.id"
        " JOIN task_runs w ON w.id = d.task_run_id"
        " JOIN task_runs a ON a.run_id = w.run_id AND a.name = 'after'"
        " WHERE w.run_id = ANY(%s)",
        (run_ids,),
    ).fetchall()
    trips = [float(r[0]) for r in rows]
    return {
        "p50_ms": _pct(trips, 50),
        "p99_ms": _pct(trips, 99),
        "send_p50_ms": _pct(calls, 50),
        "send_p99_ms": _pct(calls, 99),
    }


def measure(
    triggers: Triggers,
    events: Events,
    conn: psycopg.Connection[Any],
    runs: int,
    timeout_s: float,
    record: Callable[..., None],
) -> None:
    """Record the event round trip of ``runs`` runs (see :func:`round_trip`)."""
    e = round_trip(triggers, events, conn, runs, timeout_s)
    record("event round trip p50", "ms", e["p50_ms"], runs=runs)
    record("event round trip p99", "ms", e["p99_ms"])
    record("event send p50", "ms", e["send_p50_ms"])
    record("event send p99", "ms", e["send_p99_ms"])
