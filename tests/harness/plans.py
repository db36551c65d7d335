"""Whether a named statement's generic plan is the plan PostgreSQL makes for its values.

A statement prepared server-side (``store/part.py`` ``PREPARED``) runs a generic plan after
five executions, made once per connection from the statistics of that moment, unless its
estimated cost is above the custom plans'. That is only safe for a statement whose plan does
not depend on its values: inserts fed by arrays, lookups by key, joins driven by ``unnest``.
This module checks it on real data, for the parameters the store itself sends:

* :func:`capture` records the parameters of the named statements the store runs meanwhile (in
  this process, through psycopg's cursor);
* :func:`plans` prepares a statement (its ``%(name)s`` placeholders numbered) and explains it
  twice, ``plan_cache_mode`` forced to the generic plan and to a custom one for those values;
* :func:`shape` is a plan without its estimates: node types, relations, indexes, join types
  and strategies — what differs when a plan does.

``python -m tests.harness.plans --database-url URL`` fills a fresh database (``--runs`` finished
two-task runs and a backlog of READY ones), runs a trigger, a read back, a publisher's sweep
and a worker's claim and finish through the store, and prints each captured statement with
whether its generic plan has the custom plan's shape — on those tables, and made on the
freshly migrated (empty) tables then run on the full ones: a connection that prepared it
right after an install keeps that plan until an ANALYZE of its tables invalidates it.
``--cost RUNS`` instead prints the CPU per run of that hot path (:func:`hot_path_cost`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from flowforge.config import Config, DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import Continuation, Finish
from flowforge.domain.states import TaskState
from flowforge.store import queries
from flowforge.store.claims import Claims
from flowforge.store.db import Database
from flowforge.store.outbox import Outbox
from flowforge.store.part import PREPARED
from flowforge.store.passes import Passes
from flowforge.store.reads import Reads
from flowforge.store.triggers import Triggers
from tests.harness import cpuprobe

PARAM_NUMBER = re.compile(r"\$\d+")
#: What a plan node keeps in its shape: what it does, not what it estimates.
SHAPE_KEYS = (
    "Node Type",
    "Strategy",
    "Partial Mode",
    "Operation",
    "Relation Name",
    "Index Name",
    "Join Type",
    "Scan Direction",
    "Parent Relationship",
    "Subplan Name",
    "CTE Name",
)
Shape = tuple[Any, ...]


@dataclass(frozen=True)
class Captured:
    name: str
    query: bytes
    params: Mapping[str, Any]


@contextmanager
def capture(names: Sequence[str]) -> Iterator[list[Captured]]:
    """Record (in order) every execution of the named statements by a psycopg cursor of this
    process while the block runs."""
    texts = {queries.load()[n]: n for n in names}
    # a statement over psycopg's parse cache runs raw (store/db.py run_statement): its numbered
    # text, with its parameters as a list in its names' order
    raw = {queries.numbered(text)[0]: (text, queries.numbered(text)[1]) for text in texts}
    found: list[Captured] = []
    original = psycopg.Cursor.execute

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        name = texts.get(query) if isinstance(query, bytes) else None
        if name is not None:
            found.append(Captured(name, query, dict(params or {})))
        elif isinstance(query, bytes) and query in raw and isinstance(params, list):
            text, order = raw[query]
            found.append(Captured(texts[text], text, dict(zip(order, params, strict=True))))
        return original(self, query, params, **kwargs)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    try:
        yield found
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]


def numbered(query: bytes) -> tuple[bytes, list[str]]:
    """``query`` with its ``%(name)s`` placeholders as ``$1, $2, ...`` (one per name, in the
    order each first appears) and ``%%`` as ``%``; the names in that order (the conversion the
    store itself makes for a statement it sends raw: ``queries.numbered``)."""
    text, names = queries.numbered(query)
    return text, list(names)


def shape(node: Mapping[str, Any]) -> Shape:
    """A plan node (EXPLAIN's JSON) and its children without estimates. An init plan's name
    carries the number of the parameter it returns (``InitPlan 10 (returns $21)``), which a
    generic plan numbers after its own parameters: the number is left out."""
    own = tuple(
        PARAM_NUMBER.sub("$", v) if isinstance(v, str) else v
        for v in (node.get(k) for k in SHAPE_KEYS)
    )
    return (own, tuple(shape(child) for child in node.get("Plans", ())))


def rows_handled(
    node: Mapping[str, Any], cte: str | None = None, relation: str | None = None
) -> int:
    """Over an ANALYZEd JSON plan: the rows its nodes produced or threw away (by a filter or
    a join filter), summed over their loops (EXPLAIN reports each per loop) — the work a plan
    did, which a quadratic plan multiplies. Only nodes inside the CTE named ``cte``, and only
    reads of the table ``relation`` (not its update), when given."""
    inside = cte is None or node.get("Subplan Name") == f"CTE {cte}"
    read = node.get("Relation Name") == relation and node["Node Type"] != "ModifyTable"
    own = 0
    if inside and (relation is None or read):
        thrown = node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Join Filter", 0)
        own = (node["Actual Rows"] + thrown) * node["Actual Loops"]
    below = None if inside else cte  # inside the CTE, so are its nodes
    return own + sum(rows_handled(c, below, relation) for c in node.get("Plans", ()))


def explain_analyzed(
    conn: psycopg.Connection[Any], query: bytes, params: Mapping[str, Any]
) -> dict[str, Any]:
    """The root node of ``EXPLAIN (ANALYZE, FORMAT JSON)`` of ``query`` run once with
    ``params`` in a transaction rolled back, JIT off as the store's sessions run
    (``flowforge/store/db.py`` ``session_options``: a JIT compile can cost more than the
    statement being measured)."""
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL jit = off")
        row = conn.execute(b"EXPLAIN (ANALYZE, FORMAT JSON) " + query, params).fetchone()
    if row is None:
        raise RuntimeError("EXPLAIN returned no plan")
    found = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return dict(found[0]["Plan"])


def plans(conn: psycopg.Connection[Any], captured: Captured) -> dict[str, Shape]:
    """The generic and the custom plan's shapes of ``captured`` on ``conn`` (autocommit)."""
    text, order = numbered(captured.query)
    name = f"probe_{uuid.uuid4().hex[:12]}"
    conn.execute(sql.SQL("PREPARE {} AS ").format(sql.Identifier(name)).as_bytes(conn) + text)
    args = sql.SQL(", ").join(sql.Literal(captured.params[n]) for n in order)
    found: dict[str, Shape] = {}
    try:
        for mode in ("generic", "custom"):
            conn.execute(f"SET plan_cache_mode = force_{mode}_plan")
            explain = sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE {}{}").format(
                sql.Identifier(name), sql.SQL(" ({})").format(args) if order else sql.SQL("")
            )
            row = conn.execute(explain).fetchone()
            assert row is not None
            plan = row[0] if not isinstance(row[0], str) else json.loads(row[0])
            found[mode] = shape(plan[0]["Plan"])
    finally:
        conn.execute("RESET plan_cache_mode")
        conn.execute(sql.SQL("DEALLOCATE {}").format(sql.Identifier(name)))
    return found


