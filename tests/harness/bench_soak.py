"""``scripts/bench --soak MINUTES``: a tree fed at a fixed rate for a while, sampled as it goes
(issue 22, "Over time"; docs/performance.md "Soak and payloads").

On a fresh database, a ``flowforge up`` tree with ``--workers`` workers runs two-task chains
(``a`` → ``b``, no-op handlers). First a short burst measures the most chains per second the
tree finishes; then the soak triggers chains at ``--soak-rate`` (default: half that maximum), in
small batches every :data:`TICK_S`, for ``MINUTES``. Every interval (30 s; a twelfth of a soak
shorter than six minutes) it samples:

* the RSS of every process of the tree (``/proc``), by process title and pid;
* p50/p99 of dispatch (run created → ``a`` started) and of the hop (``a`` finished → ``b``
  finished) of the chains seen finished since the last sample (database timestamps), and how
  many: the rate finished, and the backlog (triggered, not yet finished);
* live and dead tuples, heap and index bytes of the hot tables (``pg_stat_user_tables``,
  ``pg_relation_size``, ``pg_indexes_size``);
* the open connections to the bench database (``pg_stat_activity``).

The verdicts (:mod:`tests.harness.bench_soak_verdicts`) judge those samples; the server's
autovacuum settings are reported with them (a server with autovacuum off cannot bound bloat).
Finished runs are kept, as with no retention purge: tables of runs grow with them, and bloat is
the dead tuples, not the size. Nothing here asserts a figure. Run alone::

    python -m tests.harness.bench_soak --database-url URL --broker-url URL --minutes 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers
from tests.harness import bench, bench_maps, bench_soak_verdicts

#: Seconds between two trigger batches of the feed.
TICK_S = 0.1
#: Seconds between samples of a soak of six minutes or more; shorter: a twelfth of it.
INTERVAL_S = 30.0
#: Chains the burst that measures the maximum rate triggers at once.
BURST_RUNS = 1000
#: Where the engine's rows churn: what autovacuum has to keep up with.
HOT_TABLES = (
    "workflow_runs",
    "task_runs",
    "task_attempts",
    "task_edges",
    "outbox",
    "processes",
    "counters",
    "idempotency_keys",
)
AUTOVACUUM_SETTINGS = (
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_vacuum_cost_limit",
    "autovacuum_vacuum_cost_delay",
)

SOAK = WorkflowDef(
    "soak", (TaskDef("a", "bench.noop"), TaskDef("b", "bench.noop", depends_on=("a",)))
)

#: Per finished chain: id, dispatch (ms), hop (ms); among the ids given.
FINISHED = """
SELECT r.id,
       extract(epoch FROM a.started_at - r.created_at) * 1000,
       extract(epoch FROM b.finished_at - a.finished_at) * 1000
  FROM workflow_runs r
  JOIN task_runs a ON a.run_id = r.id AND a.name = 'a'
  JOIN task_runs b ON b.run_id = r.id AND b.name = 'b'
 WHERE r.id = ANY(%(ids)s::uuid[]) AND b.state = 'SUCCEEDED'
"""
TABLE_STATS = """
SELECT relname, n_live_tup, n_dead_tup, pg_relation_size(relid), pg_indexes_size(relid),
       autovacuum_count, autoanalyze_count
  FROM pg_stat_user_tables WHERE relname = ANY(%(tables)s)
