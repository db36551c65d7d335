"""Fill a scratch database fast with what a busy deployment has stored (issue 22, "Scale of
what is stored"; ``scripts/bench --stored``).

Two kinds of rows, each in its real shape — copied, column by column, from a template run the
store itself triggered (:class:`~flowforge.store.triggers.Triggers`), with only the columns of
its later state replaced — and inserted by ``generate_series`` in batches, one transaction each:

* a **backlog**: one-task runs RUNNING whose task is READY on :data:`BACKLOG_QUEUE`, a queue no
  worker consumes, its dispatch published (an outbox row stamped, as the publisher leaves it; no
  message is sent: the broker's queue is not what is measured);
* **finished runs**: one-task runs SUCCEEDED, their task SUCCEEDED with a result, its attempt
  and its published outbox row (token 0: the claim made it 1), finished
  :data:`FINISHED_AGE_DAYS` days ago and older (one second apart), so a retention shorter than
  that purges them and the default (30 days) not;
* **dead runs** (optional): one-task runs FAILED, their task DEAD after
  :data:`DEAD_ATTEMPTS` failed attempts (each with its outbox row and its error), over
  :data:`DEAD_HANDLERS` handlers, finished as long ago as the finished runs. Retention keeps a
  run with a DEAD task, so a deployment's store holds them until ``flowforge purge``; ``stats``
  and the dead page read them.

Ids are derived from the row's number (``md5``), so a task's run is found without a join.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers

BACKLOG_QUEUE = "flowforge.stored.backlog"
BACKLOG_WORKFLOW = WorkflowDef("stored-backlog", (TaskDef("t", "bench.noop"),))
FINISHED_WORKFLOW = WorkflowDef("stored-finished", (TaskDef("t", "bench.noop"),))
DEAD_WORKFLOW = WorkflowDef("stored-dead", (TaskDef("t", "bench.noop"),))
#: Attempts a dead task made (each failed with handler_error), and handlers the dead tasks are
#: spread over (``stats`` groups dead tasks by workflow, handler and reason).
DEAD_ATTEMPTS = 3
DEAD_HANDLERS = 5
#: Rows inserted per transaction.
BATCH = 100_000
#: The newest finished run finished this many days ago.
FINISHED_AGE_DAYS = 2
#: How long ago the backlog became READY (seconds): older than redispatch_after_s, so the
#: lost-dispatch check judges it.
BACKLOG_AGE_S = 3600

# Per table, the columns whose value differs from the template's: SQL over the series number
# ``g``, the template's row ``t`` and the kind's clock ``at`` (a timestamptz).
_RUN_ID = "md5(%(kind)s || '-run-' || g)::uuid"
_TASK_ID = "md5(%(kind)s || '-task-' || g)::uuid"
_BACKLOG = {
    "workflow_runs": {
        "id": _RUN_ID,
        "state": "'RUNNING'",
        "input": "jsonb_build_object('i', g)",
        "created_at": "at",
        "started_at": "at",
        "updated_at": "at",
    },
    "task_runs": {
        "id": _TASK_ID,
        "run_id": _RUN_ID,
        "state": "'READY'",
        "queue": f"'{BACKLOG_QUEUE}'",
        "created_at": "at",
        "ready_at": "at",
        "updated_at": "at",
    },
}
_FINISHED = {
    "workflow_runs": {
        **_BACKLOG["workflow_runs"],
        "state": "'SUCCEEDED'",
        "finished_at": "at + interval '20 milliseconds'",
    },
    "task_runs": {
        **_BACKLOG["task_runs"],
        "state": "'SUCCEEDED'",
        "queue": "t.queue",
        "attempt": "1",
        "fencing_token": "1",
        "result": "jsonb_build_object('ok', true, 'i', g)",
        "started_at": "at + interval '5 milliseconds'",
        "finished_at": "at + interval '10 milliseconds'",
    },
}
_DEAD = {
    "workflow_runs": {**_FINISHED["workflow_runs"], "state": "'FAILED'"},
    "task_runs": {
        **_FINISHED["task_runs"],
        "state": "'DEAD'",
        "handler": f"'bench.dead' || mod(g, {DEAD_HANDLERS})",
        "attempt": str(DEAD_ATTEMPTS),
        "fencing_token": str(DEAD_ATTEMPTS),
        "result": "NULL",
        "failure_reason": "'max_attempts_exceeded'",
        "last_error": "'ValueError: stored failure ' || g",
    },
}
# a dispatch per attempt (token a - 1, published) and the attempt itself (token a)
_OUTBOX = """
INSERT INTO outbox (task_run_id, fencing_token, created_at, published_at, queue, priority)
SELECT md5(%(kind)s || '-task-' || g)::uuid, a - 1, at, at + interval '1 millisecond',
       {queue}, 0
  FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g, LATERAL (SELECT {clock} AS at) c,
       generate_series(1, {attempts}) AS a
