"""The server's CPU per statement that writes task_runs rows, for layouts of its constraints and
indexes compared A/B (issue 22, "Efficiency"; docs/performance.md "CHECK constraints on the hot
tables").

Each layout is a fresh database migrated to this checkout's newest schema, then changed by the
layout's SQL (``--layout NAME=FILE``; ``NAME=`` for none), then given ``ROWS`` task rows of one
run (READY) and a map parent. Workloads, each timed by the CPU of its one backend
(``/proc/PID/schedstat``: nanoseconds, the client's work and the wire left out) and reported in
µs per unit:

* ``update``: one-row ``UPDATE task_runs SET updated_at = now()`` statements in a plpgsql loop
  (each statement planned once, executed ``--n`` times: what every execution pays is left);
* ``update_state``: the same, flipping ``state`` between READY and RUNNING (every index moves);
* ``insert``: one-row INSERTs in a loop (``--n`` / 10; a one-task run's trigger), rolled back;
* ``fanout``: one INSERT of 10,000 task rows, rolled back (µs per row);
* ``map``: one INSERT of 100,000 map items of the parent, rolled back (µs per row).

Every workload runs once unmeasured first (the session's caches), then measured; the layouts
alternate, their order reversed every other round. Run alone, on a server others may use
(only the one backend is measured, but their load slows it)::

    python -m tests.harness.row_cost --database-url URL --layout base= \
        --layout lean=lean.sql [--rounds 3] [--n 20000] [--work update,insert] \
        [--fanout 10000] [--map-items 100000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg

from flowforge.store.migrate import migrate
from tests.harness.resources import create_database, drop_database

ROWS = 5_000
RUN = "00000000-0000-0000-0000-000000000001"
MAP = "00000000-0000-0000-0000-0000000000aa"
REQUIRED = "run_id, handler, pending_deps, max_attempts, base_delay_s, max_delay_s, jitter"
REQUIRED_VALUES = f"'{RUN}', 'h', 0, 3, 1, 60, 'full'"
PICK = "DECLARE ids uuid[] := ARRAY(SELECT id FROM task_runs WHERE name LIKE 't%' ORDER BY id);"
#: name: (statement with {n}, units it does for n, rolled back)
WORK: dict[str, tuple[str, int, bool]] = {
    "update": (
        f"DO $$ {PICK} BEGIN FOR i IN 1..{{n}} LOOP"
        f" UPDATE task_runs SET updated_at = now() WHERE id = ids[1 + i % {ROWS}];"
        " END LOOP; END $$",
        1,
        False,
    ),
    "update_state": (
        f"DO $$ {PICK} BEGIN FOR i IN 1..{{n}} LOOP"
        " UPDATE task_runs SET state = CASE state WHEN 'READY' THEN 'RUNNING' ELSE 'READY' END,"
        f" updated_at = now() WHERE id = ids[1 + i % {ROWS}]; END LOOP; END $$",
        1,
        False,
    ),
    "insert": (
        "DO $$ BEGIN FOR i IN 1..{n} / 10 LOOP"
        f" INSERT INTO task_runs (id, name, state, {REQUIRED})"
        f" VALUES (gen_random_uuid(), 'x' || i, 'READY', {REQUIRED_VALUES}); END LOOP; END $$",
        10,
        True,
    ),
    "fanout": (
        f"INSERT INTO task_runs (id, name, {REQUIRED})"
        f" SELECT gen_random_uuid(), 'f' || g, {REQUIRED_VALUES}"
        " FROM generate_series(1, {rows}) g",
        0,
        True,
    ),
    "map": (
        f"INSERT INTO task_runs (id, name, map_id, item_index, item, state, {REQUIRED})"
        f" SELECT gen_random_uuid(), 'map[' || g || ']', '{MAP}', g, to_jsonb(g), 'PENDING',"
        f" {REQUIRED_VALUES} FROM generate_series(0, {{rows}} - 1) g",
        0,
        True,
    ),
}
#: Rows the fan-out and the map insert by default (``--fanout``, ``--map-items``).
ROWS_WRITTEN = {"fanout": 10_000, "map": 100_000}


def backend_ns(pid: int) -> int:
    """CPU (ns) the process ``pid`` has run (the first field of its schedstat)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def fill(url: str, layout_sql: str) -> None:
    """Apply ``layout_sql`` to the migrated database at ``url`` and give it its rows."""
    with psycopg.connect(url, autocommit=True) as conn:
        if layout_sql.strip():
            conn.execute(layout_sql.encode())
        conn.execute(
            "INSERT INTO workflow_definitions (name, digest, definition) VALUES ('w', 'd', '{}')"
        )
        conn.execute(
            "INSERT INTO workflow_runs (id, workflow, workflow_digest, input, fail_fast)"
            f" VALUES ('{RUN}', 'w', 'd', '{{}}', false)"
        )
        conn.execute(
            f"INSERT INTO task_runs (id, name, state, {REQUIRED})"
            f" SELECT gen_random_uuid(), 't' || g, 'READY', {REQUIRED_VALUES}"
            f" FROM generate_series(1, {ROWS}) g"
        )
        conn.execute(
            f"INSERT INTO task_runs (id, name, state, for_each, max_parallel, {REQUIRED})"
            f" VALUES ('{MAP}', 'map', 'RUNNING', 'items', 10, {REQUIRED_VALUES})"
        )
        conn.execute("VACUUM ANALYZE task_runs")


