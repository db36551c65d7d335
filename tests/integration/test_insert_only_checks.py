"""Migration 0026: the checks of task_runs' insert-only columns are a trigger now, and every value
they refused is still refused — on INSERT and on an UPDATE that sets the column — with the
constraint's own error (docs/performance.md "CHECK constraints on the hot tables")."""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql as pgsql

from flowforge.errors import DatabaseConstraintError
from flowforge.store.pgerrors import translate

pytestmark = pytest.mark.integration

RUN_ID = uuid.UUID(int=1)
GOOD_ID = uuid.UUID(int=2)
#: The columns every task row needs, valid.
BASE_ROW: dict[str, Any] = {
    "run_id": RUN_ID,
    "handler": "h",
    "pending_deps": 0,
    "max_attempts": 3,
    "base_delay_s": 1.0,
    "max_delay_s": 60.0,
    "jitter": "full",
}
#: Each moved condition: (constraint name, columns of a row that breaks it — set by the INSERT
#: and by the UPDATE of a good row). GOOD is the good row's own id (a real map parent).
GOOD = object()
MOVED: list[tuple[str, dict[str, Any]]] = [
    ("task_runs_breaker_cooldown_s_check", {"breaker_cooldown_s": 0.0}),
    ("task_runs_breaker_failures_check", {"breaker_failures": 0}),
    ("task_runs_breaker_window_s_check", {"breaker_window_s": -1.0}),
    ("task_runs_concurrency_limit_check", {"concurrency_limit": 0}),
    (
        "task_runs_event_timeout_s_check",
        {"event_name": "e", "event_key": "k", "event_timeout_s": 0.0},
    ),
    ("task_runs_event_wait_check", {"event_name": "e"}),
    ("task_runs_item_check", {"item_index": 0}),
    ("task_runs_item_index_check", {"map_id": GOOD, "item_index": -1}),
    ("task_runs_max_attempts_check", {"max_attempts": 0}),
    ("task_runs_max_parallel_check", {"max_parallel": 0}),
    ("task_runs_on_dead_check", {"on_dead": "ignore"}),
    ("task_runs_priority_check", {"priority": 10}),
    ("task_runs_rate_limit_check", {"rate_limit": 0}),
    ("task_runs_rate_per_s_check", {"rate_per_s": 0.0}),
    ("task_runs_run_if_check", {"run_if": "sometimes"}),
    ("task_runs_sleep_s_check", {"sleep_s": 0.0}),
]
#: The checks that stay CHECK constraints: the columns the store's UPDATEs set.
KEPT = {
    "task_runs_cancel_cause_check",
    "task_runs_parked_on_check",
    "task_runs_pending_deps_check",
    "task_runs_progress_check",
    "task_runs_state_check",
}


@pytest.fixture
def good_row(sql: psycopg.Connection[Any]) -> uuid.UUID:
    """A run and one valid task row of it (GOOD_ID)."""
    sql.execute(
        "INSERT INTO workflow_definitions (name, digest, definition) VALUES ('w', 'd', '{}')"
    )
    sql.execute(
        "INSERT INTO workflow_runs (id, workflow, workflow_digest, input, fail_fast)"
        " VALUES (%s, 'w', 'd', '{}', false)",
        (RUN_ID,),
    )
    _insert(sql, {"id": GOOD_ID, "name": "good"})
    return GOOD_ID


def _values(columns: dict[str, Any]) -> dict[str, Any]:
    return {k: (GOOD_ID if v is GOOD else v) for k, v in columns.items()}


def _insert(conn: psycopg.Connection[Any], columns: dict[str, Any]) -> None:
    row = {**BASE_ROW, **_values(columns)}
    conn.execute(
        pgsql.SQL("INSERT INTO task_runs ({}) VALUES ({})").format(
            pgsql.SQL(", ").join(map(pgsql.Identifier, row)),
            pgsql.SQL(", ").join(map(pgsql.Placeholder, row)),
        ),
        row,
    )


def _update(conn: psycopg.Connection[Any], task_id: uuid.UUID, columns: dict[str, Any]) -> None:
    values = _values(columns)
    conn.execute(
        pgsql.SQL("UPDATE task_runs SET {} WHERE id = %(id)s").format(
            pgsql.SQL(", ").join(
                pgsql.SQL("{} = {}").format(pgsql.Identifier(k), pgsql.Placeholder(k))
                for k in values
            )
        ),
        {**values, "id": task_id},
    )


def _assert_refused_by(exc: pg_errors.CheckViolation, constraint: str) -> None:
    """The error PostgreSQL gives for a broken CHECK constraint, and what a user is told."""
    assert exc.sqlstate == "23514"
    assert exc.diag.constraint_name == constraint
    assert exc.diag.table_name == "task_runs"
    assert str(exc).splitlines()[0] == (
        f'new row for relation "task_runs" violates check constraint "{constraint}"'
    )
    told = translate(exc)
    assert isinstance(told, DatabaseConstraintError)
    assert constraint in str(told)


