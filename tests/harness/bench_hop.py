"""Where a chain's hop spends the tree's CPU, by process and by thread of the worker (issue 22,
"Efficiency"; docs/performance.md "The worker's side of a hop").

Starts one tree (``--workers``, default 1) on a fresh database of the server given, runs
``--throughput`` one-task runs (if any) and then a ``--chain``-step chain ``--repeat`` times
(none with ``--chain 0``), and reports per workload the tree's CPU per task (a chain's task is
a hop), per process (named by its title) and, for a chain, per thread of the first worker
(user and system CPU, by thread id), beside the hop p50, p99 and mean.

``--py-spy PATH`` samples the first worker (or the first process whose title holds
``--spy-role``, e.g. ``scheduler``) with ``py-spy record`` (speedscope format, to PATH)
during the last chain, or during the throughput workload with ``--chain 0``; it samples only
threads holding the GIL (``--gil``: Python's own CPU) unless ``SPY_FLAGS`` in the environment
says otherwise (``SPY_FLAGS=--idle``: wall time, waits included). Run alone::

    python -m tests.harness.bench_hop --database-url URL --broker-url URL [--chain 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from flowforge.config import DatabaseConfig
from flowforge.store.db import Database
from flowforge.store.triggers import Triggers
from tests.harness import bench, bench_maps
from tests.harness.cpuprobe import cpu_seconds, stat_user_system_s

T = TypeVar("T")
#: A hop over this many times the p50 counts as slow (:func:`slow_hops`).
SLOW_HOP = 3.0
#: py-spy's sampling rate (per second): low enough not to weigh on a 2-core machine.
SPY_RATE = 250


def title(pid: int) -> str:
    """A tree process's title (``flowforge: worker 1/1``), or the end of its command line."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text if text.startswith("flowforge") else text[-60:]


def thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """User and system CPU (s) of each thread of ``pid``, by thread id."""
    found: dict[int, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = stat_user_system_s((task / "stat").read_text())
        except OSError:
            continue
    return found


def spent(
    pids: list[int], worker: int, tasks: int, work: Callable[[], T]
) -> tuple[T, dict[str, Any]]:
    """``work()``'s result and the CPU per task (ms) it cost the tree, each process of it and
    each thread of ``worker`` (user, system)."""
    before, threads_before = cpu_seconds(pids), thread_cpu(worker)
    result = work()
    after, threads_after = cpu_seconds(pids), thread_cpu(worker)
    per_pid = {pid: 1000 * (cpu - before.get(pid, 0.0)) / tasks for pid, cpu in after.items()}
    threads = {
        str(tid): [
            round(1000 * (user - threads_before.get(tid, (0.0, 0.0))[0]) / tasks, 3),
            round(1000 * (system - threads_before.get(tid, (0.0, 0.0))[1]) / tasks, 3),
        ]
        for tid, (user, system) in threads_after.items()
    }
    return result, {
        "tree cpu ms/task": round(sum(per_pid.values()), 3),
        "by process": {
            f"{title(pid)} ({pid})": round(ms, 3)
            for pid, ms in sorted(per_pid.items(), key=lambda kv: -kv[1])
            if ms > 0
        },
        "worker threads user/sys ms/task": {t: v for t, v in threads.items() if sum(v) > 0},
        "load": os.getloadavg()[0],
    }


def slow_hops(conn: psycopg.Connection[Any], p50_ms: float) -> dict[str, float]:
    """How many hops of the chain just run (the only run in the tables) took over
    :data:`SLOW_HOP` times the p50, and their mean (ms): the hops that went through the
    publisher and the broker instead of the worker's own claim."""
    rows = conn.execute(
        "SELECT extract(epoch FROM finished_at - lag(finished_at) OVER (ORDER BY seq)) * 1000"
        " FROM task_runs ORDER BY seq"
    ).fetchall()
    slow = [float(r[0]) for r in rows if r[0] is not None and float(r[0]) > SLOW_HOP * p50_ms]
    return {
        "slow hops": len(slow),
        "slow hop mean ms": round(sum(slow) / len(slow), 1) if slow else 0.0,
    }


def broker_hops(conn: psycopg.Connection[Any]) -> int:
    """How many steps of the chain just run (the only run in the tables) came through the
    publisher and the broker: a step the worker's finish claimed has its outbox row stamped by
    that transaction (``published_at`` = its ``started_at``, both the transaction's now()),
    one the publisher sent was stamped by the publisher's sweep, before its claim."""
    row = conn.execute(
        "SELECT count(*) FROM outbox o JOIN task_runs t ON t.id = o.task_run_id"
        " WHERE o.published_at IS DISTINCT FROM t.started_at"
    ).fetchone()
    return int(row[0]) if row else -1


def spy(worker: int, path: str) -> subprocess.Popen[bytes]:
    """py-spy recording ``worker`` until :func:`unspy`."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    flags = os.environ.get("SPY_FLAGS", "--gil").split()
    argv = [exe, "record", "-p", str(worker), "-f", "speedscope", "-o", path]
    return subprocess.Popen(
        [*argv, "-r", str(SPY_RATE), "--nonblocking", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def unspy(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("bench_hop", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--chain", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--throughput", type=int, default=0)
    parser.add_argument("--py-spy", dest="py_spy", default=None)
    parser.add_argument("--spy-role", dest="spy_role", default="worker")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"chains": []}
    with bench.fresh_database(args.database_url) as url, tempfile.TemporaryDirectory() as tmp:
        tree = bench.Tree(Path(tmp), url, args.broker_url, args.workers)
        db = Database(DatabaseConfig(url=url, pool_min=1, pool_max=2), "flowforge-bench")
        db.open()
        try:
            tree.start()
            pids = tree.pids()
            worker = next(pid for pid in pids if "worker" in title(pid))
            spied = next(pid for pid in pids if args.spy_role in title(pid))
            repo = Triggers(db)
            with psycopg.connect(url, autocommit=True) as conn:
                if args.throughput:
                    settings = bench.Settings(tasks=args.throughput, timeout_s=600.0)
                    sampler = spy(spied, args.py_spy) if args.py_spy and not args.chain else None
                    done, cost = spent(
                        pids,
                        worker,
                        args.throughput,
                        lambda: bench.throughput(repo, conn, settings),
                    )
                    unspy(sampler)
                    report["throughput"] = {"tasks/s": round(done["tasks_per_s"], 1), **cost}
                for rep in range(args.repeat if args.chain else 0):
                    bench_maps.truncate(conn, bench.TABLES.replace("processes, ", ""))
                    last = rep == args.repeat - 1
                    sampler = spy(spied, args.py_spy) if args.py_spy and last else None
                    hops, cost = spent(
                        pids, worker, args.chain, lambda: bench.chain(repo, conn, args.chain, 600.0)
                    )
                    unspy(sampler)
                    figures = {k: round(hops[k], 3) for k in ("p50_ms", "p99_ms", "mean_ms")}
                    tail = {**slow_hops(conn, hops["p50_ms"]), "broker hops": broker_hops(conn)}
                    report["chains"].append({**figures, **tail, **cost})
        finally:
            tree.stop()
            db.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
