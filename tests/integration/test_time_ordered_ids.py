"""Migration 0027 and domain/ids.py: every id the store makes for a run, a task or a map's item
is a version-7 UUID that begins with the millisecond it was made, by the database's clock or
the process's (docs/performance.md, "Time-ordered ids")."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from tests.helpers import mapped, run_list
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]


def millis(made: uuid.UUID) -> int:
    return made.int >> 80


def test_the_database_makes_version_7_ids_from_its_clock(sql: Sql) -> None:
    clock = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    before = sql.execute(clock).fetchone()
    rows = sql.execute("SELECT flowforge_new_id() FROM generate_series(1, 1000)").fetchall()
    after = sql.execute(clock).fetchone()
    assert before is not None and after is not None
    made = [uuid.UUID(str(r[0])) for r in rows]
    assert len(set(made)) == 1000
    assert {m.version for m in made} == {7} and {m.variant for m in made} == {uuid.RFC_4122}
    assert all(before[0] <= millis(m) <= after[0] for m in made)


def test_runs_tasks_and_map_items_get_ids_in_the_order_they_were_made(
    repo: Store, sql: Sql
) -> None:
    first = run_list(repo, sql, [1, 2, 3], mapped())
    second = repo.trigger(mapped(), {}).run_id
    rows = sql.execute(
        "SELECT id, run_id, map_id IS NOT NULL FROM task_runs WHERE run_id = ANY(%s)",
        ([first, second],),
    ).fetchall()
    ids = [uuid.UUID(str(r[0])) for r in rows] + [first, second]
    assert {i.version for i in ids} == {7}
    assert sum(1 for r in rows if r[2]) == 3  # the items, made by the database
    # (within one millisecond the order is random: compare the milliseconds)
    assert millis(first) <= millis(second)  # triggered later
    items = [uuid.UUID(str(r[0])) for r in rows if r[2]]
    assert all(millis(first) <= millis(i) for i in items)  # made after their run