@pytest.mark.parametrize(("constraint", "bad"), MOVED, ids=[name for name, _ in MOVED])
def test_an_insert_of_a_bad_value_is_refused_with_the_constraints_error(
    sql: psycopg.Connection[Any], good_row: uuid.UUID, constraint: str, bad: dict[str, Any]
) -> None:
    with pytest.raises(pg_errors.CheckViolation) as refused:
        _insert(sql, {"id": uuid.uuid4(), "name": "bad", **bad})
    _assert_refused_by(refused.value, constraint)
    assert sql.execute("SELECT count(*) FROM task_runs").fetchone() == (1,)


@pytest.mark.parametrize(("constraint", "bad"), MOVED, ids=[name for name, _ in MOVED])
def test_an_update_to_a_bad_value_is_refused_with_the_constraints_error(
    sql: psycopg.Connection[Any], good_row: uuid.UUID, constraint: str, bad: dict[str, Any]
) -> None:
    before = sql.execute("SELECT to_jsonb(t) FROM task_runs t WHERE id = %s", (good_row,))
    kept = before.fetchone()
    with pytest.raises(pg_errors.CheckViolation) as refused:
        _update(sql, good_row, bad)
    _assert_refused_by(refused.value, constraint)
    after = sql.execute("SELECT to_jsonb(t) FROM task_runs t WHERE id = %s", (good_row,))
    assert after.fetchone() == kept


def test_a_row_of_many_tasks_with_one_bad_is_refused_whole(
    sql: psycopg.Connection[Any], good_row: uuid.UUID
) -> None:
    """A fan-out insert (one statement, many rows): one bad row refuses the statement."""
    with pytest.raises(pg_errors.CheckViolation) as refused:
        sql.execute(
            "INSERT INTO task_runs (id, run_id, name, handler, pending_deps, max_attempts,"
            " base_delay_s, max_delay_s, jitter, priority)"
            " SELECT gen_random_uuid(), %s, 't' || g, 'h', 0, 3, 1, 60, 'full',"
            " CASE WHEN g = 700 THEN 12 ELSE 5 END FROM generate_series(1, 1000) g",
            (RUN_ID,),
        )
    _assert_refused_by(refused.value, "task_runs_priority_check")
    assert sql.execute("SELECT count(*) FROM task_runs").fetchone() == (1,)


def test_null_passes_as_it_does_a_check(sql: psycopg.Connection[Any], good_row: uuid.UUID) -> None:
    """The conditions hold unless false: the nullable columns take NULL (no sleep, no limit)."""
    nullable = {
        "sleep_s": None,
        "max_parallel": None,
        "concurrency_limit": None,
        "rate_limit": None,
        "rate_per_s": None,
        "breaker_failures": None,
        "breaker_window_s": None,
        "breaker_cooldown_s": None,
        "event_name": None,
        "event_key": None,
        "event_timeout_s": None,
    }
    _insert(sql, {"id": uuid.uuid4(), "name": "nulls", **nullable})
    _update(sql, good_row, nullable)
    _update(sql, good_row, {"map_id": GOOD, "item_index": 0, "priority": 9, "run_if": "all_done"})
    assert sql.execute("SELECT count(*) FROM task_runs").fetchone() == (2,)


def test_refused_with_session_replication_role_replica_too(
    sql: psycopg.Connection[Any], good_row: uuid.UUID
) -> None:
    """A replica-role session (logical replication's apply, a restore) skips ordinary
    triggers but not constraints: this trigger is ENABLE ALWAYS."""
    with pytest.raises(pg_errors.CheckViolation) as refused, sql.transaction():
        sql.execute("SET LOCAL session_replication_role = replica")
        _update(sql, good_row, {"max_attempts": 0})
    _assert_refused_by(refused.value, "task_runs_max_attempts_check")


def test_the_moved_checks_are_gone_and_the_kept_ones_stay(sql: psycopg.Connection[Any]) -> None:
    rows = sql.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = 'task_runs'::regclass AND contype = 'c'"
    ).fetchall()
    assert {str(name) for (name,) in rows} == KEPT


def test_the_trigger_watches_every_column_its_conditions_read(
    sql: psycopg.Connection[Any],
) -> None:
    """An UPDATE naming none of the trigger's columns skips it: so each column a condition
    reads must be in the list, or an UPDATE of that column alone would go unchecked."""
    row = sql.execute(
        "SELECT pg_get_triggerdef(oid), tgenabled FROM pg_trigger"
        " WHERE tgrelid = 'task_runs'::regclass AND tgname = 'task_runs_insert_only_checks'"
    ).fetchone()
    assert row is not None
    definition, enabled = str(row[0]), str(row[1])
    assert enabled == "A"  # ALWAYS
    listed = re.search(r"UPDATE OF (.*?) ON ", definition)
    when = re.search(r"WHEN \((.*)\) EXECUTE", definition)
    assert listed is not None and when is not None
    watched = {c.strip() for c in listed.group(1).split(",")}
    read = set(re.findall(r"new\.(\w+)", when.group(1)))
    assert read == watched
    assert {c for _, bad in MOVED for c in bad} <= watched
