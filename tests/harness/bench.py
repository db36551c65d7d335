"""``scripts/bench``: FlowForge's speed, measured on a real ``flowforge up`` tree.

Each workload runs on a fresh database (tables truncated between repetitions) against a tree
with ``--workers`` workers, and every figure is the median of ``--repeat`` repetitions with its
min and max. Latencies come from database timestamps. Nothing here asserts a figure: it prints a
table and writes JSON with the machine, versions, settings and every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import psycopg
import yaml

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.limits import Concurrency
from flowforge.domain.names import BANDS, band_queue
from flowforge.store.db import Database
from flowforge.store.events import Events
from flowforge.store.migrate import migrate
from flowforge.store.triggers import Triggers
from tests.harness import (
    api_children,
    bench_api,
    bench_async,
    bench_events,
    bench_maps,
    bench_priorities,
    bench_rates,
    bench_schedules,
    bench_submit,
    cpuprobe,
    services,
)
from tests.harness.resources import (
    child_pids,
    create_database,
    drop_database,
    free_ports,
    start_tree,
)

HANDLER_MODULE = "tests.harness.bench_handlers"
API_WORKFLOW = "bench-api"
TABLES = (
    "event_deliveries, events, "
    "schedule_fires, schedules, counters, processes, requeue_audit, idempotency_keys, outbox, "
    "task_attempts, task_edges, task_runs, workflow_runs, workflow_definitions"
)
POLL_S = 0.02
READY_TIMEOUT_S = 60.0
TRIGGER_BATCH = 500
#: Statements per floor measurement, and iterations of the pure-Python CPU probe.
FLOOR_STATEMENTS = 1000
CPU_PROBE_ITERATIONS = 1_000_000


@dataclass
class Settings:
    workers: int = 4
    repeat: int = 3
    tasks: int = 5000
    fanout: int = 5000
    chain: int = 200
    latency_runs: int = 500
    scale: tuple[int, ...] = (1000, 10000)
    api_requests: int = 2000
    api_clients: int = 4
    schedules: int = 10_000
    schedule_batch: int = 500  # the scheduler's default batch_size
    event_runs: int = 200
    timeout_s: float = 600.0
    map_width: int = 10_000  # a for_each map's items, against the static fan-out as wide
    priority_backlog: int = 10_000  # priority-0 tasks a priority-9 one is measured behind
    priority_samples: int = 10
    # and behind a backlog whose handlers take this long (ms): the workers, not the engine,
    # are what is saturated
    priority_backlog_ms: float = 10.0
    nap_per_worker: int = 40  # sync 50 ms runs per worker (async: 16 times as many)
    submit: bench_submit.SubmitSettings = field(default_factory=bench_submit.SubmitSettings)


@dataclass
class Result:
    name: str
    unit: str
    samples: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "median": statistics.median(self.samples) if self.samples else None,
            "min": min(self.samples, default=None),
            "max": max(self.samples, default=None),
            "samples": self.samples,
            **self.extra,
        }


# ---------------------------------------------------------------------------- the tree


class Tree:
    """A ``flowforge up`` subprocess on its own queue, with a no-op handler."""

    def __init__(
        self,
        directory: Path,
        database_url: str,
        broker_url: str,
        workers: int,
        reserved: int = 0,
        queue: str | None = None,
        api_processes: int = 1,
        scheduler: dict[str, Any] | None = None,
        api_threads: int | None = None,
    ) -> None:
        """``reserved``: that many more workers, reserved for priorities 5 and above;
        ``queue``: the task queue (None: one of its own), shared by trees given the same;
        ``api_processes``: the api's ``processes``; ``scheduler``: the config's ``scheduler:``
        section (None: the defaults); ``api_threads``: the api's ``threads`` (None: the
        default)."""
        self.queue = queue or f"flowforge.bench.{uuid.uuid4().hex[:8]}"
        [self.api_port] = free_ports(1)
        workflows = directory / "workflows"
        workflows.mkdir()
        api_workflow = {"name": API_WORKFLOW, "tasks": [{"name": "t", "handler": "bench.noop"}]}
        (workflows / "api.yaml").write_text(yaml.safe_dump(api_workflow))
        config = {
            "database": {"url": database_url, "pool_max": 4},
            "broker": {"url": broker_url, "queue": self.queue},
            "handlers": [HANDLER_MODULE],
            "workflows": ["workflows"],
            "processes": {"workers": workers}
            if not reserved
            else {
                "pools": [
                    {"queue": self.queue, "workers": workers},
                    {"queue": self.queue, "workers": reserved, "min_priority": 5},
                ]
            },
            "api": {
                **bench_api.api_settings(self.api_port),
                "processes": api_processes,
                **({} if api_threads is None else {"threads": api_threads}),
            },
            "logging": {"level": "WARNING"},
        }
        if scheduler is not None:
            config["scheduler"] = scheduler
        self.config_path = directory / "bench.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = directory / "tree.log"
        self.database_url = database_url
        self.broker_url = broker_url
        self.workers = workers + reserved
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
        env[bench_api.TOKEN_ENV] = bench_api.TOKEN
        self.proc = start_tree(self.config_path, env, self.log_path)
        wait_for_workers(self.database_url, self.workers, self)

    def exited(self) -> str | None:
        """Why the tree is no longer running (its exit code and log's tail), or None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        tail = " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])
        return f"flowforge up exited with {self.proc.returncode}: {tail}"

    def pids(self) -> list[int]:
        """The supervisor and every process under it, as they are now (none before start)."""
        return cpuprobe.process_tree(self.proc.pid if self.proc else None)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.broker_url))
            channel = conn.channel()
            for index in range(len(BANDS)):  # the queue and its priority bands
                channel.queue_delete(band_queue(self.queue, index))
            conn.close()
        except pika.exceptions.AMQPError:
            pass

    def memory_kb(self) -> dict[str, Any]:
        """RSS and PSS (kB) summed over the supervisor and its children but the api child (the
        memory target is the tree of roles; the api's own RSS is ``api_rss_kb``), and each
        process's RSS by its title (``by_process``: which role grew)."""
        if self.proc is None:
            return {}
        pids = [self.proc.pid, *child_pids(self.proc.pid, recursive=True)]
        apis = set(api_children.api_pids(self.proc.pid))
        totals = {"rss_kb": 0, "pss_kb": 0, "api_rss_kb": 0}
        by_process: dict[str, int] = {}
        counted = 0
        for pid in pids:
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            except OSError:
                continue
            api = pid in apis
            counted += not api
            for line in rollup:
                if line.startswith("Rss:"):
                    totals["api_rss_kb" if api else "rss_kb"] += int(line.split()[1])
                    name = api_children.title(pid) or str(pid)
                    by_process[name if name not in by_process else f"{name} ({pid})"] = int(
                        line.split()[1]
                    )
                elif line.startswith("Pss:") and not api:
                    totals["pss_kb"] += int(line.split()[1])
        return {**totals, "processes": counted, "by_process": by_process}


