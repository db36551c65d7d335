"""CPU, writing transactions and WAL per task of one tree (issue 22, "Efficiency";
docs/performance.md "Chain hop and CPU per task").

Two workloads, each between two readings of :class:`Probe`:

* ``throughput``: ``--tasks`` one-task runs (:func:`tests.harness.bench.throughput`);
* ``chain``: one run of a ``--chain``-step chain (:func:`tests.harness.bench.chain`), whose
  hop (finish → next finish) p50 is reported beside its cost.

Per workload: CPU per task in ms summed over every process of the tree, PostgreSQL's and
RabbitMQ's (and each group's), the same less the idle rate watched for ``IDLE_S`` before it
(``busy``: a chain's tasks are few and its wall long, so the roles' idle polls weigh), the
server's writing transactions and WAL bytes per task, and the load average when it ended.
``scripts/bench`` records the throughput's as ``cpu per task`` and ``wal bytes per task``.
The services are the PostgreSQL server the harness is connected to and the RabbitMQ node on
the broker URL's port: run on services nothing else uses. Run alone::

    python -m tests.harness.bench_cost --database-url URL --broker-url URL [--chain 200]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psycopg

from flowforge.config import DatabaseConfig
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers
from tests.harness import bench, bench_maps
from tests.harness.cpuprobe import (
    cpu_seconds,
    listener_pid,
    process_tree,
    server_counters,
    server_pids,
    spent,
)

Record = Callable[..., None]
T = TypeVar("T")


@dataclass(frozen=True)
class Reading:
    """CPU (s) of each tree's processes and of each service's, and the server's counters."""

    trees: list[dict[int, float]]
    services: dict[str, dict[int, float]]
    counters: tuple[int, int]


@dataclass(frozen=True)
class Cost:
    """What happened between two readings: CPU (s) of every tree (one figure per tree) and of
    each service, writing transactions and WAL bytes."""

    trees_s: list[float]
    services_s: dict[str, float]
    xacts: int
    wal_bytes: int

    @property
    def total_s(self) -> float:
        return sum(self.trees_s) + sum(self.services_s.values())

    def per_task(self, tasks: int) -> dict[str, float]:
        """The cost per task: CPU in ms (trees, each service, all), transactions, WAL bytes."""
        figures = {"trees cpu ms": 1000 * sum(self.trees_s) / tasks}
        for name, seconds in self.services_s.items():
            figures[f"{name} cpu ms"] = 1000 * seconds / tasks
        figures["cpu ms"] = 1000 * self.total_s / tasks
        figures["xacts"] = self.xacts / tasks
        figures["wal bytes"] = self.wal_bytes / tasks
        return figures


class Probe:
    """Readings of the trees whose supervisors are ``tree_pids`` (their processes found once,
    at construction: start the trees first), of ``conn``'s PostgreSQL server and of the
    RabbitMQ node listening on ``broker_port``, each with its children (on a machine where
    others run servers of their own, only the ones measured), and of ``conn``'s server's
    counters."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        tree_pids: Sequence[int | None],
        broker_port: int,
    ) -> None:
        self._conn = conn
        self.pids = [process_tree(pid) for pid in tree_pids]
        self._broker = listener_pid(broker_port)

    def services(self) -> dict[str, list[int]]:
        """The pids of the services measured, by service, as they are now."""
        return {"postgresql": server_pids(self._conn), "rabbitmq": process_tree(self._broker)}

    def read(self) -> Reading:
        services = {name: cpu_seconds(p) for name, p in self.services().items()}
        return Reading([cpu_seconds(p) for p in self.pids], services, server_counters(self._conn))


def amqp_port(url: str) -> int:
    """The port of an ``amqp://`` or ``amqps://`` URL (the scheme's default when it names
    none)."""
    parsed = urlsplit(url)
    return parsed.port or (5671 if parsed.scheme == "amqps" else 5672)


def cost(before: Reading, after: Reading) -> Cost:
    """What was spent between ``before`` and ``after`` (two readings of one :class:`Probe`)."""
    xacts, wal = (a - b for a, b in zip(after.counters, before.counters, strict=True))
    return Cost(
        [spent(b, a) for b, a in zip(before.trees, after.trees, strict=True)],
        {name: spent(before.services.get(name, {}), cpu) for name, cpu in after.services.items()},
        xacts,
        wal,
    )


def costed(probe: Probe, tasks: int, work: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """``work()``'s result and what it cost per task (:meth:`Cost.per_task`) over
    ``tasks`` tasks."""
    before = probe.read()
    result = work()
    return result, cost(before, probe.read()).per_task(tasks)


def record_cost(record: Callable[..., None], label: str, per_task: dict[str, float]) -> None:
    """Record a workload's cost per task as ``<label> <figure> per task``."""
    units = {"xacts": "xacts/task", "wal bytes": "bytes/task"}
    for figure, value in per_task.items():
        record(f"{label} {figure} per task", units.get(figure, "ms/task"), value)
    record(f"{label} load average", "1 min", os.getloadavg()[0])


