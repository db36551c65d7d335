"""Failover on a private 3-node RabbitMQ cluster and a PostgreSQL primary with a synchronous
replica (SPEC 1: many trees against one cluster and one replicated database).

Two `flowforge up` trees share the cluster (every node's URL in ``broker.url``, the task queue
replicated on all three) and the database (a libpq multi-host URL with
``target_session_attrs=read-write``). Runs are in flight when a service node is SIGKILLed:
the RabbitMQ node leading the task queue, or the PostgreSQL primary (then the replica is
promoted, as a failover manager would). Every run must still succeed, each handler must run
once, and no role process may have been restarted: the roles fail over by themselves.
Handlers record their executions in a file, not in the database that fails over under them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
import yaml

from flowforge.config import DatabaseConfig
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.errors import FlowForgeError
from flowforge.store.db import Database
from flowforge.store.migrate import migrate
from tests.chaos.support import unavailable
from tests.conftest import TABLES, TEST_EXECUTIONS_DDL
from tests.e2e import HANDLERS_MODULE, RECORD_URL_ENV, REPO
from tests.harness.cluster import PrivateRabbitCluster
from tests.harness.replication import PrivateReplicatedPostgres
from tests.harness.resources import child_pids, free_ports
from tests.harness.services import ServiceUnavailable
from tests.helpers import wait_for
from tests.store import Store

#: Room for the services to start (the shared cluster, when this is its first user) plus every
#: wait below (seconds).
pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

WORKERS_PER_TREE = 2
RUNS = 40
SECOND_BATCH = 15
#: Each task sleeps this long, so the batch is still running when a node is killed (seconds).
TASK_S = 0.05
READY_TIMEOUT_S = 60.0
#: The slowest legitimate recovery is a stranded claim: its lease lapses (30 s) and the next
#: reaper sweep re-dispatches it. Anything slower is a defect (seconds).
SETTLE_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
TRIGGER_RETRY_PAUSE_S = 0.05


def workflow() -> WorkflowDef:
    """a → (b, c) → d: a release, a fan-out and a join per run."""
    return WorkflowDef(
        "failover",
        (
            TaskDef("a", "e2e.sleep_logged"),
            TaskDef("b", "e2e.sleep_logged", depends_on=("a",)),
            TaskDef("c", "e2e.sleep_logged", depends_on=("a",)),
            TaskDef("d", "e2e.sleep_logged", depends_on=("b", "c")),
        ),
    )


# ------------------------------------------------------------------ services and trees


@dataclass
class Cluster:
    base_dir: Path
    pg: PrivateReplicatedPostgres
    rabbit: PrivateRabbitCluster


@pytest.fixture(scope="module")
def replicated() -> Iterator[tuple[Path, PrivateReplicatedPostgres]]:
    """The PostgreSQL primary and its synchronous replica, for the module."""
    base_dir = Path(tempfile.mkdtemp(prefix="ff-failover-"))
    base_dir.chmod(0o755)  # the postgres account must enter it
    primary_port, replica_port = free_ports(2)
    pg = PrivateReplicatedPostgres(base_dir, primary_port, replica_port)
    try:
        try:
            pg.start()
        except ServiceUnavailable as exc:
            unavailable(str(exc))
        yield base_dir, pg
    finally:
        try:
            pg.stop()
        finally:
            shutil.rmtree(base_dir, ignore_errors=True)


@pytest.fixture
def services(
    replicated: tuple[Path, PrivateReplicatedPostgres], rabbit_cluster: PrivateRabbitCluster
) -> Cluster:
    """Both services whole again: a killed broker node restarted (the RabbitMQ cluster is the
    one tests/integration/test_private_cluster.py uses too: tests/shared_cluster.py), a
    failed-over pair rebuilt (a fresh, empty database), and the schema in place."""
    base_dir, pg = replicated
    cluster = Cluster(base_dir, pg, rabbit_cluster)
    for index in range(len(cluster.rabbit.nodes)):
        if index not in cluster.rabbit.running_nodes():
            cluster.rabbit.restart(index)
    cluster.pg.start()
    migrate(cluster.pg.url)
    with psycopg.connect(cluster.pg.url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS test_executions")
        conn.execute(TEST_EXECUTIONS_DDL)
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    return cluster


@dataclass
class Tree:
    """One `flowforge up` process tree against the cluster."""

    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    roles: dict[int, str] = field(default_factory=dict)

    def start(self, database_url: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")}
        env["FLOWFORGE_DATABASE_URL"] = database_url
        env[RECORD_URL_ENV] = database_url  # where e2e handlers record executions
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(self.config), "up"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("ab"),
        )

    def children(self) -> set[int]:
        assert self.proc is not None
        return set(child_pids(self.proc.pid))

    def tail(self) -> str:
        return " | ".join(self.log.read_text(errors="replace").splitlines()[-8:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)


@pytest.fixture
def trees(services: Cluster, tmp_path: Path) -> Iterator[list[Tree]]:
    """Two trees on one queue of their own, both with every worker registered."""
    queue = f"flowforge.failover.{os.urandom(4).hex()}"
    settings: dict[str, Any] = {
        "database": {"url": services.pg.url, "connect_timeout_s": 2},
        "broker": {
            "url": services.rabbit.urls,
            "queue": queue,
            "quorum_initial_group_size": 3,
            "heartbeat_s": 10,
        },
        "handlers": [HANDLERS_MODULE],
        "processes": {"workers": WORKERS_PER_TREE},
        "scheduler": {"poll_interval_s": 0.5},
        "logging": {"level": "INFO"},
    }
    started = []
    try:
        for n in range(2):
            config = tmp_path / f"tree-{n}.yaml"
            config.write_text(yaml.safe_dump(settings))
            tree = Tree(config, tmp_path / f"tree-{n}.log")
            tree.start(services.pg.url)
            started.append(tree)
        wait_for(
            lambda: live_workers(services.pg.url) >= 2 * WORKERS_PER_TREE,
            timeout=READY_TIMEOUT_S,
            what="both trees' workers to register",
        )
        yield started
    finally:
        for tree in started:
            tree.stop()


def live_workers(url: str) -> int:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute("SELECT count(*) FROM processes WHERE role = 'worker'").fetchone()
    except psycopg.OperationalError:
        return 0
    return int(row[0]) if row else 0


# ------------------------------------------------------------------ reading the outcome


@dataclass
class Outcome:
    url: str
    log: Path  # the handlers' execution log (e2e.sleep_logged)

    def _rows(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=2) as conn:
                return conn.execute(query, params).fetchall()
        except psycopg.OperationalError:
            return []  # between a primary's death and the promotion

    def all_succeeded(self, run_ids: set[UUID]) -> bool:
        rows = self._rows(
            "SELECT count(*) FROM workflow_runs WHERE id = ANY(%s) AND state = 'SUCCEEDED'",
            (list(run_ids),),
        )
        return bool(rows) and rows[0][0] == len(run_ids)

    def unfinished(self, run_ids: set[UUID]) -> list[tuple[Any, ...]]:
        """(task, state, attempt, token, lease left in s, lease owner) of every task of the runs
        that has not succeeded: what a run that never settles is waiting for."""
        return self._rows(
            "SELECT name, state, attempt, fencing_token,"
            " round(extract(epoch FROM lease_expires_at - now())::numeric, 1), lease_owner"
            " FROM task_runs WHERE run_id = ANY(%s) AND state <> 'SUCCEEDED' ORDER BY name",
            (list(run_ids),),
        )

    def executions_per_task(self, run_ids: set[UUID]) -> dict[UUID, int]:
        """Executions the handlers logged, per task of the given runs (0 if none)."""
        rows = self._rows("SELECT id FROM task_runs WHERE run_id = ANY(%s)", (list(run_ids),))
        counts = dict.fromkeys((r[0] for r in rows), 0)
        for line in self.log.read_text().splitlines() if self.log.exists() else []:
            task_run_id = UUID(line.split()[0])
            if task_run_id in counts:
                counts[task_run_id] += 1
        return counts

    def explain(self, wrong: dict[UUID, int], trees: list[Tree]) -> str:
        """What a task run that did not execute exactly once went through: the handler's
        execution lines (task, attempt, pid), its attempts as stored, and every line the trees
        logged about it or from the processes that ran it, other than routine hand-backs."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        parts = []
        for task_run_id, count in wrong.items():
            runs = [line for line in lines if line.startswith(str(task_run_id))]
            pids = {line.split()[2] for line in runs}
            attempts = self._rows(
                "SELECT attempt, fencing_token, worker, outcome, failure_reason, error,"
                " started_at::time, finished_at::time FROM task_attempts"
                " WHERE task_run_id = %s ORDER BY attempt",
                (task_run_id,),
            )
            logged = [
                line
                for tree in trees
                for line in tree.log.read_text(errors="replace").splitlines()
                if (str(task_run_id) in line or any(f"[{pid}]" in line for pid in pids))
                and "handed back" not in line
            ]
            parts.append(
                f"{task_run_id} ran {count}x: executions {runs}; attempts {attempts};"
                f" logged {logged[-30:]}"
            )
        return "\n".join(parts)

    def runs_with_keys(self, keys: list[str]) -> dict[str, UUID]:
        rows = self._rows(
            "SELECT idempotency_key, id FROM workflow_runs WHERE idempotency_key = ANY(%s)",
            (keys,),
        )
        return {r[0]: r[1] for r in rows}

    def succeeded_tasks(self) -> int:
        rows = self._rows("SELECT count(*) FROM task_runs WHERE state = 'SUCCEEDED'")
        return int(rows[0][0]) if rows else 0


