"""Dramatiq on RabbitMQ with delivery confirms, its durable settings stated.

``python -m tests.harness.compare.dramatiq_bench ...`` (the driver runs it in
``.venv-compare``). The same module is the workers' broker and actors: ``dramatiq
tests.harness.compare.dramatiq_bench`` imports it, configured from ``CMP_*`` variables.

Settings (from Dramatiq's documentation, "Brokers", "Composition", "Cookbook"):
``RabbitmqBroker(confirm_delivery=True)``: every enqueue waits for the broker's confirm; Dramatiq
declares its own queues (durable classic queues with a dead-letter queue; it offers no quorum
queue) and publishes persistent messages, acked after the actor ran (Dramatiq always acks
late). ``--processes WORKERS --threads 1``: one message at a time per process, its default
prefetch (twice the threads: 2). No results middleware: a chain is a ``pipeline`` (with
``pipe_ignore``), which needs none. A fan-out/join is a ``group`` with a completion callback,
which needs the ``GroupCallbacks`` middleware and a Redis or Memcached barrier: not on the
PostgreSQL and RabbitMQ this comparison runs on, so it reports "n/a".

Ends are observed on the broker: the queue's ready messages (up to two per worker process may
still be running, each a no-op), a chain's last message on a marker queue no worker consumes.
"""

from __future__ import annotations

import sys
import time
from importlib import metadata
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker

from tests.harness.compare import common

QUEUE = common.service("CMP_QUEUE")
MARKER = f"{QUEUE}.done"
broker = RabbitmqBroker(url=common.service("CMP_BROKER_URL"), confirm_delivery=True)
dramatiq.set_broker(broker)


def _noop(i: int = 0) -> None:
    return None


def _done() -> None:
    return None


noop = dramatiq.actor(_noop, actor_name="noop", queue_name=QUEUE, max_retries=0)
done = dramatiq.actor(_done, actor_name="done", queue_name=MARKER, max_retries=0)


def queues(queue: str) -> tuple[str, ...]:
    """Every queue a run declares: the task and marker queues with Dramatiq's delay (.DQ) and
    dead-letter (.XQ) queues."""
    return tuple(f"{q}{s}" for q in (queue, f"{queue}.done") for s in ("", ".DQ", ".XQ"))


def main(argv: list[str] | None = None) -> int:
    args = common.parser("dramatiq_bench").parse_args(argv)
    worker = [sys.executable, "-m", "dramatiq", __spec__.name if __spec__ else "", "--queues"]
    worker += [QUEUE, "--processes", str(args.workers), "--threads", "1"]
    looker = common.Broker(common.service("CMP_BROKER_URL"))
    report: dict[str, Any] = {
        "tool": "Dramatiq",
        "version": metadata.version("dramatiq"),
        "processes": f"--processes {args.workers} --threads 1",
    }
    try:
        broker.declare_queue(QUEUE, ensure=True)
        broker.declare_queue(MARKER, ensure=True)
        with common.Workers([worker], args.log) as workers:
            common.wait_until(
                lambda: workers.check() and looker.counts(QUEUE)[1] >= args.workers,
                common.START_TIMEOUT_S,
                "the Dramatiq workers",
            )
            started = time.perf_counter()
            for i in range(args.tasks):
                noop.send(i)
            ended = common.wait_until(
                lambda: looker.counts(QUEUE)[0] == 0, args.timeout, "an empty queue"
            )
            report["single"] = common.rate(args.tasks, started, ended)
            steps = [
                noop.message_with_options(args=(i,), pipe_ignore=True) for i in range(args.chain)
            ]
            started = time.perf_counter()
            dramatiq.pipeline([*steps, done.message()]).run()
            report["chain"] = common.per_hop(
                args.chain, started, looker.wait_marker(MARKER, args.timeout)
            )
            report["fanout"] = {"na": "a group's completion callback needs Redis or Memcached"}
    finally:
        broker.close()
        looker.delete(queues(QUEUE))
        looker.close()
    common.emit(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