#: A two-task workflow (an edge, a dependent made READY by the finish).
FLOW = WorkflowDef("plans", (TaskDef("a", "plans.noop"), TaskDef("b", "plans.noop", ("a",))))
#: A one-task workflow: its finish settles the run itself (no pass derives it).
SOLO = WorkflowDef("plans-solo", (TaskDef("only", "plans.noop"),))
#: Every statement prepared server-side: the hot path's and the scheduler's pass.
NAMES = tuple(sorted(PREPARED))


def fill(url: str, runs: int, backlog: int) -> None:
    """``runs`` finished runs of :data:`FLOW` (their outbox published) and ``backlog`` runs
    whose first task is READY with its outbox row pending; then ANALYZE."""
    db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1), "flowforge-plans")
    db.open()
    try:
        triggers = Triggers(db)
        for offset in range(0, runs + backlog, 1000):
            triggers.trigger_many(FLOW, [{"i": i} for i in range(offset, offset + 1000)])
    finally:
        db.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "WITH done AS (SELECT id FROM workflow_runs ORDER BY created_at, id LIMIT %s)"
            " UPDATE task_runs SET state = 'SUCCEEDED', attempt = 1, started_at = now(),"
            " finished_at = now(), result = '{}'::jsonb, pending_deps = 0"
            " WHERE run_id IN (SELECT id FROM done)",
            (runs,),
        )
        conn.execute(
            "UPDATE workflow_runs SET state = 'SUCCEEDED', started_at = now(),"
            " finished_at = now() WHERE id IN (SELECT run_id FROM task_runs"
            " WHERE state = 'SUCCEEDED' AND name = 'b')"
        )
        conn.execute(
            "UPDATE outbox SET published_at = now() WHERE task_run_id IN"
            " (SELECT id FROM task_runs WHERE state = 'SUCCEEDED')"
        )
        conn.execute("ANALYZE")


