"""Procrastinate on PostgreSQL (a database of its own), its durable settings stated.

``python -m tests.harness.compare.procrastinate_bench ...`` (the driver runs it in
``.venv-compare``). The same module is the workers' app: ``procrastinate --app
tests.harness.compare.procrastinate_bench.app worker`` imports it, configured from ``CMP_*``
variables.

Settings (from Procrastinate's documentation, "Quickstart", "Defer a job", "Launch a worker"):
``PsycopgConnector`` on the run's scratch database, whose schema the bench applies; a job is a
row committed by its defer (PostgreSQL's default ``synchronous_commit``), and its status is
committed when it ends; the bench's jobs are deferred in batches (``batch_defer_async``, as
FlowForge's bench triggers in batches). WORKERS worker processes, each ``--concurrency 1``,
listening for new jobs (LISTEN/NOTIFY, the default). A chain is each task deferring the next;
Procrastinate has no fan-out/join: "n/a". Ends are observed in ``procrastinate_jobs``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from importlib import metadata
from typing import Any

import procrastinate
import psycopg

from tests.harness.compare import common

QUEUE = common.service("CMP_QUEUE")
app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=common.service("CMP_DATABASE_URL"))
)


async def _noop(i: int = 0) -> None:
    return None


async def _step(i: int, n: int) -> None:
    if i + 1 < n:
        await step.defer_async(i=i + 1, n=n)


noop = app.task(name="noop", queue=QUEUE)(_noop)
step = app.task(name="step", queue=QUEUE)(_step)


def _count(conninfo: str, query: str) -> int:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def _succeeded(conninfo: str, task: str) -> int:
    return _count(
        conninfo,
        "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        + (" AND task_name = 'noop'" if task == "noop" else " AND task_name = 'step'"),
    )


async def _defer_all(tasks: int) -> None:
    for offset in range(0, tasks, common.BATCH):
        await noop.batch_defer_async(
            *({"i": i} for i in range(offset, min(tasks, offset + common.BATCH)))
        )


async def _measure(args: Any, database: str, workers: common.Workers) -> dict[str, Any]:
    report: dict[str, Any] = {}
    started = time.perf_counter()
    await _defer_all(args.tasks)
    ended = common.wait_until(
        lambda: workers.check() and _succeeded(database, "noop") >= args.tasks,
        args.timeout,
        "the jobs",
    )
    report["single"] = common.rate(args.tasks, started, ended)
    started = time.perf_counter()
    await step.defer_async(i=0, n=args.chain)
    ended = common.wait_until(
        lambda: workers.check() and _succeeded(database, "step") >= args.chain,
        args.timeout,
        "the chain",
    )
    report["chain"] = common.per_hop(args.chain, started, ended)
    report["fanout"] = {"na": "Procrastinate has no fan-out/join"}
    return report


async def _run(args: Any) -> dict[str, Any]:
    database = common.service("CMP_DATABASE_URL")
    app_path = f"{__spec__.name if __spec__ else ''}.app"
    worker = [sys.executable, "-m", "procrastinate", "--app", app_path, "--log-level", "warning"]
    worker += ["worker", "--queues", QUEUE, "--concurrency", "1"]
    report: dict[str, Any] = {
        "tool": "Procrastinate",
        "version": metadata.version("procrastinate"),
        "processes": f"{args.workers} worker processes, --concurrency 1",
    }
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        with common.Workers([worker] * args.workers, args.log) as workers:
            common.wait_until(
                lambda: (
                    workers.check()
                    and _count(database, "SELECT count(*) FROM procrastinate_workers")
                    >= args.workers
                ),
                common.START_TIMEOUT_S,
                "the Procrastinate workers",
            )
            report |= await _measure(args, database, workers)
    return report


def main(argv: list[str] | None = None) -> int:
    args = common.parser("procrastinate_bench").parse_args(argv)
    common.emit(asyncio.run(_run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
