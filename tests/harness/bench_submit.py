"""``scripts/bench``'s submission workloads (issue 22, docs/performance.md "Submitting work").

What a caller pays to start work, against a real ``flowforge up`` tree that executes the runs
meanwhile (its no-op handler), each figure in runs per second (wall, from the first call to the
last answer):

* ``submit one``: :meth:`Client.trigger` in a loop, one run per call, one caller — how most
  users submit work;
* ``submit threads``: :meth:`Client.trigger` from ``clients`` threads at once on one client, as a
  threaded web app calls it (the calls share commits: flowforge/coalesce.py);
* ``submit http``: ``POST /api/v1/runs`` from ``clients`` threads, each with one keep-alive
  connection (``http.client``), one run per request; with the latency median and p99;
* ``submit many``: :meth:`Client.trigger_many`, ``per_call`` runs per call;
* ``submit http batch``: ``POST /api/v1/runs:batch``, ``per_call`` runs per request, one client.

Nothing here asserts a figure. Run alone (a tree of its own, nothing else measured)::

    python -m tests.harness.bench_submit --database-url URL --broker-url URL [--quick]

``--api-only`` runs the api children alone (tests/harness/api_children.py: the tree's api spec
under a supervisor) instead of a tree: nothing publishes or executes the runs, so the figures
are the submission path's own, not shared with the work it creates — the A/B of a change to
that path on a busy 2-core machine. ``--api-processes N`` sets ``api.processes``.

Run alone, each workload also records the CPU per run (ms, read from /proc by
tests/harness/cpuprobe.py) of the caller (this process), the api children, the rest of the
tree, PostgreSQL and RabbitMQ (every process of each server: use servers nothing else uses).

``--only`` picks workloads (``one,threads,http,many,http-batch``): an A/B against code without the
batch endpoint leaves ``http-batch`` out.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from flowforge.client import Client
from flowforge.config import load_config
from tests.harness import CHECKOUT, api_children, bench_api, bench_maps, cpuprobe
from tests.harness.resources import child_pids

WORKLOADS = ("one", "threads", "http", "many", "http-batch")
Record = Callable[..., None]


@dataclass(frozen=True)
class SubmitSettings:
    """How many runs each workload submits, and how."""

    runs: int = 3000  # one at a time (Client.trigger) and over HTTP
    clients: int = 16  # HTTP clients, one keep-alive connection each; threads of `threads`
    batch_runs: int = 10_000  # through trigger_many and the batch endpoint
    per_call: int = 1000  # runs per trigger_many call / batch request
    only: tuple[str, ...] = WORKLOADS


QUICK = SubmitSettings(runs=200, clients=16, batch_runs=1000, per_call=500)


def one_at_a_time(client: Client, workflow: str, runs: int) -> float:
    """``Client.trigger`` ``runs`` times in a loop; runs/s."""
    started = time.perf_counter()
    for n in range(runs):
        client.trigger(workflow, {"n": n})
    return runs / (time.perf_counter() - started)


def threaded(client: Client, workflow: str, runs: int, callers: int) -> float:
    """``Client.trigger`` from ``callers`` threads at once on one client (a threaded web
    app's), one run per call, ``runs`` split between them; runs/s. The calls share commits
    (flowforge/coalesce.py)."""
    each = runs // callers
    start = threading.Barrier(callers + 1)

    def caller(k: int) -> None:
        start.wait(60.0)
        for n in range(k * each, (k + 1) * each):
            client.trigger(workflow, {"n": n})

    with ThreadPoolExecutor(callers) as pool:
        futures = [pool.submit(caller, k) for k in range(callers)]
        start.wait(60.0)
        started = time.perf_counter()
        for future in futures:
            future.result()  # a caller's error is the bench's
        return each * callers / (time.perf_counter() - started)


def many(client: Client, workflow: str, runs: int, per_call: int) -> float:
    """``Client.trigger_many`` with ``per_call`` runs a call, ``runs`` in all; runs/s."""
    started = time.perf_counter()
    for offset in range(0, runs, per_call):
        client.trigger_many(
            workflow, [{"n": n} for n in range(offset, min(runs, offset + per_call))]
        )
    return runs / (time.perf_counter() - started)


def http_batch(port: int, workflow: str, runs: int, per_call: int) -> float:
    """``POST /api/v1/runs:batch`` with ``per_call`` runs a request over one keep-alive
    connection, ``runs`` in all; runs/s."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=bench_api.TIMEOUT_S)
    headers = {"Authorization": f"Bearer {bench_api.TOKEN}", "Content-Type": "application/json"}
    try:
        started = time.perf_counter()
        for offset in range(0, runs, per_call):
            items = [
                {"workflow": workflow, "input": {"n": n}}
                for n in range(offset, min(runs, offset + per_call))
            ]
            conn.request("POST", "/api/v1/runs:batch", json.dumps({"runs": items}), headers)
            answer = json.loads(bench_api.check(conn.getresponse(), 201))
            if len(answer["runs"]) != len(items):
                raise RuntimeError(f"the batch answered {len(answer['runs'])} of {len(items)}")
        return runs / (time.perf_counter() - started)
    finally:
        conn.close()


def measure(
    client: Client,
    port: int,
    workflow: str,
    settings: SubmitSettings,
    record: Record,
    probe: cpuprobe.Probe | None = None,
) -> None:
    """Every workload of ``settings.only``, in the order of :data:`WORKLOADS`; with ``probe``,
    also the CPU per run of each of its groups (``submit one: CPU per run, api``, in ms)."""
    s = settings

    def probed(name: str, runs: int, work: Callable[[], float], **extra: Any) -> None:
        if probe is not None:
            probe.start()
        record(name, "runs/s", work(), runs=runs, **extra)
        if probe is not None:
            for group, seconds in probe.stop().items():
                record(f"{name}: CPU per run, {group}", "ms/run", 1000 * seconds / runs)

    def http() -> float:
        bench_api.wait_live(port, 60.0)
        figures, _ = bench_api.trigger(port, workflow, s.runs, s.clients)
        latency[:] = [figures.p50_ms, figures.p99_ms]
        return figures.requests_per_s

    latency: list[float] = []
    threaded_runs = s.runs - s.runs % s.clients
    workloads: dict[str, tuple[str, int, Callable[[], float], dict[str, Any]]] = {
        "one": ("submit one", s.runs, lambda: one_at_a_time(client, workflow, s.runs), {}),
        "threads": (
            "submit threads",
            threaded_runs,
            lambda: threaded(client, workflow, s.runs, s.clients),
            {"callers": s.clients},
        ),
        "http": ("submit http", s.runs, http, {"clients": s.clients}),
        "many": (
            "submit many",
            s.batch_runs,
            lambda: many(client, workflow, s.batch_runs, s.per_call),
            {"per_call": s.per_call},
        ),
        "http-batch": (
            "submit http batch",
            s.batch_runs,
            lambda: http_batch(port, workflow, s.batch_runs, s.per_call),
            {"per_call": s.per_call},
        ),
    }
    for key in WORKLOADS:
        if key in s.only:
            name, runs, work, extra = workloads[key]
            probed(name, runs, work, **extra)
            if key == "http":
                record("submit http p50", "ms", latency[0])
                record("submit http p99", "ms", latency[1])


def run(
    config_path: Path,
    port: int,
    settings: SubmitSettings,
    record: Record,
    probe: cpuprobe.Probe | None = None,
) -> None:
    """:func:`measure` with a :class:`Client` of the tree's config (``scripts/bench``)."""
    with Client(load_config(config_path, env={})) as client:
        measure(client, port, bench_api_workflow(), settings, record, probe)


def probe_of(supervisor: int, database: str) -> cpuprobe.Probe:
    """CPU by who spends it: this process (the caller: ``Client``, the HTTP clients), the api
    children of the tree under ``supervisor``, the rest of that tree, PostgreSQL (the whole
    server, and the backends of ``database`` alone), RabbitMQ."""
    me = os.getpid()

    def rest() -> list[int]:
        apis = set(api_children.api_pids(supervisor))
        return [p for p in [supervisor, *child_pids(supervisor, True)] if p not in apis]

    return cpuprobe.Probe(
        {
            "caller": lambda: [me],
            "api": lambda: api_children.api_pids(supervisor),
            "tree": rest,
            **cpuprobe.services(),
            "postgresql backends": lambda: cpuprobe.backends(database),
        }
    )


def bench_api_workflow() -> str:
    """The one-task workflow the bench tree defines for its api workloads."""
    from tests.harness import bench

    return bench.API_WORKFLOW


@contextmanager
def api_alone(tree: Any) -> Iterator[int]:
    """The api children alone (``api.processes`` of them under a supervisor, as in a tree:
    tests/harness/api_children.py) with ``tree``'s config (a :class:`~tests.harness.bench.Tree`
    not started), from this checkout, serving until the block ends; yields their supervisor's
    pid."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
    env[bench_api.TOKEN_ENV] = bench_api.TOKEN
    command = [sys.executable, "-m", "tests.harness.api_children", str(tree.config_path)]
    with tree.log_path.open("ab") as log:
        proc = subprocess.Popen(
            command, cwd=CHECKOUT, env=env, stdout=subprocess.DEVNULL, stderr=log
        )
    try:
        bench_api.wait_live(tree.api_port, 60.0)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def settle(conn: psycopg.Connection[Any], timeout_s: float) -> None:
    """Wait until the tree has executed every run submitted (so the next repetition does not
    measure against the last one's backlog)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(*) FROM task_runs WHERE state NOT IN ('SUCCEEDED', 'DEAD')"
        ).fetchone()
        if row is not None and row[0] == 0:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the tree did not finish the submitted runs in {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    from tests.harness import bench

    parser = bench.alone_parser("bench_submit", __doc__, workers=4)
    parser.add_argument("--quick", action="store_true", help="a few hundred runs")
    parser.add_argument("--runs", type=int, default=SubmitSettings.runs)
    parser.add_argument("--clients", type=int, default=SubmitSettings.clients)
    parser.add_argument("--batch-runs", type=int, default=SubmitSettings.batch_runs)
    parser.add_argument("--per-call", type=int, default=SubmitSettings.per_call)
    parser.add_argument("--only", default=",".join(WORKLOADS), help="workloads, comma-separated")
    parser.add_argument("--json", type=Path, help="where to write every repetition as JSON")
    parser.add_argument(
        "--api-only", action="store_true", help="the api child alone: nothing executes the runs"
    )
    parser.add_argument(
        "--api-processes", type=int, default=1, help="api.processes: api children on the port"
    )
    parser.add_argument(
        "--api-threads", type=int, help="api.threads: request threads per api child (the default)"
    )
    args = parser.parse_args(argv)
    only = tuple(w for w in args.only.split(",") if w)
    if set(only) - set(WORKLOADS):
        parser.error(f"--only takes {', '.join(WORKLOADS)}")
    settings = (
        SubmitSettings(args.runs, args.clients, args.batch_runs, args.per_call, only)
        if not args.quick
        else SubmitSettings(QUICK.runs, QUICK.clients, QUICK.batch_runs, QUICK.per_call, only)
    )
    results: dict[str, bench.Result] = {}

    def record(name: str, unit: str, value: float, **extra: Any) -> None:
        results.setdefault(name, bench.Result(name, unit)).samples.append(round(value, 3))
        results[name].extra.update(extra)

    with bench.fresh_database(args.database_url) as url, tempfile.TemporaryDirectory() as tmp:
        floors = bench.floors(url)
        tree = bench.Tree(
            Path(tmp),
            url,
            args.broker_url,
            args.workers,
            api_processes=args.api_processes,
            api_threads=args.api_threads,
        )
        with ExitStack() as stack:
            if args.api_only:
                supervisor = stack.enter_context(api_alone(tree))
            else:
                stack.callback(tree.stop)
                tree.start()
                assert tree.proc is not None
                supervisor = tree.proc.pid
            probe = probe_of(supervisor, str(conninfo_to_dict(url)["dbname"]))
            with psycopg.connect(url, autocommit=True) as conn:
                for rep in range(args.repeat):
                    print(f"repetition {rep + 1}/{args.repeat}", file=sys.stderr)
                    bench_maps.truncate(conn, bench.TABLES.replace("processes, ", ""))
                    run(tree.config_path, tree.api_port, settings, record, probe)
                    if not args.api_only:
                        settle(conn, 600.0)
    report = {"floors": floors, "results": {n: r.summary() for n, r in results.items()}}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    bench.print_table({"floors": floors, "results": report["results"], "memory": {}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