def exercise(url: str) -> list[Captured]:
    """A trigger, its run read back, the api's trigger (answered from its inserts), a
    publisher's sweep, a claim of the new run's first task and its finish (claiming the
    dependent it makes READY), the dependent's finish, a one-task run's finish (which settles
    that run itself), then a scheduler's pass (which propagates the two-task run's last task
    and derives its run) and what its loop asks after a pass that found nothing (the next time
    something is due), through the store."""
    from flowforge.roles.scheduler import Scheduler  # a role: not for the --cost path

    db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1), "flowforge-plans")
    db.open()
    scheduler = Scheduler(Config(database=DatabaseConfig(url=url, pool_min=1, pool_max=1)))
    scheduler.initialize()
    try:
        with capture(NAMES) as found:
            run_id = Triggers(db).trigger(FLOW, {"probe": True}).run_id
            run = Reads(db).get_run(run_id)
            answered = Triggers(db).trigger(FLOW, {"probe": "api"}, with_run=True).run
            assert answered is not None  # the api's trigger, answered from its inserts
            Outbox(db).publish_outbox(10, lambda batch: [d.outbox_id for d in batch])
            first = next(t for t in run.tasks if t.name == "a")
            claims = Claims(db)
            (claimed,) = claims.claim_many([(first.id, first.fencing_token)], "plans/1", 30.0)
            assert claimed.claim is not None, claimed
            token = claimed.claim.fencing_token
            then = Continuation("plans/1", 30.0, 1)
            done = Finish(TaskState.SUCCEEDED, {})
            (second,) = claims.finish_many([(first.id, token, done)], 1, then).claimed
            claims.finish_many([(second.task_run_id, second.fencing_token, done)])
            (only,) = Reads(db).get_run(Triggers(db).trigger(SOLO, {"probe": 1}).run_id).tasks
            (solo,) = claims.claim_many([(only.id, only.fencing_token)], "plans/1", 30.0)
            assert solo.claim is not None, solo
            claims.finish_many([(only.id, solo.claim.fencing_token, done)])  # settles its run
            scheduler.run_pass()
            Passes(db).next_due_s([FLOW.name])
        return found
    finally:
        scheduler.shutdown()
        db.close()


def hot_path_cost(url: str, runs: int) -> dict[str, float]:
    """CPU (ms) per run of the store's hot path, in this process and in its one backend: for
    each run a trigger, its read back, a publisher's sweep, the claim of its first task and a
    finish that claims the second, then the second's finish — every statement on one pooled
    connection, so the backend's CPU is theirs alone (nothing polls meanwhile)."""
    db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1), "flowforge-plans")
    db.open()
    try:
        (backend,) = db.execute(b"SELECT pg_backend_pid() AS pid")
        triggers, reads, outbox, claims = Triggers(db), Reads(db), Outbox(db), Claims(db)
        probe = cpuprobe.Probe(
            {"client": lambda: [os.getpid()], "backend": lambda: [backend["pid"]]}
        )
        done = Finish(TaskState.SUCCEEDED, {})
        for warm in (True, False):
            probe.start()
            for n in range(10 if warm else runs):
                run = reads.get_run(triggers.trigger(FLOW, {"n": n}).run_id)
                outbox.publish_outbox(10, lambda batch: [d.outbox_id for d in batch])
                first = next(t for t in run.tasks if t.name == "a")
                (claimed,) = claims.claim_many([(first.id, first.fencing_token)], "plans/1", 30.0)
                assert claimed.claim is not None, claimed
                then = Continuation("plans/1", 30.0, 1)
                token = claimed.claim.fencing_token
                found = claims.finish_many([(first.id, token, done)], 1, then)
                for claim in found.claimed:
                    claims.finish_many([(claim.task_run_id, claim.fencing_token, done)])
            spent = probe.stop()
        return {group: 1000 * seconds / runs for group, seconds in spent.items()}
    finally:
        db.close()


