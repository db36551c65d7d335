"""The publisher's pace on an outbox backlog, per sweep size (docs/performance.md "Priorities").

A smaller sweep bounds how long a priority-9 row waits for the sweep in flight, and costs the
publisher one transaction and one confirm round trip more per sweep. This measures that cost
alone: ``--rows`` one-task runs are triggered with no worker running (each leaves one pending
outbox row), then a :class:`~flowforge.roles.publisher.Publisher` of each ``--sizes`` (in
turn, ``--repeat`` rounds, alternating) sweeps them all into a queue of its own; the figure is
rows published per second. The messages are deleted with their queues afterwards.

    python -m tests.harness.bench_outbox --database-url URL --broker-url URL --sizes 500,100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import uuid
from typing import Any

import pika
import psycopg

from flowforge.config import BrokerConfig, DatabaseConfig, load_config
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.names import BANDS, band_queue
from flowforge.roles.publisher import Publisher
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers

TRIGGER_BATCH = 500


def pace(url: str, broker_url: str, queue: str, rows: int, size: int) -> float:
    """Trigger ``rows`` runs (outbox rows pending), sweep them with sweeps of ``size``."""
    from tests.harness import bench, bench_maps

    with psycopg.connect(url, autocommit=True) as conn:
        bench_maps.truncate(conn, bench.TABLES)
    db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
    db.open()
    try:
        wf = WorkflowDef("outbox", (TaskDef("t", "bench.noop"),))
        for offset in range(0, rows, TRIGGER_BATCH):
            count = min(rows, offset + TRIGGER_BATCH) - offset
            Triggers(db).trigger_many(wf, [{"i": offset + i} for i in range(count)])
    finally:
        db.close()
    base = load_config(env={})
    config = dataclasses.replace(
        base,
        database=DatabaseConfig(url=url, pool_min=1, pool_max=2),
        broker=BrokerConfig(url=(broker_url,), queue=queue),
    )
    publisher = Publisher(config, batch_size=size)
    publisher.initialize()
    try:
        started = time.perf_counter()
        published = 0
        while True:
            handed, stamped = publisher.sweep()
            published += stamped
            if handed == 0:
                break
        elapsed = time.perf_counter() - started
    finally:
        publisher.shutdown()
    if published != rows:
        raise RuntimeError(f"published {published} of {rows}")
    return rows / elapsed


def delete_queues(broker_url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        channel = conn.channel()
        for index in range(len(BANDS)):
            channel.queue_delete(band_queue(queue, index))
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    from tests.harness import bench

    parser = argparse.ArgumentParser(prog="bench_outbox", description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--sizes", default="500,100")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    queue = f"flowforge.bench.outbox.{uuid.uuid4().hex[:8]}"
    paces: dict[int, list[float]] = {size: [] for size in sizes}
    try:
        with bench.fresh_database(args.database_url) as url:
            for rep in range(args.repeat):
                for size in sizes:
                    paces[size].append(pace(url, args.broker_url, queue, args.rows, size))
                    print(
                        f"round {rep + 1}, sweep {size}: {paces[size][-1]:.0f}/s", file=sys.stderr
                    )
    finally:
        delete_queues(args.broker_url, queue)
    report: dict[str, Any] = {
        f"publisher pace, sweeps of {size}": {
            "unit": "rows/s",
            "median": round(statistics.median(values), 1),
            "samples": [round(v, 1) for v in values],
        }
        for size, values in paces.items()
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