def settle(outcome: Outcome, run_ids: set[UUID], trees: list[Tree], what: str) -> None:
    """Wait until every run succeeded; on timeout, say what the runs wait for and what the
    trees logged last."""
    try:
        wait_for(lambda: outcome.all_succeeded(run_ids), timeout=SETTLE_TIMEOUT_S, what=what)
    except AssertionError as exc:
        waiting = outcome.unfinished(run_ids)[:20]
        logs = " || ".join(tree.tail() for tree in trees)
        raise AssertionError(f"{exc}; unfinished tasks: {waiting}; last logs: {logs}") from None


def assert_ran_once_each(outcome: Outcome, run_ids: set[UUID], trees: list[Tree]) -> None:
    per_task = outcome.executions_per_task(run_ids)
    assert len(per_task) == 4 * len(run_ids)
    wrong = {k: v for k, v in per_task.items() if v != 1}
    assert not wrong, outcome.explain(wrong, trees)


def assert_no_role_restarted(trees: list[Tree], before: list[set[int]]) -> None:
    for tree, children in zip(trees, before, strict=True):
        assert tree.proc is not None and tree.proc.poll() is None, tree.tail()
        assert tree.children() == children, f"a role was restarted: {tree.tail()}"


# ------------------------------------------------------------------ the tests


