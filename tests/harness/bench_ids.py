"""What the ids of new rows cost a big store: random (UUID version 4) against time-ordered
(version 7, ``flowforge/domain/ids.py``), alternated on one filled database (issue 22, "Scale
of what is stored"; docs/performance.md "Time-ordered ids").

One fresh database on the server at ``--database-url`` gets ``--rows`` finished one-task runs
(:func:`tests.harness.stored_fill.fill`: run, task, attempt and outbox rows, random ids, as an
install upgraded from random ids has). Then ``--rounds`` pairs of rounds, the two kinds
alternated, each a CHECKPOINT (so each round starts where a checkpoint left the pages: the
first change of a page after one writes the whole page to the WAL) and ``--runs`` one-task runs
triggered in batches of 500 (:meth:`Triggers.trigger_many`, as ``scripts/bench``'s throughput
workload) with that kind of id. Per round: runs/s, WAL bytes and full-page images per run
(``pg_stat_wal``), and blocks the server read from outside its buffer cache per run
(``pg_stat_database.blks_read``). Nothing executes the runs: the inserts are what is measured.

The server's settings decide the figure: the effect needs indexes larger than
``shared_buffers``. Nothing here asserts a figure. Run alone::

    python -m tests.harness.bench_ids --database-url URL [--rows 1000000] [--runs 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from flowforge.config import DatabaseConfig
from flowforge.domain import ids
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers
from tests.harness import bench, stored_fill


def random_id(now_ns: int | None = None) -> uuid.UUID:
    """A version-4 UUID, as the store made before ``domain/ids.py``."""
    return uuid.uuid4()


KINDS: dict[str, Callable[..., uuid.UUID]] = {"random": random_id, "time-ordered": ids.new_id}
BATCH = 500


@contextmanager
def ids_of(kind: str) -> Iterator[None]:
    """New runs and tasks planned with ``kind``'s ids for the block."""
    made = ids.new_id
    ids.new_id = KINDS[kind]
    try:
        yield
    finally:
        ids.new_id = made


def counters(db: Database, conn: psycopg.Connection[Any]) -> dict[str, float]:
    """The server's WAL position and its counters of full-page images and blocks read, with
    the triggering session's statistics flushed first (a backend flushes them only now and
    then: ``pg_stat_force_next_flush`` makes its next transaction's end do it)."""
    db.execute(b"SELECT pg_stat_force_next_flush()")
    db.execute(b"SELECT 1")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, w.wal_fpi, d.blks_read FROM pg_stat_wal w,"
        " pg_stat_database d WHERE d.datname = current_database()"
    ).fetchone()
    assert row is not None
    return {"wal bytes": float(row[0]), "fpi": float(row[1]), "blocks read": float(row[2])}


def one_round(
    db: Database, repo: Triggers, conn: psycopg.Connection[Any], kind: str, runs: int
) -> dict[str, float]:
    workflow = WorkflowDef(f"ids-{kind}", (TaskDef("t", "bench.noop"),))
    conn.execute("CHECKPOINT")
    before = counters(db, conn)
    started = time.perf_counter()
    with ids_of(kind):
        for offset in range(0, runs, BATCH):
            repo.trigger_many(
                workflow, [{"i": i} for i in range(offset, min(runs, offset + BATCH))]
            )
    took = time.perf_counter() - started
    after = counters(db, conn)
    figures = {name: (after[name] - before[name]) / runs for name in before}
    return {"runs/s": runs / took, **{f"{k} per run": v for k, v in figures.items()}}


def measure(
    server_url: str, rows: int, runs: int, rounds: int, log: Callable[[str], None]
) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
    with bench.fresh_database(server_url) as url:
        took = stored_fill.fill(url, 0, rows, log)
        log(f"ids: filled {rows:,} finished runs in {sum(took.values()):.0f} s")
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=1), "flowforge-bench-ids")
        db.open()
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                for n in range(rounds):
                    for kind in KINDS if n % 2 == 0 else reversed(list(KINDS)):
                        got = one_round(db, Triggers(db), conn, kind, runs)
                        log(
                            f"ids: round {n + 1} {kind}: "
                            + ", ".join(f"{k} {v:,.1f}" for k, v in got.items())
                        )
                        for name, value in got.items():
                            samples[kind].setdefault(name, []).append(round(value, 2))
                size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
                buffers = conn.execute("SHOW shared_buffers").fetchone()
        finally:
            db.close()
    return {
        "rows": rows,
        "runs per round": runs,
        "database bytes": size[0] if size else None,
        "shared_buffers": buffers[0] if buffers else None,
        "samples": samples,
        "medians": {k: {n: statistics.median(v) for n, v in s.items()} for k, s in samples.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_ids", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    report = measure(
        args.database_url, args.rows, args.runs, args.rounds, lambda m: print(m, file=sys.stderr)
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