#: How long the tree is watched doing nothing before each workload (seconds).
IDLE_S = 2.0


def idle_cpu_rate(probe: Probe) -> float:
    """CPU (s per s) of everything measured while the tree has nothing to do: its roles' polls,
    heartbeats and the servers' housekeeping, which a workload's readings include for as long
    as it lasts (most of a chain's, whose tasks are few and slow to come)."""
    before = probe.read()
    time.sleep(IDLE_S)  # a measuring window, not a wait for a condition
    return cost(before, probe.read()).total_s / IDLE_S


def record_busy_cpu(record: Record, label: str, idle: float, wall_s: float, cpu_ms: float) -> None:
    """Record ``<label> busy cpu ms per task``: ``cpu_ms`` (the workload's CPU per task) less
    what the idle rate ``idle`` (CPU s per s, per task) spent over its ``wall_s``."""
    record(f"{label} busy cpu ms per task", "ms/task", cpu_ms - 1000 * idle * wall_s)


def measure(
    repo: Triggers,
    conn: psycopg.Connection[Any],
    probe: Probe,
    tasks: int,
    length: int,
    record: Record,
    timeout_s: float = 600.0,
) -> None:
    """One repetition of both workloads on a running tree (tables emptied before each)."""
    bench_maps.truncate(conn, bench.TABLES.replace("processes, ", ""))
    settings = bench.Settings(tasks=tasks, timeout_s=timeout_s)
    idle = idle_cpu_rate(probe)
    started = time.monotonic()
    done, per_task = costed(probe, tasks, lambda: bench.throughput(repo, conn, settings))
    wall = time.monotonic() - started
    record("cost: throughput", "tasks/s", done["tasks_per_s"])
    record_cost(record, "throughput", per_task)
    record_busy_cpu(record, "throughput", idle / tasks, wall, per_task["cpu ms"])
    bench_maps.truncate(conn, bench.TABLES.replace("processes, ", ""))
    idle = idle_cpu_rate(probe)
    started = time.monotonic()
    hops, per_task = costed(probe, length, lambda: bench.chain(repo, conn, length, timeout_s))
    wall = time.monotonic() - started
    record("cost: chain p50", "ms/hop", hops["p50_ms"], length=length)
    record_cost(record, "chain", per_task)
    record_busy_cpu(record, "chain", idle / length, wall, per_task["cpu ms"])


def main(argv: list[str] | None = None) -> int:
    parser = bench.alone_parser("bench_cost", __doc__, workers=4)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--chain", type=int, default=200)
    args = parser.parse_args(argv)
    results: dict[str, bench.Result] = {}

    def record(name: str, unit: str, value: float, **extra: Any) -> None:
        results.setdefault(name, bench.Result(name, unit)).samples.append(round(value, 4))

    with bench.fresh_database(args.database_url) as url, tempfile.TemporaryDirectory() as tmp:
        tree = bench.Tree(Path(tmp), url, args.broker_url, args.workers)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        try:
            tree.start()
            with psycopg.connect(url, autocommit=True) as conn:
                probe = Probe(
                    conn,
                    [tree.proc.pid if tree.proc else None],
                    amqp_port(args.broker_url),
                )
                for rep in range(args.repeat):
                    print(f"repetition {rep + 1}/{args.repeat}", file=sys.stderr)
                    measure(Triggers(db), conn, probe, args.tasks, args.chain, record)
        finally:
            tree.stop()
            db.close()
    print(json.dumps({name: r.summary() for name, r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