"""
_ATTEMPTS = """
INSERT INTO task_attempts (task_run_id, attempt, fencing_token, worker, started_at, finished_at,
                           outcome, failure_reason, error)
SELECT md5(%(kind)s || '-task-' || g)::uuid, a, a, 'stored-fill/0',
       at + interval '5 milliseconds', at + interval '10 milliseconds', {outcome}
  FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g, LATERAL (SELECT {clock} AS at) c,
       generate_series(1, {attempts}) AS a
"""
_SUCCEEDED_ATTEMPT = "'succeeded', NULL, NULL"
_FAILED_ATTEMPT = "'failed', 'handler_error', 'ValueError: stored failure ' || g"
# one second apart, newest FINISHED_AGE_DAYS days ago; the backlog a millisecond apart
_FINISHED_CLOCK = f"now() - interval '{FINISHED_AGE_DAYS} days' - g * interval '1 second'"
_BACKLOG_CLOCK = f"now() - interval '{BACKLOG_AGE_S} seconds' + g * interval '1 microsecond'"


class _Kind(NamedTuple):
    """One kind of row the fill copies: its template's workflow, the columns replaced, the
    clock, its dispatches' queue (SQL), the attempts each task made and how they ended (SQL
    for ``outcome, failure_reason, error``; None: no attempt, the task never ran)."""

    name: str
    shape: Mapping[str, Mapping[str, str]]
    clock: str
    queue: str
    attempts: int
    outcome: str | None


_KINDS = (
    _Kind("backlog", _BACKLOG, _BACKLOG_CLOCK, f"'{BACKLOG_QUEUE}'", 1, None),
    _Kind("finished", _FINISHED, _FINISHED_CLOCK, "NULL", 1, _SUCCEEDED_ATTEMPT),
    _Kind("dead", _DEAD, _FINISHED_CLOCK, "NULL", DEAD_ATTEMPTS, _FAILED_ATTEMPT),
)


def _columns(conn: psycopg.Connection[Any], table: str) -> list[str]:
    """The columns an INSERT may name (not generated, not a sequence's)."""
    found = conn.execute(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = 'public' AND table_name = %s AND is_generated = 'NEVER'"
        " AND coalesce(column_default, '') NOT LIKE 'nextval(%%'"
        " ORDER BY ordinal_position",
        (table,),
    ).fetchall()
    return [str(r[0]) for r in found]


def _copy(
    conn: psycopg.Connection[Any],
    table: str,
    template: str,
    replaced: Mapping[str, str],
    clock: str,
) -> sql.Composed:
    """INSERT into ``table`` a copy of its template row per series number, ``replaced``'s
    columns computed."""
    columns = _columns(conn, table)
    values = [
        sql.SQL(replaced[c]) if c in replaced else sql.SQL("t.{}").format(sql.Identifier(c))
        for c in columns
    ]
    return sql.SQL(
        "INSERT INTO {table} ({columns}) SELECT {values}"
        " FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g,"
        " LATERAL (SELECT {clock} AS at) c, (SELECT * FROM {table} WHERE id = {template}) t"
    ).format(
        table=sql.Identifier(table),
        columns=sql.SQL(", ").join(map(sql.Identifier, columns)),
        values=sql.SQL(", ").join(values),
        clock=sql.SQL(clock),
        template=sql.Literal(template),
    )


def _templates(database_url: str) -> dict[str, tuple[str, str]]:
    """One run of each workflow triggered through the store: (run id, task id) by kind."""
    db = Database(DatabaseConfig(url=database_url, pool_min=1, pool_max=1), "stored-fill")
    db.open()
    try:
        repo = Triggers(db)
        backlog = repo.trigger(BACKLOG_WORKFLOW, {"i": 0}, queue=BACKLOG_QUEUE).run_id
        finished = repo.trigger(FINISHED_WORKFLOW, {"i": 0}).run_id
        dead = repo.trigger(DEAD_WORKFLOW, {"i": 0}).run_id
    finally:
        db.close()
    found: dict[str, tuple[str, str]] = {}
    with psycopg.connect(database_url) as conn:
        for kind, run_id in (("backlog", backlog), ("finished", finished), ("dead", dead)):
            row = conn.execute("SELECT id FROM task_runs WHERE run_id = %s", (run_id,)).fetchone()
            assert row is not None
            found[kind] = (str(run_id), str(row[0]))
    return found


def fill(
    database_url: str,
    backlog: int,
    finished: int,
    log: Callable[[str], None] = lambda _m: None,
    dead: int = 0,
) -> dict[str, float]:
    """Insert ``backlog`` READY tasks, ``finished`` SUCCEEDED runs and ``dead`` FAILED runs
    (see the module docstring) into the migrated database at ``database_url``, then VACUUM
    ANALYZE it. Returns the seconds each part took (``backlog_s``, ``finished_s``, ``dead_s``,
    ``vacuum_s``)."""
    templates = _templates(database_url)
    took: dict[str, float] = {}
    with psycopg.connect(database_url) as conn:
        counts = {"backlog": backlog, "finished": finished, "dead": dead}
        for kind in _KINDS:
            rows = counts[kind.name]
            started = time.perf_counter()
            run_id, task_id = templates[kind.name]
            statements: list[sql.SQL | sql.Composed] = [
                _copy(conn, "workflow_runs", run_id, kind.shape["workflow_runs"], kind.clock),
                _copy(conn, "task_runs", task_id, kind.shape["task_runs"], kind.clock),
                sql.SQL(_OUTBOX.format(queue=kind.queue, clock=kind.clock, attempts=kind.attempts)),
            ]
            if kind.outcome is not None:
                tried = _ATTEMPTS.format(
                    clock=kind.clock, attempts=kind.attempts, outcome=kind.outcome
                )
                statements.append(sql.SQL(tried))
            for lo in range(1, rows + 1, BATCH):
                params = {"kind": kind.name, "lo": lo, "hi": min(rows, lo + BATCH - 1)}
                with conn.transaction():
                    for statement in statements:
                        conn.execute(statement, params)
                log(f"stored fill: {kind.name} {params['hi']:,} of {rows:,}")
            took[f"{kind.name}_s"] = time.perf_counter() - started
        # the templates go: only the copies are the shape measured
        conn.execute(
            "DELETE FROM workflow_runs WHERE id = ANY(%s::uuid[])",
            ([run for run, _task in templates.values()],),
        )
        conn.commit()
        conn.autocommit = True
        started = time.perf_counter()
        conn.execute("VACUUM ANALYZE")
        took["vacuum_s"] = time.perf_counter() - started
    return took


def bytes_per_task_run(database_url: str) -> dict[str, Any]:
    """The database's size over its task runs: ``database_bytes`` (pg_database_size),
    ``task_runs`` (estimated from the statistics) and ``bytes_per_task_run``, and the bytes of
    each table with its indexes and TOAST per task run (``tables``)."""
    with psycopg.connect(database_url) as conn:
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        count = conn.execute("SELECT count(*) FROM task_runs").fetchone()
        tables = conn.execute(
            "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'public' AND c.relkind = 'r'"
            " ORDER BY pg_total_relation_size(c.oid) DESC LIMIT 6"
        ).fetchall()
    total = int(size[0]) if size else 0
    tasks = max(1, int(count[0]) if count else 0)
    return {
        "database_bytes": total,
        "task_runs": tasks,
        "bytes_per_task_run": total / tasks,
        "tables": {str(name): round(int(b) / tasks, 1) for name, b in tables},
    }