def test_killing_the_rabbitmq_node_that_leads_the_queue_loses_nothing(
    services: Cluster, trees: list[Tree], tmp_path: Path
) -> None:
    db = Database(DatabaseConfig(url=services.pg.url, pool_min=1, pool_max=2), "failover")
    db.open()
    try:
        repo = Store(db)
        outcome = Outcome(services.pg.url, tmp_path / "executions.log")
        run_input = {"seconds": TASK_S, "log": str(outcome.log)}
        children = [tree.children() for tree in trees]
        queue = yaml.safe_load(trees[0].config.read_text())["broker"]["queue"]
        assert services.rabbit.members(queue) == [0, 1, 2]  # replicated on every node
        leader = services.rabbit.leader(queue)

        first = {r.run_id for r in repo.trigger_many(workflow(), [run_input] * RUNS)}
        wait_for(
            lambda: outcome.succeeded_tasks() >= RUNS // 2,
            timeout=SETTLE_TIMEOUT_S,
            what="the batch to be under way",
        )
        assert not outcome.all_succeeded(first), "the batch ended before the node was killed"
        services.rabbit.kill(leader)

        settle(outcome, first, trees, "every run to succeed after the leader died")
        assert_ran_once_each(outcome, first, trees)
        assert_no_role_restarted(trees, children)
        for tree in trees:  # the roles reported the lost connections; pika's narration is off
            assert " pika." not in tree.log.read_text(errors="replace"), tree.tail()
        wait_for(
            lambda: services.rabbit.leader(queue) != leader,
            timeout=SETTLE_TIMEOUT_S,
            what="the queue to report its new leader",
        )

        # The killed node comes back and rejoins; the cluster serves a second batch.
        services.rabbit.restart(leader)
        assert sorted(services.rabbit.running_nodes()) == [0, 1, 2]
        second = {r.run_id for r in repo.trigger_many(workflow(), [run_input] * SECOND_BATCH)}
        settle(outcome, second, trees, "the second batch to succeed")
        assert_ran_once_each(outcome, second, trees)
        assert_no_role_restarted(trees, children)
    finally:
        db.close()