def compare(
    made_on: psycopg.Connection[Any], run_on: psycopg.Connection[Any], found: list[Captured]
) -> list[tuple[str, bool, bool]]:
    """For each statement: (name, generic == custom on ``run_on``, the generic plan made on
    ``made_on`` == the custom one on ``run_on``)."""
    seen: dict[str, tuple[str, bool, bool]] = {}
    for captured in found:
        at_size = plans(run_on, captured)
        early = plans(made_on, captured)["generic"]
        same = at_size["generic"] == at_size["custom"]
        verdict = (captured.name, same, early == at_size["custom"])
        # a statement run twice (a claim alone and in a finish) must hold for both
        old = seen.get(captured.name, verdict)
        seen[captured.name] = (verdict[0], old[1] and same, old[2] and verdict[2])
    return list(seen.values())


def reads(plan: Shape) -> dict[str, str]:
    """How a plan reads each table: ``whole`` where any node scans it sequentially, else
    ``index`` (an index, index-only or bitmap heap scan). What a plan made at another size
    must not get wrong: which tables it reads whole."""
    found: dict[str, str] = {}
    node_type, relation = SHAPE_KEYS.index("Node Type"), SHAPE_KEYS.index("Relation Name")

    def walk(node: Shape) -> None:
        own, children = node
        if own[relation] is not None and own[node_type] != "ModifyTable":
            whole = own[node_type] == "Seq Scan" or found.get(own[relation]) == "whole"
            found[own[relation]] = "whole" if whole else "index"
        for child in children:
            walk(child)

    walk(plan)
    return found


def whole_reads_beyond(
    made_on: psycopg.Connection[Any], run_on: psycopg.Connection[Any], found: list[Captured]
) -> dict[str, set[str]]:
    """The statements whose generic plan made on ``made_on`` reads some table whole
    (:func:`reads`) that the custom plan on ``run_on`` reads through an index or not at all
    (its values turned that subtree off): {name: those tables}."""
    beyond: dict[str, set[str]] = {}
    for captured in found:
        early = reads(plans(made_on, captured)["generic"])
        at_size = reads(plans(run_on, captured)["custom"])
        tables = {t for t, how in early.items() if how == "whole" and at_size.get(t) != "whole"}
        if tables:
            beyond.setdefault(captured.name, set()).update(tables)
    return beyond


def main(argv: list[str] | None = None) -> int:
    from tests.harness import bench

    parser = argparse.ArgumentParser(prog="plans", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument(
        "--cost", type=int, metavar="RUNS", help="instead: CPU per run of the hot path (ms)"
    )
    args = parser.parse_args(argv)
    if args.cost is not None:
        with bench.fresh_database(args.database_url) as url:
            fill(url, args.runs, args.backlog)
            print(json.dumps(hot_path_cost(url, args.cost)))
        return 0
    with (
        bench.fresh_database(args.database_url) as empty,
        bench.fresh_database(args.database_url) as full,
    ):
        started = time.monotonic()
        fill(full, args.runs, args.backlog)
        print(f"filled in {time.monotonic() - started:.0f} s", file=sys.stderr)
        found = exercise(full)
        exercise(empty)  # the empty tables' definitions and rows, as a fresh install has
        with (
            psycopg.connect(empty, autocommit=True) as early,
            psycopg.connect(full, autocommit=True) as late,
        ):
            early.execute("ANALYZE")
            for name, same, early_same in compare(early, late, found):
                print(f"{name:24} generic = custom: {same!s:5}  made empty: {early_same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
