"""Prepared statements (store/part.py ``PREPARED``) are parsed once per connection and planned
for their values; only ``GENERIC_PLANS`` run PostgreSQL's generic plan, and theirs is the plan
it makes for the values even when made on empty tables (docs/performance.md, "Several api
processes and prepared statements").

Read from the server itself: ``pg_prepared_statements`` of the pool's one connection counts
each statement's generic and custom plans; tests/harness/plans.py explains a statement both
ways with the parameters the store sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.model import Finish
from flowforge.domain.states import TaskState
from flowforge.store import queries
from flowforge.store.claims import Claims
from flowforge.store.db import Database
from flowforge.store.part import GENERIC_PLANS, PREPARED
from flowforge.store.reads import Reads
from flowforge.store.triggers import Triggers
from tests.harness import bench, plans

pytestmark = pytest.mark.integration

#: Executions of each statement: PostgreSQL plans the first five for their values whatever the
#: mode, and may switch to its generic plan from the sixth.
EXECUTIONS = 8


@pytest.fixture
def one_connection(clean_database_url: str) -> Iterator[Database]:
    """A pool of one connection, so every statement runs on the session inspected."""
    db = Database(DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=1), "prepared")
    db.open()
    try:
        yield db
    finally:
        db.close()


def prepared_plans(db: Database) -> dict[str, tuple[int, int]]:
    """(generic plans, custom plans) of each statement prepared on the pool's connection, by
    its name in queries.sql."""
    names = {
        plans.numbered(text)[0].decode().strip(): name for name, text in queries.load().items()
    }
    found: dict[str, tuple[int, int]] = {}
    rows: list[dict[str, Any]] = db.execute(
        b"SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
    )
    for row in rows:
        name = names.get(row["statement"].strip())
        if name is not None:
            found[name] = (row["generic_plans"], row["custom_plans"])
    return found


def test_the_hot_statements_are_prepared_and_planned_for_their_values_but_the_inserts(
    one_connection: Database,
) -> None:
    db = one_connection
    triggers, reads, claims = Triggers(db), Reads(db), Claims(db)
    for n in range(EXECUTIONS):
        run = reads.get_run(triggers.trigger(plans.FLOW, {"n": n}).run_id)
        first = next(t for t in run.tasks if t.name == "a")
        (claimed,) = claims.claim_many([(first.id, first.fencing_token)], "w/1", 30.0)
        assert claimed.claim is not None
        done = Finish(TaskState.SUCCEEDED, {})
        claims.finish_many([(first.id, claimed.claim.fencing_token, done)])
    found = prepared_plans(db)
    exercised = {"claim", "finish", "get_run", "get_run_tasks", "run_children"}
    exercised |= {"insert_runs", "insert_tasks", "insert_edges", "register_definitions"}
    assert exercised <= set(found) <= PREPARED
    for name in exercised - GENERIC_PLANS:
        assert found[name][0] == 0, (name, found[name])  # never the generic plan
    for name in {"insert_runs", "insert_tasks", "insert_edges"}:
        generic, custom = found[name]
        assert custom <= 5 and generic >= EXECUTIONS - 5, (name, found[name])


@pytest.mark.slow
def test_a_generic_plan_made_on_empty_tables_is_the_custom_plan_at_size(
    pg_server_url: str,
) -> None:
    """Only for GENERIC_PLANS: a connection that prepares them right after an install keeps
    that plan until an ANALYZE — it must be the plan PostgreSQL makes for 5,000 runs."""
    with bench.fresh_database(pg_server_url) as empty, bench.fresh_database(pg_server_url) as full:
        plans.fill(full, 5_000, 1_000)
        found = plans.exercise(full)
        plans.exercise(empty)
        with (
            psycopg.connect(empty, autocommit=True) as early,
            psycopg.connect(full, autocommit=True) as late,
        ):
            early.execute("ANALYZE")
            verdicts = plans.compare(early, late, [c for c in found if c.name in GENERIC_PLANS])
    assert {name for name, _, _ in verdicts} == GENERIC_PLANS
    assert [v for v in verdicts if not (v[1] and v[2])] == []