def wait_for_workers(database_url: str, workers: int, *trees: Tree) -> None:
    """Return once ``workers`` workers are registered in the database; RuntimeError if one
    of ``trees`` exits first or they are not there within :data:`READY_TIMEOUT_S`."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with psycopg.connect(database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            for tree in trees:
                if (why := tree.exited()) is not None:
                    raise RuntimeError(why)
            row = conn.execute("SELECT count(*) FROM processes WHERE role = 'worker'").fetchone()
            if row and row[0] >= workers:
                return
            time.sleep(0.1)
    raise RuntimeError("the tree did not become ready in time")


# ---------------------------------------------------------------------------- workloads


def _one(name: str) -> WorkflowDef:
    return WorkflowDef(name, (TaskDef("t", "bench.noop"),))


def _fanout(width: int) -> WorkflowDef:
    middle = tuple(TaskDef(f"m{i}", "bench.noop", depends_on=("start",)) for i in range(width))
    return WorkflowDef(
        f"fanout-{width}",
        (
            TaskDef("start", "bench.noop"),
            *middle,
            TaskDef("end", "bench.noop", depends_on=tuple(m.name for m in middle)),
        ),
    )


def _chain(length: int) -> WorkflowDef:
    return WorkflowDef(
        f"chain-{length}",
        tuple(
            TaskDef(f"c{i}", "bench.noop", depends_on=(f"c{i - 1}",) if i else ())
            for i in range(length)
        ),
    )


#: True once ``n`` tasks SUCCEEDED and no task is left unsettled. While any is, the partial
#: index of unsettled tasks answers at its first entry; the count runs once, at the end. (A
#: ``count(*)`` every poll read every finished task 50 times a second, billing the harness's
#: own reads to the tree's CPU per task: docs/performance.md, "Generic plans at the tables'
#: size".)
ALL_SUCCEEDED = (
    "SELECT CASE WHEN EXISTS (SELECT 1 FROM task_runs"
    " WHERE state <> ALL (ARRAY['SUCCEEDED', 'CANCELLED'])) THEN false"
    " ELSE (SELECT count(*) FROM task_runs WHERE state = 'SUCCEEDED') = %(n)s END"
)


def _wait_until(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # prepared: planned once, not at every poll (task_runs' 31 indexes made the planning
        # most of a poll's cost, billed to the tree's CPU per task: docs/performance.md "The
        # bench's completion poll, prepared")
        row = conn.execute(query, params, prepare=True).fetchone()
        if row and row[0]:
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for: {query}")


#: The wide limit of the limited throughput workload: more than its tasks, so never reached; what
#: it measures is the admission gate's cost (docs/performance.md "Concurrency limits").
WIDE_LIMIT = 100_000


def throughput(
    repo: Triggers, conn: psycopg.Connection[Any], s: Settings, limited: bool = False
) -> dict[str, float]:
    """Independent one-task runs, triggered in batches; tasks/s from the first run created to
    the last task finished. ``limited``: every task has ``concurrency: {key: bench, limit:
    WIDE_LIMIT}`` (the admission pass makes each READY)."""
    wf = _one("throughput")
    if limited:
        task = TaskDef("t", "bench.noop", concurrency=Concurrency("bench", WIDE_LIMIT))
        wf = WorkflowDef("throughput-limited", (task,))
    started = time.perf_counter()
    for offset in range(0, s.tasks, TRIGGER_BATCH):
        repo.trigger_many(
            wf, [{"i": i} for i in range(offset, min(s.tasks, offset + TRIGGER_BATCH))]
        )
    triggered = time.perf_counter()
    _wait_until(conn, ALL_SUCCEEDED, {"n": s.tasks}, s.timeout_s)
    row = conn.execute(
        "SELECT extract(epoch FROM max(t.finished_at) - min(r.created_at))"
        " FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id"
    ).fetchone()
    wall = float(row[0]) if row and row[0] else time.perf_counter() - started
    return {"tasks_per_s": s.tasks / wall, "trigger_per_s": s.tasks / (triggered - started)}


def _run_to_success(
    repo: Triggers, conn: psycopg.Connection[Any], workflow: WorkflowDef, timeout_s: float
) -> uuid.UUID:
    """Trigger one run of ``workflow`` and wait until it SUCCEEDED; return its id."""
    run_id = repo.trigger(workflow).run_id
    _wait_until(
        conn,
        "SELECT state = 'SUCCEEDED' FROM workflow_runs WHERE id = %(id)s",
        {"id": run_id},
        timeout_s,
    )
    return run_id


def fanout(
    repo: Triggers, conn: psycopg.Connection[Any], width: int, timeout_s: float
) -> dict[str, float]:
    run_id = _run_to_success(repo, conn, _fanout(width), timeout_s)
    row = conn.execute(
        "SELECT extract(epoch FROM finished_at - created_at) FROM workflow_runs WHERE id = %(id)s",
        {"id": run_id},
    ).fetchone()
    wall = float(row[0]) if row else 0.0
    tasks = width + 2
    return {"wall_s": wall, "tasks_per_s": tasks / wall, "ms_per_task": 1000 * wall / tasks}


def chain(
    repo: Triggers, conn: psycopg.Connection[Any], length: int, timeout_s: float
) -> dict[str, float]:
    run_id = _run_to_success(repo, conn, _chain(length), timeout_s)
    # A hop is one step's finish to the next step's finish: the next step's claim, its no-op
    # handler and its finish. The first definition, finish → next start, is reported
    # too but reads about 0 by construction: the worker claims the next step inside the
    # finishing transaction, and both stamps are that transaction's now().
    rows = conn.execute(
        "SELECT extract(epoch FROM finished_at - lag(finished_at) OVER (ORDER BY seq)) * 1000,"
        " extract(epoch FROM started_at - lag(finished_at) OVER (ORDER BY seq)) * 1000"
        " FROM task_runs WHERE run_id = %(id)s ORDER BY seq",
        {"id": run_id},
    ).fetchall()
    hops = sorted(float(r[0]) for r in rows if r[0] is not None)
    gaps = sorted(float(r[1]) for r in rows if r[1] is not None)
    return {
        "p50_ms": _pct(hops, 50),
        "p99_ms": _pct(hops, 99),
        "mean_ms": statistics.fmean(hops),
        "start_gap_p50_ms": _pct(gaps, 50),
    }


def dispatch(
    repo: Triggers, conn: psycopg.Connection[Any], runs: int, timeout_s: float
) -> dict[str, float]:
    wf = _one("latency")
    for i in range(runs):
        run = repo.trigger(wf, {"i": i})
        _wait_until(
            conn,
            "SELECT bool_and(started_at IS NOT NULL) FROM task_runs WHERE run_id = %(id)s",
            {"id": run.run_id},
            timeout_s,
        )
    rows = conn.execute(
        "SELECT extract(epoch FROM t.started_at - r.created_at) * 1000"
        " FROM task_runs t JOIN workflow_runs r ON r.id = t.run_id WHERE r.workflow = 'latency'"
    ).fetchall()
    lat = sorted(float(r[0]) for r in rows)
    return {"p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99)}


def _pct(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    index = min(len(values) - 1, max(0, round(pct / 100 * (len(values) - 1))))
    return values[index]


# ---------------------------------------------------------------------------- running


@contextmanager
def service_urls(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(server URL for databases, broker URL): given, or the private dev services."""
    if args.database_url and args.broker_url:
        yield args.database_url, args.broker_url
        return
    pg = services.PrivatePostgres(services.DEFAULT_BASE_DIR, port=services.DEFAULT_PG_PORT)
    rabbit = services.PrivateRabbitMQ(
        services.DEFAULT_BASE_DIR,
        services.DEFAULT_AMQP_PORT,
        services.DEFAULT_DIST_PORT,
        services.DEFAULT_NODE_NAME,
    )
    pg.start()
    rabbit.start()
    yield args.database_url or pg.url, args.broker_url or rabbit.url


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    url = create_database(server_url, "flowforge_bench")
    try:
        migrate(url)
        yield url
    finally:
        drop_database(server_url, url)


