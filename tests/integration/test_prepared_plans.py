"""Prepared statements (store/part.py ``PREPARED``) are parsed once per connection and run
PostgreSQL's generic plan once it has found it no worse than five custom ones; a connection's
cached plans are discarded when the tables it plans for change size class, so a generic plan
made on small tables is not run on big ones (store/plansize.py; docs/performance.md, "Generic
plans at the tables' size").

Read from the server itself: ``pg_prepared_statements`` of the pool's one connection counts
each statement's generic and custom plans, and ``EXPLAIN EXECUTE`` of a prepared statement
shows the plan that connection would run; tests/harness/plans.py explains a statement both
ways with the parameters the store sent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import RateLimit
from flowforge.domain.model import Finish
from flowforge.domain.states import TaskState
from flowforge.store import queries, rows
from flowforge.store.claims import Claims, _finish_params
from flowforge.store.db import Database
from flowforge.store.part import PREPARED
from flowforge.store.plansize import CHECK_S, FLOOR_PAGES, PlanSizes
from flowforge.store.reads import Reads
from flowforge.store.triggers import Triggers
from tests.harness import bench, plans
from tests.helpers import pool_of

pytestmark = pytest.mark.integration

#: Executions of each statement: PostgreSQL plans the first five for their values whatever the
#: mode, and may switch to its generic plan from the sixth.
EXECUTIONS = 8


@pytest.fixture
def one_connection(pg_server_url: str) -> Iterator[Database]:
    """A pool of one connection, so every statement runs on the session inspected, on a
    database of its own: whether PostgreSQL picks a statement's generic plan weighs it against
    the custom plans' costs, which the shared session database's statistics (what earlier
    tests left) would move."""
    with bench.fresh_database(pg_server_url) as url, pool_of(url, 1, "prepared") as db:
        yield db


def prepared_plans(db: Database) -> dict[str, tuple[int, int, str]]:
    """(generic plans, custom plans, server-side name) of each statement prepared on the
    pool's connection, by its name in queries.sql."""
    names = {
        plans.numbered(text)[0].decode().strip(): name for name, text in queries.load().items()
    }
    found: dict[str, tuple[int, int, str]] = {}
    rows: list[dict[str, Any]] = db.execute(
        b"SELECT name, statement, generic_plans, custom_plans FROM pg_prepared_statements"
    )
    for row in rows:
        name = names.get(row["statement"].strip())
        if name is not None:
            found[name] = (row["generic_plans"], row["custom_plans"], row["name"])
    return found


def exercise(db: Database, times: int) -> str:
    """``times`` two-task runs triggered, read back, claimed and their first task finished
    through the store; the last run's id."""
    triggers, reads, claims = Triggers(db), Reads(db), Claims(db)
    for n in range(times):
        run = reads.get_run(triggers.trigger(plans.FLOW, {"n": n}).run_id)
        first = next(t for t in run.tasks if t.name == "a")
        (claimed,) = claims.claim_many([(first.id, first.fencing_token)], "w/1", 30.0)
        assert claimed.claim is not None
        done = Finish(TaskState.SUCCEEDED, {})
        claims.finish_many([(first.id, claimed.claim.fencing_token, done)])
    return str(run.id)


