"""Rate limits with real trees (issue 20, SPEC 7.4): 8 workers on 2 trees (``flowforge up``) on
one database and one queue, far more workers than the rate needs, one tree SIGKILLed mid-way.
What a partner sees is calls: the test measures the spread of attempt STARTS
(``task_attempts.started_at``, the database clock), not admissions — the most starts in any
sliding window of ``per`` must be at most the limit, and the rate achieved close to it.

The schedulers poll every 5 s (the tests' default is 0.2 s): a window freeing up must wake them
(``next_due``), or the rate would fall to a batch per poll.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.client import Client
from flowforge.config import load_config
from flowforge.definitions import workflow_from_mapping
from tests.e2e import Stack
from tests.helpers import query_count, wait_for
from tests.trees import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real trees

Sql = psycopg.Connection[tuple[Any, ...]]

RUNS = 100
LIMIT = 20
PER_S = 1.0
DONE_S = 180.0
WORKFLOW = workflow_from_mapping(
    {
        "name": "rated",
        "tasks": [
            {
                "name": "call",
                "handler": "e2e.sleep",
                "rate_limit": {"limit": LIMIT, "per": "1s", "key": "partner"},
            }
        ],
    }
)


def max_in_window(starts: list[datetime], per_s: float) -> int:
    """The most starts in any half-open window [t, t + per) — a window starting at a start
    holds at least as many as any other, so those are the only ones to look at."""
    best = 0
    end = 0  # the first start at or after start + per
    for i, start in enumerate(starts):
        while end < len(starts) and (starts[end] - start).total_seconds() < per_s:
            end += 1
        best = max(best, end - i)
    return best


def test_max_in_window_counts_a_sliding_window() -> None:
    from datetime import UTC, timedelta

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    at = [t0 + timedelta(seconds=s) for s in (0, 0.5, 0.99, 1.0, 1.2, 1.3, 3)]
    assert max_in_window(at, 1.0) == 5  # [0.5, 1.5) holds 0.5, 0.99, 1.0, 1.2 and 1.3
    assert max_in_window(at[:4], 1.0) == 3  # [0, 1) holds 0, 0.5, 0.99; 1.0 is out
    assert max_in_window([], 1.0) == 0


def test_starts_per_window_never_exceed_the_limit_with_8_workers_on_2_trees(
    stack: Stack, sql: Sql, tmp_path: Path, trees: list[Tree]
) -> None:
    config = stack.config_path(processes={"workers": 4}, scheduler={"poll_interval_s": 5.0})
    for i in range(2):
        trees.append(Tree(config, tmp_path / f"tree-{i}.log", env=stack.env()))
    for tree in trees:
        tree.ready()
    with Client(load_config(config, env={}), [WORKFLOW]) as client:
        runs: list[UUID] = [
            r.run_id for r in client.trigger_many("rated", [{"seconds": 0.05}] * RUNS)
        ]
    # one tree SIGKILLed mid-way: the window lives in the database, the survivor keeps to it
    wait_for(
        lambda: query_count(sql, "SELECT count(*) FROM test_executions") >= RUNS // 3,
        60.0,
        0.05,
        "executions",
    )
    trees[0].kill()

    def settled() -> bool:
        assert trees[1].proc.poll() is None, f"the tree exited:\n{trees[1].log()[-3000:]}"
        done = "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s) AND state = 'SUCCEEDED'"
        return query_count(sql, done, runs) == len(runs)

    wait_for(settled, DONE_S, 0.2, "every run to succeed")
    starts = [
        row[0]
        for row in sql.execute(
            "SELECT started_at FROM task_attempts WHERE rate_key = 'partner' ORDER BY started_at"
        )
    ]
    peak = max_in_window(starts, PER_S)
    # the rate while the window was the only brake: the first RUNS starts (a reaped task's
    # retry waits for its lease and backoff, not for the window)
    first = starts[:RUNS]
    rate = (len(first) - 1) / (first[-1] - first[0]).total_seconds()
    reaped = query_count(sql, "SELECT count(*) FROM task_attempts WHERE outcome = 'lease_expired'")
    print(  # the figures docs/flow-control.md quotes
        f"starts: {len(starts)}, most in any {PER_S:g}s window: {peak} (limit {LIMIT}), "
        f"rate over the first {RUNS}: {rate:.1f}/s, reaped: {reaped}"
    )
    assert peak <= LIMIT
    assert peak == LIMIT  # the limit was reached for, not a trickle by chance
    assert rate >= 0.75 * LIMIT  # close to the limit: not starved by the poll interval
    extra = query_count(sql, "SELECT count(*) FROM task_attempts WHERE attempt > 1")
    assert extra == reaped  # held back, no task used an attempt