def cost(url: str, work: str, n: int, rows: Mapping[str, int] = ROWS_WRITTEN) -> float:
    """µs of the backend's CPU per unit of ``work`` (a statement, or a row written); ``rows``:
    the rows the fan-out and the map write."""
    template, per, rollback = WORK[work]
    written = rows.get(work)
    statement = template.replace("{n}", str(n)).replace("{rows}", str(written)).encode()
    units = written or n // per
    with psycopg.connect(url) as conn:
        pid = conn.info.backend_pid
        conn.execute(statement)  # unmeasured: the session's caches, the plpgsql code
        conn.rollback()
        before = backend_ns(pid)
        conn.execute(statement)
        spent = backend_ns(pid) - before
        if rollback:
            conn.rollback()
        else:
            conn.commit()
    return spent / units / 1000


@contextmanager
def layouts(server_url: str, named: dict[str, str]) -> Iterator[dict[str, str]]:
    """A filled database per layout (name: URL), dropped at the end."""
    with ExitStack() as stack:
        urls = {}
        for name, layout_sql in named.items():
            url = create_database(server_url, "flowforge_rowcost")
            stack.callback(drop_database, server_url, url)
            migrate(url)
            fill(url, layout_sql)
            urls[name] = url
        yield urls


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="row_cost", description=__doc__)
    parser.add_argument("--database-url", required=True, help="a server to create databases on")
    parser.add_argument(
        "--layout", action="append", required=True, metavar="NAME=FILE", help="(FILE empty: none)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=20_000, help="statements of an update loop")
    parser.add_argument("--work", default=",".join(WORK))
    parser.add_argument("--fanout", type=int, default=ROWS_WRITTEN["fanout"], help="its rows")
    parser.add_argument("--map-items", type=int, default=ROWS_WRITTEN["map"], help="its rows")
    args = parser.parse_args(argv)
    rows = {"fanout": args.fanout, "map": args.map_items}
    named = {}
    for item in args.layout:
        name, _, path = item.partition("=")
        named[name] = Path(path).read_text(encoding="utf-8") if path else ""
    works = args.work.split(",")
    found: dict[tuple[str, str], list[float]] = {}
    with layouts(args.database_url, named) as urls:
        for round_ in range(args.rounds):
            order = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
            for work in works:
                for name in order:
                    us = cost(urls[name], work, args.n, rows)
                    found.setdefault((work, name), []).append(us)
                    print(
                        f"round {round_} {work:12} {name:10} {us:9.2f} µs"
                        f"  load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    print("median µs per unit (statement; a row for fanout and map): samples")
    for (work, name), samples in found.items():
        listed = ", ".join(f"{s:.1f}" for s in samples)
        print(f"{work:12} {name:10} {statistics.median(samples):9.2f}: {listed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
