"""``scripts/chaos``: a bounded soak of a live ``flowforge up`` tree under injected faults.

On private PostgreSQL and RabbitMQ instances (they get killed, so never shared ones) it runs a
tree, triggers a mix of workflows — fan-out, chains, failing-then-succeeding handlers, handlers
that always fail, slow handlers, idempotency-keyed handlers — and meanwhile, on a seeded random
schedule, SIGKILLs random children, SIGKILLs and restarts the broker, restarts PostgreSQL, and
SIGTERMs and restarts the whole supervisor. Then it waits for quiescence and checks invariants
from the database and a side table in which every handler execution is recorded. It prints a
table and JSON, and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.errors import FlowForgeError
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from flowforge.store.triggers import Triggers
from tests.harness.resources import child_pids, create_database, free_ports, start_tree
from tests.harness.services import PrivatePostgres, PrivateRabbitMQ

HANDLER_MODULE = "tests.harness.chaos_handlers"
SIDE_TABLE = """
CREATE TABLE IF NOT EXISTS chaos_executions (
    id          bigserial   PRIMARY KEY,
    task_run_id uuid        NOT NULL,
    attempt     integer     NOT NULL,
    kind        text        NOT NULL,
    key         text,
    pid         integer     NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
RETRY = RetryPolicy(max_attempts=8, base_delay=0.2, max_delay=2.0, jitter=Jitter.FULL)
DOOMED_RETRY = RetryPolicy(max_attempts=2, base_delay=0.1, max_delay=0.2, jitter=Jitter.FULL)
FAULTS = ("kill_child", "kill_broker", "restart_postgres", "restart_tree")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def workflows() -> dict[str, WorkflowDef]:
    fan = tuple(
        TaskDef(f"leaf{i}", "chaos.step", depends_on=("root",), retry=RETRY) for i in range(8)
    )
    return {
        "fanout": WorkflowDef(
            "chaos-fanout",
            (
                TaskDef("root", "chaos.step", retry=RETRY),
                *fan,
                TaskDef("join", "chaos.step", depends_on=tuple(t.name for t in fan), retry=RETRY),
            ),
        ),
        "chain": WorkflowDef(
            "chaos-chain",
            tuple(
                TaskDef(f"c{i}", "chaos.step", depends_on=(f"c{i - 1}",) if i else (), retry=RETRY)
                for i in range(5)
            ),
        ),
        "flaky": WorkflowDef("chaos-flaky", (TaskDef("f", "chaos.flaky", retry=RETRY),)),
        "doomed": WorkflowDef("chaos-doomed", (TaskDef("d", "chaos.doomed", retry=DOOMED_RETRY),)),
        "slow": WorkflowDef("chaos-slow", (TaskDef("s", "chaos.slow", retry=RETRY),)),
        "keyed": WorkflowDef(
            "chaos-keyed", (TaskDef("k", "chaos.keyed", retry=RETRY, idempotency_key="{key}"),)
        ),
    }


@dataclass
class Soak:
    duration_s: float
    seed: int
    faults_per_minute: float
    workers: int
    base_dir: Path
    log: Callable[[str], None]
    rng: random.Random = field(init=False)
    faults: Counter[str] = field(default_factory=Counter)
    triggered: dict[str, list[str]] = field(default_factory=dict)
    trigger_errors: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        # Ports free right now, not fixed ones: fixed ports in the ephemeral range collided
        # with whatever the machine (or another test's private services) held at the time.
        pg_port, amqp_port, dist_port, epmd_port = free_ports(4)
        self.pg = PrivatePostgres(self.base_dir, pg_port)
        self.rabbit = PrivateRabbitMQ(
            self.base_dir, amqp_port, dist_port, "flowforge-chaos", epmd_port=epmd_port
        )
        self.tree: subprocess.Popen[bytes] | None = None
        self.db: Database | None = None  # opened by setup()
        self.workdir = Path(tempfile.mkdtemp(prefix="ff-chaos-soak-"))
        self.workdir.chmod(0o755)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        self.pg.start()
        self.rabbit.start()
        self.db_url = create_database(self.pg.admin_url, "chaos")
        migrate(self.db_url)
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            conn.execute(SIDE_TABLE)
        config = {
            "database": {"url": self.db_url, "pool_max": 3, "connect_timeout_s": 2},
            "broker": {"url": self.rabbit.url, "queue": "flowforge.chaos", "heartbeat_s": 10},
            "handlers": [HANDLER_MODULE],
            "processes": {"workers": self.workers, "drain_timeout_s": 15, "restart_limit": 1000},
            "worker": {"lease_s": 3.0, "heartbeat_s": 1.0, "key_wait_s": 0.3},
            "scheduler": {"poll_interval_s": 0.5},
        }
        self.config_path = self.workdir / "chaos.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        db = Database(
            DatabaseConfig(url=self.db_url, pool_max=2, connect_timeout_s=2), "flowforge-chaos"
        )
        db.open()
        self.db = db
        self.repo = Triggers(db)

    def start_tree(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
        env["FLOWFORGE_CHAOS_DB"] = self.db_url
        self.tree = start_tree(self.config_path, env, self.workdir / "tree.log")

    def stop_tree(self, sig: int = signal.SIGTERM) -> None:
        if self.tree is None or self.tree.poll() is not None:
            return
        self.tree.send_signal(sig)
        try:
            self.tree.wait(40)
        except subprocess.TimeoutExpired:
            self.tree.kill()
            self.tree.wait(10)

    def teardown(self) -> None:
        self.stop_tree()
        if self.db is not None:
            self.db.close()
        for service in (self.rabbit, self.pg):
            try:
                service.stop()
            except Exception as exc:  # keep stopping the other one
                self.log(f"could not stop {service!r}: {exc}")

    # ------------------------------------------------------------------ load and faults

    def trigger_some(self) -> None:
        defs = workflows()
        kind = self.rng.choice(list(defs))
        count = self.rng.randint(1, 5)
        inputs: list[dict[str, Any]] = [{"n": self.rng.randint(0, 10**9)} for _ in range(count)]
        if kind == "slow":
            for i in inputs:
                i["seconds"] = round(self.rng.uniform(0.2, 1.5), 2)
        if kind == "keyed":
            for i in inputs:
                i["key"] = f"key-{self.rng.randint(0, 20)}"  # few keys: many runs share one
        try:
            results = self.repo.trigger_many(defs[kind], inputs)
        except FlowForgeError:
            self.trigger_errors += 1  # not acknowledged: such a run may or may not exist
            return
        self.triggered.setdefault(kind, []).extend(str(r.run_id) for r in results)

    def inject(self) -> None:
        fault = self.rng.choice(FAULTS)
        self.faults[fault] += 1
        self.log(f"fault: {fault}")
        if fault == "kill_child":
            children = child_pids(self.tree.pid) if self.tree else []
            if children:
                os.kill(self.rng.choice(children), signal.SIGKILL)
        elif fault == "kill_broker":
            self.rabbit.kill()
            time.sleep(self.rng.uniform(0.5, 2.0))
            self.rabbit.start()
        elif fault == "restart_postgres":
            self.pg.stop()
            time.sleep(self.rng.uniform(0.5, 2.0))
            self.pg.start()
        elif fault == "restart_tree":
            self.stop_tree()
            self.start_tree()

    def run(self) -> None:
        self.start_tree()
        end = time.monotonic() + self.duration_s
        interval = 60.0 / self.faults_per_minute if self.faults_per_minute > 0 else float("inf")
        next_fault = time.monotonic() + self.rng.uniform(0.5, 1.5) * interval
        while time.monotonic() < end:
            self.trigger_some()
            if time.monotonic() >= next_fault:
                self.inject()
                next_fault = time.monotonic() + self.rng.uniform(0.5, 1.5) * interval
            time.sleep(self.rng.uniform(0.1, 0.4))
        for service in (self.pg, self.rabbit):
            service.start()
        if self.tree is None or self.tree.poll() is not None:
            self.start_tree()

    def quiesce(self, timeout_s: float) -> bool:
        ids = [r for runs in self.triggered.values() for r in runs]
        deadline = time.monotonic() + timeout_s
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s::uuid[])"
                    " AND state = ANY(%s) AND finished_at IS NOT NULL",
                    (ids, list(TERMINAL)),
                ).fetchone()
                pending = conn.execute(
                    "SELECT count(*) FROM outbox WHERE published_at IS NULL"
                ).fetchone()
                if row and row[0] == len(ids) and pending and pending[0] == 0:
                    return True
                time.sleep(0.5)
        return False


