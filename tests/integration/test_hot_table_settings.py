"""Migration 0025: the four hot tables are vacuumed by their churn, not their size
(docs/operations.md "Autovacuum of the hot tables")."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

pytestmark = pytest.mark.integration

HOT = ("task_runs", "workflow_runs", "task_attempts", "outbox")


def test_the_hot_tables_carry_their_own_autovacuum_thresholds(
    sql: psycopg.Connection[Any],
) -> None:
    rows = sql.execute(
        "SELECT relname, reloptions FROM pg_class WHERE relname = ANY(%s) AND relkind = 'r'",
        (list(HOT),),
    ).fetchall()
    options = {str(name): set(opts or ()) for name, opts in rows}
    assert set(options) == set(HOT)
    for table in HOT:
        assert {
            "autovacuum_vacuum_scale_factor=0.02",
            "autovacuum_vacuum_threshold=10000",
        } <= options[table], table
