"""Issue 22's measurement: what a join's claim carries, and what its worker holds, for a
``width``-wide fan-in and an ``items``-item map's join (docs/performance.md "Wide fan-in").

One-off, not part of ``scripts/bench``: it builds both runs in a scratch database (the
upstream tasks finished by SQL, as their execution is not what is measured), then for each
(workload, variant) starts a fresh Python process that claims the join (in a transaction rolled
back, so every variant claims the same READY task), builds ``ctx.upstream`` as a worker does and
reads every upstream element as a handler summing them would. It reports the claim's time, the
bytes of upstream results the claim returned (as JSON) and the process's peak RSS over its
baseline.

Variants: ``before`` runs the ``claim`` query of a ``queries.sql`` given with ``--before-sql``
(main's, e.g. ``git show main:flowforge/store/queries.sql > /tmp/q.sql``) — everything inline;
``after`` this checkout's with ``worker.upstream_inline_items`` / ``upstream_page_items``.

``python -m tests.harness.bench_fanin --server-url URL --before-sql /tmp/q.sql``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import DEFAULT_UPSTREAM_INLINE, DEFAULT_UPSTREAM_PAGE
from flowforge.domain.states import TaskState
from flowforge.roles.upstream import bounded
from flowforge.store import queries, rows
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from flowforge.store.upstreams import Upstreams
from tests.harness.bench_maps import map_workflow
from tests.harness.resources import create_database, drop_database
from tests.store import Store


def fan_in_workflow(width: int) -> WorkflowDef:
    tops = tuple(TaskDef(f"t{i:05}", "bench.noop") for i in range(width))
    join = TaskDef("join", "bench.noop", depends_on=tuple(t.name for t in tops))
    return WorkflowDef(f"fanin-{width}", (*tops, join))


def build(url: str, width: int, items: int) -> dict[str, tuple[str, int]]:
    """Both runs, their joins READY: {workload: (join id, token)}."""
    db = Database(DatabaseConfig(url=url), "bench-fanin")
    db.open()
    repo = Store(db)
    joins: dict[str, tuple[str, int]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        # a fan-in: every upstream SUCCEEDED with a ~200-byte result, the join READY
        run_id = repo.trigger(fan_in_workflow(width), {}).run_id
        conn.execute(
            "UPDATE task_runs SET state = 'SUCCEEDED', finished_at = now(),"
            " result = jsonb_build_object('n', seq, 'value', repeat('x', 180))"
            " WHERE run_id = %s AND name <> 'join'",
            (run_id,),
        )
        joins["fan-in"] = _ready(conn, run_id)
        # a map: list finished with its items, expanded, every item SUCCEEDED, settled
        run_id = repo.trigger(map_workflow(items), {}).run_id  # list → process → end
        [(list_id, token)] = conn.execute(
            "SELECT t.id, o.fencing_token FROM task_runs t JOIN outbox o ON o.task_run_id = t.id"
            " WHERE t.run_id = %s AND t.name = 'list'",
            (run_id,),
        ).fetchall()
        claim = repo.claim(list_id, token, "bench", 600.0).claim
        assert claim is not None
        repo.finish(list_id, claim.fencing_token, TaskState.SUCCEEDED, result=list(range(items)))
        for _ in range(20):
            if not repo.propagate(100) + repo.expand_maps(100):
                break
        conn.execute(
            "UPDATE task_runs SET state = 'SUCCEEDED', finished_at = now(),"
            " result = jsonb_build_object('i', item_index, 'value', repeat('x', 20))"
            " WHERE run_id = %s AND map_id IS NOT NULL",
            (run_id,),
        )
        repo.settle_maps(100)
        joins["map"] = _ready(conn, run_id)
    db.close()
    return joins


def _ready(conn: psycopg.Connection[Any], run_id: UUID) -> tuple[str, int]:
    row = conn.execute(
        "UPDATE task_runs SET state = 'READY', pending_deps = 0, ready_at = now()"
        " WHERE run_id = %s AND name IN ('join', 'end') RETURNING id, fencing_token",
        (run_id,),
    ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1])


def _status_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Start ``VmHWM`` afresh (Linux: 5 to clear_refs), so imports' peak does not count."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(url: str, join: str, token: int, sql_file: str | None, inline: int, page: int) -> None:
    """One variant in this (fresh) process: claim, build ctx.upstream, read every element."""
    named = queries.parse(Path(sql_file).read_text()) if sql_file else queries.load()
    db = Database(DatabaseConfig(url=url), "bench-fanin-pages")
    db.open()
    pages = Upstreams(db, inline=inline)
    params = rows.claim_params([(UUID(join), token)], "bench", 60.0, False, inline)
    with psycopg.connect(url, row_factory=dict_row) as conn:
        conn.execute("SELECT 1")
        _reset_peak()
        base = _status_kib("VmRSS")
        started = time.perf_counter()
        row = conn.execute(named["claim"], params).fetchone()
        claim_s = time.perf_counter() - started
        assert row is not None, "the join was not claimable"
        carried = len(json.dumps(row["upstream"])) + len(json.dumps(row.get("upstream_large")))
        claim = rows.claim(row)
        del row
        upstream = bounded(claim, pages, page)
        started = time.perf_counter()
        elements = 0
        for value in upstream.values():
            if isinstance(value, dict):
                elements += 1
            else:
                elements += sum(1 for _ in value)
        read_s = time.perf_counter() - started
        conn.rollback()
        peak = _status_kib("VmHWM")  # while ctx.upstream is still held, as a handler holds it
    db.close()
    figures = {
        "claim_ms": round(1000 * claim_s, 1),
        "claim_bytes": carried,
        "read_all_ms": round(1000 * read_s, 1),
        "elements": elements,
        "peak_rss_over_base_mib": round((peak - base) / 1024, 1),
    }
    print(json.dumps(figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.bench_fanin")
    parser.add_argument("--server-url", required=True, help="a server to create a database on")
    parser.add_argument("--before-sql", help="main's queries.sql, for the before variant")
    parser.add_argument("--width", type=int, default=10_000)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--inline", type=int, default=DEFAULT_UPSTREAM_INLINE)
    parser.add_argument("--page", type=int, default=DEFAULT_UPSTREAM_PAGE)
    parser.add_argument(
        "--measure", nargs=3, metavar=("URL", "JOIN", "TOKEN"), help=argparse.SUPPRESS
    )
    parser.add_argument("--sql", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        url, join, token = args.measure
        measure(url, join, int(token), args.sql, args.inline, args.page)
        return 0
    url = create_database(args.server_url, "flowforge_fanin")
    try:
        migrate(url)
        joins = build(url, args.width, args.items)
        variants = [("after", None)] + ([("before", args.before_sql)] if args.before_sql else [])
        for workload, (join, token) in joins.items():
            for variant, sql_file in variants:
                for _ in range(args.repeat):
                    command = [sys.executable, "-m", "tests.harness.bench_fanin"]
                    command += ["--server-url", args.server_url, "--inline", str(args.inline)]
                    command += ["--page", str(args.page), "--measure", url, join, str(token)]
                    if sql_file:
                        command += ["--sql", sql_file]
                    out = subprocess.run(command, check=True, capture_output=True, text=True)
                    print(workload, variant, out.stdout.strip(), flush=True)
    finally:
        drop_database(args.server_url, url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