def relations_scanned(db: Database, statement: str, run_id: str) -> dict[str, str]:
    """How the plan the pool's connection runs for the prepared ``get_run`` reads each
    relation: {relation: node type}, from ``EXPLAIN EXECUTE``."""
    # a utility statement takes no bound parameter: the id is a literal (a UUID, checked)
    query = f"EXPLAIN (FORMAT JSON) EXECUTE {statement}('{uuid.UUID(run_id)}')".encode()
    (row,) = db.execute(query)
    found: dict[str, str] = {}

    def walk(node: dict[str, Any]) -> None:
        if "Relation Name" in node:
            found[node["Relation Name"]] = node["Node Type"]
        for child in node.get("Plans", ()):
            walk(child)

    plan = row["QUERY PLAN"]
    walk((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    return found


def test_the_hot_statements_are_prepared_and_run_their_generic_plans(
    one_connection: Database,
) -> None:
    exercise(one_connection, EXECUTIONS)
    found = prepared_plans(one_connection)
    exercised = {"claim", "finish", "get_run", "get_run_tasks", "run_children"}
    exercised |= {"insert_runs", "insert_tasks", "insert_edges", "register_definitions"}
    exercised |= {"notify_new_tasks"}
    assert exercised <= set(found) <= PREPARED
    for name in exercised - {"register_definitions"}:  # registered once per version
        generic, custom, _ = found[name]
        assert custom <= 5 and generic >= EXECUTIONS - 5, (name, found[name])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_generic_plan_made_on_small_tables_is_made_again_once_they_grew(
    pg_server_url: str,
) -> None:
    """The danger store/plansize.py closes: a generic plan made while workflow_runs was tiny
    reads it whole, and nothing makes it again until an ANALYZE (autovacuum is off here). Once
    the table's size class changed, the next checkout after ``CHECK_S`` closes the connection
    and takes a new one: each statement is prepared again, planned at the size the table has,
    and — no history of cheap custom plans on the tiny table — PostgreSQL takes its generic
    plan again after five custom ones."""
    clock = Clock()
    with bench.fresh_database(pg_server_url) as url:
        with psycopg.connect(url, autocommit=True) as sql:
            for table in ("workflow_runs", "task_runs", "task_edges", "outbox"):
                sql.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            sql.execute("ANALYZE")  # the statistics of a fresh install: empty tables
        config = DatabaseConfig(url=url, pool_min=1, pool_max=1)
        db = Database(config, "prepared", plan_sizes=PlanSizes(clock=clock))
        db.open()
        try:
            run_id = exercise(db, EXECUTIONS)
            statement = prepared_plans(db)["get_run"][2]
            assert relations_scanned(db, statement, run_id) == {"workflow_runs": "Seq Scan"}
            (before,) = db.execute(b"SELECT pg_backend_pid() AS pid")
            # a burst: 20,000 runs written behind the connection's back, no ANALYZE
            with psycopg.connect(url, autocommit=True) as sql:
                sql.execute(
                    "INSERT INTO workflow_runs SELECT (jsonb_populate_record(NULL::workflow_runs,"
                    " to_jsonb(w) || jsonb_build_object('id', gen_random_uuid()))).*"
                    " FROM (SELECT * FROM workflow_runs LIMIT 1) w, generate_series(1, 20000)"
                )
            clock.now += CHECK_S / 2  # not read again yet: the old plan is still the one run
            assert relations_scanned(db, statement, run_id) == {"workflow_runs": "Seq Scan"}
            clock.now += CHECK_S
            run_id = exercise(db, EXECUTIONS)  # its first checkout replaces the connection
            generic, custom, again = prepared_plans(db)["get_run"]
            (after,) = db.execute(b"SELECT pg_backend_pid() AS pid")
            assert after["pid"] != before["pid"]  # a new session: nothing of the old one's plans
            assert (generic, custom) == (EXECUTIONS - 5, 5)  # the generic plan, once more
            scanned = relations_scanned(db, again, run_id)
            assert scanned == {"workflow_runs": "Index Scan"}, scanned
        finally:
            db.close()


@pytest.mark.slow
def test_a_generic_plan_made_at_an_eighth_of_the_size_reads_each_table_as_at_size(
    pg_server_url: str,
) -> None:
    """What a size class allows: no prepared statement's generic plan made on tables an eighth
    of the size (2,500 runs), nor one made at size, reads a table whole that the plan
    PostgreSQL makes for the values on 20,000 runs reads through an index (plans.reads). Node
    for node the two may differ where the custom plan leaves out a subtree its values turn off
    (the claim's outbox lock when not local, the finish's outbox count), or reads a key by a
    bitmap rather than a plain index scan."""
    with bench.fresh_database(pg_server_url) as small, bench.fresh_database(pg_server_url) as big:
        plans.fill(big, 20_000, 2_000)
        plans.fill(small, 2_500, 250)
        found = plans.exercise(big)
        plans.exercise(small)
        with (
            psycopg.connect(small, autocommit=True) as early,
            psycopg.connect(big, autocommit=True) as late,
        ):
            early.execute("ANALYZE")
            late.execute("ANALYZE")
            assert {c.name for c in found} >= PREPARED - {"register_definitions"}
            assert plans.whole_reads_beyond(early, late, found) == {}
            assert plans.whole_reads_beyond(late, late, found) == {}  # made at size, too


@pytest.mark.slow
def test_at_size_the_claim_and_the_finish_still_run_their_generic_plans(
    pg_server_url: str,
) -> None:
    """PostgreSQL keeps a generic plan only while its estimated cost is below the custom
    plans' average. A custom plan sees how long a parameter array is (``unnest`` of a constant
    array is estimated at its length), a generic one guesses 10; on tables of 20,000 runs the
    claim and the finish of one task were then planned for their values at every execution,
    forever (docs/performance.md, "Prepared statements that PostgreSQL plans anyway"). With one
    array of each behind a sub-select, the custom plans guess as the generic one does; every
    other statement a trigger, a read and a claim run takes its generic plan at size too."""
    with bench.fresh_database(pg_server_url) as url:
        plans.fill(url, 20_000, 2_000)
        with psycopg.connect(url, autocommit=True) as sql:
            sql.execute("ANALYZE")
        with pool_of(url, 1, "prepared") as db:
            exercise(db, EXECUTIONS)
            found = prepared_plans(db)
    exercised = {"claim", "finish", "get_run", "get_run_tasks", "run_children"}
    exercised |= {"insert_runs", "insert_tasks", "insert_edges", "notify_new_tasks"}
    for name in exercised:
        generic, custom, _ = found[name]
        assert custom <= 5 and generic >= EXECUTIONS - 5, (name, found[name])


#: A READY backlog: the claims of a busy tree's first seconds, or of a small install's burst.
BACKLOG = 3000
#: Tasks one claim asks for (a worker's prefetch window).
WINDOW = 16


def _claim_reads(plan: dict[str, Any]) -> tuple[int, int]:
    """(rows the claimed UPDATE's read of task_runs passed up, rows its joins' filters threw
    away), summed over the ANALYZEd JSON plan's nodes below the ``Update on task_runs t``."""
    passed = removed = 0

    def walk(node: dict[str, Any], inside: bool) -> None:
        nonlocal passed, removed
        table = node.get("Relation Name") == "task_runs" and node.get("Alias") == "t"
        modify = node["Node Type"] == "ModifyTable"
        inside = inside or (table and modify)
        if inside and table and not modify:
            passed += node["Actual Rows"] * node["Actual Loops"]
        if inside:
            removed += node.get("Rows Removed by Join Filter", 0) * node.get("Actual Loops", 1)
        for child in node.get("Plans", ()):
            walk(child, inside)

    walk(plan, False)
    return passed, removed


def _prepare_generic(sql: psycopg.Connection[Any], name: str, statement: str) -> list[str]:
    """PREPARE ``statement`` (a named query) as ``name`` on ``sql``, generic plans forced (the
    plan is made at its first EXECUTE, at the tables' size then); its parameters' names in
    ``$n`` order."""
    text, order = plans.numbered(queries.load()[statement])
    sql.execute("SET plan_cache_mode = force_generic_plan")
    sql.execute(b"PREPARE " + name.encode() + b" AS " + text)
    return order


def _explain_execute(
    sql: psycopg.Connection[Any],
    name: str,
    order: list[str],
    params: dict[str, Any],
    analyze: bool = True,
) -> Any:
    """The JSON plan of ``EXPLAIN ANALYZE EXECUTE name`` with ``params`` (run, so rows are
    counted: the caller rolls back what it must not keep); without ``analyze``, the plan only
    (nothing runs)."""
    args = pgsql.SQL(", ").join(pgsql.Literal(params[n]) for n in order)
    options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
    explain = pgsql.SQL("EXPLAIN (" + options + ") EXECUTE {} ({})")
    row = sql.execute(explain.format(pgsql.Identifier(name), args)).fetchone()
    assert row is not None
    found = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return found[0]["Plan"]


def _fanout(width: int, join: bool = False) -> WorkflowDef:
    """A start task, ``width`` middle tasks after it (``m0``...), and with ``join`` a task
    after all of them."""
    middle = tuple(f"m{i}" for i in range(width))
    tasks = [TaskDef("start", "plans.noop")]
    tasks += (TaskDef(m, "plans.noop", depends_on=("start",)) for m in middle)
    tasks += [TaskDef("join", "plans.noop", depends_on=middle)] if join else []
    return WorkflowDef(f"{'fanin' if join else 'fan'}-{width}", tuple(tasks))


def _finish_explained(
    sql: psycopg.Connection[Any], statement: str, order: list[str], run_id: Any, task: str
) -> dict[str, Any]:
    """The ANALYZEd plan of the prepared finish ``statement`` ending the task named ``task``
    of the RUNNING run ``run_id`` (made RUNNING here, with its own token), rolled back."""
    row = sql.execute(
        "UPDATE task_runs SET state = 'RUNNING', fencing_token = fencing_token + 1"
        " WHERE run_id = %s AND name = %s RETURNING id, fencing_token",
        (run_id, task),
    ).fetchone()
    assert row is not None
    ended = [(row[0], row[1], Finish(TaskState.SUCCEEDED, {"ok": 1}))]
    sql.execute("BEGIN")
    plan: dict[str, Any] = _explain_execute(sql, statement, order, _finish_params(ended))
    sql.execute("ROLLBACK")
    return plan


def test_a_claim_planned_on_a_small_table_takes_its_window_from_a_grown_backlog(
    pg_server_url: str,
) -> None:
    """A generic plan made while task_runs held a few dozen READY tasks is run against
    thousands until store/plansize.py's next reading drains the pool (up to ``CHECK_S`` after
    the jump, and not at all below its floor). The claim's plan made then scans task_runs: it
    must still pick out the window's tasks by their ids, not pass every READY task up to a
    join that compares each with every id asked for (3,000 rows and 48,000 comparisons a
    claim: in the bench's throughput, the claim's statement time tripled in the repetitions
    where it happened; docs/performance.md, "The claim's plan on a small table")."""
    flow = WorkflowDef("small-then-grown", (TaskDef("a", "plans.noop"),))
    with bench.fresh_database(pg_server_url) as url, pool_of(url, 1, "grown") as db:
        triggers = Triggers(db)
        triggers.trigger_many(flow, [{"n": n} for n in range(40)])
        with psycopg.connect(url, autocommit=True) as sql:
            sql.execute("ALTER TABLE task_runs SET (autovacuum_enabled = false)")
            sql.execute("ANALYZE task_runs")
            order = _prepare_generic(sql, "grown_claim", "claim")

            def claim(count: int) -> dict[str, Any]:
                ready = sql.execute(
                    "SELECT id, fencing_token FROM task_runs WHERE state = 'READY' LIMIT %s",
                    (count,),
                ).fetchall()
                params = rows.claim_params([(r[0], r[1]) for r in ready], "w/1", 30.0, False)
                plan: dict[str, Any] = _explain_execute(sql, "grown_claim", order, params)
                return plan

            claim(4)  # the generic plan, made now: task_runs a page or two
            triggers.trigger_many(flow, [{"n": n} for n in range(BACKLOG)])  # no ANALYZE
            passed, removed = _claim_reads(claim(WINDOW))
    assert passed <= WINDOW, passed
    assert removed <= WINDOW * WINDOW, removed


def _settling_index_scans(plan: dict[str, Any]) -> list[str]:
    """The indexes through which the finish's ``settling`` CTE reads task_runs."""
    found: list[str] = []

    def walk(node: dict[str, Any], inside: bool) -> None:
        inside = inside or node.get("Subplan Name") == "CTE settling"
        if inside and node.get("Relation Name") == "task_runs" and "Index Name" in node:
            found.append(node["Index Name"])
        for child in node.get("Plans", ()):
            walk(child, inside)

    walk(plan, False)
    return found


def test_a_finish_planned_on_small_tables_reaches_the_run_from_its_task(
    pg_server_url: str,
) -> None:
    """The finish asks whether the run it ends is a one-task run it may settle
    (test_finish_settles). A generic plan made on near-empty tables (a fresh install, a
    bench's truncated tables) must reach the run from the finished task, not read every task
    of the RUNNING run through an index on the run's id to find it: once per finish, the whole
    width of a fan-out each time (docs/performance.md, "A finish settles a one-task run")."""

    with (
        bench.fresh_database(pg_server_url) as url,
        pool_of(url, 1, "wide") as db,
        psycopg.connect(url, autocommit=True) as sql,
    ):
        sql.execute("ALTER TABLE task_runs SET (autovacuum_enabled = false)")
        sql.execute("ALTER TABLE workflow_runs SET (autovacuum_enabled = false)")
        order = _prepare_generic(sql, "small_finish", "finish")

        def finish_middle(width: int) -> dict[str, Any]:
            """The finish of one middle task of a new fan-out: the plan is the one made at
            the first call."""
            run_id = Triggers(db).trigger(_fanout(width), {}).run_id
            sql.execute("UPDATE workflow_runs SET state = 'RUNNING' WHERE id = %s", (run_id,))
            return _finish_explained(sql, "small_finish", order, run_id, "m7")

        finish_middle(40)  # the generic plan, made now: a page of tasks, never analyzed
        plan = finish_middle(3000)
    assert set(_settling_index_scans(plan)) <= {"task_runs_pkey"}, _settling_index_scans(plan)


def _cte_work(plan: dict[str, Any], cte: str) -> tuple[list[tuple[str, int]], int]:
    """In an ANALYZEd JSON plan, inside its CTE ``cte``: (node type, rows passed up) of each
    read of task_runs, and the rows every node of the CTE produced, summed over its loops."""
    reads: list[tuple[str, int]] = []
    rows = 0

    def walk(node: dict[str, Any], inside: bool) -> None:
        nonlocal rows
        inside = inside or node.get("Subplan Name") == f"CTE {cte}"
        produced = node["Actual Rows"] * node["Actual Loops"]
        read = node.get("Relation Name") == "task_runs" and node["Node Type"] != "ModifyTable"
        if inside and read:
            reads.append((node["Node Type"], produced))
        rows += produced if inside else 0
        for child in node.get("Plans", ()):
            walk(child, inside)

    walk(plan, False)
    return reads, rows


def test_a_finish_planned_on_unanalyzed_edges_reads_its_dependents_by_their_ids(
    pg_server_url: str,
) -> None:
    """A finished task counts one dependency off each of its dependents (the
    ``release_dependents`` fragment). Once a wide fan-out is in a task_edges not analyzed
    since it was truncated (a fresh install, a bench's repetition), a generic plan guesses that
    a finish has dozens of dependents; for a planner that believes it, reading task_runs whole
    and hashing it is cheaper than that many lookups by id. In a fan-out each middle task has
    one dependent (the join), and that plan read every task of the table on each middle task's
    finish: the bench's fan-outs ran at half speed in the repetitions where the workers'
    connections made that plan. Naming the ids a second time beside the join (as the claim
    does) turned it into a nested loop that scanned all the start task's dependents once for
    each of them: 25 million rows for a 5,000-wide fan-out's start. Whatever the plan, the
    dependents are read by their ids, and the work is linear in their number
    (docs/performance.md, "Where the halved fan-out's time goes")."""

    found: dict[str, tuple[list[tuple[str, int]], int]] = {}
    with (
        bench.fresh_database(pg_server_url) as url,
        pool_of(url, 1, "unanalyzed") as db,
        psycopg.connect(url, autocommit=True) as sql,
    ):
        sql.execute("ALTER TABLE task_runs SET (autovacuum_enabled = false)")
        sql.execute("ALTER TABLE task_edges SET (autovacuum_enabled = false)")
        # a fan-out written since the tables were truncated, not yet analyzed: the planner
        # guesses 1 in 200 of the edges' rows share an upstream (dozens of dependents)
        Triggers(db).trigger(_fanout(BACKLOG, join=True), {})
        order = _prepare_generic(sql, "unanalyzed_finish", "finish")
        run_id = Triggers(db).trigger(_fanout(BACKLOG, join=True), {}).run_id
        sql.execute("UPDATE workflow_runs SET state = 'RUNNING' WHERE id = %s", (run_id,))
        for name in ("m7", "start"):  # one dependent (the join); BACKLOG of them
            plan = _finish_explained(sql, "unanalyzed_finish", order, run_id, name)
            found[name] = _cte_work(plan, "released")
    reads, _ = found["m7"]
    assert reads and all(kind != "Seq Scan" and passed <= 1 for kind, passed in reads), reads
    reads, rows = found["start"]
    assert all(kind != "Seq Scan" and passed <= BACKLOG for kind, passed in reads), reads
    assert rows <= 4 * BACKLOG, rows  # the join with each dependent rescanned: 9 million


#: Tasks one promote pass takes (the scheduler's batch).
PROMOTE_LIMIT = 500


@contextmanager
def _finished_work(
    pg_server_url: str, name: str, runs: int = BACKLOG
) -> Iterator[tuple[Database, psycopg.Connection[Any]]]:
    """A database of its own holding ``runs`` one-task runs, every task and run SUCCEEDED and
    analyzed — a tree's finished work, on which the statistics say every other state is rare
    — with autovacuum off for task_runs, so nothing analyzes what the test adds next: a pool
    of one connection (``name``) and a plain autocommit connection."""
    one = WorkflowDef("done-work", (TaskDef("a", "plans.noop"),))
    with (
        bench.fresh_database(pg_server_url) as url,
        pool_of(url, 1, name) as db,
        psycopg.connect(url, autocommit=True) as sql,
    ):
        sql.execute("ALTER TABLE task_runs SET (autovacuum_enabled = false)")
        Triggers(db).trigger_many(one, [{"n": n} for n in range(runs)])
        sql.execute("UPDATE task_runs SET state = 'SUCCEEDED', finished_at = now()")
        sql.execute("UPDATE workflow_runs SET state = 'SUCCEEDED', finished_at = now()")
        sql.execute("ANALYZE task_runs")
        sql.execute("ANALYZE workflow_runs")
        yield db, sql


def test_a_promote_planned_while_pending_was_rare_reads_its_batch_by_id(
    pg_server_url: str,
) -> None:
    """The scheduler's promote pass (the ``dispatch`` fragment, admit_gated's too) makes the
    tasks it chose READY. Its generic plan, made while the statistics said PENDING tasks were
    rare (a busy tree's finished work analyzed, before a map's items arrive), read the PENDING
    tasks through the state index and rescanned the chosen batch for each: a 10,000-item map's
    first passes took 350 to 600 ms each (4 million rows) and the bench's first map ran at half
    speed (docs/performance.md, "The map's first repetition"). The batch is read by its ids,
    and the work is linear in it."""
    two = WorkflowDef(
        "waiting", (TaskDef("a", "plans.noop"), TaskDef("b", "plans.noop", depends_on=("a",)))
    )
    with _finished_work(pg_server_url, "rare") as (db, sql):  # PENDING is rare
        order = _prepare_generic(sql, "rare_promote", "promote_ready")
        _explain_execute(sql, "rare_promote", order, {"limit": PROMOTE_LIMIT})  # planned now
        Triggers(db).trigger_many(two, [{"n": n} for n in range(BACKLOG)])
        # their dependency met: each b waits for nothing but a promote pass (no ANALYZE)
        sql.execute("UPDATE task_runs SET pending_deps = 0 WHERE name = 'b'")
        sql.execute("BEGIN")
        plan = _explain_execute(sql, "rare_promote", order, {"limit": PROMOTE_LIMIT})
        sql.execute("ROLLBACK")
    reads, rows = _cte_work(plan, "promoted")
    assert sum(passed for _, passed in reads) <= PROMOTE_LIMIT, reads
    assert rows <= 4 * PROMOTE_LIMIT, rows  # the batch rescanned for each PENDING task: millions


#: The scheduler's statements that change rows a CTE of theirs chose: each names them by id
#: (``= ANY`` of an InitPlan's array) and joins no row source to the table (see dispatch); the
#: indexes each update may read its own table through.
CHOSEN_BY_ID = {
    "promote_ready": {"task_runs_pkey"},
    "start_timers": {"task_runs_pkey", "workflow_runs_pkey"},
    "wake_timers": {"task_runs_pkey"},
    "expire_event_waits": {"task_runs_pkey"},
    "open_item_slots": {"task_runs_pkey"},
    "start_due_runs": {
        "workflow_runs_pkey",
        "task_runs_run_state_idx",
        "task_runs_run_id_name_key",
    },
}


def _updates_read_by(plan: dict[str, Any]) -> set[str]:
    """How each update of task_runs or workflow_runs in a JSON plan reads its own table (its
    InitPlans and SubPlans apart): the index name, or the node type of a read without one."""
    found: set[str] = set()

    def reads(node: dict[str, Any], table: str) -> None:
        if node.get("Parent Relationship") in ("InitPlan", "SubPlan"):
            return
        if node.get("Relation Name") == table:
            found.add(node.get("Index Name") or node["Node Type"])
        for child in node.get("Plans", ()):
            reads(child, table)

    def walk(node: dict[str, Any]) -> None:
        table = node.get("Relation Name")
        update = node["Node Type"] == "ModifyTable" and node.get("Operation") == "Update"
        if update and table in ("task_runs", "workflow_runs"):
            for child in node.get("Plans", ()):
                reads(child, table)
        for child in node.get("Plans", ()):
            walk(child)

    walk(plan)
    return found


@pytest.mark.parametrize("statement", sorted(CHOSEN_BY_ID))
def test_a_pass_planned_while_its_states_were_rare_updates_its_rows_by_their_keys(
    statement: str, pg_server_url: str
) -> None:
    """The family of test_a_promote_planned_while_pending_was_rare_reads_its_batch_by_id: a
    generic plan made while the statistics said the state a pass looks for was rare (finished
    work analyzed) must still update the rows it chose through their keys, not read every row
    in that state through an index and rescan the chosen ones for each."""
    with _finished_work(pg_server_url, "rare") as (_db, sql):
        order = _prepare_generic(sql, "rare_pass", statement)
        params = dict.fromkeys(order, PROMOTE_LIMIT)  # each one's parameters: limits
        plan = _explain_execute(sql, "rare_pass", order, params, analyze=False)
    found = _updates_read_by(plan)
    assert found and found <= CHOSEN_BY_ID[statement], found


#: The dispatches a statement is given (a publisher's confirmed batch) or claims (a window).
STAMPED = 500


@pytest.mark.parametrize("statement", ["stamp_outbox", "claim"])
def test_a_statement_planned_while_the_outbox_was_published_reads_its_dispatches_by_key(
    statement: str, pg_server_url: str
) -> None:
    """The publisher's stamp of a confirmed batch and the claim of tasks a worker's own finish
    released (``local``: their outbox rows taken unpublished) find their outbox rows among
    the unpublished ones. A generic plan made while the statistics said nearly every row was
    published (a quiet tree's outbox, analyzed) took the index of unpublished rows as the
    cheap way in and read every unpublished row for each batch: behind a 5,000-wide
    fan-out's dispatches, each 500-row stamp read 5,500 rows, ten times per fan-out
    (docs/performance.md, "The publisher's stamp on a published outbox"). The rows are read
    by their keys, whatever the backlog."""
    one = WorkflowDef("published", (TaskDef("a", "plans.noop"),))
    with (
        bench.fresh_database(pg_server_url) as url,
        pool_of(url, 1, "published") as db,
        psycopg.connect(url, autocommit=True) as sql,
    ):
        sql.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        Triggers(db).trigger_many(one, [{"n": n} for n in range(BACKLOG)])
        sql.execute("UPDATE outbox SET published_at = now()")
        sql.execute("ANALYZE outbox")  # a quiet tree: the unpublished rows are rare
        order = _prepare_generic(sql, "published_" + statement, statement)

        def params(count: int) -> dict[str, Any]:
            pending = sql.execute(
                "SELECT o.id, o.task_run_id, o.fencing_token FROM outbox o"
                " WHERE o.published_at IS NULL ORDER BY o.id LIMIT %s",
                (count,),
            ).fetchall()
            if statement == "stamp_outbox":
                return {"ids": [p[0] for p in pending], "joined": []}
            return rows.claim_params([(p[1], p[2]) for p in pending], "w/1", 30.0, True)

        _explain_execute(sql, "published_" + statement, order, params(4))  # planned now
        Triggers(db).trigger_many(one, [{"n": n} for n in range(BACKLOG)])  # no ANALYZE
        sql.execute("BEGIN")
        plan = _explain_execute(sql, "published_" + statement, order, params(STAMPED))
        sql.execute("ROLLBACK")
    assert plans.rows_handled(plan, relation="outbox") <= 2 * STAMPED


#: A worker's finished batch (its prefetch's width, at most).
FINISHED = 64


def test_a_finish_planned_while_running_was_rare_reads_its_batch_by_id(
    pg_server_url: str,
) -> None:
    """The finish's ``done`` (the update that ends the batch's tasks) has its own join to the
    outcomes. Its generic plan, made while task_runs was past store/plansize.py's floor and
    the statistics said RUNNING tasks were rare (finished work analyzed: a bench's
    repetition, a tree after a quiet spell), read task_runs whole at every finish and compared
    each RUNNING task with every outcome, until the table grew eightfold and the pool was
    drained (docs/performance.md, "The finish's batch by id"). It reads the batch by its
    ids."""
    one = WorkflowDef("more-work", (TaskDef("a", "plans.noop"),))
    with _finished_work(pg_server_url, "rare-running", BACKLOG // 5) as (db, sql):
        pages = sql.execute("SELECT pg_relation_size('task_runs') / 8192").fetchone()
        assert pages and pages[0] >= FLOOR_PAGES  # past the floor: a drain would not replan
        order = _prepare_generic(sql, "rare_finish", "finish")
        _explain_execute(sql, "rare_finish", order, _finish_params([]))  # planned now
        Triggers(db).trigger_many(one, [{"n": n} for n in range(BACKLOG // 2)])  # no ANALYZE
        pages = sql.execute("SELECT pg_relation_size('task_runs') / 8192").fetchone()
        assert pages and pages[0] < 8 * FLOOR_PAGES  # the same size class: still that plan
        running = sql.execute(
            "UPDATE task_runs SET state = 'RUNNING', attempt = 1, fencing_token = 1"
            " WHERE state = 'READY' RETURNING id, fencing_token"
        ).fetchall()
        batch = [(r[0], r[1], Finish(TaskState.SUCCEEDED, {"ok": 1})) for r in running]
        sql.execute("BEGIN")
        plan = _explain_execute(sql, "rare_finish", order, _finish_params(batch[:FINISHED]))
        sql.execute("ROLLBACK")
    read = plans.rows_handled(plan, cte="done", relation="task_runs")
    assert 0 < read <= 2 * FINISHED, read


def test_an_admission_pass_planned_while_pending_was_rare_reads_its_candidates_by_id(
    pg_server_url: str,
) -> None:
    """The admission pass (``admit_gated``, planned at each call) locks the candidates its keys'
    lines chose (``waiting``). Planned on statistics that said PENDING tasks were rare
    (finished work analyzed, then a backlog of rate-limited tasks triggered), it read every
    PENDING task through the state index and compared each with every candidate: 800,877 rows
    handled and 227 ms a pass behind 3,950 waiting tasks, about eight times as much as
    behind 350 (docs/performance.md, "admit_gated's waiting by id"). It reads the candidates
    by their ids: the rows every node of ``waiting`` handles stay linear in the backlog."""
    rated = WorkflowDef(
        "rated", (TaskDef("a", "plans.noop", rate_limit=RateLimit(50, 1.0, "bench")),)
    )
    with _finished_work(pg_server_url, "rare-admission") as (db, sql):  # PENDING is rare
        Triggers(db).trigger_many(rated, [{"n": n} for n in range(BACKLOG)])  # no ANALYZE
        # the ones admitted at the trigger have run: the rest wait for the pass
        sql.execute("UPDATE task_runs SET state = 'SUCCEEDED' WHERE state = 'READY'")
        sql.execute("DELETE FROM task_attempts")
        (waiting,) = sql.execute(
            "SELECT count(*) FROM task_runs WHERE state = 'PENDING'"
        ).fetchone() or (0,)
        params = {"ckeys": [], "rkeys": ["bench"], "per_key": PROMOTE_LIMIT, "maps": []}
        plan = plans.explain_analyzed(sql, queries.load()["admit_gated"], params)
    handled = plans.rows_handled(plan, cte="waiting")
    assert waiting > 2_000  # a backlog, not the few the trigger admitted
    assert handled <= 3 * waiting, (handled, waiting)
