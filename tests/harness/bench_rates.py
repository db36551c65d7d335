"""The rate-limited workload scripts/bench measures (issue 20): one-task runs under
``rate_limit: {limit: RATE, per: 1s}``, on a tree with far more worker capacity than the rate
needs, so the window is the only brake. What it reports is what a partner would see: the
attempts' STARTS (``task_attempts.started_at``, the database clock) — the rate achieved over
them against the limit, and the most of them in any one-second sliding window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import RateLimit
from flowforge.store.triggers import Triggers

POLL_S = 0.01
#: The limit, per second.
RATE = 50
#: The most runs of the workload: ten windows' worth (the rate over k windows is biased up by
#: about k/(k - 1): the first window starts full).
MAX_RUNS = 10 * RATE
WORKFLOW = WorkflowDef(
    "bench-rated", (TaskDef("t", "bench.noop", rate_limit=RateLimit(RATE, 1.0, "bench")),)
)


def peak_in_window(starts: list[float], per_s: float) -> int:
    """The most of ``starts`` (sorted seconds) in any half-open window [t, t + per)."""
    best = end = 0
    for i, start in enumerate(starts):
        while end < len(starts) and starts[end] - start < per_s:
            end += 1
        best = max(best, end - i)
    return best


def measure(
    triggers: Triggers,
    conn: psycopg.Connection[Any],
    tasks: int,
    timeout_s: float,
    record: Callable[..., None],
) -> None:
    """Trigger ``min(tasks, MAX_RUNS)`` runs at once and record the starts' rate and peak."""
    runs = min(tasks, MAX_RUNS)
    triggers.trigger_many(WORKFLOW, [{"i": i} for i in range(runs)])
    deadline = time.monotonic() + timeout_s
    query = (
        "SELECT count(*) FROM workflow_runs WHERE workflow = 'bench-rated' AND state = 'SUCCEEDED'"
    )
    while time.monotonic() < deadline:
        row = conn.execute(query).fetchone()
        if row and row[0] == runs:
            break
        time.sleep(POLL_S)
    else:
        raise RuntimeError(f"timed out after {timeout_s}s waiting for {runs} rate-limited runs")
    starts = [
        float(r[0])
        for r in conn.execute(
            "SELECT extract(epoch FROM started_at) FROM task_attempts WHERE rate_key = 'bench'"
            " ORDER BY started_at"
        )
    ]
    rate = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 else 0.0
    record("rate-limited starts", "starts/s", rate, limit=RATE, runs=runs)
    record("rate-limited peak per 1s", "starts", float(peak_in_window(starts, 1.0)), limit=RATE)