@dataclass
class Triggers:
    """Triggers runs one by one, each with its own idempotency key, and sorts them into
    acknowledged (the trigger returned a run id) and uncertain (the trigger raised: the run
    may or may not exist)."""

    url: str
    total: int
    run_input: dict[str, Any]
    acknowledged: dict[str, UUID] = field(default_factory=dict)
    uncertain: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        db = Database(DatabaseConfig(url=self.url, pool_min=1, pool_max=1, connect_timeout_s=1))
        db.open()
        repo = Store(db)
        try:
            for n in range(self.total):
                key = f"failover-{n}"
                try:
                    self.acknowledged[key] = repo.trigger(
                        workflow(), self.run_input, idempotency_key=key
                    ).run_id
                except FlowForgeError:
                    self.uncertain.append(key)
                    time.sleep(TRIGGER_RETRY_PAUSE_S)  # pacing the load, not waiting for a state
        finally:
            db.close()
            self.done.set()


def test_killing_the_postgresql_primary_and_promoting_the_replica_loses_nothing_acknowledged(
    services: Cluster, trees: list[Tree], tmp_path: Path
) -> None:
    outcome = Outcome(services.pg.url, tmp_path / "executions.log")
    children = [tree.children() for tree in trees]
    triggers = Triggers(services.pg.url, RUNS, {"seconds": TASK_S, "log": str(outcome.log)})
    thread = threading.Thread(target=triggers.run, name="triggers", daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: len(triggers.acknowledged) >= RUNS // 3 and outcome.succeeded_tasks() > 0,
            timeout=SETTLE_TIMEOUT_S,
            what="runs to be under way",
        )
        services.pg.kill_primary()
        wait_for(
            lambda: triggers.uncertain or triggers.done.is_set(),
            timeout=SETTLE_TIMEOUT_S,
            what="a trigger to fail while there is no primary",
        )
        services.pg.promote_replica()
        assert triggers.done.wait(SETTLE_TIMEOUT_S), "the triggers never finished"
    finally:
        thread.join(SETTLE_TIMEOUT_S)

    assert triggers.uncertain, "no trigger ran during the outage: the test proved nothing"
    acknowledged = set(triggers.acknowledged.values())
    settle(
        outcome, acknowledged, trees, "every acknowledged run to succeed on the promoted replica"
    )
    # An uncertain trigger either committed (its run exists and must succeed too) or not.
    committed_anyway = outcome.runs_with_keys(triggers.uncertain)
    everything = acknowledged | set(committed_anyway.values())
    settle(outcome, everything, trees, "runs whose trigger failed but committed to succeed")
    existing = outcome._rows("SELECT id FROM workflow_runs")
    assert {r[0] for r in existing} == everything  # no run appeared from nowhere
    assert_ran_once_each(outcome, everything, trees)
    assert_no_role_restarted(trees, children)
