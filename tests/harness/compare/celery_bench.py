"""Celery on RabbitMQ, durable settings stated, with no result backend or PostgreSQL's.

``python -m tests.harness.compare.celery_bench --backend none|postgresql ...`` (the driver runs
it in ``.venv-compare``). The same module is the workers' app: ``celery -A
tests.harness.compare.celery_bench worker`` imports it and configures it from ``CMP_*``
variables the bench sets.

Settings (from Celery's documentation, "Configuration and defaults", "Using RabbitMQ",
"Canvas"): the task queue is a quorum queue (``x-queue-type: quorum`` in ``task_queues``, Celery
5.5+), publishes wait for confirms (``broker_transport_options={"confirm_publish": True}``),
messages are persistent (the default delivery mode), ``task_acks_late=True`` (a message is
acked after its task ran, and after its result was stored), ``worker_prefetch_multiplier=1``,
one prefork worker with ``--concurrency WORKERS``. Results: none (``task_ignore_result``), or
the SQLAlchemy database backend on PostgreSQL (``db+postgresql+psycopg://``), where a chord's
join is Celery's ``chord_unlock`` task polling the results every
``result_chord_retry_interval`` (0.1 s here; Celery's default is 1 s).

Ends are observed where the tool keeps its state: the results table (PostgreSQL backend), the
queue's ready messages (no backend: up to WORKERS deliveries may still be running, each a
no-op), a marker message on a queue no worker consumes (a chain's last step, a chord's body).
"""

from __future__ import annotations

import os
import sys
import time
from importlib import metadata
from typing import Any

import psycopg
from celery import Celery, chain, chord
from kombu import Exchange, Queue
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL

from tests.harness.compare import common

app = Celery("flowforge-compare")
#: What Celery's workers declare on a vhost once they see a quorum queue (native delayed
#: delivery, celery/worker/consumer/delayed_delivery.py): removed after the run when the run
#: made them, kept when they were there before it (another Celery app on the vhost uses them).
DELAYED_QUEUES = tuple(f"celery_delayed_{level}" for level in range(28))
DELAYED_EXCHANGES = (*DELAYED_QUEUES, "celery_delayed_delivery")
#: The chord join's poll (Celery's default: 1 s); stated in docs/performance.md.
CHORD_RETRY_S = 0.1


def configure(broker_url: str, backend_url: str, queue: str) -> None:
    """Apply the stated settings; ``backend_url`` empty: no result backend."""
    app.conf.update(
        broker_url=broker_url,
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=True,
        result_backend=backend_url or None,
        task_ignore_result=not backend_url,
        result_chord_retry_interval=CHORD_RETRY_S,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_queues=[
            Queue(
                queue,
                Exchange(queue, type="direct"),
                routing_key=queue,
                queue_arguments={"x-queue-type": "quorum"},
            )
        ],
        task_default_queue=queue,
        task_default_exchange=queue,
        task_default_routing_key=queue,
        worker_enable_remote_control=False,
        worker_hijack_root_logger=False,
    )


def _noop(i: int = 0) -> None:
    return None


noop = app.task(name="bench.noop")(_noop)
QUEUE = common.service("CMP_QUEUE")
MARKER = f"{QUEUE}.done"
configure(common.service("CMP_BROKER_URL"), os.environ.get("CMP_BACKEND_URL", ""), QUEUE)


def backend_url(conninfo: str) -> str:
    """The SQLAlchemy URL Celery's database backend takes, for a libpq conninfo."""
    p = conninfo_to_dict(conninfo)
    url = URL.create(
        "postgresql+psycopg",
        username=p.get("user"),
        password=p.get("password"),
        host=p.get("host"),
        port=int(str(p["port"])) if p.get("port") else None,
        database=p.get("dbname"),
    )
    return "db+" + str(url.render_as_string(hide_password=False))


def _succeeded(conninfo: str) -> int:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        try:
            row = conn.execute(
                "SELECT count(*) FROM celery_taskmeta WHERE status = 'SUCCESS'"
            ).fetchone()
        except psycopg.errors.UndefinedTable:  # Celery creates it with the first result
            return 0
    return int(row[0]) if row else 0


def main(argv: list[str] | None = None) -> int:
    p = common.parser("celery_bench")
    p.add_argument("--backend", choices=("none", "postgresql"), required=True)
    args = p.parse_args(argv)
    database = common.service("CMP_DATABASE_URL")
    backend = backend_url(database) if args.backend == "postgresql" else ""
    # the workers import this module: the backend reaches them through their environment
    os.environ["CMP_BACKEND_URL"] = backend
    configure(common.service("CMP_BROKER_URL"), backend, QUEUE)
    worker = [sys.executable, "-m", "celery", "-A", __spec__.name if __spec__ else "", "worker"]
    worker += ["--pool", "prefork", "--concurrency", str(args.workers), "--loglevel", "WARNING"]
    worker += ["--without-mingle", "--without-gossip", "--without-heartbeat", "-Q", QUEUE]
    broker = common.Broker(common.service("CMP_BROKER_URL"))
    report: dict[str, Any] = {
        "tool": "Celery",
        "version": metadata.version("celery"),
        "backend": args.backend,
        "processes": f"1 prefork worker, --concurrency {args.workers}",
    }
    delayed = () if broker.exists(DELAYED_QUEUES[-1]) else DELAYED_QUEUES
    try:
        broker.declare_marker(MARKER)
        done = app.signature("bench.done", queue=MARKER, immutable=True)
        with common.Workers([worker], args.log) as workers:
            common.wait_until(
                lambda: workers.check() and broker.counts(QUEUE)[1] >= 1,
                common.START_TIMEOUT_S,
                "the Celery worker",
            )
            started = time.perf_counter()
            with app.producer_or_acquire() as producer:
                for i in range(args.tasks):
                    noop.apply_async((i,), producer=producer)
            if backend:
                ended = common.wait_until(
                    lambda: _succeeded(database) >= args.tasks, args.timeout, "the results"
                )
            else:
                ended = common.wait_until(
                    lambda: broker.counts(QUEUE)[0] == 0, args.timeout, "an empty queue"
                )
            report["single"] = common.rate(args.tasks, started, ended)
            started = time.perf_counter()
            chain(*(noop.si(i) for i in range(args.chain)), done).apply_async()
            report["chain"] = common.per_hop(
                args.chain, started, broker.wait_marker(MARKER, args.timeout)
            )
            if not backend:
                report["fanout"] = {"na": "a chord needs a result backend"}
            else:
                started = time.perf_counter()
                header = [noop.si(i) for i in range(args.fanout)]
                # the join runs as a task of the queue (chord_unlock goes to its body's queue),
                # and links to the marker
                join = noop.si(-2)
                join.link(done)
                chain(noop.si(-1), chord(header, join)).apply_async()
                report["fanout"] = common.rate(
                    args.fanout + 2, started, broker.wait_marker(MARKER, args.timeout)
                )
    finally:
        broker.delete(
            (QUEUE, MARKER, *delayed), (QUEUE, MARKER, *(DELAYED_EXCHANGES if delayed else ()))
        )
        broker.close()
    common.emit(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