def measure(
    settings: Settings, server_url: str, broker_url: str, log: Callable[[str], None]
) -> dict[str, Any]:
    from tests.harness import bench_cost  # it builds on this module

    results: dict[str, Result] = {}
    memory: dict[str, Any] = {}

    def record(name: str, unit: str, value: float, **extra: Any) -> None:
        results.setdefault(name, Result(name, unit)).samples.append(round(value, 3))
        results[name].extra.update(extra)

    with fresh_database(server_url) as url, tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        tree = Tree(Path(tmp), url, broker_url, settings.workers)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        repo = Triggers(db)
        events = Events(db)
        try:
            floor = floors(url)
            for _ in range(settings.repeat):  # the bench plays the scheduler: no tree needed
                bench_schedules.measure(url, settings.schedules, settings.schedule_batch, record)
            # the runs the schedules made are not the tree's work: once started, it would
            # publish and execute them under the workloads measured next
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f"TRUNCATE {TABLES} CASCADE")
            tree.start()
            time.sleep(1.0)
            memory["idle"] = tree.memory_kb()
            with psycopg.connect(url, autocommit=True) as conn:
                for rep in range(settings.repeat):
                    log(f"repetition {rep + 1}/{settings.repeat}")
                    # the scheduler may still be settling the last workload: retried on deadlock
                    bench_maps.truncate(conn, TABLES.replace("processes, ", ""))
                    # what the tree, PostgreSQL and RabbitMQ spend per task (bench_cost.py)
                    probe = bench_cost.Probe(
                        conn,
                        [tree.proc.pid if tree.proc else None],
                        bench_cost.amqp_port(broker_url),
                    )
                    t, cost = bench_cost.costed(
                        probe, settings.tasks, lambda: throughput(repo, conn, settings)
                    )
                    record("cpu per task", "ms/task", cost["cpu ms"])
                    record("wal bytes per task", "bytes/task", cost["wal bytes"])
                    bench_cost.record_cost(record, "throughput", cost)
                    memory["load"] = max(
                        memory.get("load", {}), tree.memory_kb(), key=lambda m: m.get("rss_kb", 0)
                    )
                    record("throughput", "tasks/s", t["tasks_per_s"])
                    record("trigger rate", "runs/s", t["trigger_per_s"])
                    # the same, every task under a wide concurrency limit: A/B in each repetition
                    bench_maps.truncate(conn, TABLES.replace("processes, ", ""))
                    t = throughput(repo, conn, settings, limited=True)
                    record("throughput (wide limit)", "tasks/s", t["tasks_per_s"])
                    # a rate limit that is reached: the starts' rate against the limit
                    bench_maps.truncate(conn, TABLES.replace("processes, ", ""))
                    bench_rates.measure(repo, conn, settings.tasks, settings.timeout_s, record)
                    f = fanout(repo, conn, settings.fanout, settings.timeout_s)
                    record("fan-out", "tasks/s", f["tasks_per_s"], width=settings.fanout)
                    record("fan-out wall", "s", f["wall_s"])
                    c, cost = bench_cost.costed(
                        probe,
                        settings.chain,
                        lambda: chain(repo, conn, settings.chain, settings.timeout_s),
                    )
                    record("chain p50", "ms/hop", c["p50_ms"], length=settings.chain)
                    bench_cost.record_cost(record, "chain", cost)
                    record("chain p99", "ms/hop", c["p99_ms"])
                    record("chain start gap p50", "ms", c["start_gap_p50_ms"])
                    d = dispatch(repo, conn, settings.latency_runs, settings.timeout_s)
                    record("dispatch p50", "ms", d["p50_ms"], runs=settings.latency_runs)
                    record("dispatch p99", "ms", d["p99_ms"])
                    for width in settings.scale:
                        s = fanout(repo, conn, width, settings.timeout_s)
                        record(f"per-task cost @{width}", "ms/task", s["ms_per_task"])
                    m = bench_maps.map_run(repo, conn, settings.map_width, settings.timeout_s)
                    record("map", "tasks/s", m["tasks_per_s"], width=settings.map_width)
                    s = fanout(repo, conn, settings.map_width, settings.timeout_s)
                    record("map's static fan-out", "tasks/s", s["tasks_per_s"])
                    bench_events.measure(
                        repo, events, conn, settings.event_runs, settings.timeout_s, record
                    )
                    api_workloads(tree.api_port, settings, record)
                    bench_submit.run(tree.config_path, tree.api_port, settings.submit, record)
                    bench_submit.settle(conn, settings.timeout_s)  # not under the next workload
                    for backlog_ms in (0.0, settings.priority_backlog_ms):
                        bench_priorities.measure(
                            repo,
                            conn,
                            settings.priority_backlog,
                            settings.priority_samples,
                            settings.timeout_s,
                            record,
                            backlog_ms,
                        )
                    bench_maps.truncate(conn, TABLES.replace("processes, ", ""))
                    bench_async.measure(
                        repo,
                        conn,
                        settings.workers,
                        settings.nap_per_worker,
                        settings.timeout_s,
                        record,
                    )
        finally:
            tree.stop()
            db.close()
    scale = [results[f"per-task cost @{w}"].summary()["median"] for w in settings.scale]
    return {
        "results": {name: r.summary() for name, r in results.items()},
        "scale_ratio": (scale[-1] / scale[0]) if len(scale) > 1 and scale[0] else None,
        "memory": memory,
        "floors": floor,
    }


