"""The worker's hot statements reach rows by primary key, whatever the statistics say.

Task and run states change faster than PostgreSQL's statistics: right after ANALYZE has seen
only finished tasks, a burst of triggers creates thousands of READY tasks, PENDING dependents
and PENDING runs that the statistics call rare. A plan that trusts them reads *every* such row
once per claim or per released dependent — measured at 19 s for one finish of a 10,000-wide
fan-out. These tests build exactly that situation and ask PostgreSQL for the plans of the
claim and the finish, with real parameters, as the worker runs them (unprepared, so planned
for the values): task_runs and workflow_runs are read by primary key, or at most once whole
(a hash join over a large share of the table), never through an index on the state.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import DEFAULT_UPSTREAM_INLINE, Finish
from flowforge.domain.output import Captured, Output, Progress
from flowforge.domain.states import TaskState
from flowforge.store import queries, rows
from tests.helpers import claim_task, single, task_ids
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]

#: Tables whose rows the hot statements must reach by primary key.
KEYED = {"task_runs": "task_runs_pkey", "workflow_runs": "workflow_runs_pkey"}
#: Keyed too: a map's own items by its id (the claim counts an upstream map's, issue 22) —
#: as many as that map has, whatever the table's states.
KEYED_ALSO = {"task_runs_map_item_idx"}
#: Large enough that reading a table whole costs more than 16 primary-key lookups.
HISTORY = 4000
BURST = 3000


def _fanout(width: int) -> WorkflowDef:
    middle = tuple(TaskDef(f"m{i}", "tests.noop", depends_on=("start",)) for i in range(width))
    return WorkflowDef(f"plan-fanout-{width}", (TaskDef("start", "tests.noop"), *middle))


def _scans(
    plan: dict[str, Any], rescanned: bool = False
) -> Iterator[tuple[str, str, str | None, bool]]:
    """(node type, relation, index, rescanned) of every node of a JSON plan that reads a table;
    ``rescanned``: it sits on the inner side of a nested loop, so it runs once per outer row."""
    if "Relation Name" in plan and plan["Node Type"] != "ModifyTable":
        yield plan["Node Type"], plan["Relation Name"], plan.get("Index Name"), rescanned
    for child in plan.get("Plans", ()):
        inner = plan["Node Type"] == "Nested Loop" and child.get("Parent Relationship") == "Inner"
        yield from _scans(child, rescanned or inner)


def _bad_scans(
    sql: Sql, query: bytes, params: dict[str, Any]
) -> list[tuple[str, str, str | None, bool]]:
    """Reads of task_runs / workflow_runs that grow with the table: through any index but the
    primary key (those are indexes on the state), or a whole-table scan repeated per row. A
    single sequential scan feeding a hash join is linear and allowed."""
    row = sql.execute(b"EXPLAIN (FORMAT JSON) " + query, params, prepare=False).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    scans = list(_scans(plan))
    assert any(relation == "task_runs" for _, relation, _, _ in scans), scans
    bad = [
        s
        for s in scans
        if s[1] in KEYED
        and (s[2] not in (None, KEYED[s[1]], *KEYED_ALSO) or (s[2] is None and s[3]))
    ]
    if bad:
        print(json.dumps(plan, indent=1))
    return bad


@pytest.fixture
def skewed(truncated_database_url: str, repo: Store, sql: Sql) -> uuid.UUID:
    """Statistics that saw only finished work, then a burst; the fan-out's run id (on tables
    truncated first, so no dead tuple of an earlier test weighs on the plans)."""
    runs = repo.trigger_many(single("plan-history"), [{"n": n} for n in range(HISTORY)])
    sql.execute("UPDATE task_runs SET state = 'SUCCEEDED', finished_at = now(), propagated = true")
    sql.execute("UPDATE workflow_runs SET state = 'SUCCEEDED', finished_at = now()")
    sql.execute("ANALYZE task_runs")
    sql.execute("ANALYZE workflow_runs")
    assert len(runs) == HISTORY
    repo.trigger_many(single("plan-burst"), [{"n": n} for n in range(BURST)])
    return repo.trigger(_fanout(BURST)).run_id


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_claim_reads_tasks_and_runs_by_primary_key(
    skewed: uuid.UUID, sql: Sql, local: bool
) -> None:
    """``local`` (a worker's claim of what its finish released) also marks the claimed
    tasks' upstream tasks propagated (upstream_settled): through the edges' index too."""
    rows = sql.execute(
        "SELECT task_run_id, fencing_token FROM outbox WHERE published_at IS NULL"
        " ORDER BY id LIMIT 16"
    ).fetchall()
    params = {
        "ids": [r[0] for r in rows],
        "tokens": [r[1] for r in rows],
        "worker": "plan-test",
        "lease_s": 30.0,
        "local": local,
        "keyless_only": True,
        "inline": DEFAULT_UPSTREAM_INLINE,
    }
    assert len(rows) == 16
    assert _bad_scans(sql, queries.load()["claim"], params) == []


def test_finish_releasing_a_wide_fanout_reads_tasks_by_primary_key(
    skewed: uuid.UUID, repo: Store, sql: Sql
) -> None:
    start = task_ids(repo, skewed)["start"]
    token = claim_task(repo, sql, start).fencing_token
    # the running attempt's live output write (migration 0021) reaches it by key as well
    live = Captured(Output("line\n", 0), Progress(0.5, ""))
    written = rows.output_columns([(start, token, live)])
    assert _bad_scans(sql, queries.load()["write_output"], written) == []
    params = {
        **rows.finish_columns([(start, token, Finish(TaskState.SUCCEEDED))]),
        "offer": 16,
        "queue": None,
        "min_priority": 0,
        "publish": True,
    }
    assert _bad_scans(sql, queries.load()["finish"], params) == []
    # and the statement really releases the whole fan-out
    finished = repo.finish_many([(start, token, Finish(TaskState.SUCCEEDED, None))], 16)
    assert finished.committed == {start}
    row = sql.execute(
        "SELECT count(*) FROM task_runs WHERE run_id = %s AND state = 'READY'", (skewed,)
    ).fetchone()
    assert row == (BURST,)