# ---------------------------------------------------------------------------- invariants

INVARIANTS: dict[str, str] = {
    "acknowledged runs not terminal": """
        SELECT r.id FROM workflow_runs r
         WHERE r.id = ANY(%(ids)s::uuid[]) AND (r.state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
               OR r.finished_at IS NULL)""",
    "acknowledged runs missing": """
        SELECT i FROM unnest(%(ids)s::uuid[]) AS i
         WHERE NOT EXISTS (SELECT 1 FROM workflow_runs r WHERE r.id = i)""",
    "succeeded attempt not executed exactly once": """
        SELECT t.id FROM task_runs t
         WHERE t.state = 'SUCCEEDED'
           AND NOT EXISTS (SELECT 1 FROM task_attempts a WHERE a.task_run_id = t.id
                            AND a.attempt = t.attempt AND a.outcome = 'reused')
           AND (SELECT count(*) FROM chaos_executions e
                 WHERE e.task_run_id = t.id AND e.attempt = t.attempt) <> 1""",
    "an attempt executed twice": """
        SELECT task_run_id, attempt FROM chaos_executions
         GROUP BY task_run_id, attempt HAVING count(*) > 1""",
    "executed again after it succeeded": """
        SELECT t.id FROM task_runs t JOIN chaos_executions e ON e.task_run_id = t.id
         WHERE t.state = 'SUCCEEDED' AND (e.attempt > t.attempt OR e.at > t.finished_at)""",
    "keyed work executed more than once per key": """
        SELECT e.key FROM chaos_executions e
          JOIN task_runs t ON t.id = e.task_run_id AND t.attempt = e.attempt
         WHERE e.kind = 'keyed' AND t.state = 'SUCCEEDED'
         GROUP BY e.key HAVING count(*) > 1""",
    "dead task without its full attempt history": """
        SELECT t.id FROM task_runs t
         WHERE t.state = 'DEAD'
           AND ((SELECT count(*) FROM task_attempts a WHERE a.task_run_id = t.id
                  AND a.finished_at IS NOT NULL AND a.outcome <> 'running') <> t.attempt
                OR t.attempt < 1)""",
    "running without a live lease": """
        SELECT id FROM task_runs
         WHERE state = 'RUNNING' AND (lease_expires_at IS NULL OR lease_expires_at < now())""",
    "outbox rows not stamped": "SELECT id FROM outbox WHERE published_at IS NULL",
    "doomed runs not failed": """
        SELECT id FROM workflow_runs WHERE workflow = 'chaos-doomed' AND id = ANY(%(ids)s::uuid[])
           AND state <> 'FAILED'""",
    "healthy runs not succeeded": """
        SELECT id FROM workflow_runs WHERE workflow <> 'chaos-doomed' AND id = ANY(%(ids)s::uuid[])
           AND state <> 'SUCCEEDED'""",
}