#: One workload run alone: ``(triggers, conn, record)``; it records its figures.
Workload = Callable[[Triggers, psycopg.Connection[Any], Callable[..., None]], None]


def alone_parser(prog: str, description: str | None, workers: int) -> argparse.ArgumentParser:
    """The arguments every harness module run alone takes (``--workers``, ``--repeat``, the
    servers); it adds its own."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    return parser


def run_alone(args: argparse.Namespace, workload: Workload, reserved: int = 0) -> int:
    """:func:`alone` with ``args`` of :func:`alone_parser`; prints the summary as JSON."""
    report = alone(
        args.database_url, args.broker_url, args.workers, args.repeat, workload, reserved
    )
    print(json.dumps(report, indent=2))
    return 0


def alone(
    server_url: str,
    broker_url: str,
    workers: int,
    repeat: int,
    workload: Workload,
    reserved: int = 0,
) -> dict[str, Any]:
    """Run ``workload`` ``repeat`` times on a tree of its own (a fresh database, truncated
    between repetitions) and return the summary of every figure it recorded: a harness
    module's own ``main`` (``python -m tests.harness.bench_priorities``, ``bench_async``);
    ``reserved``: that many more workers, reserved for priorities 5 and above."""
    results: dict[str, Result] = {}

    def record(name: str, unit: str, value: float, **extra: Any) -> None:
        results.setdefault(name, Result(name, unit)).samples.append(round(value, 3))
        results[name].extra.update(extra)

    with fresh_database(server_url) as url, tempfile.TemporaryDirectory() as tmp:
        tree = Tree(Path(tmp), url, broker_url, workers, reserved)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        try:
            tree.start()
            with psycopg.connect(url, autocommit=True) as conn:
                for rep in range(repeat):
                    print(f"repetition {rep + 1}/{repeat}", file=sys.stderr)
                    bench_maps.truncate(conn, TABLES.replace("processes, ", ""))
                    workload(Triggers(db), conn, record)
        finally:
            tree.stop()
            db.close()
    return {name: r.summary() for name, r in results.items()}


def api_workloads(port: int, settings: Settings, record: Callable[..., None]) -> None:
    """The api's request path (tests/harness/bench_api.py), while the tree runs what it creates."""
    n, clients = settings.api_requests, settings.api_clients
    bench_api.wait_live(port, READY_TIMEOUT_S)
    created, run_ids = bench_api.trigger(port, API_WORKFLOW, n, clients)
    record("api trigger", "req/s", created.requests_per_s, requests=n, clients=clients)
    record("api trigger p50", "ms", created.p50_ms)
    record("api trigger p99", "ms", created.p99_ms)
    got = bench_api.read(port, run_ids, n, clients)
    record("api read", "req/s", got.requests_per_s)
    record("api read p50", "ms", got.p50_ms)
    live = bench_api.live(port, n, clients)
    record("api live", "req/s", live.requests_per_s)
    record("api live p50", "ms", live.p50_ms)


