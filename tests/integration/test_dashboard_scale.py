"""The dashboard's queries with 100,000 runs (200,000 task runs) in a scratch database.

Timings are not asserted; plans and rows read are. Each query is run the way the repository
runs it (the named query from queries.sql, parameters bound, unprepared) under
``EXPLAIN (ANALYZE, FORMAT JSON)``. Proven here:

- every runs page — any combination of state, workflow, created since/until and cursor — is an
  index scan of workflow_runs (never a Seq Scan) that reads at most a few hundred rows;
- the overview's per-minute throughput, retry backlog, poison candidates and dead tasks by
  reason, ``stats``' dead tasks by workflow, and every dead-task list, count and bulk-requeue
  selection, read task_runs through an index (never a Seq Scan), touching only the rows they
  report on;
- the run and task counts by state add up to every run and task while the tables hold fewer
  rows than the cap; above it (lowered here to a few thousand rather than 100,000 rows
  inserted), the overview, ``stats``, /metrics' and /health/ready's counts read no table
  sequentially: each unsettled state is counted through an index up to the cap, a count above
  it and the settled states are PostgreSQL's estimate and say so (migration 0024);
- the repository's pages walk the 100,000 runs newest first through cursors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.model import DeadFilter
from flowforge.domain.reasons import FailureReason
from flowforge.store import queries
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from flowforge.store.reads import DEAD_GROUPS_CAP
from tests.harness.resources import create_database, drop_database
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Sql = psycopg.Connection[tuple[Any, ...]]

RUNS = 100_000
TASKS_PER_RUN = 2
PAGE = 51  # what the api asks for: a page of 50 and one more to know if there is a next
#: Rows a page query may read from a table (matches plus rows skipped by a filter).
PAGE_READ_BOUND = 1_000
#: Rows an overview or dead-task query may read from task_runs (~1% of them are reported on).
REPORT_READ_BOUND = 5_000
SCAN_NODES = {"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan"}

SEED = (
    """
    INSERT INTO workflow_definitions (name, digest, definition)
    SELECT 'wf-' || w, 'd', '{}' FROM generate_series(0, 9) AS w
    """,
    # one run every 10 s back from now; 1% FAILED, 1% CANCELLED, 3% RUNNING, 1% PENDING
    """
    INSERT INTO workflow_runs (id, workflow, workflow_digest, state, input, fail_fast,
                               created_at, started_at, finished_at)
    SELECT gen_random_uuid(), 'wf-' || mod(i / 3, 10), 'd', s.state, jsonb_build_object('i', i),
           true, now() - i * interval '10 seconds', now() - i * interval '10 seconds',
           CASE WHEN s.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
                THEN now() - i * interval '10 seconds' + interval '2 seconds' END
      FROM generate_series(1, %(runs)s) AS i,
           LATERAL (SELECT CASE WHEN mod(i, 100) = 0 THEN 'FAILED'
                                WHEN mod(i, 100) = 1 THEN 'CANCELLED'
                                WHEN mod(i, 100) BETWEEN 2 AND 4 THEN 'RUNNING'
                                WHEN mod(i, 100) = 5 THEN 'PENDING'
                                ELSE 'SUCCEEDED' END AS state) AS s
    """,
    # two tasks per run, in states that agree with the run's
    """
    INSERT INTO task_runs (id, run_id, name, handler, state, pending_deps, attempt,
                           max_attempts, base_delay_s, max_delay_s, jitter, failure_reason,
                           retry_at, created_at, started_at, finished_at)
    SELECT gen_random_uuid(), r.id, 'step-' || n, 'h.step' || n, t.state, 0,
           CASE WHEN t.state = 'RETRYING' THEN 4 WHEN t.state = 'PENDING' THEN 0 ELSE 1 END,
           5, 1, 60, 'full',
           CASE WHEN t.state = 'DEAD' THEN (ARRAY['permanent_error', 'crash_loop'])
                                           [1 + (hashtext(r.id::text) & 1)] END,
           CASE WHEN t.state = 'RETRYING' THEN now() + interval '1 minute' END,
           r.created_at, r.started_at,
           CASE WHEN t.state IN ('SUCCEEDED', 'DEAD', 'CANCELLED')
                THEN r.created_at + n * interval '1 second' END
      FROM workflow_runs r
     CROSS JOIN generate_series(1, 2) AS n,
           LATERAL (SELECT CASE r.state
                             WHEN 'SUCCEEDED' THEN 'SUCCEEDED'
                             WHEN 'FAILED' THEN CASE WHEN n = 1 THEN 'DEAD' ELSE 'CANCELLED' END
                             WHEN 'CANCELLED' THEN 'CANCELLED'
                             WHEN 'PENDING' THEN 'PENDING'
                             ELSE CASE WHEN n = 1 THEN 'SUCCEEDED'
                                       WHEN mod(hashtext(r.id::text), 2) = 0 THEN 'RETRYING'
                                       ELSE 'RUNNING' END
                           END AS state) AS t
    """,
)


@pytest.fixture(scope="module")
def scale_url(pg_server_url: str) -> Iterator[str]:
    """A migrated scratch database holding 100,000 runs, vacuumed and analysed."""
    url = create_database(pg_server_url, "flowforge_scale")
    try:
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in SEED:
                conn.execute(statement, {"runs": RUNS})
            conn.execute("VACUUM ANALYZE")
        yield url
    finally:
        drop_database(pg_server_url, url)


@pytest.fixture(scope="module")
def big(scale_url: str) -> Iterator[Sql]:
    with psycopg.connect(scale_url, autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def big_repo(scale_url: str) -> Iterator[Store]:
    database = Database(DatabaseConfig(url=scale_url, pool_min=1, pool_max=2))
    database.open()
    yield Store(database)
    database.close()


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def explain(conn: Sql, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The executed plan's nodes of the named query, run as the repository runs it."""
    query = b"EXPLAIN (ANALYZE, FORMAT JSON) " + queries.load()[name]
    row = conn.execute(query, params, prepare=False).fetchone()
    assert row is not None
    return list(nodes(row[0][0]["Plan"]))