def check(db_url: str, ids: list[str]) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return {
            name: len(conn.execute(query.encode(), {"ids": ids}).fetchall())
            for name, query in INVARIANTS.items()
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load and faults")
    parser.add_argument("--seed", type=int, default=None, help="for a reproducible schedule")
    parser.add_argument("--intensity", type=float, default=6.0, help="faults per minute")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--quiesce-timeout", type=float, default=180.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--base-dir", type=Path, default=None, help="for the private services")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    base_dir = args.base_dir or Path(tempfile.mkdtemp(prefix="ff-chaos-services-"))
    base_dir.chmod(0o755)
    soak = Soak(
        args.duration,
        seed,
        args.intensity,
        args.workers,
        base_dir,
        lambda m: print(m, file=sys.stderr),
    )
    started = time.monotonic()
    try:
        soak.setup()
        soak.run()
        quiet = soak.quiesce(args.quiesce_timeout)
        ids = [r for runs in soak.triggered.values() for r in runs]
        violations = check(soak.db_url, ids)
        with psycopg.connect(soak.db_url, autocommit=True) as conn:
            tasks = conn.execute("SELECT count(*) FROM task_runs").fetchone()
            executions = conn.execute("SELECT count(*) FROM chaos_executions").fetchone()
    finally:
        soak.teardown()
    report = {
        "seed": seed,
        "duration_s": args.duration,
        "intensity_per_min": args.intensity,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": {kind: len(runs) for kind, runs in soak.triggered.items()},
        "runs_total": len(ids),
        "tasks": tasks[0] if tasks else 0,
        "executions": executions[0] if executions else 0,
        "trigger_errors": soak.trigger_errors,
        "faults": dict(soak.faults),
        "quiesced": quiet,
        "violations": violations,
        "violations_total": sum(violations.values()) + (0 if quiet else 1),
    }
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if report["violations_total"]:
        # the tree's logs and the services' data are the evidence: keep them
        print(f"kept for diagnosis: {soak.workdir} {base_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(soak.workdir, ignore_errors=True)
    if args.base_dir is None:  # ours: about 75 MB of PostgreSQL and RabbitMQ data per run
        shutil.rmtree(base_dir, ignore_errors=True)
    return 0


def print_report(report: dict[str, Any]) -> None:
    print(f"seed {report['seed']}  wall {report['wall_s']}s  quiesced {report['quiesced']}")
    print(
        f"runs {report['runs_total']} {report['runs']}  tasks {report['tasks']}"
        f"  executions {report['executions']}"
    )
    print(f"trigger errors (unacknowledged) {report['trigger_errors']}")
    print("faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(report["faults"].items())))
    print(f"{'invariant':<48} violations")
    for name, n in report["violations"].items():
        print(f"{name:<48} {n}")
    print(f"{'TOTAL':<48} {report['violations_total']}")


if __name__ == "__main__":
    sys.exit(main())