def floors(url: str) -> dict[str, float]:
    """What this machine gives anything, measured right before the workloads: PostgreSQL commits
    per second with one client (one durable INSERT each), one ``SELECT 1`` round trip (ms), and
    a fixed pure-Python loop (ms). Every figure above moves with these: compare runs by them."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_floor (x integer)")
        try:
            started = time.perf_counter()
            for _ in range(FLOOR_STATEMENTS):
                conn.execute("INSERT INTO bench_floor VALUES (1)")
            commits_s = FLOOR_STATEMENTS / (time.perf_counter() - started)
            started = time.perf_counter()
            for _ in range(FLOOR_STATEMENTS):
                conn.execute("SELECT 1")
            round_trip_ms = (time.perf_counter() - started) * 1000 / FLOOR_STATEMENTS
        finally:
            conn.execute("DROP TABLE bench_floor")
    started = time.perf_counter()
    total = 0
    for i in range(CPU_PROBE_ITERATIONS):
        total += i
    cpu_ms = (time.perf_counter() - started) * 1000
    return {
        "postgresql_commits_per_s": round(commits_s),
        "postgresql_round_trip_ms": round(round_trip_ms, 3),
        "python_loop_ms": round(cpu_ms, 1),
    }


def machine(server_url: str, broker_url: str) -> dict[str, Any]:
    with psycopg.connect(server_url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    conn_amqp = pika.BlockingConnection(pika.URLParameters(broker_url))
    rabbit = conn_amqp._impl.server_properties.get("version", b"?")
    conn_amqp.close()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "postgresql": row[0] if row else "?",
        "rabbitmq": rabbit.decode() if isinstance(rabbit, bytes) else str(rabbit),
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"{'workload':<24} {'median':>10} {'min':>10} {'max':>10}  unit")
    for name, r in report["results"].items():
        print(f"{name:<24} {r['median']:>10.1f} {r['min']:>10.1f} {r['max']:>10.1f}  {r['unit']}")
    if report.get("scale_ratio"):
        print(f"{'per-task cost ratio':<24} {report['scale_ratio']:>10.2f}  (largest / smallest)")
    f = report["floors"]
    print(
        f"machine floors: PostgreSQL {f['postgresql_commits_per_s']} commits/s (one client),"
        f" {f['postgresql_round_trip_ms']:.2f} ms per round trip;"
        f" Python loop {f['python_loop_ms']:.0f} ms"
    )
    for phase, m in report.get("memory", {}).items():
        rss, pss = m.get("rss_kb", 0) / 1024, m.get("pss_kb", 0) / 1024
        print(
            f"memory {phase:<17} rss {rss:>7.1f} MiB  pss {pss:>7.1f} MiB"
            f"  ({m.get('processes')} processes; the api child apart:"
            f" rss {m.get('api_rss_kb', 0) / 1024:.1f} MiB)"
        )
        each = ", ".join(
            f"{name.removeprefix('flowforge: ')} {kb / 1024:.1f}"
            for name, kb in m.get("by_process", {}).items()
        )
        if each:
            print(f"  by process, MiB: {each}")


def merge_json(path: Path, key: str, report: dict[str, Any]) -> None:
    """Merge ``report`` into the JSON file at ``path`` under ``key`` (the file's other figures,
    when it holds a bench report, stay)."""
    try:
        existing = json.loads(path.read_text())
    except (OSError, ValueError):
        existing = {}
    if not isinstance(existing, dict):
        existing = {}
    path.write_text(json.dumps(existing | {key: report}, indent=2))


def run_trees(args: argparse.Namespace) -> int:
    """``scripts/bench --trees 1,2,3``: several trees on one database and queue
    (:mod:`tests.harness.bench_trees`), ``--workers`` each; the report merged into ``--json``
    under ``"trees"``."""
    from tests.harness import bench_trees  # it builds on this module

    results: dict[str, Result] = {}

    def record(name: str, unit: str, value: float, **extra: Any) -> None:
        results.setdefault(name, Result(name, unit)).samples.append(round(value, 3))

    counts = [int(c) for c in args.trees.split(",")]
    tasks = 300 if args.quick else args.tasks
    repeat = 1 if args.quick else args.repeat
    with service_urls(args) as (server_url, broker_url):
        with fresh_database(server_url) as url:
            measured_floors = floors(url)
        report: dict[str, Any] = {
            "machine": machine(server_url, broker_url),
            "floors": measured_floors,
            "settings": {"trees": counts, "workers": args.workers, "tasks": tasks},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        bench_trees.measure(
            server_url,
            broker_url,
            counts,
            args.workers,
            tasks,
            repeat,
            record,
            lambda m: print(m, file=sys.stderr),
        )
    report["results"] = {name: r.summary() for name, r in results.items()}
    merge_json(args.json, "trees", report)
    print_table(report)
    print(f'JSON written to {args.json} (under "trees")')
    return 0


def run_stored(args: argparse.Namespace) -> int:
    """``scripts/bench --stored ROWS``: the engine and the dashboard's reads with ROWS READY
    tasks and ROWS finished runs stored, against the empty database
    (:mod:`tests.harness.bench_stored`); the report merged into ``--json`` under ``"stored"``."""
    from tests.harness import bench_stored  # it builds on this module

    # all of --tasks: retention's cost compares a throughput while purging with one without,
    # and one shorter than a few cycles of the purge's pacing (a batch, then a pause) measures
    # the phase it fell in (docs/performance.md "Stored scale on a quiet machine, and dead tasks
    # in the store")
    tasks = 100 if args.quick else args.tasks
    runs = 10 if args.quick else min(args.latency_runs, 100)
    with service_urls(args) as (server_url, broker_url):
        with fresh_database(server_url) as url:
            measured_floors = floors(url)
        report: dict[str, Any] = {
            "machine": machine(server_url, broker_url),
            "floors": measured_floors,
            "settings": {
                "rows": args.stored,
                "workers": args.workers,
                "tasks": tasks,
                "runs": runs,
            },
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        report |= bench_stored.measure(
            server_url,
            broker_url,
            args.stored,
            args.workers,
            tasks,
            runs,
            lambda m: print(m, file=sys.stderr),
            5.0 if args.quick else 60.0,
        )
    merge_json(args.json, "stored", report)
    bench_stored.print_report(report)
    print(f'JSON written to {args.json} (under "stored")')
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--fanout", type=int, help="fan-out width (5,000; --compare: 1,000)")
    parser.add_argument("--chain", type=int, default=200)
    parser.add_argument("--latency-runs", type=int, default=500)
    parser.add_argument("--schedules", type=int, default=10_000, help="schedules due at once")
    parser.add_argument("--event-runs", type=int, default=200, help="events sent one at a time")
    parser.add_argument("--scale", default="1000,10000", help="fan-out widths, comma-separated")
    parser.add_argument("--map-width", type=int, default=10_000, help="items of the map workload")
    parser.add_argument(
        "--priority-backlog", type=int, default=10_000, help="priority-0 tasks queued ahead"
    )
    parser.add_argument("--quick", action="store_true", help="a few hundred tasks, one repetition")
    parser.add_argument("--json", type=Path, default=Path("bench.json"), help="where to write JSON")
    parser.add_argument("--database-url", help="a PostgreSQL server URL (a database is created)")
    parser.add_argument("--broker-url", help="a RabbitMQ URL")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="single runs, chain and fan-out/join against Celery, Dramatiq and Procrastinate",
    )
    parser.add_argument(
        "--trees",
        help="tree counts (e.g. 1,2,3): that many trees on one database and queue, --workers each,"
        " instead of the other workloads",
    )
    parser.add_argument(
        "--stored",
        type=int,
        metavar="ROWS",
        help="ROWS READY tasks and ROWS finished runs stored, against an empty database,"
        " instead of the other workloads",
    )
    parser.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="a tree fed at a fixed rate for MINUTES, sampled; verdicts (RSS, p99, bloat,"
        " connections) instead of the other workloads",
    )
    parser.add_argument("--soak-rate", type=float, help="chains/s (default: half the most)")
    parser.add_argument(
        "--payloads",
        action="store_true",
        help="throughput and bytes per task with 100 B, 10 KB and 100 KB inputs and results",
    )
    args = parser.parse_args(argv)
    if args.trees:
        return run_trees(args)
    if args.stored:
        return run_stored(args)
    if args.soak is not None:
        from tests.harness import bench_soak  # it builds on this module

        return bench_soak.run(args)
    if args.payloads:
        from tests.harness import bench_payloads  # it builds on this module

        return bench_payloads.run(args)
    if args.fanout is None:
        args.fanout = 1000 if args.compare else 5000
    settings = Settings(
        workers=args.workers,
        repeat=args.repeat,
        tasks=args.tasks,
        fanout=args.fanout,
        chain=args.chain,
        latency_runs=args.latency_runs,
        scale=tuple(int(w) for w in args.scale.split(",")),
        schedules=args.schedules,
        map_width=args.map_width,
        event_runs=args.event_runs,
        priority_backlog=args.priority_backlog,
    )
    if args.quick:
        settings = Settings(
            workers=args.workers,
            repeat=1,
            tasks=300,
            fanout=200,
            chain=20,
            latency_runs=20,
            scale=(50, 200),
            api_requests=200,
            schedules=300,
            event_runs=20,
            timeout_s=120,
            map_width=200,
            priority_backlog=1000,
            priority_samples=5,
            nap_per_worker=10,
            submit=bench_submit.QUICK,
        )
    if args.compare:
        # imported here: the comparison builds on this module (docs/performance.md,
        # "Compared in one run")
        from tests.harness.compare import driver

        return driver.run(args, settings)
    with service_urls(args) as (server_url, broker_url):
        report = {
            "machine": machine(server_url, broker_url),
            "settings": vars(settings)
            | {"scale": list(settings.scale), "submit": vars(settings.submit)},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **measure(settings, server_url, broker_url, lambda m: print(m, file=sys.stderr)),
        }
    args.json.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
