"""Edges hold their upstream task's name (migration 0023, issue 22 "Wide fan-in"): written by
every trigger, filled for edges the version before inserts without it, back-filled for edges
that existed before the migration, and what a join's name pages read on the edges' index."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store import queries
from flowforge.store.db import Database
from flowforge.store.migrate import _apply_pending, available_migrations, migrate
from tests.harness.resources import create_database, drop_database
from tests.store import Store

pytestmark = pytest.mark.integration

Sql = psycopg.Connection[tuple[Any, ...]]
EDGE_NAMES = 23  # the migration that adds task_edges.upstream_name


def diamond() -> WorkflowDef:
    return WorkflowDef(
        "diamond",
        (
            TaskDef("a", "tests.noop"),
            TaskDef("b", "tests.noop", depends_on=("a",)),
            TaskDef("c", "tests.noop", depends_on=("a",)),
            TaskDef("d", "tests.noop", depends_on=("b", "c")),
        ),
    )


def edges_by_name(sql: Sql, run_id: uuid.UUID) -> set[tuple[str, str, str]]:
    """(upstream's name, the name the edge holds, downstream's name) of a run's edges."""
    rows = sql.execute(
        "SELECT u.name, e.upstream_name, d.name FROM task_edges e"
        " JOIN task_runs u ON u.id = e.upstream_id JOIN task_runs d ON d.id = e.downstream_id"
        " WHERE d.run_id = %s",
        (run_id,),
    ).fetchall()
    return {(str(u), str(n), str(d)) for u, n, d in rows}


def test_a_trigger_writes_each_edges_upstream_name(repo: Store, sql: Sql) -> None:
    run_id = repo.trigger(diamond(), {}).run_id
    assert edges_by_name(sql, run_id) == {
        ("a", "a", "b"),
        ("a", "a", "c"),
        ("b", "b", "d"),
        ("c", "c", "d"),
    }


def test_an_edge_inserted_without_a_name_as_the_version_before_does_gets_it(
    repo: Store, sql: Sql
) -> None:
    run_id = repo.trigger(diamond(), {}).run_id
    ids = dict(sql.execute("SELECT name, id FROM task_runs WHERE run_id = %s", (run_id,)))
    sql.execute("DELETE FROM task_edges WHERE downstream_id = %s", (ids["d"],))
    # the insert_edges of the version before migration 0023: no upstream_name column named
    sql.execute(
        "INSERT INTO task_edges (upstream_id, downstream_id)"
        " SELECT * FROM unnest(%s::uuid[], %s::uuid[])",
        ([ids["b"], ids["c"]], [ids["d"], ids["d"]]),
    )
    assert {e for e in edges_by_name(sql, run_id) if e[2] == "d"} == {
        ("b", "b", "d"),
        ("c", "c", "d"),
    }


def test_the_edges_are_indexed_by_downstream_then_upstream_name(sql: Sql) -> None:
    """The name pages read their edges by (downstream_id, upstream_name); the index on
    downstream_id alone is gone (the composite serves its lookups)."""
    rows = sql.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'task_edges'"
    ).fetchall()
    indexes = {str(name): str(definition) for name, definition in rows}
    assert "task_edges_downstream_idx" not in indexes
    assert indexes["task_edges_downstream_name_idx"].endswith("(downstream_id, upstream_name)")


@pytest.fixture
def before_edge_names(pg_server_url: str) -> Iterator[str]:
    """A new database migrated up to the migration before 0023, dropped after the test."""
    url = create_database(pg_server_url, "flowforge_edges")
    before = tuple(m for m in available_migrations() if m.version < EDGE_NAMES)
    with psycopg.connect(url, autocommit=True) as conn:
        _apply_pending(conn, before)
    yield url
    drop_database(pg_server_url, url)


def test_the_migration_fills_the_names_of_edges_that_existed_before_it(
    before_edge_names: str,
) -> None:
    run_id, top, join = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(before_edge_names, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO workflow_definitions (name, digest, definition) VALUES ('w', 'd', '{}')"
        )
        conn.execute(
            "INSERT INTO workflow_runs (id, workflow, workflow_digest, input, fail_fast)"
            " VALUES (%s, 'w', 'd', '{}', false)",
            (run_id,),
        )
        conn.execute(
            "INSERT INTO task_runs (id, run_id, name, handler, pending_deps, max_attempts,"
            " base_delay_s, max_delay_s, jitter)"
            " VALUES (%s, %s, 'top', 'h', 0, 1, 1, 1, 'none'), (%s, %s, 'join', 'h', 1, 1, 1, 1,"
            " 'none')",
            (top, run_id, join, run_id),
        )
        conn.execute(
            "INSERT INTO task_edges (upstream_id, downstream_id) VALUES (%s, %s)", (top, join)
        )
        applied = _apply_pending(conn, available_migrations())
        assert applied[0] == EDGE_NAMES
        row = conn.execute(
            "SELECT upstream_name FROM task_edges WHERE downstream_id = %s", (join,)
        ).fetchone()
    assert row == ("top",)


@pytest.fixture
def own_database(pg_server_url: str) -> Iterator[str]:
    """A migrated database of this test's own: its ANALYZE leaves statistics the session
    database's plan tests must not see."""
    url = create_database(pg_server_url, "flowforge_edge_pages")
    migrate(url)
    yield url
    drop_database(pg_server_url, url)


def test_a_name_page_of_a_wide_join_reads_its_edges_index_range_not_every_edge(
    own_database: str,
) -> None:
    """The page is an ordered range of task_edges_downstream_name_idx that stops at the page's
    limit: with 2,000 upstream tasks, a page of 50 reads about 50 edges, never all of them."""
    tops = tuple(TaskDef(f"t{i:04}", "tests.noop") for i in range(2000))
    join = TaskDef("join", "tests.noop", depends_on=tuple(t.name for t in tops))
    db = Database(DatabaseConfig(url=own_database), "edge-pages")
    db.open()
    try:
        run_id = Store(db).trigger(WorkflowDef("wide", (*tops, join)), {}).run_id
    finally:
        db.close()
    with psycopg.connect(own_database, autocommit=True) as sql:
        sql.execute("ANALYZE task_edges")
        sql.execute("ANALYZE task_runs")
        row = sql.execute(
            "SELECT id FROM task_runs WHERE run_id = %s AND name = 'join'", (run_id,)
        ).fetchone()
        assert row is not None
        params = {"id": row[0], "after": "t0999", "limit": 50, "inline": 1000, "results": True}
        plan = sql.execute(
            b"EXPLAIN (ANALYZE, FORMAT JSON) " + queries.load()["upstream_names_page"],
            {**params, "name": None},
        ).fetchone()
    assert plan is not None
    edge_scans: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "task_edges":
            edge_scans.append(node)
        for child in node.get("Plans", ()):
            walk(child)

    walk(plan[0][0]["Plan"])
    assert [n["Index Name"] for n in edge_scans] == ["task_edges_downstream_name_idx"]
    assert edge_scans[0]["Actual Rows"] <= 51  # the page's edges (and the one that ends it)