"""


def interval_for(duration_s: float) -> float:
    """Seconds between samples: :data:`INTERVAL_S`, shorter for a short soak (12 samples)."""
    return min(INTERVAL_S, max(1.0, duration_s / 12))


def max_rate(repo: Triggers, conn: psycopg.Connection[Any], runs: int, timeout_s: float) -> float:
    """Chains per second the tree finishes when ``runs`` are triggered at once (database
    timestamps: first run created → last task finished)."""
    for offset in range(0, runs, bench.TRIGGER_BATCH):
        repo.trigger_many(SOAK, [{}] * min(bench.TRIGGER_BATCH, runs - offset))
    bench._wait_until(
        conn,
        "SELECT count(*) = %(n)s FROM workflow_runs WHERE state = 'SUCCEEDED'",
        {"n": runs},
        timeout_s,
    )
    row = conn.execute(
        "SELECT extract(epoch FROM max(finished_at) - min(created_at)) FROM workflow_runs"
    ).fetchone()
    return runs / float(row[0]) if row and row[0] else 0.0


def _rss_kb(pids: list[int]) -> dict[str, int]:
    """RSS (kB) of each process alive of ``pids``, by ``title [pid]``."""
    found = {}
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        rss = next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
        found[f"{title} [{pid}]"] = rss
    return found


def _tables(conn: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    return {
        name: {
            "live": live,
            "dead": dead,
            "bytes": heap,
            "index_bytes": index,
            "autovacuums": vacuums,
            "autoanalyzes": analyzes,
        }
        for name, live, dead, heap, index, vacuums, analyzes in conn.execute(
            TABLE_STATS, {"tables": list(HOT_TABLES)}
        ).fetchall()
    }


class Soak:
    """The feed and the samples of one soak on ``tree`` (started) through ``repo``."""

    def __init__(
        self, tree: bench.Tree, repo: Triggers, conn: psycopg.Connection[Any], rate: float
    ) -> None:
        self.tree, self.repo, self.conn, self.rate = tree, repo, conn, rate
        self.pending: list[uuid.UUID] = []  # triggered, not yet seen finished
        self.samples: list[dict[str, Any]] = []
        self.triggered = 0

    def run(self, duration_s: float, interval_s: float, log: Callable[[str], None]) -> None:
        started = time.monotonic()
        self.sample(0.0)
        next_sample = interval_s
        while (elapsed := time.monotonic() - started) < duration_s:
            if (why := self.tree.exited()) is not None:
                raise RuntimeError(why)
            due = int(self.rate * elapsed) - self.triggered
            if due > 0:
                results = self.repo.trigger_many(SOAK, [{}] * due)
                self.pending.extend(r.run_id for r in results)
                self.triggered += due
            if elapsed >= next_sample:
                s = self.sample(elapsed)
                next_sample += interval_s
                log(
                    f"soak {elapsed:6.0f}s: {s['finished_per_s']:.0f} chains/s,"
                    f" backlog {s['backlog']}, hop p99 {s['hop_p99_ms']} ms,"
                    f" rss {sum(s['rss_kb'].values()) / 1024:.0f} MiB,"
                    f" {s['connections']} connections"
                )
            time.sleep(max(0.0, TICK_S - (time.monotonic() - started - elapsed)))
        self.sample(time.monotonic() - started)

    def sample(self, t_s: float) -> dict[str, Any]:
        rows = self.conn.execute(FINISHED, {"ids": self.pending}).fetchall() if self.pending else []
        done = {r[0] for r in rows}
        self.pending = [i for i in self.pending if i not in done]
        dispatch = sorted(float(r[1]) for r in rows)
        hops = sorted(float(r[2]) for r in rows)
        row = self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchone()
        since = t_s - self.samples[-1]["t_s"] if self.samples else 0.0
        found = {
            "t_s": round(t_s, 1),
            "finished": len(rows),
            "finished_per_s": round(len(rows) / since, 1) if since > 0 else 0.0,
            "backlog": len(self.pending),
            "dispatch_p50_ms": _rounded(bench._pct(dispatch, 50)) if dispatch else None,
            "dispatch_p99_ms": _rounded(bench._pct(dispatch, 99)) if dispatch else None,
            "hop_p50_ms": _rounded(bench._pct(hops, 50)) if hops else None,
            "hop_p99_ms": _rounded(bench._pct(hops, 99)) if hops else None,
            "rss_kb": _rss_kb(self.tree.pids()),
            "tables": _tables(self.conn),
            "connections": int(row[0]) if row else 0,
            "load_average": round(os.getloadavg()[0], 2),
        }
        self.samples.append(found)
        return found


def _rounded(value: float) -> float:
    return round(value, 2)


def autovacuum_settings(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The server's autovacuum settings and the hot tables' own (``reloptions``)."""
    found: dict[str, Any] = {}
    for name in AUTOVACUUM_SETTINGS:
        row = conn.execute(f"SHOW {name}").fetchone()  # names from the constant above
        found[name] = row[0] if row else None
    found["tables"] = {
        name: options
        for name, options in conn.execute(
            "SELECT relname, reloptions FROM pg_class"
            " WHERE relname = ANY(%(t)s) AND reloptions IS NOT NULL",
            {"t": list(HOT_TABLES)},
        ).fetchall()
    }
    return found