def scans(plan: list[dict[str, Any]], table: str) -> list[dict[str, Any]]:
    return [n for n in plan if n["Node Type"] in SCAN_NODES and n.get("Relation Name") == table]


def rows_read(plan: list[dict[str, Any]], table: str) -> int:
    """Rows the scans of ``table`` produced or filtered out, over all their loops."""
    return sum(
        (n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"]
        for n in scans(plan, table)
    )


def assert_indexed(plan: list[dict[str, Any]], table: str, bound: int, what: Any) -> None:
    found = scans(plan, table)
    assert found, (what, plan)
    assert all(n["Node Type"] != "Seq Scan" for n in found), (what, found)
    assert rows_read(plan, table) <= bound, (what, rows_read(plan, table))


def run_pages(big: Sql) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every filter combination of the runs page, first page and a page deep down."""
    now = datetime.now(UTC)
    deep = big.execute(
        "SELECT created_at, id FROM workflow_runs ORDER BY created_at DESC, id DESC"
        " OFFSET %s LIMIT 1",
        (RUNS // 2,),
    ).fetchone()
    assert deep is not None
    windows = [(None, None), (now - timedelta(days=8), now - timedelta(days=2))]
    for state, workflow, (since, until), cursor in itertools.product(
        (None, "SUCCEEDED", "FAILED", "PENDING"), (None, "wf-3"), windows, (None, deep)
    ):
        params = {
            "state": state,
            "workflow": workflow,
            "since": since,
            "until": until,
            "limit": PAGE,
            "before_created": cursor[0] if cursor else None,
            "before_id": cursor[1] if cursor else None,
        }
        yield "list_runs", params


def test_every_runs_page_is_an_index_scan_that_reads_a_page_not_the_table(big: Sql) -> None:
    checked = 0
    for name, params in run_pages(big):
        plan = explain(big, name, params)
        assert_indexed(plan, "workflow_runs", PAGE_READ_BOUND, params)
        checked += 1
    assert checked == 4 * 2 * 2 * 2


DEAD_FILTERS = [
    {"reason": None, "workflow": None, "handler": None},
    {"reason": "permanent_error", "workflow": None, "handler": None},
    {"reason": "crash_loop", "workflow": "wf-3", "handler": None},
    {"reason": None, "workflow": None, "handler": "h.step1"},
]


def test_the_overview_and_dead_task_queries_read_task_runs_through_indexes(big: Sql) -> None:
    reports = [
        ("finished_per_minute", {}),
        ("stats_retry_backlog", {}),
        ("stats_poison_candidates", {"threshold": 3, "limit": 20}),
        ("dead_by_reason", {}),
        # each dead task's run by key, not workflow_runs read whole for a hash join
        ("stats_dead_by_workflow", {"cap": DEAD_GROUPS_CAP}),
    ]
    for match in DEAD_FILTERS:
        reports += [
            ("list_dead", {**match, "limit": PAGE, "before_finished": None, "before_id": None}),
            ("count_dead", match),
            ("dead_ids_matching", {**match, "limit": 1000}),
        ]
    for name, params in reports:
        plan = explain(big, name, params)
        assert_indexed(plan, "task_runs", REPORT_READ_BOUND, (name, params))
        assert all(n["Node Type"] != "Seq Scan" for n in scans(plan, "workflow_runs")), name


def test_the_state_counts_below_the_cap_are_exact_and_add_up(big: Sql, big_repo: Store) -> None:
    overview = big_repo.overview(poison_threshold=3, fresh_s=15.0, cap=RUNS * TASKS_PER_RUN)
    assert not overview.estimated_runs and not overview.estimated_tasks
    assert sum(overview.runs.values()) == RUNS
    assert sum(overview.tasks.values()) == RUNS * TASKS_PER_RUN
    assert overview.runs["FAILED"] == RUNS // 100
    assert sum(overview.dead_by_reason.values()) == RUNS // 100
    assert len(overview.poison_candidates) == 20  # the list is bounded
    assert len(overview.finished_per_minute) == 60
    finished_last_hour = sum(
        m.succeeded + m.dead + m.cancelled for m in overview.finished_per_minute
    )
    row = big.execute(
        "SELECT count(*) FROM task_runs"
        " WHERE finished_at >= date_trunc('minute', now()) - interval '59 minutes'"
    ).fetchone()
    assert row == (finished_last_hour,) and finished_last_hour > 0


def test_the_repository_walks_the_runs_newest_first_through_cursors(
    big: Sql, big_repo: Store
) -> None:
    expected = [
        r[0]
        for r in big.execute(
            "SELECT id FROM workflow_runs WHERE workflow = 'wf-3'"
            " ORDER BY created_at DESC, id DESC LIMIT 150"
        ).fetchall()
    ]
    walked = []
    before = None
    for _ in range(3):
        page = big_repo.list_runs(workflow="wf-3", limit=50, before=before)
        walked += [r.id for r in page]
        before = (page[-1].created_at, page[-1].id)
    assert walked == expected
    dead = big_repo.list_dead(
        20, match=DeadFilter(reason=FailureReason.CRASH_LOOP, workflow="wf-3")
    )
    assert dead and all(
        (t.failure_reason, t.workflow) == (FailureReason.CRASH_LOOP, "wf-3") for t in dead
    )


#: The cap the capped-count tests lower COUNT_CAP to: below the SUCCEEDED runs and task runs
#: (94,000 and 191,000 or so), above every other state's.
CAP = 5_000


def xact_reads(conn: psycopg.Connection[Any], table: str) -> tuple[int, int]:
    """Sequential scans of ``table`` begun and the rows they read, in this transaction so far."""
    row = conn.execute(
        "SELECT seq_scan, seq_tup_read FROM pg_stat_xact_user_tables WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_counts_above_the_cap_are_estimated_and_read_about_the_cap_at_most(
    big: Sql, scale_url: str
) -> None:
    from flowforge.store.reads import Reads

    truth = dict(big.execute("SELECT state, count(*) FROM task_runs GROUP BY state").fetchall())
    runs_truth = dict(
        big.execute("SELECT state, count(*) FROM workflow_runs GROUP BY state").fetchall()
    )
    with psycopg.connect(scale_url) as conn:  # one transaction: its own table statistics
        database = Database(DatabaseConfig(url=scale_url, pool_min=1, pool_max=1))
        database.open()
        try:
            reads = Reads(database)
            overview = reads.overview(3, 15.0, cap=CAP)
            stats = reads.stats(3, cap=CAP)
            tasks = reads.task_state_counts(cap=CAP)
            loads = reads.queue_loads(cap=CAP)
        finally:
            database.close()
        # the same statements again, in this transaction, to count what they read
        for name, params in (
            ("run_state_counts", {"cap": CAP}),
            ("task_state_counts", {"cap": CAP}),
            ("queue_load", {"cap": CAP, "fresh_s": 15.0}),
            ("stats_attempts", {"cap": CAP}),
        ):
            conn.execute(queries.load()[name], params, prepare=False).fetchall()
        # stats_attempts' exact branch is a sequential scan that never runs (a one-time
        # filter); a count of a common state may scan the table, but stops after the cap
        assert xact_reads(conn, "task_runs")[1] == 0
        assert xact_reads(conn, "workflow_runs")[1] <= 2 * CAP
    # settled task states and the SUCCEEDED runs are estimated (within the sample's error)
    assert overview.estimated_tasks == {"SUCCEEDED", "CANCELLED"}
    assert overview.estimated_runs == {"SUCCEEDED"}
    for state in ("SUCCEEDED", "CANCELLED"):
        assert abs(overview.tasks[state] - truth[state]) <= 0.1 * truth[state], state
        assert tasks[state] == overview.tasks[state]
    assert (
        abs(overview.runs["SUCCEEDED"] - runs_truth["SUCCEEDED"]) <= 0.1 * runs_truth["SUCCEEDED"]
    )
    # the unsettled states, below the cap, are exact
    for state in ("DEAD", "RUNNING", "RETRYING", "PENDING"):
        assert overview.tasks[state] == truth[state] < CAP, state
    assert overview.runs["FAILED"] == runs_truth["FAILED"] == RUNS // 100
    # the retry distribution is the statistics' (attempt 1 is most of the rows)
    assert stats.attempts_estimated
    assert abs(stats.attempts[1] - RUNS * TASKS_PER_RUN) <= 0.1 * RUNS * TASKS_PER_RUN
    assert loads == ()  # no READY task, no worker


def test_a_queue_with_more_ready_tasks_than_the_cap_reads_cap_plus_one_estimated(
    big: Sql, big_repo: Store
) -> None:
    big.execute(
        "UPDATE task_runs SET state = 'READY', queue = 'bulk', ready_at = now()"
        " WHERE id IN (SELECT id FROM task_runs WHERE state = 'SUCCEEDED' LIMIT %s)",
        (CAP + 10,),
    )
    try:
        (bulk,) = big_repo.queue_loads(cap=CAP)
        assert (bulk.queue, bulk.ready, bulk.estimated, bulk.unserved) == (
            "bulk",
            CAP + 1,
            True,
            True,
        )
        (exact,) = big_repo.queue_loads(cap=2 * CAP)
        assert (exact.ready, exact.estimated) == (CAP + 10, False)
    finally:
        big.execute(
            "UPDATE task_runs SET state = 'SUCCEEDED', queue = NULL, ready_at = NULL"
            " WHERE state = 'READY' AND queue = 'bulk'"
        )