def soak(
    server_url: str,
    broker_url: str,
    minutes: float,
    rate: float | None,
    workers: int,
    log: Callable[[str], None],
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run one soak (the module's docstring) and return its report: settings, autovacuum,
    samples and verdicts."""
    duration_s = minutes * 60
    interval_s = interval_for(duration_s)
    with bench.fresh_database(server_url) as url, tempfile.TemporaryDirectory() as tmp:
        tree = bench.Tree(Path(tmp), url, broker_url, workers)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        try:
            tree.start()
            with psycopg.connect(url, autocommit=True) as conn:
                repo = Triggers(db)
                measured = None
                if rate is None:
                    burst = max(50, min(BURST_RUNS, int(duration_s * 10)))
                    measured = max_rate(repo, conn, burst, timeout_s)
                    rate = measured / 2
                    bench_maps.truncate(conn, bench.TABLES.replace("processes, ", ""))
                log(f"soak: {rate:.1f} chains/s for {minutes} min, a sample every {interval_s}s")
                autovacuum = autovacuum_settings(conn)
                run = Soak(tree, repo, conn, rate)
                run.run(duration_s, interval_s, log)
        finally:
            tree.stop()
            db.close()
    return {
        "settings": {
            "minutes": minutes,
            "rate_chains_per_s": round(rate, 2),
            "tasks_per_chain": len(SOAK.tasks),
            "measured_max_chains_per_s": None if measured is None else round(measured, 2),
            "interval_s": interval_s,
            "workers": workers,
            "triggered": run.triggered,
        },
        "autovacuum": autovacuum,
        "samples": run.samples,
        "verdicts": bench_soak_verdicts.verdicts(
            run.samples, duration_s, autovacuum["autovacuum"] == "on"
        ),
    }


def print_report(report: dict[str, Any]) -> None:
    """The samples as a table, then the verdicts."""
    print(
        f"{'t s':>6} {'done/s':>7} {'backlog':>7} {'disp p50':>8} {'disp p99':>8} {'hop p50':>8}"
        f" {'hop p99':>8} {'rss MiB':>8} {'conns':>5} {'dead task_runs':>14} {'dead outbox':>11}"
    )
    for s in report["samples"]:
        tables = s["tables"]
        print(
            f"{s['t_s']:>6.0f} {s['finished_per_s']:>7.1f} {s['backlog']:>7}"
            f" {_cell(s['dispatch_p50_ms'])} {_cell(s['dispatch_p99_ms'])}"
            f" {_cell(s['hop_p50_ms'])} {_cell(s['hop_p99_ms'])}"
            f" {sum(s['rss_kb'].values()) / 1024:>8.1f} {s['connections']:>5}"
            f" {tables.get('task_runs', {}).get('dead', 0):>14}"
            f" {tables.get('outbox', {}).get('dead', 0):>11}"
        )
    print(f"autovacuum: {report['autovacuum']['autovacuum']}")
    for name, v in report["verdicts"].items():
        if isinstance(v, dict):
            word = {True: "ok", False: "FAILED", None: "not judged"}[v["ok"]]
            print(f"verdict {name:<13} {word:<10} {v['why']}")


def _cell(value: float | None) -> str:
    return f"{value:>8.1f}" if value is not None else f"{'-':>8}"


def run(args: argparse.Namespace) -> int:
    """``scripts/bench --soak MINUTES [--soak-rate R]``: the report merged into ``--json``
    under ``"soak"`` and printed."""
    with bench.service_urls(args) as (server_url, broker_url):
        report = {
            "machine": bench.machine(server_url, broker_url),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **soak(
                server_url,
                broker_url,
                args.soak,
                args.soak_rate,
                args.workers,
                lambda m: print(m, file=sys.stderr),
            ),
        }
    bench.merge_json(args.json, "soak", report)
    print_report(report)
    print(f'JSON written to {args.json} (under "soak")')
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--rate", type=float, help="chains/s (default: half the measured most)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    args = parser.parse_args(argv)
    report = soak(
        args.database_url,
        args.broker_url,
        args.minutes,
        args.rate,
        args.workers,
        lambda m: print(m, file=sys.stderr),
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
